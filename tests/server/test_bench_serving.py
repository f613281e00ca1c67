"""scripts/bench_serving.py against a running server: a short seeded sweep of two rates, JSON and PNG."""

from __future__ import annotations

import json

import bench_serving as bench
import pytest

from server_testlib import TEST_API_KEY, server_kind


def test_workload_is_seeded_and_shaped():
    args = bench.build_parser().parse_args(
        [
            "--num-prompts",
            "50",
            "--input-len",
            "20",
            "--input-len-range",
            "0.5",
            "--output-len",
            "10",
            "--shared-prefix-len",
            "8",
            "--seed",
            "3",
        ]
    )
    a, b = bench.make_workload(args), bench.make_workload(args)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert all(10 <= len(r.prompt) - 8 <= 30 and r.output_len == 10 for r in a)
    assert len({tuple(r.prompt[:8]) for r in a}) == 1  # the shared prefix


def test_each_run_of_a_sweep_gets_its_own_prompts():
    """A later rate on the same server must not find its prompts in the prefix cache: same lengths and
    shared prefix, other bodies; run 0 is the workload `make_workload(args)` draws without a run."""
    args = bench.build_parser().parse_args(
        [
            "--num-prompts",
            "20",
            "--input-len",
            "40",
            "--input-len-range",
            "0.5",
            "--shared-prefix-len",
            "8",
            "--seed",
            "3",
        ]
    )
    first, second = bench.make_workload(args, run=0), bench.make_workload(args, run=1)
    assert [len(r.prompt) for r in first] == [len(r.prompt) for r in second]
    assert [r.output_len for r in first] == [r.output_len for r in second]
    assert {tuple(r.prompt[:8]) for r in first} == {tuple(r.prompt[:8]) for r in second}  # one shared prefix
    assert all(a.prompt[8:] != b.prompt[8:] for a, b in zip(first, second))
    assert [r.prompt for r in bench.make_workload(args)] == [r.prompt for r in first]
    assert [r.prompt for r in bench.make_workload(args, run=1)] == [r.prompt for r in second]  # seeded


def test_sweep_writes_json_and_plot(shared_server, tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = bench.main(
        [
            "--base-url",
            shared_server.url,
            "--api-key",
            TEST_API_KEY,
            "--num-prompts",
            "16",
            "--input-len",
            "12",
            "--output-len",
            "8",
            "--output-len-range",
            "0.5",
            "--request-rate",
            "20,inf",
            "--max-concurrency",
            "8",
            "--slo-ttft",
            "5000",
            "--slo-tpot",
            "1000",
            "--result-json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    runs = report["runs"]["server"]
    assert [r["request_rate"] for r in runs] == [20.0, "inf"]
    for r in runs:
        assert r["completed"] == 16 and r["failed"] == 0
        assert 16 * 4 <= r["total_output_tokens"] <= 16 * 12 and r["total_input_tokens"] == 16 * 12
        for key in (
            "request_throughput",
            "output_throughput",
            "total_token_throughput",
            "goodput",
            "mean_ttft_ms",
            "p50_ttft_ms",
            "p90_ttft_ms",
            "p99_ttft_ms",
            "p99_tpot_ms",
            "p99_itl_ms",
            "p99_e2el_ms",
        ):
            assert r[key] == r[key] and r[key] >= 0, key  # present and not NaN
        if server_kind() == "real":  # the step composition scraped from /metrics (the mock has no steps)
            assert sum(r["steps_by_kind"].values()) > 0
            assert 0 < r["step_tokens"] <= r["step_token_slots"] and 0 < r["token_slot_fill"] <= 1
    assert png.stat().st_size > 1000


def test_step_composition_counts_slots_from_the_histogram():
    before = {
        "steps": {"decode": 2, "prefill": 0, "mixed": 0},
        "buckets": {1.0: 1, 2.0: 2, 4.0: 2, float("inf"): 2},
        "tokens": 3,
    }
    # New: a decode of 1 token, a mixed step of 3 tokens (4 slots), a prefill of 4 (4 slots).
    after = {
        "steps": {"decode": 3, "prefill": 1, "mixed": 1},
        "buckets": {1.0: 2, 2.0: 3, 4.0: 5, float("inf"): 5},
        "tokens": 11,
    }
    got = bench.step_composition(before, after)
    assert got["steps_by_kind"] == {"decode": 1, "prefill": 1, "mixed": 1}
    assert (got["step_tokens"], got["step_token_slots"]) == (8, 9) and got["token_slot_fill"] == 8 / 9
    assert got["arrivals_joined"] is None  # a server without the counter
    joined = bench.step_composition(dict(before, arrivals_joined=1.0), dict(after, arrivals_joined=3.0))
    assert joined["arrivals_joined"] == 2
