"""Ragged paged attention (prefill / mixed batches): interpret kernels vs reference, validation, lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_testlib import assert_close, covering_grid, fast_jit, interpret_for, make_ragged_case
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, reference_ragged_paged_attention

ARG_ORDER = ("q", "k_pages", "v_pages", "page_table", "context_lens", "query_start_loc", "num_seqs")
# A cache's storage (the kv_cache_dtype setting's values): int8 pages with scales, float8 pages without.
FP8 = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}


def storage(kv):
    """make_ragged_case's arguments for a cache stored as `kv` ("auto", "int8" or a key of FP8)."""
    return dict(quantized=kv == "int8", fp8=FP8.get(kv))


def run_both(case, backend, **kw):
    args = [case[n] for n in ARG_ORDER] + [case["k_scale"], case["v_scale"]]  # scales: None unless int8
    split = lambda a: (a[:-2], dict(k_scale=a[-2], v_scale=a[-1]))  # noqa: E731
    ref = fast_jit(lambda *a: reference_ragged_paged_attention(*split(a)[0], **split(a)[1], **kw))(*args)
    interpret = interpret_for(backend)
    out = fast_jit(
        lambda *a: ragged_paged_attention(*split(a)[0], **split(a)[1], backend=backend, interpret=interpret, **kw)
    )(*args)
    return out, ref


def assert_padding_rows_zero(out, case):
    used = int(case["query_start_loc"][int(case["num_seqs"])])
    assert np.all(np.asarray(out[used:], np.float32) == 0.0), "rows owned by no sequence must be zero"


# ---------------------------------------------------------------- GPU (Triton) kernel, interpreted: wide sweep
@pytest.mark.parametrize("page_size,head_dim,group,dtype", covering_grid(per_pair=1))
def test_gpu_matches_reference(page_size, head_dim, group, dtype):
    case = make_ragged_case(page_size * 3 + group, page_size=page_size, head_dim=head_dim, group=group, dtype=dtype)
    # Alternate a sliding window in so that it meets every page size and group.
    window = 11 if (page_size // 8 + group) % 2 else None
    out, ref = run_both(case, "gpu", sliding_window=window)
    assert out.shape == case["q"].shape and out.dtype == case["q"].dtype
    assert_close(out, ref, dtype)
    assert_padding_rows_zero(out, case)


@pytest.mark.parametrize("bq,ppcb", [(4, 2), (8, 4), (16, 1)])
def test_gpu_block_sizes(bq, ppcb):
    case = make_ragged_case(1, page_size=16, head_dim=64, group=4, dtype=jnp.float32)
    out, ref = run_both(case, "gpu", queries_per_block=bq, pages_per_compute_block=ppcb)
    assert_close(out, ref, jnp.float32)


def test_gpu_pure_decode_and_window_of_one():
    seqs = [(9, 1), (16, 1), (1, 1), (40, 1)]
    case = make_ragged_case(
        2, page_size=8, head_dim=64, group=8, dtype=jnp.float32, seqs=seqs, pad_tokens=0, spare_seq_slots=0
    )
    for window in (None, 1):
        out, ref = run_both(case, "gpu", sliding_window=window, sm_scale=0.2)
        assert_close(out, ref, jnp.float32)


@pytest.mark.parametrize(
    "page_size,head_dim,group,dtype,window,kv",
    [
        (16, 64, 4, jnp.float32, None, "int8"),
        (8, 128, 1, jnp.bfloat16, 11, "int8"),
        (32, 64, 8, jnp.float16, None, "int8"),
        (16, 64, 4, jnp.float32, 11, "fp8_e4m3"),
        (8, 128, 2, jnp.bfloat16, None, "fp8_e5m2"),
    ],
)
def test_gpu_8bit_kv_cache(page_size, head_dim, group, dtype, window, kv):
    """int8 pages with per-token scales (NaN scales on unused pages and past each length must not
    leak), or float8 pages widened to q's dtype (NaN traps, GARBAGE past the lengths)."""
    case = make_ragged_case(9 + group, page_size=page_size, head_dim=head_dim, group=group, dtype=dtype, **storage(kv))
    out, ref = run_both(case, "gpu", sliding_window=window)
    assert_close(out, ref, dtype)
    assert_padding_rows_zero(out, case)


def test_gpu_num_seqs_as_python_int_and_shape_1():
    case = make_ragged_case(3, page_size=16, head_dim=64, group=1, dtype=jnp.float32)
    n = int(case["num_seqs"])
    args = [case[k] for k in ARG_ORDER[:-1]]
    ref = fast_jit(lambda *a: reference_ragged_paged_attention(*a, n))(*args)
    interpret = interpret_for("gpu")
    out = fast_jit(
        lambda *a: ragged_paged_attention(*a, jnp.full((1,), n, jnp.int32), backend="gpu", interpret=interpret)
    )(*args)
    assert_close(out, ref, jnp.float32)


# ---------------------------------------------------------------- TPU (Mosaic) kernel, interpreted: chosen cases
TPU_CASES = [
    # page_size, head_dim, group, dtype, window, queries_per_block, pages_per_compute_block
    (8, 64, 1, jnp.float32, None, 8, 2),
    (16, 128, 4, jnp.float32, 11, 4, 1),
    (32, 64, 8, jnp.float32, None, None, None),  # default block sizes
    (16, 128, 1, jnp.bfloat16, None, 16, 3),  # block not dividing the table width
    (16, 64, 8, jnp.bfloat16, 11, 8, 2),
    (32, 64, 4, jnp.bfloat16, 11, 8, 1, "int8"),  # int8 cache (TPU pages of 32 int8 rows), window
    (32, 128, 1, jnp.float32, None, 16, 2, "int8"),  # int8 cache
    (32, 64, 4, jnp.bfloat16, 11, 8, 2, "fp8_e4m3"),  # float8 pages: 32-row tiles too
    (32, 64, 1, jnp.float32, None, 16, 1, "fp8_e5m2"),
]


@pytest.mark.parametrize(
    "page_size,head_dim,group,dtype,window,bq,ppcb,kv", [c if len(c) == 8 else c + ("auto",) for c in TPU_CASES]
)
def test_tpu_matches_reference(page_size, head_dim, group, dtype, window, bq, ppcb, kv):
    # Fewer tokens than the GPU mix: every grid step costs real time in the TPU simulator.
    seqs = [(1, 1), (2 * page_size + 5, page_size + 3), (page_size, 1), (7, 0)]
    case = make_ragged_case(
        page_size + group,
        page_size=page_size,
        head_dim=head_dim,
        group=group,
        dtype=dtype,
        num_kv_heads=1,
        seqs=seqs,
        pad_tokens=2,
        **storage(kv),
    )
    out, ref = run_both(case, "tpu", sliding_window=window, queries_per_block=bq, pages_per_compute_block=ppcb)
    assert_close(out, ref, dtype)
    assert_padding_rows_zero(out, case)


# ---------------------------------------------------------------- reference sanity: prefill == per-token decode
def test_reference_equals_per_token_decode():
    case = make_ragged_case(
        4, page_size=8, head_dim=64, group=2, dtype=jnp.float32, seqs=[(13, 6)], pad_tokens=0, spare_seq_slots=0
    )
    ref = fast_jit(reference_ragged_paged_attention)(*[case[n] for n in ARG_ORDER])
    # Token j of the prompt, decoded alone (a sequence of one query token), sees exactly the first
    # 13 - 6 + j + 1 cached tokens.
    q = case["q"]
    lens = jnp.arange(8, 14, dtype=jnp.int32)
    table = jnp.repeat(case["page_table"][:1], 6, axis=0)
    starts = jnp.arange(7, dtype=jnp.int32)
    dec = fast_jit(reference_ragged_paged_attention)(
        q, case["k_pages"], case["v_pages"], table, lens, starts, jnp.int32(6)
    )
    np.testing.assert_allclose(np.asarray(ref), np.asarray(dec), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- validation
def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _good():
    return dict(
        q=_sds((10, 8, 64), jnp.bfloat16),
        k_pages=_sds((2, 12, 16, 64), jnp.bfloat16),
        v_pages=_sds((2, 12, 16, 64), jnp.bfloat16),
        page_table=_sds((3, 4), jnp.int32),
        context_lens=_sds((3,), jnp.int32),
        query_start_loc=_sds((4,), jnp.int32),
        num_seqs=_sds((1,), jnp.int32),
    )


def _trace(backend="gpu", kw=None, **over):
    a = _good()
    a.update(over)
    jax.eval_shape(lambda **x: ragged_paged_attention(**x, backend=backend, **(kw or {})), **a)


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(q=_sds((10, 7, 64), jnp.bfloat16)), "multiple of num_kv_heads"),
        (dict(q=_sds((10, 8, 128), jnp.bfloat16)), "head_dim"),
        (dict(context_lens=_sds((4,), jnp.int32)), "context_lens must have shape"),
        (dict(query_start_loc=_sds((3,), jnp.int32)), "query_start_loc must have shape"),
        (dict(num_seqs=_sds((2,), jnp.int32)), "num_seqs must be"),
        (dict(page_table=_sds((3, 4), jnp.float32)), "page_table must be int32"),
        (
            dict(k_pages=_sds((2, 12, 16, 64), jnp.float32), v_pages=_sds((2, 12, 16, 64), jnp.float32)),
            "must equal q dtype",
        ),
    ],
)
def test_validation_errors(over, match):
    with pytest.raises(ValueError, match=match):
        _trace(**over)


def test_validation_options_and_backends():
    with pytest.raises(ValueError, match="sliding_window"):
        _trace(kw=dict(sliding_window=0))
    with pytest.raises(ValueError, match="power-of-two queries_per_block"):
        _trace(kw=dict(queries_per_block=12))
    with pytest.raises(ValueError, match="multiple of 16"):
        _trace("tpu", k_pages=_sds((2, 12, 8, 64), jnp.bfloat16), v_pages=_sds((2, 12, 8, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match="needs k_scale"):
        _trace(k_pages=_sds((2, 12, 16, 64), jnp.int8), v_pages=_sds((2, 12, 16, 64), jnp.int8))
    fp8 = _sds((2, 12, 16, 64), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="only valid with an int8"):  # float8 pages carry no scales here
        _trace(
            k_pages=fp8,
            v_pages=fp8,
            kw=dict(k_scale=_sds((2, 12, 16), jnp.float32), v_scale=_sds((2, 12, 16), jnp.float32)),
        )
    with pytest.raises(ValueError, match="multiple of 32"):  # TPU float8 pages: whole 32-row tiles
        _trace("tpu", k_pages=fp8, v_pages=fp8)
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="interpret=True"):
            _trace(None)


# ---------------------------------------------------------------- lowering for the real backends
def _lowering_args(dtype, head_dim, page_size):
    return [
        _sds((24, 8, head_dim), dtype),
        _sds((2, 12, page_size, head_dim), dtype),
        _sds((2, 12, page_size, head_dim), dtype),
        _sds((3, 5), jnp.int32),
        _sds((3,), jnp.int32),
        _sds((4,), jnp.int32),
        _sds((1,), jnp.int32),
    ]


LOWER_CASES = [(d, h) for d in (jnp.bfloat16, jnp.float32) for h in (64, 128)]


@pytest.mark.parametrize("dtype,head_dim", LOWER_CASES)
def test_lowers_for_tpu(dtype, head_dim):
    f = lambda *a: ragged_paged_attention(*a, backend="tpu", sliding_window=64)
    exported = jax.export.export(jax.jit(f), platforms=["tpu"])(*_lowering_args(dtype, head_dim, 32))
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize("kv", ["int8", *FP8])
@pytest.mark.parametrize("platform,page_size", [("tpu", 32), ("cuda", 16)])
def test_8bit_cache_lowers(platform, page_size, kv):
    """int8 pages with their scales, float8 pages alone: Mosaic and Triton lower their widening."""
    args = _lowering_args(jnp.bfloat16, 128, page_size)
    args[1] = args[2] = _sds(args[1].shape, FP8.get(kv, jnp.int8))
    scales = [_sds(args[1].shape[:3], jnp.float32)] * 2 if kv == "int8" else []
    backend = "tpu" if platform == "tpu" else "gpu"
    f = lambda *a: ragged_paged_attention(
        *a[:7], k_scale=a[7] if scales else None, v_scale=a[8] if scales else None, backend=backend, sliding_window=64
    )
    text = jax.jit(f).trace(*args, *scales).lower(lowering_platforms=(platform,)).as_text()
    assert ("tpu_custom_call" if platform == "tpu" else "triton") in text


@pytest.mark.parametrize("dtype,head_dim", LOWER_CASES)
def test_lowers_for_cuda(dtype, head_dim):
    f = lambda *a: ragged_paged_attention(*a, backend="gpu", sliding_window=64)
    text = jax.jit(f).trace(*_lowering_args(dtype, head_dim, 16)).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
