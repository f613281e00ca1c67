"""scripts/bench_host_overhead.py: its --quick run on a tiny dummy model, and its arithmetic.

No timing assertions: the checks catch a broken measurement (missing or negative numbers, phases
that overlap or add up to more than the step, steps that were not all-row decodes, a wrong buffer
size), not a slow machine."""

import json
import math
import statistics

import bench_host_overhead as bho
import pytest


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bho") / "report.json"
    assert bho.main(["--quick", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_quick_report_structure_and_numbers(report):
    assert report["phases"] == list(bho.PHASES)
    assert len(report["load_average_start"]) == 3 and len(report["load_average_end"]) == 3
    assert report["machine"]["cores"] >= 1 and report["machine"]["backend"] == "cpu"
    (model,) = report["models"]
    assert model["name"] == "tiny" and model["skipped"] == []
    s = report["settings"]
    points = model["points"]
    assert [(p["batch"], p["context"], p["async_scheduling"]) for p in points] == [
        (b, c, m) for c in s["contexts"] for b in s["batches"] for m in (False, True)
    ]
    for p in points:
        where = f"batch {p['batch']} context {p['context']}"
        assert "error" not in p, where
        assert p["valid"], (where, p["problems"])
        for key in ("engine_tokens_per_s", "device_tokens_per_s", "ratio", "step_us", "device_step_us", "host_us"):
            assert math.isfinite(p[key]) and p[key] > 0, (where, key, p[key])
        assert p["ratio_range"][0] <= p["ratio"] <= p["ratio_range"][1]
        assert p["ratio_of_medians"] == pytest.approx(p["engine_tokens_per_s"] / p["device_tokens_per_s"])
        assert len(p["ratio_per_round"]) == s["rounds"]
        assert len(p["raw_step_s"]) == s["rounds"] * s["steps"]
        phases = p["phases_us"]
        assert set(phases) == set(bho.PHASES)
        # every wrapped phase ran in every step (but copy: in one process a plain step's call copies
        # its NumPy inputs itself, inside dispatch); `other` (the uncovered rest) is never negative,
        # so the measured phases add up to at most the step
        for name in bho.PHASES:
            assert phases[name] > 0 or name in ("other", "copy"), (where, name, phases[name])
        assert phases["other"] >= -1e-3, (where, phases)
        assert sum(v for k, v in phases.items() if k != "other") <= p["step_us"] * (1 + 1e-9), (where, phases)
        # the engine waits for the device inside its step: a step is at least its wait
        assert p["step_us"] >= phases["wait"]
        # a ragged decode bucket (tokens, pages): one token per row, padded to the token bucket; the
        # packed buffer is int32 words
        assert len(p["bucket"]) == 2 and p["bucket"][0] >= p["batch"]
        assert p["bytes_to_device_per_step"] > 0 and p["bytes_to_device_per_step"] % 4 == 0
        assert p["bytes_from_device_per_step"] > 0
        # every timed step attended at most `context` tokens, all within the one page bucket
        lo, hi = p["contexts_attended"]
        assert p["prompt_tokens"] < lo <= hi <= p["context"]
        assert hi <= p["bucket"][1] * model["page_size"]


def test_larger_batches_copy_more_bytes(report):
    pts = {(p["batch"], p["context"]): p for p in report["models"][0]["points"] if p["async_scheduling"]}
    # Per-row inputs double; the per-engine row metadata (query starts, context lengths, page tables of
    # max_num_seqs rows) does not.
    one, two = pts[(1, 32)]["bytes_to_device_per_step"], pts[(2, 32)]["bytes_to_device_per_step"]
    assert one < two < 2 * one


def test_phase_split_and_prompt_length():
    marks = {"schedule": 1.0, "pack": 2.0, "copy": 0.5, "dispatch": 0.5, "wait": 3.0, "postprocess": 1.0, "emit": 1.0}
    ph = bho.phase_split(marks, 10.0)
    assert ph["other"] == pytest.approx(1.0) and list(ph) == list(bho.PHASES)
    assert bho.phase_split({}, 2.0)["other"] == 2.0
    assert bho.phase_split(marks, 8.0)["other"] < 0  # overlapping intervals show up, not hidden
    assert bho.prompt_length(128, 50) == 77


def test_summarize_point_rates():
    # 2 rounds of 4 steps at batch 8: engine 0.4 s / round, device 0.2 s / round
    s = bho.summarize_point(8, [0.1] * 8, [0.4, 0.4], [0.2, 0.25], 4, [bho.phase_split({"wait": 0.06}, 0.1)] * 8)
    assert s["engine_tokens_per_s"] == pytest.approx(80.0)
    assert s["device_tokens_per_s"] == pytest.approx(statistics.median([160.0, 128.0]))
    assert s["ratio_range"] == pytest.approx([0.5, 0.625])
    assert s["phases_us"]["wait"] == pytest.approx(6e4) and s["host_us"] == pytest.approx(4e4)
    s = bho.summarize_point(1, [0.1], [0.1], [0.05], 1, [bho.phase_split({"wait": 0.05, "dispatch": 0.01}, 0.1)])
    assert s["host_us"] == pytest.approx(4e4)  # neither wait nor dispatch is host work
