"""python scripts/bench_grammar_masks.py runs and reports mask times (a smoke test; numbers are in docs/ARCHITECTURE.md)."""

import json

import bench_grammar_masks as bench


def test_bench_smoke(capsys):
    assert bench.main(["--docs", "2"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    r = json.loads(line)
    assert r["library"] == "llguidance" and r["vocab"] == 8192
    assert r["mask_us_second_pass_n"] > 0 and r["mask_us_second_pass_p50"] > 0
    json.loads(r["example"])


def test_step_inputs_smoke():
    r = bench.time_step_inputs(8192, 4, iters=20)
    assert r["mask_bytes"] == 4 * 256 * 4 + 4
    assert r["pack_put_us_without_mask"] > 0 and r["pack_put_us_with_mask"] > 0
