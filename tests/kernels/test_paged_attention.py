"""Paged decode attention: interpret-mode kernels vs the reference, validation errors, TPU/CUDA lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_testlib import assert_close, covering_grid, fast_jit, interpret_for, make_decode_case
from pallas_kernels.paged_attention import paged_attention, reference_paged_attention
from pallas_kernels.paged_attention import gpu as pa_gpu

ARG_ORDER = ("q", "k_pages", "v_pages", "seq_lens", "page_table")


def run_both(case, backend, **kw):
    args = [case[n] for n in ARG_ORDER]
    scales = dict(k_scale=case["k_scale"], v_scale=case["v_scale"])
    ref = fast_jit(lambda *a: reference_paged_attention(*a[:5], k_scale=a[5], v_scale=a[6], **kw))(
        *args, scales["k_scale"], scales["v_scale"])
    interpret = interpret_for(backend)
    out = fast_jit(lambda *a: paged_attention(*a[:5], k_scale=a[5], v_scale=a[6], backend=backend,
                                              interpret=interpret, **kw))(*args, scales["k_scale"], scales["v_scale"])
    return out, ref


# ---------------------------------------------------------------- GPU (Triton) kernel, interpreted: wide sweep
GPU_GRID = covering_grid()


@pytest.mark.parametrize("page_size,head_dim,group,dtype", GPU_GRID)
def test_gpu_matches_reference(page_size, head_dim, group, dtype):
    case = make_decode_case(page_size + head_dim + group, page_size=page_size, head_dim=head_dim, group=group,
                            dtype=dtype)
    out, ref = run_both(case, "gpu")
    assert out.shape == case["q"].shape and out.dtype == case["q"].dtype
    assert_close(out, ref, dtype)
    assert np.all(np.asarray(out[3], np.float32) == 0.0), "seq_len 0 must give exact zeros"


@pytest.mark.parametrize("page_size,head_dim,group,dtype", [
    (16, 64, 4, jnp.float32), (32, 128, 1, jnp.bfloat16), (8, 128, 8, jnp.float16),
])
def test_gpu_int8_kv_cache(page_size, head_dim, group, dtype):
    case = make_decode_case(7, page_size=page_size, head_dim=head_dim, group=group, dtype=dtype, quantized=True)
    out, ref = run_both(case, "gpu")
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("ppcb", [1, 2, 8])
def test_gpu_pages_per_compute_block(ppcb):
    case = make_decode_case(3, page_size=16, head_dim=64, group=4, dtype=jnp.float32, max_pages=11)
    out, ref = run_both(case, "gpu", pages_per_compute_block=ppcb)
    assert_close(out, ref, jnp.float32)


def test_gpu_single_split(monkeypatch):
    # Many programs already -> no split of the sequence axis; exercise that path too.
    monkeypatch.setattr(pa_gpu, "_TARGET_PROGRAMS", 1)
    assert pa_gpu.split_plan(11, 2, 5, 2)[0] == 1
    case = make_decode_case(4, page_size=8, head_dim=64, group=4, dtype=jnp.float32)
    out, ref = run_both(case, "gpu")
    assert_close(out, ref, jnp.float32)


def test_gpu_all_empty_and_custom_scale():
    case = make_decode_case(5, page_size=16, head_dim=64, group=4, dtype=jnp.float32, lens=[0, 0, 9])
    out, ref = run_both(case, "gpu", sm_scale=0.3)
    assert_close(out, ref, jnp.float32)
    assert np.all(np.asarray(out[:2]) == 0.0)


# ---------------------------------------------------------------- TPU (Mosaic) kernel, interpreted: chosen cases
TPU_CASES = [
    # page_size, head_dim, group, dtype, quantized, pages_per_compute_block
    (8, 64, 1, jnp.float32, False, None),
    (16, 128, 4, jnp.float32, False, 2),
    (32, 64, 8, jnp.float32, False, 1),
    (8, 128, 8, jnp.float32, False, 3),  # block size not dividing the table width
    (32, 128, 4, jnp.bfloat16, False, 1),
    (32, 64, 4, jnp.bfloat16, True, 1),  # int8 cache
    (32, 128, 1, jnp.float32, True, 2),  # int8 cache
]


@pytest.mark.parametrize("page_size,head_dim,group,dtype,quantized,ppcb", TPU_CASES)
def test_tpu_matches_reference(page_size, head_dim, group, dtype, quantized, ppcb):
    case = make_decode_case(11 + page_size + group, page_size=page_size, head_dim=head_dim, group=group,
                            dtype=dtype, num_kv_heads=1, quantized=quantized)
    out, ref = run_both(case, "tpu", pages_per_compute_block=ppcb)
    assert_close(out, ref, dtype)
    assert np.all(np.asarray(out[3], np.float32) == 0.0)


# ---------------------------------------------------------------- reference sanity
def test_reference_matches_dense_softmax():
    case = make_decode_case(0, page_size=8, head_dim=64, group=2, dtype=jnp.float32, num_kv_heads=1,
                            lens=[5, 13])
    ref = fast_jit(reference_paged_attention)(*[case[n] for n in ARG_ORDER])
    for b, n in enumerate([5, 13]):
        pages = np.asarray(case["page_table"][b])
        k = np.asarray(case["k_pages"][0][pages]).reshape(-1, 64)[:n]
        v = np.asarray(case["v_pages"][0][pages]).reshape(-1, 64)[:n]
        for h in range(2):
            s = np.asarray(case["q"][b, h]) @ k.T / 8.0
            p = np.exp(s - s.max())
            np.testing.assert_allclose(np.asarray(ref[b, h]), (p / p.sum()) @ v, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- validation
def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _good(dtype=jnp.bfloat16, page_size=16, head_dim=64):
    return dict(q=_sds((2, 8, head_dim), dtype), k_pages=_sds((2, 10, page_size, head_dim), dtype),
                v_pages=_sds((2, 10, page_size, head_dim), dtype), seq_lens=_sds((2,), jnp.int32),
                page_table=_sds((2, 4), jnp.int32))


def _trace(backend="gpu", kw=None, **over):
    a = _good()
    a.update(over)
    jax.eval_shape(lambda **x: paged_attention(**x, backend=backend, **(kw or {})), **a)


@pytest.mark.parametrize("over,match", [
    (dict(q=_sds((2, 7, 64), jnp.bfloat16)), "multiple of num_kv_heads"),
    (dict(q=_sds((2, 8, 128), jnp.bfloat16)), "head_dim"),
    (dict(q=_sds((2, 8), jnp.bfloat16)), "q must be"),
    (dict(v_pages=_sds((2, 9, 16, 64), jnp.bfloat16)), "v_pages shape"),
    (dict(seq_lens=_sds((2,), jnp.int64 if jax.config.jax_enable_x64 else jnp.float32)), "seq_lens must be int32"),
    (dict(seq_lens=_sds((3,), jnp.int32)), "seq_lens must have shape"),
    (dict(page_table=_sds((3, 4), jnp.int32)), "page_table must be"),
    (dict(k_pages=_sds((2, 10, 16, 64), jnp.float32), v_pages=_sds((2, 10, 16, 64), jnp.float32)), "must equal q dtype"),
    (dict(k_pages=_sds((2, 10, 16, 64), jnp.int8), v_pages=_sds((2, 10, 16, 64), jnp.int8)), "needs k_scale"),
    (dict(q=_sds((2, 8, 64), jnp.int32)), "q must be float32"),
])
def test_validation_errors(over, match):
    with pytest.raises(ValueError, match=match):
        _trace(**over)


def test_validation_scales():
    with pytest.raises(ValueError, match="only valid with an int8"):
        _trace(kw=dict(k_scale=_sds((2, 10, 16), jnp.float32), v_scale=_sds((2, 10, 16), jnp.float32)))
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        _trace(kw=dict(k_scale=_sds((2, 10, 16), jnp.float32)))
    i8 = dict(k_pages=_sds((2, 10, 16, 64), jnp.int8), v_pages=_sds((2, 10, 16, 64), jnp.int8))
    with pytest.raises(ValueError, match="k_scale must have shape"):
        _trace(kw=dict(k_scale=_sds((2, 10), jnp.float32), v_scale=_sds((2, 10, 16), jnp.float32)), **i8)


def test_backend_alignment_errors():
    with pytest.raises(ValueError, match="multiple of 16"):
        _trace("tpu", k_pages=_sds((2, 10, 8, 64), jnp.bfloat16), v_pages=_sds((2, 10, 8, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match="power-of-two page_size"):
        _trace("gpu", k_pages=_sds((2, 10, 12, 64), jnp.bfloat16), v_pages=_sds((2, 10, 12, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match="pages_per_compute_block \\* page_size >= 16"):
        a = _good(page_size=8)
        jax.eval_shape(lambda **x: paged_attention(**x, backend="gpu", pages_per_compute_block=1), **a)
    with pytest.raises(ValueError, match="backend must be one of"):
        _trace("cuda")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU-only error")
def test_cpu_without_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="interpret=True"):
        _trace(None)


# ---------------------------------------------------------------- lowering for the real backends (no device needed)
def _lowering_args(dtype, head_dim, quantized, page_size):
    kv = jnp.int8 if quantized else dtype
    a = [_sds((3, 8, head_dim), dtype), _sds((2, 12, page_size, head_dim), kv),
         _sds((2, 12, page_size, head_dim), kv), _sds((3,), jnp.int32), _sds((3, 5), jnp.int32)]
    sc = _sds((2, 12, page_size), jnp.float32) if quantized else None
    return a, sc


LOWER_CASES = [(d, h, False) for d in (jnp.bfloat16, jnp.float32) for h in (64, 128)] + [(jnp.bfloat16, 128, True)]


@pytest.mark.parametrize("dtype,head_dim,quantized", LOWER_CASES)
def test_lowers_for_tpu(dtype, head_dim, quantized):
    a, sc = _lowering_args(dtype, head_dim, quantized, 32)
    f = lambda q, k, v, l, p, ks, vs: paged_attention(q, k, v, l, p, k_scale=ks, v_scale=vs, backend="tpu")
    exported = jax.export.export(jax.jit(f), platforms=["tpu"])(*a, sc, sc)
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize("dtype,head_dim,quantized", LOWER_CASES)
def test_lowers_for_cuda(dtype, head_dim, quantized):
    a, sc = _lowering_args(dtype, head_dim, quantized, 16)
    f = lambda q, k, v, l, p, ks, vs: paged_attention(q, k, v, l, p, k_scale=ks, v_scale=vs, backend="gpu")
    text = jax.jit(f).trace(*a, sc, sc).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
