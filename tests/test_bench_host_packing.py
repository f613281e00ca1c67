"""scripts/bench_host_packing.py on tiny settings: every point measured, positive, and the output
section timing what it claims (one delta per request per step). No timing assertions."""

import json

import bench_host_packing as bhp


def test_small_run_reports_every_point(tmp_path):
    out = tmp_path / "report.json"
    bhp.main(
        [
            "--batches",
            "1,9",
            "--contexts",
            "32",
            "--lengths",
            "4",
            "--logprobs",
            "none,2",
            "--steps",
            "3",
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert [(p["batch"], p["context"]) for p in report["packing"]] == [(1, 32), (9, 32)]  # the loop and the arrays
    assert [(r["batch"], r["logprobs"]) for r in report["outputs"]] == [(1, None), (1, 2), (9, None), (9, 2)]
    assert all(p["us_per_step"] > 0 for p in report["packing"] + report["outputs"])
    assert [r["batch"] for r in report["sampling"]] == [1, 9]
    assert all(r["from_params_us_per_row"] > 0 and r["pack_us"] > 0 for r in report["sampling"])


def test_each_timed_step_emits_one_token_per_request():
    requests = bhp.make_requests(3, 5, logprobs=1)
    bhp.time_steps(3, 5, 1, steps=2)  # runs
    processor = bhp.OutputProcessor(None, (0,), 10**7)
    seq = requests[0].seqs[0]
    seq.output_token_ids.append(9)
    seq.logprobs.append({9: -0.5})
    (out,) = processor.delta(requests[0]).outputs
    assert out.token_ids == [9] and out.logprobs == [{9: -0.5}]
