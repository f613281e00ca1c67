"""scripts/gpu_check.py: its help needs no JAX, and its dry run (CPU, tiny shapes, interpret mode) completes."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "gpu_check.py")


def test_help_and_import_need_no_jax():
    code = (
        "import sys; sys.path.insert(0, 'scripts'); import gpu_check; gpu_check.build_parser(); "
        "assert 'jax' not in sys.modules, 'gpu_check imports jax at module level'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
    out = subprocess.run([sys.executable, SCRIPT, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--dry-run" in out.stdout


@pytest.mark.slow  # about 1.5 minutes on 2 shared cores: server start-up compiles two buckets
def test_dry_run_writes_a_complete_report(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one CPU device, as on a plain machine
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--dry-run", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(out.read_text())
    assert report["errors"] == [], report["errors"]
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert report["dry_run"] and report["ok"]
    kernels = {row["kernel"] for row in report["bench"]["kernels"]}
    assert kernels == {
        "ragged_paged_attention (decode)",
        "ragged_paged_attention (prefill)",
        "int8_matmul",
        "int4_matmul",
    }
    for row in report["bench"]["kernels"]:
        assert row["seconds"]["kernel"] > 0 and row["bound_seconds"] > 0
        reference = "reference" if row["kernel"] in ("int8_matmul", "int4_matmul") else "engine_reference"
        assert row["max_abs_error_vs"][reference] < 0.1
    assert report["bench"]["copy_bandwidth"]["bytes_per_second"] > 0
    assert report["tests"]["returncode"] == 0 and report["tests"]["passed"] > 0
    server = report["server"]
    assert server["single"]["completion_tokens"] == server["limits"]["max_tokens"]
    assert server["concurrent"]["output_tokens_per_s"] > 0 and server["exit_code"] == 0
    assert [c["streams"] for c in server["concurrency"]] == [1, 2] and server["throughput_vs_one_stream"]["1"] == 1
    bound = report["batch1_vs_weight_read_bound"]
    assert bound["weight_bytes"] > 0 and 0 < bound["fraction_of_bound"]
    # The copy census of the compiled decode step (CPU here: no dynamic-slice-fusion variants).
    copies = report["copies"]["variants"]
    assert set(copies) == {"scanned", "unrolled"}
    assert all(v["compile_s"] > 0 for v in copies.values())


def test_copy_census_reads_unfused_ops_only():
    import sys as _sys

    _sys.path.insert(0, os.path.join(REPO, "scripts"))
    import gpu_check

    hlo = """HloModule m

%fused_computation (p: f32[4,8]) -> f32[2,8] {
  %p = f32[4,8]{1,0} parameter(0)
  ROOT %ds = f32[2,8]{1,0} dynamic-slice(%p, %c, %c), dynamic_slice_sizes={2,8}
}

ENTRY %main (a: bf16[1024,1024]) -> bf16[1024,1024] {
  %a = bf16[1024,1024]{1,0} parameter(0)
  %copy.1 = bf16[1024,1024]{0,1} copy(%a)
  ROOT %g = s32[4]{0} gather(%x, %y)
}
"""
    census = gpu_check.hlo_copy_census(hlo)
    assert census["copy"] == {
        "count": 1,
        "bytes": 2 << 20,
        "large": [{"shape": "bf16[1024,1024]", "bytes": 2 << 20, "in": "main"}],
    }
    assert census["gather"]["count"] == 1 and "dynamic-slice" not in census
