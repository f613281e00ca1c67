"""int4 weight-only matmul: reference vs float64 NumPy, interpret kernels vs reference, block table, validation,
TPU/CUDA lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_testlib import fast_jit, interpret_for
from pallas_kernels.int4_matmul import dequantize_int4, int4_matmul, reference_int4_matmul
from pallas_kernels.int4_matmul.blocks import TABLE, pick_blocks, tpu_k_unit


def make_codes(rng, m, k, n, group_size):
    """Random codes q u8[k, n] in 0..15, their packed bytes, scales, biases (Q4_1-like: bias near -8 * scale)."""
    q = rng.integers(0, 16, size=(k, n)).astype(np.uint8)
    packed = (q[0::2] | (q[1::2] << 4)).astype(np.uint8)  # row 2i low nibble, 2i + 1 high
    s = rng.uniform(1e-3, 1e-2, size=(k // group_size, n)).astype(np.float32)
    b = (-8 * s * rng.uniform(0.5, 1.5, size=s.shape)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    return x, q, packed, s, b


def make_case(seed, m, k, n, group_size, dtype):
    x, _, packed, s, b = make_codes(np.random.default_rng(seed), m, k, n, group_size)
    return jnp.asarray(x, dtype), jnp.asarray(packed), jnp.asarray(s), jnp.asarray(b)


def check(out, ref, dtype):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    ref = np.asarray(jnp.asarray(ref, jnp.float32))
    assert np.all(np.isfinite(out))
    scale = np.abs(ref).max()
    # 16-bit x: the dequantized tile and the output are rounded to x's dtype; f32 sees summation order only.
    tol = {jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3}.get(jnp.dtype(dtype), 1e-5)
    np.testing.assert_allclose(out, ref, atol=tol * scale, rtol=tol)


@pytest.mark.parametrize(
    "m,k,n,group_size",
    [(1, 64, 8, 32), (3, 256, 24, 64), (16, 384, 5, 128), (2, 96, 7, 96), (4, 40, 3, 40), (1, 128, 16, 2)],
)
def test_reference_matches_float64_dequantize_then_matmul(m, k, n, group_size):
    x, q, packed, s, b = make_codes(np.random.default_rng(k + n), m, k, n, group_size)
    w64 = q.astype(np.float64) * np.repeat(s, group_size, 0) + np.repeat(b, group_size, 0)
    want = x.astype(np.float64) @ w64
    w = fast_jit(lambda *a: dequantize_int4(*a, group_size))(jnp.asarray(packed), jnp.asarray(s), jnp.asarray(b))
    np.testing.assert_allclose(np.asarray(w), w64, rtol=0, atol=2**-22 * np.abs(w64).max())  # two f32 roundings
    got = fast_jit(lambda *a: reference_int4_matmul(*a, group_size=group_size))(
        jnp.asarray(x), jnp.asarray(packed), jnp.asarray(s), jnp.asarray(b)
    )
    assert got.dtype == jnp.float32 and got.shape == (m, n)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_reference_q4_0_as_scale_and_bias():
    # GGUF Q4_0: w = (q - 8) * d, i.e. scale d and bias -8 d.
    rng = np.random.default_rng(1)
    x, q, packed, d, _ = make_codes(rng, 2, 64, 4, 32)
    want = x.astype(np.float64) @ ((q.astype(np.float64) - 8) * np.repeat(d, 32, 0))
    got = fast_jit(lambda *a: reference_int4_matmul(*a, group_size=32))(
        jnp.asarray(x), jnp.asarray(packed), jnp.asarray(d), jnp.asarray(-8 * d)
    )
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def run_both(x, v, s, b, group_size, backend, **kw):
    ref = fast_jit(lambda *a: reference_int4_matmul(*a, group_size=group_size))(x, v, s, b)
    interpret = interpret_for(backend)
    out = fast_jit(lambda *a: int4_matmul(*a, group_size=group_size, backend=backend, interpret=interpret, **kw))(
        x, v, s, b
    )
    assert out.shape == ref.shape and out.dtype == x.dtype
    return out, ref


GPU_CASES = [
    # m, k, n, group_size, dtype, explicit blocks
    (1, 64, 48, 32, jnp.float32, {}),  # decode row, sizes below every block
    (3, 192, 96, 32, jnp.bfloat16, {}),  # 3 k steps of 64, 3 column blocks of 32
    (16, 384, 160, 128, jnp.float32, dict(block_k=128, block_n=32)),  # 3 x 128 k, 5 x 32 n
    (64, 320, 64, 64, jnp.bfloat16, dict(block_m=32, block_k=64)),  # 2 row blocks, 5 k steps of one group
    (7, 96, 130, 32, jnp.bfloat16, dict(block_k=64)),  # k and n padded (a whole zero group)
    (2, 48, 32, 16, jnp.float32, {}),  # groups of 16: k padded to the 32-row minimum block
]


@pytest.mark.parametrize("m,k,n,group_size,dtype,blocks", GPU_CASES)
def test_gpu_matches_reference(m, k, n, group_size, dtype, blocks):
    x, v, s, b = make_case(m + n, m, k, n, group_size, dtype)
    out, ref = run_both(x, v, s, b, group_size, "gpu", **blocks)
    check(out, ref, dtype)


TPU_CASES = [  # interpret-mode Mosaic costs ~1 s a call: few cases, each covering several things
    (1, 768, 384, 32, jnp.bfloat16, dict(block_k=256, block_n=128)),  # decode row: 3 k steps x 3 n blocks
    (3, 192, 96, 64, jnp.float32, {}),  # full-dimension blocks smaller than any tile
    (64, 2048, 256, 128, jnp.bfloat16, dict(block_m=32, block_n=128, block_k=1024)),  # 2 x 2 x 2 grid
    (16, 512, 130, 32, jnp.float32, dict(block_n=128)),  # n padded to 256
]


@pytest.mark.parametrize("m,k,n,group_size,dtype,blocks", TPU_CASES)
def test_tpu_matches_reference(m, k, n, group_size, dtype, blocks):
    x, v, s, b = make_case(m + n, m, k, n, group_size, dtype)
    out, ref = run_both(x, v, s, b, group_size, "tpu", **blocks)
    check(out, ref, dtype)


SHAPES = [(1, 4096, 4096), (37, 4096, 11008), (2048, 11008, 4096), (3, 576, 576), (1, 576, 49152)]  # m, k, n


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("m,k,n,group_size", [(*s, g) for s in SHAPES for g in (32, 64, 128) if s[1] % g == 0])
def test_block_table_gives_legal_blocks(backend, m, k, n, group_size):
    assert set(TABLE) == {"tpu", "gpu"}
    dtype = jnp.bfloat16
    bm, bn, bk = pick_blocks(backend, m, k, n, dtype, group_size)
    if backend == "tpu":
        assert bm % 16 == 0 and (bn % 128 == 0 or bn == n)
        assert bk == k or bk % tpu_k_unit(group_size) == 0
    else:
        assert all(b >= 16 and b & (b - 1) == 0 for b in (bm, bn, bk)) and bk % group_size == 0
    if k % 256 == 0 and n % 128 == 0 and (backend == "gpu" or k % tpu_k_unit(group_size) == 0 or k <= 2048):
        assert k % bk == 0 and n % bn == 0, "aligned weights must not be padded (a copy per call)"


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _args(m=4, k=64, n=16, g=32, x=jnp.bfloat16, v=jnp.uint8, s=jnp.float32, v_rows=None, s_shape=None):
    return (
        _sds((m, k), x),
        _sds((k // 2 if v_rows is None else v_rows, n), v),
        _sds(s_shape or (k // g, n), s),
        _sds((k // g, n), jnp.float32),
    )


@pytest.mark.parametrize(
    "args,kw,match",
    [
        (_args(v_rows=64), {}, "k // 2"),
        (_args(v=jnp.int8), {}, "values must be uint8"),
        (_args(s_shape=(1, 16)), {}, "scales must have shape"),
        (_args(s=jnp.bfloat16), {}, "scales must be float32"),
        (_args(x=jnp.int32), {}, "x must be float32"),
        (_args(), dict(group_size=48), "must divide k"),
        (_args(), dict(group_size=3), "positive even int"),
        (_args(k=96, g=96 // 2), dict(group_size=48), "power of two >= 16"),
        (_args(), dict(block_m=24), "power of two"),
        (_args(), dict(block_k=16), "block_k must be >= group_size"),
        (_args(), dict(backend="tpu", block_n=64), "multiple of 128"),
        (_args(), dict(backend="tpu", block_m=8), "multiple of 16"),
        (_args(k=1024), dict(backend="tpu", block_k=128), "multiple of 256"),
        (_args(k=96, g=24), dict(backend="tpu", group_size=24), "multiple of 16"),
    ],
)
def test_validation_errors(args, kw, match):
    kw = dict(kw)
    backend = kw.pop("backend", "gpu")
    group_size = kw.pop("group_size", 32)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda *a: int4_matmul(*a, group_size=group_size, backend=backend, **kw), *args)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU-only error")
@pytest.mark.parametrize("backend", [None, "auto"])
def test_cpu_without_backend_is_a_clear_error(backend):
    with pytest.raises(ValueError, match="interpret=True"):
        jax.eval_shape(lambda *a: int4_matmul(*a, group_size=32, backend=backend), *_args())


LOWER = [(jnp.bfloat16, 8, 32), (jnp.float32, 8, 128), (jnp.bfloat16, 300, 64)]


def _lower_args(dtype, m, g, k=2048, n=384):
    return [
        _sds((m, k), dtype),
        _sds((k // 2, n), jnp.uint8),
        _sds((k // g, n), jnp.float32),
        _sds((k // g, n), jnp.float32),
    ]


@pytest.mark.parametrize("dtype,m,group_size", LOWER)
def test_lowers_for_tpu(dtype, m, group_size):
    fn = jax.jit(lambda *a: int4_matmul(*a, group_size=group_size, backend="tpu"))
    exported = jax.export.export(fn, platforms=["tpu"])(*_lower_args(dtype, m, group_size))
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize("dtype,m,group_size", LOWER)
def test_lowers_for_cuda(dtype, m, group_size):
    fn = jax.jit(lambda *a: int4_matmul(*a, group_size=group_size, backend="gpu"))
    text = fn.trace(*_lower_args(dtype, m, group_size)).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


@pytest.mark.parametrize("backend,platform", [("tpu", "tpu"), ("gpu", "cuda")])
def test_decode_reads_the_packed_weight_in_place(backend, platform):
    # Aligned weights (a Llama-shaped decode matmul) go to the kernel as they are: no pad, no widening convert,
    # no slice of the u8 values or of the scales outside the kernel; only x is split into even/odd columns.
    fn = jax.jit(lambda *a: int4_matmul(*a, group_size=128, backend=backend))
    text = fn.trace(*_lower_args(jnp.bfloat16, 1, 128, k=4096, n=4096)).lower(lowering_platforms=(platform,)).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1
    # Operands: x's even and odd columns, then the caller's values, scales and biases themselves.
    assert "%arg1, %arg2, %arg3)" in calls[0], calls[0][:300]
