"""The flat ragged step: rows do not see one another, the host packers agree, the plain-JAX attention.

A mixed batch (two decodes with context, a first prompt chunk, the last chunk of a partly
prefilled prompt, a verification of 3 tokens) through `forward_ragged` gives the logits and the
cache that each row run alone through it gives; unused pages hold NaN throughout. (That the
forward itself is right is the Hugging Face parity tests': tests/model/.)
"""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.extend.core
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.model.kv_cache import KVCache, RaggedBatch, cache_shape, write_kv_slots
from jaxserve.model.layers import ragged_attention_reference
from jaxserve.model.llama import forward_ragged
from jaxserve.model.weights import init_dummy_params, unstack_layers
from jaxserve.model import ragged
from jaxserve.model.ragged import PAD_SLOT, RaggedRow, pack_ragged

PAGE = 4
P = 8  # pages per row
N, S, L = 32, 8, 8  # token bucket, rows, logits
T_REF = 32  # the one token bucket (and logits) each row runs alone at (one compilation)
# (history already cached, new tokens, logits returned): decode, decode, first prompt chunk,
# last chunk of a partly prefilled prompt, verification of 2 drafts (+ the pending token)
ROWS = [(13, 1, 1), (30, 1, 1), (0, 9, 0), (11, 7, 1), (20, 3, 3)]


def make_cfg(**kw):
    return ModelConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        **kw,
    )


def nan_cache(cfg, num_pages, quantized):
    """A cache whose every slot is a trap until written: NaN, or int8 127 with NaN scales."""
    shape = cache_shape(cfg, num_pages, PAGE)[1:]  # one replica
    if not quantized:
        return KVCache(k=jnp.full(shape, jnp.nan, jnp.float32), v=jnp.full(shape, jnp.nan, jnp.float32))
    return KVCache(
        k=jnp.full(shape, 127, jnp.int8),
        v=jnp.full(shape, 127, jnp.int8),
        k_scale=jnp.full(shape[:-1], jnp.nan),
        v_scale=jnp.full(shape[:-1], jnp.nan),
    )


RAGGED = jax.jit(forward_ragged, static_argnames=("cfg", "scan_layers"))


def run_alone(params, cache, cfg, tokens, start, pages, scan):
    """`forward_ragged` on one row alone, padded to T_REF tokens, S rows and P pages, with the logits
    of every token: (logits f32[T_REF, V] (the row's first), cache)."""
    row = RaggedRow(tokens, start, pages, len(tokens))
    batch = RaggedBatch.build([row], page_size=PAGE, num_tokens=T_REF, num_rows=S, max_pages=P, num_logits=T_REF)
    return RAGGED(params, cache, batch, cfg=cfg, scan_layers=scan)


def scenario(cfg, quantized, seed=0, spec=ROWS):
    """Page lists, history tokens and new tokens of the rows of `spec` (history, new, logits)."""
    rng = np.random.default_rng(seed)
    need = [-(-(h + n) // PAGE) for h, n, _ in spec]
    num_pages = 1 + sum(need) + 3  # page 0 (padding) and 3 pages no row owns stay NaN
    ids = rng.permutation(np.arange(1, num_pages))
    page_lists, c = [], 0
    for k in need:
        page_lists.append([int(x) for x in ids[c : c + k]])
        c += k
    history = [rng.integers(0, cfg.vocab_size, h).tolist() for h, _, _ in spec]
    new = [rng.integers(0, cfg.vocab_size, n).tolist() for _, n, _ in spec]
    return num_pages, page_lists, history, new


def run_scenario(cfg, params, quantized, scan):
    num_pages, pages, history, new = scenario(cfg, quantized)
    cache = nan_cache(cfg, num_pages, quantized)
    for (h, _, _), toks, pg in zip(ROWS, history, pages):
        if h:
            _, cache = run_alone(params, cache, cfg, toks, 0, pg, scan)
    base = cache
    ref_logits, ref_cache = [], base
    for (h, n, nl), toks, pg in zip(ROWS, new, pages):
        logits, ref_cache = run_alone(params, ref_cache, cfg, toks, h, pg, scan)
        ref_logits.append(np.asarray(logits[n - nl : n]))
    rows = [RaggedRow(toks, h, pg, nl) for (h, _, nl), toks, pg in zip(ROWS, new, pages)]
    batch = RaggedBatch.build(rows, page_size=PAGE, num_tokens=N, num_rows=S, max_pages=P, num_logits=L)
    logits, cache = RAGGED(params, base, batch, cfg=cfg, scan_layers=scan)
    return dict(
        logits=np.asarray(logits),
        cache=cache,
        ref_logits=np.concatenate(ref_logits),
        ref_cache=ref_cache,
        base=base,
        pages=pages,
        num_pages=num_pages,
    )


def assert_same_cache(got, ref):
    for name in ("k", "v", "k_scale", "v_scale"):
        a, b = getattr(got, name), getattr(ref, name)
        if a is None:
            assert b is None
            continue
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype == np.int8:  # the same float K/V up to rounding: a quantized step may differ by one
            assert np.abs(a.astype(np.int32) - b.astype(np.int32)).max() <= 1, name
        else:
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, equal_nan=True, err_msg=name)


CFG = make_cfg()
PARAMS = init_dummy_params(CFG, seed=1, dtype=jnp.float32, std=0.15)


@pytest.mark.parametrize("variant", ["unrolled", "scan", "sliding_window", "int8_kv"])
def test_mixed_batch_equals_rows_alone(variant):
    """(a) mixed rows, (c) sliding window, (d) int8 KV cache; (b) padding writes nothing, NaN does not leak."""
    cfg = make_cfg(sliding_window=6) if variant == "sliding_window" else CFG
    params = PARAMS if variant == "scan" else unstack_layers(PARAMS)
    out = run_scenario(cfg, params, quantized=variant == "int8_kv", scan=variant == "scan")
    n_logits = sum(nl for _, _, nl in ROWS)
    assert out["logits"].shape == (L, cfg.vocab_size)
    assert np.all(np.isfinite(out["logits"])), "NaN from unused pages reached the logits"
    np.testing.assert_allclose(out["logits"][:n_logits], out["ref_logits"], atol=1e-5, rtol=0)
    # Same cache, slot for slot: padding tokens (slot -1) wrote nothing, so every slot no row wrote
    # (page 0, the unowned pages, the tails of last pages) still holds its NaN.
    assert_same_cache(out["cache"], out["ref_cache"])
    owned = {p for pg in out["pages"] for p in pg}
    unowned = [p for p in range(out["num_pages"]) if p not in owned]
    k = np.asarray(out["cache"].k_scale if out["cache"].quantized else out["cache"].k)
    assert 0 in unowned and np.all(np.isnan(k[:, :, unowned])), "a padding token wrote into a page"


def test_scanned_equals_unrolled():
    """(e) the stacked-weight scan and the per-layer tuple give one result."""
    num_pages, pages, _, new = scenario(CFG, False)
    rows = [RaggedRow(toks, 0, pg, nl) for (_, _, nl), toks, pg in zip(ROWS, new, pages)]
    batch = RaggedBatch.build(rows, page_size=PAGE, num_tokens=N, num_rows=S, max_pages=P, num_logits=L)
    cache = nan_cache(CFG, num_pages, False)
    a, ca = RAGGED(PARAMS, cache, batch, cfg=CFG, scan_layers=True)
    b, cb = RAGGED(unstack_layers(PARAMS), cache, batch, cfg=CFG, scan_layers=False)
    c, _ = RAGGED(PARAMS, cache, batch, cfg=CFG, scan_layers=False)  # stacked weights, sliced per layer
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(c), np.asarray(b), atol=1e-5, rtol=0)
    assert_same_cache(ca, cb)


@pytest.mark.parametrize("pack", [ragged._pack_by_row, ragged._pack_by_array])
def test_both_packers_write_the_layout(pack):
    rows = [RaggedRow([5, 6, 7], 0, [3, 9], 0), RaggedRow([8], 5, [4, 2], 1), RaggedRow([1, 2], 2, [7], 2)]
    a = pack(rows, page_size=4, num_tokens=8, num_rows=4, max_pages=3, num_logits=4)
    np.testing.assert_array_equal(a.tokens, [5, 6, 7, 8, 1, 2, 0, 0])
    np.testing.assert_array_equal(a.positions, [0, 1, 2, 5, 2, 3, 0, 0])
    np.testing.assert_array_equal(a.slots, [12, 13, 14, 9, 30, 31, PAD_SLOT, PAD_SLOT])
    np.testing.assert_array_equal(a.token_row, [0, 0, 0, 1, 2, 2, 4, 4])
    np.testing.assert_array_equal(a.query_start, [0, 3, 4, 6, 6])
    np.testing.assert_array_equal(a.context_lens, [3, 6, 4, 0])
    np.testing.assert_array_equal(a.page_table, [[3, 9, 0], [4, 2, 0], [7, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(a.logit_index, [3, 4, 5, 0])
    with pytest.raises(ValueError, match="pages"):
        pack([RaggedRow([1] * 5, 0, [1])], page_size=4, num_tokens=8, num_rows=2, max_pages=2, num_logits=1)
    with pytest.raises(ValueError, match="num_logits"):
        pack([RaggedRow([1], 0, [1], 2)], page_size=4, num_tokens=8, num_rows=2, max_pages=2, num_logits=4)
    with pytest.raises(ValueError, match="do not fit"):
        pack(rows, page_size=4, num_tokens=5, num_rows=4, max_pages=3, num_logits=4)


def test_the_array_packer_agrees_with_the_row_loop():
    """pack_ragged takes the loop for few rows and whole-array NumPy for many: both give the same
    arrays for random steps (decodes, chunks, verifications, placeholders, spare pages)."""
    rng = np.random.default_rng(0)
    for trial in range(200):
        rows = []
        for _ in range(int(rng.integers(0, 17))):
            n = int(rng.integers(1, 6))
            start = int(rng.integers(0, 20))
            pages = rng.integers(1, 50, size=-(-(start + n) // 4) + int(rng.integers(0, 2))).tolist()
            tokens = rng.integers(-3, 100, size=n).tolist()  # placeholders (< -1) pack like any id
            rows.append(RaggedRow(tokens, start, pages, int(rng.integers(0, n + 1))))
        shape = dict(page_size=4, num_tokens=96, num_rows=16, max_pages=8, num_logits=96)
        by_row, by_array = ragged._pack_by_row(rows, **shape), ragged._pack_by_array(rows, **shape)
        for field in dataclasses.fields(by_row):
            want, got = getattr(by_row, field.name), getattr(by_array, field.name)
            np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}: {field.name}")
            assert got.dtype == want.dtype == np.int32


def test_rectangle_rows_lay_out_as_the_host_packer_does():
    """`steps.rows_as_ragged` (the research steps' layout, built on the device) gives `pack_ragged`'s
    arrays for the same rows; with all logits, every token's row by row (past num_new: the row's
    last); a padding row (num_new 0) has no tokens and context 0."""
    from jaxserve.model.kv_cache import StepBatch
    from jaxserve.steps import rows_as_ragged

    rng = np.random.default_rng(3)
    B, T, pages = 4, 5, 3
    tokens = rng.integers(0, 100, (B, T)).astype(np.int32)
    start = np.asarray([0, 7, 3, 9], np.int32)
    table = rng.permutation(np.arange(1, 1 + B * pages)).reshape(B, pages).astype(np.int32)
    layout = jax.jit(rows_as_ragged, static_argnums=(1, 2))
    num_new = np.asarray([5, 1, 3, 2], np.int32)
    got = layout(StepBatch(tokens, start, num_new, table), PAGE, False)
    rows = [RaggedRow(tokens[b, : num_new[b]].tolist(), int(start[b]), table[b].tolist()) for b in range(B)]
    want = pack_ragged(rows, page_size=PAGE, num_tokens=B * T, num_rows=B, max_pages=pages, num_logits=B)
    for field in dataclasses.fields(want):
        np.testing.assert_array_equal(np.asarray(getattr(got, field.name)), getattr(want, field.name), field.name)
    every = layout(StepBatch(tokens, start, num_new, table), PAGE, True).logit_index
    np.testing.assert_array_equal(
        np.asarray(every).reshape(B, T), [[0, 1, 2, 3, 4], [5, 5, 5, 5, 5], [6, 7, 8, 8, 8], [9, 10, 10, 10, 10]]
    )
    padded = layout(StepBatch(tokens, start, np.asarray([2, 0, 3, 0], np.int32), table), PAGE, False)
    np.testing.assert_array_equal(np.asarray(padded.query_start), [0, 2, 2, 5, 5])
    np.testing.assert_array_equal(np.asarray(padded.context_lens), [2, 0, 6, 0])
    np.testing.assert_array_equal(np.asarray(padded.token_row), [0, 0, 2, 2, 2] + [B] * (B * T - 5))
    assert np.all(np.asarray(padded.slots)[5:] == PAD_SLOT) and np.all(np.asarray(padded.logit_index) < B * T)


def test_host_packer_does_not_import_jax():
    code = "import sys, jaxserve.model.ragged; assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("quantized", [False, True])
def test_write_kv_slots_drops_out_of_range(quantized):
    cfg = make_cfg()
    cache = nan_cache(cfg, 4, quantized)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((5, 2, 16)), jnp.float32)
    slots = jnp.asarray([1, -1, 15, 16, 1000], jnp.int32)  # 4 pages of 4: 16 and beyond are out of range
    out = jax.jit(write_kv_slots)(cache, 1, k, k * 2, slots)
    got = np.asarray(out.k_scale if quantized else out.k).reshape(2, 2, 16, *(() if quantized else (16,)))
    written = np.zeros(16, bool)
    written[[1, 15]] = True
    assert np.all(np.isnan(got[0])), "layer 0 untouched"
    assert np.all(np.isnan(got[1][:, ~written])), "out-of-range slots dropped, nothing else written"
    assert np.all(np.isfinite(got[1][:, written]))
    if not quantized:
        np.testing.assert_array_equal(got[1][:, 15], np.asarray(k[2]))
        np.testing.assert_array_equal(np.asarray(out.v).reshape(2, 2, 16, 16)[1][:, 1], np.asarray(k[0] * 2))


def _largest_intermediate(fn, *args) -> int:
    """Elements of the largest array any equation of fn's jaxpr (sub-jaxprs included) makes."""

    def walk(jaxpr):
        big = 0
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                big = max(big, int(np.prod(v.aval.shape)) if hasattr(v.aval, "shape") else 0)
            for p in eqn.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        big = max(big, walk(sub.jaxpr))
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        big = max(big, walk(sub))
        return big

    return walk(jax.make_jaxpr(fn)(*args).jaxpr)


@pytest.mark.parametrize("quantized", [False, True])
def test_reference_attention_memory_is_ragged(quantized):
    """(f) no [N, heads, P*S, H] (nor per-token [N, K, P*S, H]): the intermediates stay within
    O(R*P*S*K*H + N*heads*P*S), on a step of many tokens in few rows, where the per-token gather is far larger."""
    n, rows, heads, kv, h, pages, ps = 128, 4, 4, 4, 16, 8, 8  # group 1: a per-token gather is the naive size
    ctx = pages * ps
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((n, heads, h)), jnp.float32)
    if quantized:
        kp = jnp.asarray(rng.integers(-127, 128, (kv, 40, ps, h)), jnp.int8)
        scale = jnp.asarray(rng.uniform(0.01, 0.02, (kv, 40, ps)), jnp.float32)
    else:
        kp, scale = jnp.asarray(rng.standard_normal((kv, 40, ps, h)), jnp.float32), None
    lens = [60, 1, 50, 17]  # q lengths: a long chunk, a decode, two chunks (128 tokens)
    qs = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    context = jnp.asarray([64, 30, 60, 40], jnp.int32)
    table = jnp.asarray(rng.integers(1, 40, (rows, pages)), jnp.int32)
    positions = jnp.zeros(n, jnp.int32)
    naive = n * heads * ctx * h
    bound = 2 * rows * ctx * kv * h + 3 * n * heads * ctx + rows * heads * ctx

    def ours(q, kp, table):
        stack = lambda x: None if x is None else x[None]  # noqa: E731  (a one-layer stack)
        return ragged_attention_reference(
            q,
            stack(kp),
            stack(kp),
            0,
            positions,
            qs,
            context,
            table,
            7,
            0.25,
            k_scale=stack(scale),
            v_scale=stack(scale),
        )

    got = _largest_intermediate(ours, q, kp, table)
    assert got < naive and got <= bound, (got, bound, naive)

    # The check has teeth: gathering each token's row of keys (the kernels' reference does) breaks it.
    from pallas_kernels.ragged_paged_attention import reference_ragged_paged_attention

    def per_token(q, kp, table):
        return reference_ragged_paged_attention(
            q, kp, kp, table, context, qs, jnp.int32(rows), k_scale=scale, v_scale=scale
        )

    assert _largest_intermediate(per_token, q, kp, table) > bound


# 7 one-token rows and one of 25 tokens: with N = 32, S = 8 the most work items a step can hold
# (8 + 24 // 4 = 14 tiles of the default 4 tokens)
WORST_ROWS = [(3 * i, 1, 1) for i in range(7)] + [(2, 25, 1)]


@pytest.mark.parametrize("spec", [ROWS, WORST_ROWS], ids=["mixed", "most_items"])
@pytest.mark.parametrize("query_tile", [1, 3, None, N])
def test_reference_attention_any_tile_equals_kernel_reference(query_tile, spec):
    """Every query tile gives what the kernels' plain-JAX reference (a gather of keys per token)
    gives each row alone (traced window and scale)."""
    from pallas_kernels.ragged_paged_attention import reference_ragged_paged_attention

    rng = np.random.default_rng(2)
    num_pages, pages, _, new = scenario(CFG, False, spec=spec)
    rows = [RaggedRow(toks, h, pg, nl) for (h, _, nl), toks, pg in zip(spec, new, pages)]
    b = pack_ragged(rows, page_size=PAGE, num_tokens=N, num_rows=S, max_pages=P, num_logits=L)
    kp = rng.standard_normal((2, num_pages, PAGE, 16)).astype(np.float32)
    vp = rng.standard_normal((2, num_pages, PAGE, 16)).astype(np.float32)
    for r in range(S):  # slots no row holds are NaN
        for p in range(P):
            if r >= len(rows) or p * PAGE >= b.context_lens[r]:
                continue
            kp[:, b.page_table[r, p], max(0, b.context_lens[r] - p * PAGE) :] = np.nan
    owned = {p for pg in pages for p in pg}
    kp[:, [p for p in range(num_pages) if p not in owned]] = np.nan
    vp[np.isnan(kp)] = np.nan
    q = jnp.asarray(rng.standard_normal((N, 4, 16)), jnp.float32)
    fn = jax.jit(lambda *a: ragged_attention_reference(*a, query_tile=query_tile))
    # Layer 1 of a stack whose layer 0 is NaN: the reference gathers the right layer of the whole cache.
    stack = lambda x: np.stack([np.full_like(x, np.nan), x])  # noqa: E731
    out = np.asarray(
        fn(
            q,
            stack(kp),
            stack(vp),
            jnp.int32(1),
            b.positions,
            b.query_start,
            b.context_lens,
            b.page_table,
            jnp.int32(6),
            jnp.float32(0.3),
        )
    )
    assert np.all(out[b.query_start[-1] :] == 0), "padding tokens attend to nothing"
    for r, row in enumerate(rows):
        t0, n = b.query_start[r], len(row.tokens)
        ref = reference_ragged_paged_attention(
            q[t0 : t0 + n],
            kp,
            vp,
            b.page_table[r : r + 1],
            b.context_lens[r : r + 1],
            np.asarray([0, n], np.int32),
            np.int32(1),
            sm_scale=0.3,
            sliding_window=6,
        )
        np.testing.assert_allclose(out[t0 : t0 + n], np.asarray(ref), atol=1e-5, rtol=0, err_msg=f"row {r}")


def _random_step(rng, num_tokens, num_rows, max_pages, page, num_pages):
    """Rows of random lengths and contexts (decodes and chunks) on distinct pages, packed."""
    rows, left, nxt = [], num_tokens, 1
    while left > 0 and len(rows) < num_rows:
        n = min(int(rng.integers(1, left + 1)) if rng.random() < 0.5 else 1, max_pages * page - 1)
        start = int(rng.integers(0, max_pages * page - n))
        need = -(-(start + n) // page)
        if nxt + need > num_pages:
            break
        rows.append(RaggedRow(list(range(n)), start, list(range(nxt, nxt + need))))
        nxt, left = nxt + need, left - n
    return pack_ragged(
        rows, page_size=page, num_tokens=num_tokens, num_rows=num_rows, max_pages=max_pages, num_logits=num_rows
    )


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize(
    "loop",
    [
        {},
        dict(query_tile=1, block_keys=4, pairs_per_iteration=3),
        dict(query_tile=3, block_keys=8, pairs_per_iteration=64),
    ],
    ids=["default", "many-iterations", "one-iteration"],
)
def test_blocked_attention_equals_reference(quantized, loop):
    """The engine's plain-JAX attention (key blocks per item, an online softmax over a while loop)
    gives what the reference gives: random ragged steps of 1..64 tokens, sliding windows, traced
    layer/window/scale, int8 pages with their scales, NaN in every page and scale no row owns (layer
    0 all NaN); loop shapes that split one item's blocks over iterations and put several in one."""
    from jaxserve.model.layers import ragged_attention_blocked

    rng = np.random.default_rng(5)
    kv, num_pages, page, h, heads = 2, 48, 4, 16, 4
    shape = (2, kv, num_pages, page, h)
    if quantized:
        k = rng.integers(-127, 128, shape).astype(np.int8)
        v = rng.integers(-127, 128, shape).astype(np.int8)
        ks, vs = (rng.uniform(0.001, 0.02, shape[:-1]).astype(np.float32) for _ in range(2))
        ks[0], vs[0], ks[:, :, 0], vs[:, :, 0] = np.nan, np.nan, np.nan, np.nan
        scales = dict(k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs))
    else:
        k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
        k[0], v[0], k[:, :, 0], v[:, :, 0] = np.nan, np.nan, np.nan, np.nan
        scales = {}
    blocked = jax.jit(lambda *a: ragged_attention_blocked(*a, **scales, **loop))
    reference = jax.jit(lambda *a: ragged_attention_reference(*a, **scales))
    for trial in range(12):
        n = int(rng.choice([1, 4, 8, 16, 32, 64]))
        b = _random_step(rng, n, 6, 10, page, num_pages)
        q = jnp.asarray(rng.standard_normal((n, heads, h)), jnp.float32)
        window = jnp.int32(int(rng.integers(1, 30)) if trial % 2 else np.iinfo(np.int32).max)
        args = (
            q,
            k,
            v,
            jnp.int32(1),
            b.positions,
            b.query_start,
            b.context_lens,
            b.page_table,
            window,
            jnp.float32(0.3),
        )
        got, want = np.asarray(blocked(*args)), np.asarray(reference(*args))
        real = b.query_start[-1]
        assert np.isfinite(got).all() and np.all(got[real:] == 0), trial
        np.testing.assert_allclose(got[:real], want[:real], atol=2e-6, rtol=1e-5, err_msg=f"trial {trial}")


def test_blocked_attention_cost_does_not_grow_with_the_page_table():
    """The page table's width costs nothing: the loop body's arrays are the same for 8 and 64 pages
    per row, while the reference's largest array (every item scored against the whole table) grows
    with it."""
    from jaxserve.model.layers import ragged_attention_blocked

    rng = np.random.default_rng(0)
    kv, page, h, heads, n, rows = 2, 4, 16, 4, 32, 4
    sizes = {}
    for width in (8, 64):
        k = jnp.asarray(rng.standard_normal((1, kv, 80, page, h)), jnp.float32)
        b = pack_ragged(
            [RaggedRow([1] * 20, 0, list(range(1, 6))), RaggedRow([2], 9, [6, 7, 8])],
            page_size=page,
            num_tokens=n,
            num_rows=rows,
            max_pages=width,
            num_logits=rows,
        )
        q = jnp.asarray(rng.standard_normal((n, heads, h)), jnp.float32)
        args = (q, k, k, 0, b.positions, b.query_start, b.context_lens, b.page_table)
        blocked = _largest_intermediate(lambda *a: ragged_attention_blocked(*a), *args)
        reference = _largest_intermediate(lambda *a: ragged_attention_reference(*a), *args)
        sizes[width] = blocked, reference
    assert sizes[8][0] == sizes[64][0], sizes
    assert sizes[64][1] >= 4 * sizes[8][1], sizes  # the check has teeth: the reference's grows
