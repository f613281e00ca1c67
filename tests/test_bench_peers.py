"""scripts/bench_peers.py: the report arithmetic and schema only (no engines, no timing)."""

from __future__ import annotations

import json
import math

import bench_peers as bp
import pytest


def _report(**over) -> dict:
    report = {
        "schema": bp.SCHEMA,
        "config": {},
        "machine": {},
        "weights": {},
        "notes": [],
        "batch1": [
            {"engine": "jaxserve", "dtype": "float32", "ttft_ms": 200.0, "decode_tokens_per_s": 20.0},
            {"engine": "jaxserve", "dtype": "bfloat16", "ttft_ms": 400.0, "decode_tokens_per_s": 5.0},
            {"engine": "llama.cpp", "dtype": "float32", "ttft_ms": 100.0, "decode_tokens_per_s": 25.0},
            {"engine": "llama.cpp", "dtype": "bfloat16", "ttft_ms": 150.0, "decode_tokens_per_s": 4.0},
            {"engine": "hf", "dtype": "float32", "ttft_ms": 500.0, "decode_tokens_per_s": 10.0},
        ],
        "batch16": [
            {"engine": "jaxserve", "dtype": "float32", "batch": 16, "output_tokens_per_s": 120.0},
            {"engine": "hf", "dtype": "bfloat16", "batch": 16, "output_tokens_per_s": 20.0},
            {"engine": "hf", "dtype": "float32", "batch": 16, "output_tokens_per_s": 30.0},
        ],
        "server": [
            {
                "engine": "jaxserve",
                "dtype": "float32",
                "slots": 16,
                "output_throughput": 100.0,
                "p50_ttft_ms": 1000.0,
                "p50_tpot_ms": 200.0,
            },
            {
                "engine": "llama-server",
                "dtype": "float32",
                "slots": 16,
                "output_throughput": 40.0,
                "p50_ttft_ms": 2000.0,
                "p50_tpot_ms": 300.0,
            },
            {
                "engine": "llama-server",
                "dtype": "float32",
                "slots": 32,
                "output_throughput": 50.0,
                "p50_ttft_ms": 900.0,
                "p50_tpot_ms": 400.0,
            },
            {"engine": "llama-server", "slots": 64, "error": "RuntimeError('boom')"},
        ],
    }
    report.update(over)
    return bp.finish_report(report)


def test_ratio_edge_cases():
    assert bp.ratio(3.0, 2.0) == 1.5
    assert bp.ratio(None, 2.0) is None and bp.ratio(2.0, None) is None
    assert bp.ratio(1.0, 0.0) is None
    assert bp.ratio(float("nan"), 1.0) is None and bp.ratio(1.0, float("inf")) is None
    assert bp.ratio("x", 1.0) is None


def test_batch_summary_arithmetic():
    # 1 token: 0.2 s; 11 tokens: 1.2 s -> 0.1 s per step of all rows.
    s = bp.batch_summary([0.2, 0.3, 0.1], [1.2, 1.1, 1.3], 11, batch=4)
    assert s["ttft_ms"] == pytest.approx(200.0)
    assert s["decode_ms_per_step"] == pytest.approx(100.0)
    assert s["decode_tokens_per_s"] == pytest.approx(40.0)  # 4 rows / 0.1 s
    assert s["output_tokens_per_s"] == pytest.approx(4 * 11 / 1.2)
    one = bp.batch_summary([0.5], [0.5], 3)
    assert math.isnan(one["decode_tokens_per_s"])
    with pytest.raises(ValueError):
        bp.batch_summary([0.1], [0.2], 1)


def test_comparisons_same_dtype_and_direction():
    rows = bp.comparisons(_report())
    b1 = [r for r in rows if r["section"] == "batch1"]
    # jaxserve f32 vs llama.cpp f32 and HF f32; jaxserve bf16 vs llama.cpp bf16 (no HF bf16 at batch 1)
    assert {(r["dtype"], r["peer"]) for r in b1} == {
        ("float32", "llama.cpp"),
        ("float32", "hf"),
        ("bfloat16", "llama.cpp"),
    }
    dec = next(
        r for r in b1 if r["metric"] == "decode_tokens_per_s" and r["peer"] == "llama.cpp" and r["dtype"] == "float32"
    )
    assert dec["ratio"] == pytest.approx(0.8) and dec["better"] == "higher"
    ttft = next(r for r in b1 if r["metric"] == "ttft_ms" and r["peer"] == "hf")
    assert ttft["ratio"] == pytest.approx(0.4) and ttft["better"] == "lower"
    b16 = [r for r in rows if r["section"] == "batch16"]
    assert sorted(r["ratio"] for r in b16) == pytest.approx([4.0, 6.0])  # any HF dtype at batch 16
    srv = [r for r in rows if r["section"] == "server"]
    assert len(srv) == 2 * len(bp.SERVER_METRICS)  # the failed llama-server entry is left out
    assert all(r["peer_setting"].startswith("float32, -np ") for r in srv)


def test_targets():
    targets = {t["target"] + ":" + str(t.get("dtype")): t for t in _report()["targets"]}
    f32 = targets["batch1_decode_vs_llamacpp:float32"]
    assert f32["ratio"] == pytest.approx(0.8) and f32["met"] is False
    bf16 = targets["batch1_decode_vs_llamacpp:bfloat16"]
    assert bf16["ratio"] == pytest.approx(1.25) and bf16["met"] is True
    srv = targets["server_throughput_vs_llama_server:float32"]
    # against llama-server's best throughput (-np 32): 2x, but TTFT p50 1000/900 is worse -> not met
    assert srv["ratio"] == pytest.approx(2.0) and srv["peer_setting"] == "float32, -np 32"
    assert srv["ttft_p50_ratio"] == pytest.approx(1000 / 900) and srv["tpot_p50_ratio"] == pytest.approx(0.5)
    assert srv["met"] is False
    b16 = targets["batch16_vs_hf:float32"]
    assert b16["ratio"] == pytest.approx(4.0) and b16["peer_setting"] == "float32" and b16["met"] is False


def test_server_target_met_and_missing():
    rep = _report()
    rep["server"][2]["p50_ttft_ms"] = 1500.0  # now jaxserve's TTFT is no worse
    srv = next(t for t in bp.evaluate_targets(rep) if t["target"] == "server_throughput_vs_llama_server")
    assert srv["met"] is True
    none = bp.evaluate_targets(_report(server=[], batch16=[]))
    assert all(t["met"] is None for t in none if t["target"] != "batch1_decode_vs_llamacpp")


def test_table_and_markdown_render_every_row():
    rep = _report()
    text = bp.format_table(rep["comparisons"], rep["targets"])
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["section", "metric"]
    assert len([ln for ln in lines if ln.startswith(("batch1", "batch16", "server"))]) == len(rep["comparisons"])
    assert "0.80x" in text and "-> NOT MET" in text and "-> MET" in text
    md = bp.markdown_table(rep["comparisons"]).splitlines()
    assert len(md) == 2 + len(rep["comparisons"])
    assert all(ln.startswith("|") and ln.endswith("|") for ln in md)


def test_report_schema_and_json_round_trip():
    rep = _report()
    assert bp.validate_report(rep) == []
    again = json.loads(json.dumps(rep))
    assert bp.validate_report(again) == [] and again["comparisons"] == rep["comparisons"]
    broken = dict(rep, batch1=[{"engine": "jaxserve", "dtype": "float32"}])
    del broken["targets"]
    problems = bp.validate_report(broken)
    assert "missing key 'targets'" in problems
    assert any("lacks 'decode_tokens_per_s'" in p for p in problems)
    assert bp.validate_report(dict(rep, schema="other"))


def test_fresh_prompts_never_repeat():
    p = bp.Prompts(seed=0, length=128, vocab=49152)
    seen = [tuple(x) for x in p.take(16) + p.take(16)]
    assert len(set(seen)) == 32 and all(len(x) == 128 for x in seen)
    assert all(10 <= t < 49152 for x in seen for t in x)
