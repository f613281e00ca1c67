"""python -m jaxserve.structured.bench runs and reports mask times (a smoke test; numbers are in docs/ARCHITECTURE.md)."""

import json

from jaxserve.structured import bench


def test_bench_smoke(capsys):
    assert bench.main(["--docs", "2"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    r = json.loads(line)
    assert r["library"] == "llguidance" and r["vocab"] == 8192
    assert r["mask_us_second_pass_n"] > 0 and r["mask_us_second_pass_p50"] > 0
    json.loads(r["example"])
