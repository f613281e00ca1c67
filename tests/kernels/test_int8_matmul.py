"""int8 weight-only matmul: interpret kernels vs reference, block table, validation, TPU/CUDA lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_testlib import NATIVE, fast_jit, interpret_for
from pallas_kernels.int8_matmul import int8_matmul, reference_int8_matmul
from pallas_kernels.int8_matmul.blocks import TABLE, pick_blocks


def make_case(seed, m, k, n, dtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.integers(-127, 128, size=(k, n)), jnp.int8)
    s = jnp.asarray(rng.uniform(1e-3, 1e-2, size=n), jnp.float32)
    return x, w, s


def check(out, ref, dtype):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    ref = np.asarray(jnp.asarray(ref, jnp.float32))
    scale = np.abs(ref).max()
    # Output rounding dominates for 16-bit x (bf16 2^-8, f16 2^-11 relative); f32 only sees summation order.
    tol = {jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3}.get(jnp.dtype(dtype), 1e-5)
    np.testing.assert_allclose(out, ref, atol=tol * scale, rtol=tol)


def run_both(x, w, s, backend, **kw):
    ref = fast_jit(reference_int8_matmul)(x, w, s)
    interpret = interpret_for(backend)
    out = fast_jit(lambda *a: int8_matmul(*a, backend=backend, interpret=interpret, **kw))(x, w, s)
    assert out.shape == ref.shape and out.dtype == x.dtype
    return out, ref


GPU_CASES = [
    # m, k, n, dtype, explicit blocks
    (1, 64, 48, jnp.float32, {}),  # decode row, sizes below every block
    (7, 200, 130, jnp.bfloat16, {}),  # nothing divides anything
    (33, 256, 256, jnp.bfloat16, dict(block_m=16, block_n=64, block_k=64)),  # several k steps
    (64, 96, 80, jnp.float32, dict(block_m=32, block_n=32, block_k=32)),
    (130, 128, 64, jnp.float16, {}),
]


@pytest.mark.parametrize("m,k,n,dtype,blocks", GPU_CASES)
def test_gpu_matches_reference(m, k, n, dtype, blocks):
    x, w, s = make_case(m + n, m, k, n, dtype)
    out, ref = run_both(x, w, s, "gpu", **blocks)
    check(out, ref, dtype)


TPU_CASES = [
    (5, 200, 130, jnp.float32, {}),
    (40, 384, 256, jnp.bfloat16, dict(block_m=16, block_n=128, block_k=128)),  # 3 x 2 x 3 grid
    (1, 128, 512, jnp.bfloat16, {}),
]


@pytest.mark.parametrize("m,k,n,dtype,blocks", TPU_CASES)
def test_tpu_matches_reference(m, k, n, dtype, blocks):
    x, w, s = make_case(m + n, m, k, n, dtype)
    out, ref = run_both(x, w, s, "tpu", **blocks)
    check(out, ref, dtype)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("m,k,n", [(1, 4096, 4096), (37, 4096, 11008), (2048, 11008, 4096), (3, 100, 20)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_block_table_gives_legal_blocks(backend, m, k, n, dtype):
    assert set(TABLE) == {"tpu", "gpu"}
    bm, bn, bk = pick_blocks(backend, m, k, n, dtype)
    if backend == "tpu":
        assert bm % (16 if dtype == jnp.bfloat16 else 8) == 0 and bn % 128 == 0 and bk % 128 == 0
    else:
        assert all(b >= 16 and b & (b - 1) == 0 for b in (bm, bn, bk))


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("args,kw,match", [
    ((_sds((4, 64), jnp.bfloat16), _sds((32, 16), jnp.int8), _sds((16,), jnp.float32)), {}, "k dims must match"),
    ((_sds((4, 64), jnp.bfloat16), _sds((64, 16), jnp.bfloat16), _sds((16,), jnp.float32)), {}, "w_q must be int8"),
    ((_sds((4, 64), jnp.bfloat16), _sds((64, 16), jnp.int8), _sds((1, 16), jnp.float32)), {}, "w_scale must have"),
    ((_sds((4, 64), jnp.bfloat16), _sds((64, 16), jnp.int8), _sds((16,), jnp.bfloat16)), {}, "w_scale must be float32"),
    ((_sds((4, 64), jnp.int32), _sds((64, 16), jnp.int8), _sds((16,), jnp.float32)), {}, "x must be float32"),
    ((_sds((64,), jnp.bfloat16), _sds((64, 16), jnp.int8), _sds((16,), jnp.float32)), {}, "x must be \\[m, k\\]"),
    ((_sds((4, 64), jnp.bfloat16), _sds((64, 16), jnp.int8), _sds((16,), jnp.float32)), dict(block_m=24),
     "power of two"),
    ((_sds((4, 64), jnp.bfloat16), _sds((64, 16), jnp.int8), _sds((16,), jnp.float32)),
     dict(backend="tpu", block_n=64), "multiple of 128"),
    ((_sds((4, 64), jnp.bfloat16), _sds((64, 16), jnp.int8), _sds((16,), jnp.float32)),
     dict(backend="tpu", block_m=8), "multiple of 16"),
])
def test_validation_errors(args, kw, match):
    kw = dict(kw)
    backend = kw.pop("backend", "gpu")
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda *a: int8_matmul(*a, backend=backend, **kw), *args)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU-only error")
def test_cpu_without_backend_is_a_clear_error():
    x, w, s = _sds((4, 64), jnp.float32), _sds((64, 16), jnp.int8), _sds((16,), jnp.float32)
    with pytest.raises(ValueError, match="interpret=True"):
        jax.eval_shape(int8_matmul, x, w, s)


LOWER = [(jnp.bfloat16, 8), (jnp.float32, 8), (jnp.bfloat16, 300)]


@pytest.mark.parametrize("dtype,m", LOWER)
def test_lowers_for_tpu(dtype, m):
    args = [_sds((m, 512), dtype), _sds((512, 384), jnp.int8), _sds((384,), jnp.float32)]
    exported = jax.export.export(jax.jit(lambda *a: int8_matmul(*a, backend="tpu")), platforms=["tpu"])(*args)
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize("dtype,m", LOWER)
def test_lowers_for_cuda(dtype, m):
    args = [_sds((m, 512), dtype), _sds((512, 384), jnp.int8), _sds((384,), jnp.float32)]
    text = jax.jit(lambda *a: int8_matmul(*a, backend="gpu")).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


def test_tpu_kernel_under_force_tpu_interpret_mode():
    # The other way to interpret Mosaic kernels: a context manager around an uninterpreted call.
    from jax.experimental.pallas import tpu as pltpu

    if NATIVE:
        pytest.skip("PALLAS_TESTS_NATIVE: an interpreter test")
    x, w, s = make_case(0, 8, 128, 128, jnp.float32)
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        out = fast_jit(lambda *a: int8_matmul(*a, backend="tpu"))(x, w, s)
    check(out, fast_jit(reference_int8_matmul)(x, w, s), jnp.float32)
