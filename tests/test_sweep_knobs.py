"""scripts/sweep_knobs.py's pure parts: knob -> server flags, skipping knobs the server lacks, the
Prometheus parsing, the KV summary, and the CSV schema and curves built from recorded points."""

from __future__ import annotations

import csv
import json
import pathlib

import pytest
import sweep_knobs

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sweep():
    return sweep_knobs


def test_every_knob_maps_to_a_server_flag(sweep):
    from jaxserve.serve import build_parser

    parser = build_parser()
    supported = sweep.supported_settings()
    expected = {
        "max_num_seqs",
        "max_num_batched_tokens",
        "page_size",
        "num_scheduler_steps",
        "enable_prefix_caching",
        "quantization",
        "kv_cache_dtype",
        "num_speculative_tokens",
    }
    assert set(sweep.KNOBS) == expected
    for name, knob in sweep.KNOBS.items():
        assert knob.default not in knob.values and 1 <= len(knob.values) <= 3
        for value in knob.values:
            flags = sweep.server_flags(knob, value)
            assert flags[0] == "--" + name.replace("_", "-")
            if name in supported:  # the server's own parser reads them as this setting
                ns = parser.parse_args(["--config", "configs/small.yaml", *flags])
                assert getattr(ns, name) == sweep.format_value(value)
    assert sweep.server_flags(sweep.KNOBS["enable_prefix_caching"], False) == ["--enable-prefix-caching", "false"]
    assert sweep.server_flags(sweep.KNOBS["num_speculative_tokens"], 4) == [
        "--num-speculative-tokens",
        "4",
        "--speculative-model",
        "checkpoints/small-draft",
    ]
    assert sweep.server_flags(sweep.KNOBS["num_speculative_tokens"], 0) == ["--num-speculative-tokens", "0"]
    assert (REPO / sweep.DRAFT_MODEL / "config.json").is_file()


def test_defaults_are_the_baseline_configs(sweep):
    """Each knob's default point is the baseline server's: the config's value, else EngineConfig's default."""
    from jaxserve.config import EngineConfig

    base = EngineConfig.from_yaml(str(REPO / sweep.DEFAULT_CONFIG))
    for name, knob in sweep.KNOBS.items():
        if hasattr(base, name):
            assert getattr(base, name) == knob.default, name


def test_unsupported_knobs_are_skipped_with_a_note(sweep):
    points, notes = sweep.plan_points(["page_size", "num_scheduler_steps"], {"page_size"})
    assert points == [("baseline", None), ("page_size", 8), ("page_size", 32)]
    assert len(notes) == 1 and "num_scheduler_steps" in notes[0] and "--knobs num_scheduler_steps" in notes[0]
    with pytest.raises(SystemExit):
        sweep.plan_points(["nope"], set())


def test_parse_prometheus_and_kv_summary(sweep):
    text = "\n".join(
        [
            "# HELP jaxserve:kv_cache_usage_perc KV",
            "# TYPE jaxserve:kv_cache_usage_perc gauge",
            "jaxserve:kv_cache_usage_perc 0.5",
            "jaxserve:num_requests_running 3.0",
            'jaxserve:kv_pages_used_replica{replica="0"} 9.0',
            "jaxserve:kv_pages_used 10.0",
            "jaxserve:kv_pages_free 90.0",
            "jaxserve:num_preemptions_total 2.0",
        ]
    )
    s = sweep.parse_prometheus(text)
    assert s == {
        "jaxserve:kv_cache_usage_perc": 0.5,
        "jaxserve:num_requests_running": 3.0,
        "jaxserve:kv_pages_used": 10.0,
        "jaxserve:kv_pages_free": 90.0,
        "jaxserve:num_preemptions_total": 2.0,
    }
    assert sweep.counter(s, "jaxserve:num_preemptions") == 2.0
    idle = {
        "jaxserve:kv_cache_usage_perc": 0.0,
        "jaxserve:num_requests_running": 0.0,
        "jaxserve:kv_pages_used": 1.0,
        "jaxserve:kv_pages_free": 99.0,
    }
    busy2 = {**s, "jaxserve:kv_cache_usage_perc": 0.9, "jaxserve:kv_pages_used": 40.0, "jaxserve:kv_pages_free": 60.0}
    kv = sweep.kv_summary([idle, s, busy2])
    assert kv["kv_usage_mean"] == pytest.approx(0.7)  # idle scrapes left out
    assert (kv["kv_usage_max"], kv["kv_pages_used_max"], kv["kv_pages_total"]) == (0.9, 40.0, 100.0)


def fake_record(knob, value, tput, tpot, note=""):
    runs = (
        []
        if note
        else [
            {
                "request_rate": r,
                "output_throughput": tput * f,
                "p99_tpot_ms": tpot * f,
                "completed": 48,
                "p99_itl_ms": 1.0,
            }
            for r, f in ((4.0, 0.8), ("inf", 1.0))
        ]
    )
    return {
        "knob": knob,
        "value": value,
        "server_flags": "" if knob == "baseline" else f"--x {value}",
        "runs": runs,
        "note": note,
        "server_start_s": 60.0,
        "server_peak_rss_mib": 900.0,
    }


def test_rows_csv_and_curves(sweep, tmp_path):
    records = {
        "baseline": fake_record("baseline", None, 250, 60),
        "page_size=32": fake_record("page_size", "32", 240, 58),
        "page_size=8": fake_record("page_size", "8", 260, 64),
        "quantization=int8": fake_record("quantization", "int8", 0, 0, note="failed: boom"),
    }
    rows = sweep.rows_from_records(records)
    # baseline (2 rates) + page_size default, 8, 32 (2 rates each) + quantization's default (2) and failed point
    assert [(r["knob"], r["value"], r["request_rate"]) for r in rows][:4] == [
        ("baseline", "", 4.0),
        ("baseline", "", "inf"),
        ("page_size", "16", 4.0),
        ("page_size", "16", "inf"),
    ]
    assert len(rows) == 2 + 6 + 2 + 1
    assert rows[-1]["note"] == "failed: boom" and rows[-1]["knob"] == "quantization"
    path = tmp_path / "s.csv"
    sweep.write_csv(rows, str(path))
    with open(path) as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == sweep.CSV_COLUMNS
        read = list(reader)
    assert len(read) == len(rows) and read[2]["is_default"] == "1" and read[4]["is_default"] == "0"
    curves = sweep.knob_curves(read, "inf")
    assert [p[0] for p in curves["page_size"]] == ["8", "16", "32"]  # numeric order
    assert curves["page_size"][1] == ("16", 60.0, 250.0)
    assert curves["quantization"] == [("none", 60.0, 250.0)]  # the failed point is not on its curve
    table = sweep.effects_table(read, "inf")
    assert "| page_size | 16 (default) | 250 |" in table and "| page_size | 8 | 260 (1.04x) |" in table
    assert "failed: boom" in table


def test_report_from_points_folder(sweep, tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "points").mkdir()
    for pid, rec in (
        ("baseline", fake_record("baseline", None, 250, 60)),
        ("enable_prefix_caching=false", fake_record("enable_prefix_caching", "false", 200, 70)),
    ):
        (tmp_path / "points" / f"{pid}.json").write_text(json.dumps(rec))
    args = sweep.build_parser().parse_args(["--out", str(tmp_path)])
    rows = sweep.report(args, ["skipping num_scheduler_steps: not accepted"])
    assert (tmp_path / "sweep_knobs.png").stat().st_size > 0
    curves = sweep.knob_curves(rows, "inf")
    assert [p[0] for p in curves["enable_prefix_caching"]] == ["true", "false"]  # the default first
    assert rows[-1]["knob"] == "num_scheduler_steps" and rows[-1]["note"].startswith("skipping")
