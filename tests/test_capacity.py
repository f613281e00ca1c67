"""Cost and capacity arithmetic: bench_serving's cost per million tokens, the planner's input/output costs,
and `python -m jaxserve.plan capacity` (replicas for a request rate from one replica's measured goodput)."""

from __future__ import annotations

import json
import pathlib

import bench_serving as bench
import pytest

from jaxserve import plan as planner
from jaxserve.planning import capacity, roofline
from jaxserve.config import ModelConfig
from jaxserve.planning.devices import get_device
from jaxserve.errors import ConfigError

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_bench_token_costs_by_hand():
    # 10 s, 36,000 input and 3,600 output tokens on 2 devices at $9/device-hour = $18/h = $0.005/s.
    summary = {"duration_s": 10.0, "total_input_tokens": 36_000, "total_output_tokens": 3_600}
    costs = bench.token_costs(summary, 9.0, 2)
    assert costs["cost_per_hour"] == 18.0 and costs["num_devices"] == 2
    assert costs["usd_per_million_input_tokens"] == pytest.approx(0.005 / 3600 * 1e6)  # 3,600 input tok/s
    assert costs["usd_per_million_output_tokens"] == pytest.approx(0.005 / 360 * 1e6)  # 360 output tok/s
    assert costs["usd_per_million_tokens"] == pytest.approx(0.005 / 3960 * 1e6)
    assert bench.token_costs({"duration_s": 0.0}, 9.0)["usd_per_million_output_tokens"] is None


def test_bench_summary_reports_costs_only_when_priced():
    result = bench.Result(0, ok=True, input_len=100, output_tokens=11, ttft=0.1, e2el=1.1, itl=[0.1] * 10)
    args = bench.build_parser().parse_args([])
    assert "usd_per_million_output_tokens" not in bench.summarize([result], 2.0, args)
    args = bench.build_parser().parse_args(["--cost-per-hour", "3.6", "--num-devices", "4"])
    s = bench.summarize([result], 2.0, args)
    # $14.4/h = $0.004/s; 5.5 output tokens/s -> $727.27 per M; 50 input tokens/s -> $80 per M.
    assert s["usd_per_million_output_tokens"] == pytest.approx(0.004 / 5.5 * 1e6)
    assert s["usd_per_million_input_tokens"] == pytest.approx(80.0)
    bench.print_summary("x", {**s, "request_rate": "inf", "max_concurrency": None})  # prints without error


def test_plan_input_and_output_costs():
    cfg = ModelConfig.from_dir(str(REPO / "configs" / "models" / "llama3-8b"))
    plan = roofline.make_plan(
        cfg, roofline.Target.build(get_device("h100"), (1, 1)), context=4096, batch=16, prompt_len=2048
    )
    assert plan.usd_per_million_input_tokens == pytest.approx(plan.prefill.usd_per_million_tokens)
    out = next(d for d in plan.decode if d.batch == 16)
    assert plan.usd_per_million_output_tokens == pytest.approx(out.usd_per_million_tokens)
    # Prefill is many tokens per weight read: input tokens cost far less than output tokens at the bounds.
    assert plan.usd_per_million_input_tokens < plan.usd_per_million_output_tokens / 5
    d = plan.to_dict()
    assert d["usd_per_million_input_tokens"] == plan.usd_per_million_input_tokens


def test_capacity_plan_by_hand():
    c = capacity.capacity_plan(
        10.0, 3.0, devices_per_replica=2, cost_per_device_hour=4.0, mean_input_tokens=500, mean_output_tokens=100
    )
    assert (c.replicas, c.devices) == (4, 8)  # ceil(10 / 3)
    assert c.utilisation == pytest.approx(10 / 12) and c.cost_per_hour == 32.0
    # $32/h over 10 req/s x 100 output tokens = 1000 tok/s: 32 / 3600 / 1000 * 1e6.
    assert c.usd_per_million_output_tokens == pytest.approx(32 / 3.6)
    assert c.usd_per_million_input_tokens == pytest.approx(32 / 3.6 / 5)
    assert capacity.capacity_plan(9.0, 3.0).replicas == 3  # exactly divisible: no extra replica
    assert capacity.capacity_plan(9.0, 3.0, headroom=0.2).replicas == 4
    assert capacity.capacity_plan(0.5, 3.0).replicas == 1
    assert capacity.capacity_plan(1.0, 1.0).cost_per_hour is None
    with pytest.raises(ConfigError):
        capacity.capacity_plan(1.0, 0.0)


def request(ttft, e2el, n, ok=True):
    return {"ok": ok, "ttft": ttft, "e2el": e2el, "output_tokens": n}


def test_request_goodput():
    reqs = [
        request(0.1, 1.1, 11),  # TPOT 100 ms
        request(0.5, 1.0, 11),  # TTFT 500 ms, TPOT 50 ms
        request(0.1, 3.1, 11),  # TPOT 300 ms
        request(0.0, 0.0, 0, ok=False),
    ]
    assert capacity.request_goodput(reqs, 2.0) == (1.5, 0.75)  # no SLO: every success
    assert capacity.request_goodput(reqs, 2.0, slo_ttft_ms=200) == (1.0, 0.5)
    assert capacity.request_goodput(reqs, 2.0, slo_tpot_ms=150) == (1.0, 0.5)
    assert capacity.request_goodput(reqs, 2.0, 200, 150) == (0.5, 0.25)


def run(rate, goodput, attainment, completed=10):
    return {
        "request_rate": rate,
        "completed": completed,
        "goodput": goodput,
        "slo_attainment": attainment,
        "total_input_tokens": 100 * completed,
        "total_output_tokens": 20 * completed,
        "duration_s": 5.0,
        "p99_tpot_ms": 50.0,
        "p99_ttft_ms": 300.0,
    }


def test_replica_capacity_takes_the_best_rate_within_the_slo():
    runs = [run(1.0, 0.98, 1.0), run(2.0, 1.9, 0.95), run(4.0, 2.5, 0.6), run("inf", 2.7, 0.3)]
    cap = capacity.replica_capacity(runs, min_attainment=0.9)
    assert cap.requests_per_s == 1.9 and cap.offered_rate == 2.0 and cap.meets_attainment
    assert not cap.saturated  # no request_throughput recorded: taken as served
    assert capacity.replica_capacity([{**runs[1], "request_throughput": 1.5}]).saturated  # 1.5 of 2 offered
    assert capacity.replica_capacity([runs[3]], min_attainment=0.1).saturated  # rate inf: saturation by design
    assert (cap.mean_input_tokens, cap.mean_output_tokens) == (100, 20)
    loose = capacity.replica_capacity(runs, min_attainment=0.5)
    assert loose.requests_per_s == 2.5
    none = capacity.replica_capacity(runs, min_attainment=1.01)
    assert none.requests_per_s == 2.7 and not none.meets_attainment
    with pytest.raises(ConfigError, match="no goodput"):
        capacity.replica_capacity([{"completed": 1, "duration_s": 1.0}])
    with pytest.raises(ConfigError, match="save-requests"):
        capacity.replica_capacity(runs, slo_tpot_ms=100)


def test_replica_capacity_recomputes_goodput_from_requests():
    r = run(2.0, 0.0, 0.0, completed=2)
    r["requests"] = [request(0.1, 1.1, 11), request(0.1, 3.1, 11)]
    cap = capacity.replica_capacity([r], min_attainment=0.5, slo_tpot_ms=150)
    assert cap.requests_per_s == pytest.approx(1 / 5.0) and cap.attainment == 0.5


def test_capacity_cli(tmp_path, capsys):
    report = {
        "config": {"num_devices": 2, "cost_per_hour": None, "slo_ttft": 1000, "slo_tpot": 100},
        "runs": {"server": [run(1.0, 1.0, 1.0), run(2.0, 1.9, 0.95), run("inf", 2.2, 0.4)]},
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(report))
    assert planner.main(["capacity", str(path), "--target-rate", "10", "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert "6 replica(s) = 12 device(s)" in out and "$96.00/hour" in out
    assert planner.main(["capacity", str(path), "--target-rate", "10", "--json", "--headroom", "0.25"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["plan"]["replicas"] == 7 and result["plan"]["cost_per_hour"] is None
    assert planner.main(["capacity", str(path), "--target-rate", "1", "--label", "nope"]) == 1
    assert "labels: server" in capsys.readouterr().err
    # The plan CLI without the subcommand is unchanged.
    assert planner.main(["--model", "configs/models/llama3-8b", "--device", "h100", "--context", "4096"]) == 0
    assert "per million input (prompt) tokens" in capsys.readouterr().out


def test_capacity_reads_a_real_bench_serving_report(tmp_path):
    """The JSON bench_serving writes (amain's report) is what the capacity CLI reads."""
    args = bench.build_parser().parse_args(["--slo-ttft", "500", "--slo-tpot", "120", "--cost-per-hour", "2"])
    ok = bench.Result(0, ok=True, input_len=50, output_tokens=11, ttft=0.1, e2el=1.1)
    slow = bench.Result(1, ok=True, input_len=50, output_tokens=11, ttft=0.9, e2el=1.9)
    summary = bench.summarize([ok, slow], 1.0, args)
    summary["request_rate"] = 2.0
    config = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, type(None)))}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"config": config, "runs": {"server": [summary]}}))
    cap = capacity.replica_capacity(json.loads(path.read_text())["runs"]["server"], min_attainment=0.5)
    assert cap.requests_per_s == 1.0 and cap.attainment == 0.5
    assert planner.capacity_main([str(path), "--target-rate", "3", "--min-attainment", "0.5"]) == 0
