"""scripts/roofline.py: the pure arithmetic (bounds, fractions, crossover, bandwidth range, profile
breakdown). No timing assertions; the script itself is run by hand (docs/BENCHMARKS.md, Roofline)."""

import math
from pathlib import Path

import pytest
import roofline

from jaxserve.planning import roofline as plan
from jaxserve.config import ModelConfig

REPO = Path(__file__).resolve().parents[1]

GB = 1e9


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_dir(str(REPO / "configs" / "models" / "smollm2-135m"))


def make_roof(cfg, bandwidth=50 * GB, peak=100 * GB, b=4):
    return roofline.Roof(cfg, cfg.param_bytes(b), cfg.kv_bytes_per_token(b), b, bandwidth, peak)


def test_range_summary():
    s = roofline.range_summary([60.0, 45.0, 77.0, 50.0])
    assert (s["n"], s["min"], s["max"], s["median"]) == (4, 45.0, 77.0, 55.0)
    assert s["spread_pct"] == pytest.approx(100 * (77 / 45 - 1))
    assert s["samples"] == [60.0, 45.0, 77.0, 50.0]  # in the order measured
    assert roofline.range_summary([3.0])["spread_pct"] == 0.0
    with pytest.raises(ValueError):
        roofline.range_summary([])


def test_fraction_of_bound():
    assert roofline.fraction_of_bound(8e-3, 10e-3) == pytest.approx(0.8)
    assert roofline.fraction_of_bound(1.0, 1.0) == 1.0
    with pytest.raises(ValueError):
        roofline.fraction_of_bound(1.0, 0.0)


def test_decode_bound_is_params_plus_kv_over_bandwidth(cfg):
    roof = make_roof(cfg)
    b1 = roofline.decode_bound(roof, 1, 128)
    assert b1["bytes_read"] == cfg.param_bytes(4) + 128 * cfg.kv_bytes_per_token(4)
    assert b1["memory_s"] == pytest.approx(b1["bytes_read"] / (50 * GB))
    flops = 2 * plan.matmul_params(cfg) + 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers * 128
    assert b1["compute_s"] == pytest.approx(flops / (100 * GB))
    assert b1["flops"] == pytest.approx(flops)
    assert b1["bound_by"] == "memory" and b1["bound_s"] == b1["memory_s"]
    # the KV term grows with batch x context; the weights are read once
    b8 = roofline.decode_bound(roof, 8, 1024)
    assert b8["bytes_read"] - cfg.param_bytes(4) == 8 * 1024 * cfg.kv_bytes_per_token(4)


def test_prefill_bound_matches_the_planner_for_one_prompt(cfg):
    roof = make_roof(cfg)
    ours = roofline.prefill_bound(roof, 1, 512)
    theirs = plan.prefill_bound(cfg, roofline._target(roof), roof.param_bytes, roof.kv_bytes_per_token, 512, 4)
    assert ours["memory_s"] == pytest.approx(theirs.memory_s)
    assert ours["compute_s"] == pytest.approx(theirs.compute_s)
    assert ours["bound_s"] == pytest.approx(theirs.seconds)
    assert ours["bound_by"] == "compute"
    # B prompts: B x the matmul FLOPs, attention per prompt over (C + 1) / 2 keys
    four = roofline.prefill_bound(roof, 4, 512)
    assert four["flops"] == pytest.approx(4 * ours["flops"])


def test_crossover_batch_is_where_the_bounds_meet(cfg):
    roof = make_roof(cfg)
    for context in (1, 128):
        b = roofline.crossover_batch(roof, context)
        assert b is not None and b > 0
        lo, hi = (
            roofline.decode_bound(roof, math.floor(b), context),
            roofline.decode_bound(roof, math.ceil(b) + 1, context),
        )
        assert lo["bound_by"] == "memory" and hi["bound_by"] == "compute"
        # exactly equal at the (fractional) crossover
        memory = (roof.param_bytes + b * context * roof.kv_bytes_per_token) / roof.bandwidth
        flops = b * (2 * plan.matmul_params(cfg) + 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers * context)
        assert memory == pytest.approx(flops / roof.peak_flops)
    # a longer context moves the crossover out
    assert roofline.crossover_batch(roof, 128) > roofline.crossover_batch(roof, 1)
    # KV reads that cost more than their FLOPs: never compute-bound (here: a fast-compute device)
    fast = make_roof(cfg, bandwidth=50 * GB, peak=1e15)
    assert roofline.crossover_batch(fast, 4096) is None


def test_crossover_scales_with_the_ridge(cfg):
    """Weights-only (context -> 0): B* = (P / bw) / (2 P_mm / peak) ~ peak / bw x bytes/param / 2."""
    roof = make_roof(cfg, bandwidth=50 * GB, peak=100 * GB)
    b0 = roofline.crossover_batch(roof, 0)
    assert b0 == pytest.approx((roof.param_bytes / roof.bandwidth) / (2 * plan.matmul_params(cfg) / roof.peak_flops))
    doubled = roofline.crossover_batch(make_roof(cfg, bandwidth=50 * GB, peak=200 * GB), 0)
    assert doubled == pytest.approx(2 * b0)


def test_first_compute_bound():
    pts = [
        {"batch": 1, "bound_by": "memory"},
        {"batch": 16, "bound_by": "compute"},
        {"batch": 8, "bound_by": "compute"},
        {"batch": 4, "bound_by": "memory"},
    ]
    assert roofline.first_compute_bound(pts) == 8
    assert roofline.first_compute_bound(pts[:1]) is None


def test_measured_knee():
    # flat (memory-bound) until 4, then linear: 2x the batch-1 time is reached at batch 8
    batches = [1, 2, 4, 8, 16]
    times = [10.0, 10.0, 11.0, 20.0, 40.0]
    assert roofline.measured_knee(batches, times) == pytest.approx(8.0)
    # between points: log-log interpolation (t = 10 at 4, 40 at 16: reaches 20 at 8)
    assert roofline.measured_knee([1, 4, 16], [10.0, 10.0, 40.0]) == pytest.approx(8.0)
    assert roofline.measured_knee([4, 1, 16], [10.0, 10.0, 40.0]) == pytest.approx(8.0)  # any order
    assert roofline.measured_knee(batches, [10.0] * 5) is None
    assert roofline.measured_knee([], []) is None
    assert roofline.measured_knee([1, 2], [10.0, 30.0], factor=3.0) == pytest.approx(2.0)


def test_breakdown_splits_nested_variants():
    times = {
        "weight_matmuls": 0.040,
        "model_no_attention": 0.045,
        "model": 0.050,
        "step_pipelined": 0.052,
        "step_synced": 0.053,
        "engine_execute": 0.060,
    }
    rows = roofline.breakdown(times)
    assert [r["variant"] for r in rows] == [k for k, _ in roofline.PROFILE_PARTS]
    assert [round(r["ms"], 6) for r in rows] == [40.0, 5.0, 5.0, 2.0, 1.0, 7.0]
    assert sum(r["ms"] for r in rows) == pytest.approx(60.0)
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    # a missing variant folds its part into the next one; noise may leave a part negative
    partial = roofline.breakdown({"weight_matmuls": 0.040, "model": 0.039})
    assert [round(r["ms"], 6) for r in partial] == [40.0, -1.0]
    assert roofline.breakdown({}) == []
