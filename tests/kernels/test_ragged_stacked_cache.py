"""Ragged paged attention over the whole stacked cache [L, K, NP, S, H] with a (traced) layer index.

The other layers of the stack are NaN, so a kernel that reads the wrong layer, or anything outside
the pages of its own layer that it should not, fails; the layer, window and softmax scale are traced
operands (one compiled kernel for every layer of a scanned step). Mixed rows: decodes, a first prompt
chunk, a partly prefilled chunk, an idle row, padding tokens and padding rows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_testlib import assert_close, fast_jit, interpret_for, make_ragged_case
from pallas_kernels.ragged_paged_attention import gpu as gpu_lib
from pallas_kernels.ragged_paged_attention import plan as plan_lib
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, reference_ragged_paged_attention

ARGS = ("q", "k_pages", "v_pages", "page_table", "context_lens", "query_start_loc", "num_seqs")
NUM_LAYERS, LAYER = 3, 1


def stacked(case):
    """The case's one-layer cache as layer LAYER of a NaN stack (int8: 127 with NaN scales)."""
    out = dict(case)
    for name in ("k_pages", "v_pages", "k_scale", "v_scale"):
        x = case[name]
        if x is None:
            continue
        trap = jnp.full(x.shape, 127 if x.dtype == jnp.int8 else jnp.nan, x.dtype)
        out[name] = jnp.stack([trap] * LAYER + [x] + [trap] * (NUM_LAYERS - 1 - LAYER))
    return out


def run_stacked(case, backend, window, sm_scale, **kw):
    """(kernel on the stack with traced layer/window/scale, reference on the one layer)."""
    st = stacked(case)
    interpret = interpret_for(backend)

    def kernel(layer, window, sm_scale, *a, k_scale, v_scale):
        return ragged_paged_attention(
            *a,
            layer=layer,
            sliding_window=window,
            sm_scale=sm_scale,
            k_scale=k_scale,
            v_scale=v_scale,
            backend=backend,
            interpret=interpret,
            **kw,
        )

    out = fast_jit(kernel)(
        jnp.int32(LAYER),
        jnp.int32(window),
        jnp.float32(sm_scale),
        *[st[n] for n in ARGS],
        k_scale=st["k_scale"],
        v_scale=st["v_scale"],
    )
    ref = reference_ragged_paged_attention(
        *[case[n] for n in ARGS],
        k_scale=case["k_scale"],
        v_scale=case["v_scale"],
        sliding_window=window,
        sm_scale=sm_scale,
    )
    return out, ref


def mixed_rows(page_size):
    # (context incl. new tokens, new tokens): two decodes, a first prompt chunk, a chunk after a
    # cached prefix, a row with nothing new
    return [(2 * page_size + 3, 1), (5, 1), (9, 9), (2 * page_size + 5, page_size + 3), (7, 0)]


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("window", [1 << 30, 11])  # no window (clamped inside) and a real one
def test_gpu_stacked_cache(quantized, window):
    case = make_ragged_case(
        5,
        page_size=16,
        head_dim=64,
        group=4,
        dtype=jnp.float32,
        seqs=mixed_rows(16),
        pad_tokens=3,
        spare_seq_slots=2,
        quantized=quantized,
    )
    out, ref = run_stacked(case, "gpu", window, 0.2)
    assert_close(out, ref, jnp.float32)
    used = int(case["query_start_loc"][int(case["num_seqs"])])
    assert np.all(np.asarray(out[used:]) == 0.0), "padding tokens attend to nothing"


@pytest.mark.parametrize("quantized", [False, True])
def test_tpu_stacked_cache(quantized):
    page_size = 32 if quantized else 16  # TPU int8 pages hold whole 32-row tiles
    seqs = [(2 * page_size + 3, 1), (9, 9), (2 * page_size + 5, page_size + 3), (7, 0)]
    case = make_ragged_case(
        6,
        page_size=page_size,
        head_dim=64,
        group=2,
        dtype=jnp.float32,
        num_kv_heads=1,
        seqs=seqs,
        pad_tokens=2,
        quantized=quantized,
    )
    out, ref = run_stacked(case, "tpu", 11, 0.2, queries_per_block=8, pages_per_compute_block=2)
    assert_close(out, ref, jnp.float32)


def test_gpu_decodes_split_over_context():
    """Few long decodes: the GPU kernel splits their keys over programs and merges them exactly."""
    seqs = [(7 * 16 + 3, 1), (5 * 16, 1), (1, 1)]
    case = make_ragged_case(
        7, page_size=16, head_dim=64, group=4, dtype=jnp.float32, seqs=seqs, pad_tokens=1, spare_seq_slots=0
    )
    # bq 4 x group 4 = 16 rows; 1 page per block: every key block of a row could be its own split
    items = plan_lib.max_work_items(num_tokens=4, max_seqs=3, bq=4)
    splits, _ = gpu_lib.split_plan(items, num_kv_heads=2, max_blocks=case["page_table"].shape[1])
    assert splits > 1
    for window in (1 << 30, 20):
        out, ref = run_stacked(case, "gpu", window, 0.125, queries_per_block=4, pages_per_compute_block=1)
        assert_close(out, ref, jnp.float32)


def test_one_compiled_kernel_serves_every_layer_of_a_scan():
    """A scan over layers passes its carried stack unsliced; layer i's output is layer i's attention."""
    case = make_ragged_case(
        8, page_size=16, head_dim=64, group=2, dtype=jnp.float32, seqs=mixed_rows(16), pad_tokens=1, spare_seq_slots=0
    )
    rng = np.random.default_rng(0)
    k = case["k_pages"][None] + jnp.asarray(rng.standard_normal((NUM_LAYERS, 1, 1, 1, 64)), jnp.float32)
    v = case["v_pages"][None] * jnp.arange(1, NUM_LAYERS + 1, dtype=jnp.float32)[:, None, None, None, None]
    windows = jnp.asarray([1 << 30, 6, 11], jnp.int32)
    scales = jnp.asarray([0.125, 0.2, 0.3], jnp.float32)
    rest = [case[n] for n in ARGS[3:]]
    interpret = interpret_for("gpu")

    def step(q, k, v):
        def body(_, xs):
            layer, window, scale = xs
            return None, ragged_paged_attention(
                q, k, v, *rest, layer=layer, sliding_window=window, sm_scale=scale, backend="gpu", interpret=interpret
            )

        return jax.lax.scan(body, None, (jnp.arange(NUM_LAYERS, dtype=jnp.int32), windows, scales))[1]

    out = fast_jit(step)(case["q"], k, v)
    for layer in range(NUM_LAYERS):
        ref = reference_ragged_paged_attention(
            case["q"], k[layer], v[layer], *rest, sliding_window=windows[layer], sm_scale=scales[layer]
        )
        assert_close(out[layer], ref, jnp.float32)


def test_stacked_cache_validation():
    sds = jax.ShapeDtypeStruct
    a = [
        sds((10, 8, 64), jnp.float32),
        sds((3, 2, 12, 16, 64), jnp.float32),
        sds((3, 2, 12, 16, 64), jnp.float32),
        sds((3, 4), jnp.int32),
        sds((3,), jnp.int32),
        sds((4,), jnp.int32),
        sds((1,), jnp.int32),
    ]
    with pytest.raises(ValueError, match="needs layer="):
        jax.eval_shape(lambda *x: ragged_paged_attention(*x, backend="gpu"), *a)
    with pytest.raises(ValueError, match="stacked cache"):
        jax.eval_shape(
            lambda *x: ragged_paged_attention(*x, layer=0, backend="gpu"),
            a[0],
            sds((2, 12, 16, 64), jnp.float32),
            sds((2, 12, 16, 64), jnp.float32),
            *a[3:],
        )
    with pytest.raises(ValueError, match="layer must be int32"):
        jax.eval_shape(lambda *x: ragged_paged_attention(*x[:7], layer=x[7], backend="gpu"), *a, sds((), jnp.float32))
