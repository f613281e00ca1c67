"""scripts/bench_arrival_window.py on the shipped default model: both arms run, and the held arm
really holds (windows opened). No timing assertions."""

import json

import bench_arrival_window


def test_both_arms_run_and_the_window_opens(tmp_path):
    out = tmp_path / "window.json"
    assert (
        bench_arrival_window.main(
            [
                "--config",
                "configs/small.yaml",
                "--model",
                "checkpoints/small",
                "--streams",
                "2",
                "--tokens",
                "24",
                "--rounds",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    (held,), (free,) = report["results"]["window"], report["results"]["none"]
    assert held["ms_per_step"] > 0 and free["ms_per_step"] > 0 and held["steps"] == free["steps"] > 0
    assert held["windows"] > 0 and 0 <= held["closed_late"] <= held["windows"]
    assert free["windows"] == 0
