"""scripts/bench_before_after.py: its verdict, alternation and report parsing on fake numbers (no runs)."""

import bench_before_after as bba
import pytest


def test_side_order_alternates_abba():
    assert [bba.side_order(r) for r in range(4)] == [("before", "after"), ("after", "before")] * 2


@pytest.mark.parametrize(
    "after, higher, expected",
    [
        ([100.0, 101.0, 99.0], True, "ok"),  # median 100: within before's 95..105
        ([95.0], True, "ok"),  # at before's slowest
        ([120.0], True, "ok"),  # faster
        ([90.0, 94.0, 200.0], True, "SLOWER"),  # median 94 under before's min
        ([104.0], False, "ok"),  # lower is better: within 95..105
        ([80.0], False, "ok"),
        ([106.0], False, "SLOWER"),
    ],
)
def test_verdict(after, higher, expected):
    assert bba.verdict([95.0, 100.0, 105.0], after, higher) == expected


def test_host_metrics_and_summary():
    point = {
        "batch": 16,
        "context": 128,
        "async_scheduling": True,
        "engine_tokens_per_s": 500.0,
        "host_us": 300.0,
        "valid": False,
    }
    metrics = bba.host_metrics({"models": [{"name": "small", "points": [point]}]})
    assert metrics == {
        "host small B16 ctx128 async on engine tok/s": (500.0, True, False),
        "host small B16 ctx128 async on host us/step": (300.0, False, False),
    }
    rows = bba.summarize({"m": {"before": [10.0, 12.0, 11.0], "after": [9.0, 9.5, 8.0]}}, {"m": True}, {"m": 1})
    assert rows["m"]["before"] == {"values": [10.0, 12.0, 11.0], "median": 11.0, "min": 10.0, "max": 12.0}
    assert rows["m"]["after"]["median"] == 9.0 and rows["m"]["verdict"] == "SLOWER (1 invalid runs)"
    with pytest.raises(RuntimeError, match="boom"):
        bba.host_metrics({"models": [{"name": "small", "points": [{"batch": 1, "error": "boom"}]}]})


@pytest.mark.parametrize("bad", [["--rounds", "0"], ["--skip", "host,decode"], ["--skip", "hots"]])
def test_bad_arguments_exit_before_any_run(bad):
    with pytest.raises(SystemExit):
        bba.main(["--before", ".", "--after", ".", *bad])
