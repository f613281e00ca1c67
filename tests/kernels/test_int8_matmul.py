"""int8 weight-only matmul with group-wise scales: reference vs float64 NumPy, interpret kernels vs reference,
block table, validation, TPU/CUDA lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_testlib import NATIVE, fast_jit, interpret_for
from pallas_kernels.int8_matmul import dequantize_int8, int8_matmul, reference_int8_matmul
from pallas_kernels.int8_matmul.blocks import BLOCK, COLUMN, TABLE, TILE, pick_blocks, scale_mode


def make_case(seed, m, k, n, group_size, dtype):
    """x, w_q, w_scale: f32[k // G, n], or f32[n] when group_size is None (per column)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.integers(-127, 128, size=(k, n)), jnp.int8)
    shape = (n,) if group_size is None else (k // group_size, n)
    s = jnp.asarray(rng.uniform(1e-3, 1e-2, size=shape), jnp.float32)
    return x, w, s


def check(out, ref, dtype):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    ref = np.asarray(jnp.asarray(ref, jnp.float32))
    assert np.all(np.isfinite(out))
    scale = np.abs(ref).max()
    # 16-bit x: a dequantized tile and the output are rounded to x's dtype; f32 sees summation order only.
    tol = {jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3}.get(jnp.dtype(dtype), 1e-5)
    np.testing.assert_allclose(out, ref, atol=tol * scale, rtol=tol)


@pytest.mark.parametrize(
    "m,k,n,group_size", [(1, 64, 8, 32), (3, 576, 24, 64), (2, 1536, 5, 128), (4, 96, 7, 96), (2, 40, 3, None)]
)
def test_reference_matches_float64_dequantize_then_matmul(m, k, n, group_size):
    x, w, s = make_case(k + n, m, k, n, group_size, jnp.float32)
    s64 = np.asarray(s, np.float64).reshape(-1, n)
    w64 = np.asarray(w, np.float64) * np.repeat(s64, k // s64.shape[0], 0)
    want = np.asarray(x, np.float64) @ w64
    if group_size is not None:
        np.testing.assert_allclose(np.asarray(dequantize_int8(w, s, group_size)), w64, rtol=2**-23)
    got = fast_jit(lambda *a: reference_int8_matmul(*a, group_size=group_size))(x, w, s)
    assert got.dtype == jnp.float32 and got.shape == (m, n)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_per_column_forms_agree():
    # group_size=None with f32[n] scales is the same product as group_size=k with f32[1, n].
    x, w, s = make_case(0, 3, 64, 16, None, jnp.float32)
    a = reference_int8_matmul(x, w, s)
    b = reference_int8_matmul(x, w, s[None, :], group_size=64)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def run_both(x, w, s, group_size, backend, **kw):
    ref = fast_jit(lambda *a: reference_int8_matmul(*a, group_size=group_size))(x, w, s)
    interpret = interpret_for(backend)
    out = fast_jit(lambda *a: int8_matmul(*a, group_size=group_size, backend=backend, interpret=interpret, **kw))(
        x, w, s
    )
    assert out.shape == ref.shape and out.dtype == x.dtype
    return out, ref


GPU_CASES = [
    # m, k, n, group_size, dtype, explicit blocks, how the chosen K block meets the scales
    (1, 576, 192, 32, jnp.float32, {}, TILE),  # decode row, SmolLM2's k: 9 K blocks of 2 groups
    (16, 576, 96, 64, jnp.bfloat16, {}, BLOCK),  # one group per K block
    (256, 1536, 128, 128, jnp.bfloat16, {}, BLOCK),  # prefill rows: 2 row blocks, 2 K blocks per group
    (1, 1536, 64, 128, jnp.float32, dict(block_k=512), TILE),  # 4 groups per K block
    (33, 256, 256, 32, jnp.float16, dict(block_m=16, block_n=64, block_k=128), TILE),  # 3 x 4 grid
    (5, 384, 64, 128, jnp.float32, dict(block_k=256), TILE),  # k padded by a whole zero group
    (7, 576, 130, 576, jnp.bfloat16, {}, COLUMN),  # group_size = k: per column, n padded
    (3, 200, 48, None, jnp.float32, {}, COLUMN),  # f32[n] scales, k padded
]


TPU_CASES = [  # interpret-mode Mosaic costs ~1 s a call: few cases, each covering several things
    (1, 576, 192, 32, jnp.bfloat16, {}, TILE),  # decode row: one K block of 18 groups, full-dimension blocks
    (16, 1536, 256, 128, jnp.float32, {}, TILE),  # 2 K blocks of 6 groups
    (200, 1536, 128, 128, jnp.bfloat16, dict(block_k=128), BLOCK),  # prefill rows, 12 K blocks, 1 per group
    (3, 1152, 128, 64, jnp.bfloat16, dict(block_k=512), TILE),  # k padded by 6 zero groups
    (5, 576, 576, 576, jnp.float32, {}, COLUMN),  # group_size = k: 5 column blocks
    (40, 384, 256, None, jnp.bfloat16, dict(block_m=16, block_n=128, block_k=128), COLUMN),  # 3 x 2 x 3 grid
]


@pytest.mark.parametrize(
    "backend,m,k,n,group_size,dtype,blocks,mode",
    [("gpu", *case) for case in GPU_CASES] + [("tpu", *case) for case in TPU_CASES],
)
def test_kernel_matches_reference(backend, m, k, n, group_size, dtype, blocks, mode):
    """Each case's blocks meet the scales as `mode` says, and the interpreted kernel equals the reference."""
    g = group_size or k
    assert scale_mode(k, g, pick_blocks(backend, m, k, n, dtype, g, **blocks)[2]) == mode
    x, w, s = make_case(m + n, m, k, n, group_size, dtype)
    out, ref = run_both(x, w, s, group_size, backend, **blocks)
    check(out, ref, dtype)


SHAPES = [
    (1, 4096, 4096),
    (37, 4096, 11008),
    (2048, 11008, 4096),
    (1, 576, 1536),
    (16, 1536, 576),
    (300, 576, 192),
    (1, 576, 49152),
]  # m, k, n


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("m,k,n,group_size", [(*s, g) for s in SHAPES for g in (32, 64, 128, s[1]) if s[1] % g == 0])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_block_table_gives_legal_blocks(backend, m, k, n, group_size, dtype):
    assert set(TABLE) == {"tpu", "gpu"}
    bm, bn, bk = pick_blocks(backend, m, k, n, dtype, group_size)
    if group_size < k:
        assert bk % group_size == 0 or group_size % bk == 0, "a K block spans whole groups or lies in one"
    if backend == "tpu":
        assert bm % (16 if dtype == jnp.bfloat16 else 8) == 0
        assert bn % 128 == 0 or bn == n
        assert bk % 128 == 0 or bk == k
    else:
        assert all(b >= 16 and b & (b - 1) == 0 for b in (bm, bn, bk))
    if k % 128 == 0 or k <= 1024:
        assert k % bk == 0, "weights whose k a legal block divides must not be padded (a copy per call)"


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _args(m=4, k=64, n=16, g=32, x=jnp.bfloat16, w=jnp.int8, s=jnp.float32, w_rows=None, s_shape=None):
    return (_sds((m, k), x), _sds((k if w_rows is None else w_rows, n), w), _sds(s_shape or (k // g, n), s))


SHAPE_ERRORS = [  # backend-free: the reference raises them too
    (_args(w_rows=32), {}, "k dims must match"),
    (_args(w=jnp.bfloat16), {}, "w_q must be int8"),
    (_args(s_shape=(1, 16)), {}, "w_scale must have shape \\(2, 16\\)"),
    (_args(s=jnp.bfloat16), {}, "w_scale must be float32"),
    (_args(x=jnp.int32), {}, "x must be float32"),
    (_args(m=0), {}, "empty operands"),
    (_args(s_shape=(16,)), dict(group_size=32), "k // group_size"),
    (_args(s_shape=(1, 16)), dict(group_size=None), "without group_size, w_scale must have shape \\(16,\\)"),
    (_args(), dict(group_size=0), "positive int"),
    (_args(), dict(group_size=-32), "positive int"),
    (_args(), dict(group_size=32.0), "positive int"),
    (_args(), dict(group_size=48), "must divide k"),
    (_args(k=1024, g=256), dict(backend="tpu", group_size=256, block_k=384), "multiple of group_size or divide it"),
]
BACKEND_ERRORS = [
    (_args(k=96, g=48), dict(group_size=48), "power of two"),
    (_args(), dict(block_m=24), "power of two"),
    (_args(k=96, g=12), dict(backend="tpu", group_size=12), "multiple of 8"),
    (_args(k=256), dict(backend="tpu", block_k=64), "block_k must be a multiple of 128"),
    (_args(), dict(backend="tpu", block_n=64), "multiple of 128"),
    (_args(), dict(backend="tpu", block_m=8), "multiple of 16"),
]


@pytest.mark.parametrize("args,kw,match", SHAPE_ERRORS + BACKEND_ERRORS)
def test_validation_errors(args, kw, match):
    kw = dict(kw)
    backend = kw.pop("backend", "gpu")
    group_size = kw.pop("group_size", 32)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda *a: int8_matmul(*a, group_size=group_size, backend=backend, **kw), *args)


@pytest.mark.parametrize("args,kw,match", SHAPE_ERRORS)
def test_reference_validates_the_same(args, kw, match):
    kw = dict(kw)
    group_size = kw.pop("group_size", 32)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda *a: reference_int8_matmul(*a, group_size=group_size, **kw), *args)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU-only error")
def test_cpu_without_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="interpret=True"):
        jax.eval_shape(lambda *a: int8_matmul(*a, group_size=32), *_args())


# dtype, m, group_size, block_k: a TILE decode, per column (f32[n]), a TILE prefill, a BLOCK decode
LOWER = [
    (jnp.bfloat16, 8, 32, None),
    (jnp.float32, 8, None, None),
    (jnp.bfloat16, 300, 128, None),
    (jnp.bfloat16, 1, 256, 128),
]


def _lower_args(dtype, m, g, k=1536, n=640):
    return [_sds((m, k), dtype), _sds((k, n), jnp.int8), _sds((n,) if g is None else (k // g, n), jnp.float32)]


@pytest.mark.parametrize("dtype,m,group_size,block_k", LOWER)
def test_lowers_for_tpu(dtype, m, group_size, block_k):
    fn = jax.jit(lambda *a: int8_matmul(*a, group_size=group_size, backend="tpu", block_k=block_k))
    exported = jax.export.export(fn, platforms=["tpu"])(*_lower_args(dtype, m, group_size))
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize("dtype,m,group_size,block_k", LOWER)
def test_lowers_for_cuda(dtype, m, group_size, block_k):
    fn = jax.jit(lambda *a: int8_matmul(*a, group_size=group_size, backend="gpu", block_k=block_k))
    text = fn.trace(*_lower_args(dtype, m, group_size)).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


@pytest.mark.parametrize("backend,platform", [("tpu", "tpu"), ("gpu", "cuda")])
@pytest.mark.parametrize("group_size", [128, None])
def test_decode_reads_the_int8_weight_in_place(backend, platform, group_size):
    # Aligned weights (a Llama-shaped decode matmul) go to the kernel as they are: no pad, no widening convert.
    fn = jax.jit(lambda *a: int8_matmul(*a, group_size=group_size, backend=backend))
    text = (
        fn.trace(*_lower_args(jnp.bfloat16, 1, group_size, k=4096, n=4096))
        .lower(lowering_platforms=(platform,))
        .as_text()
    )
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1
    assert ", %arg1, " in calls[0], calls[0][:300]  # w_q itself is the kernel's second operand
    # ... and no other op touches a weight-sized array (no pad, widening convert or copy of it); x is padded.
    others = [line for line in text.splitlines() if "stablehlo." in line and "custom_call" not in line]
    assert not [line for line in others if "4096x4096" in line], others


def test_tpu_kernel_under_force_tpu_interpret_mode():
    # The other way to interpret Mosaic kernels: a context manager around an uninterpreted call.
    from jax.experimental.pallas import tpu as pltpu

    if NATIVE:
        pytest.skip("PALLAS_TESTS_NATIVE: an interpreter test")
    x, w, s = make_case(0, 8, 256, 128, 32, jnp.float32)
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        out = fast_jit(lambda *a: int8_matmul(*a, group_size=32, backend="tpu"))(x, w, s)
    check(out, fast_jit(lambda *a: reference_int8_matmul(*a, group_size=32))(x, w, s), jnp.float32)
