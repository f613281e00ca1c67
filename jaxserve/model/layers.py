"""Building blocks of the decoder: RMSNorm (Gemma's (1 + weight) form too), rotary embeddings (with
linear, Llama-3.1 and YaRN scaling, and Gemma 3's local base), SwiGLU and GeGLU, the plain-JAX ragged
paged attention (a reference, and the blocked form the engine runs without the Pallas kernels), and
dense causal attention (no cache)."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.model.kv_cache import as_bytes, from_bytes
from jaxserve.model.quant import QuantArray, matmul

Weight = jax.Array | QuantArray


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """Normalise in f32 and cast back before scaling, as HF's Llama does (matters for bf16 parity).

    With `offset` (Gemma: 1.0) the scale is (offset + weight), applied in f32 before the cast, as HF's
    Gemma3RMSNorm does (a bf16 1 + weight would round)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (x32 * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse frequencies (f32[H/2]), computed on the host once per config (it is static).

    local=True: those of Gemma 3's sliding layers (base `rope_local_theta`, never scaled)."""
    h = cfg.head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    # f32 arithmetic, like HF, so positions far out round the same way.
    inv_freq = 1.0 / (np.float32(theta) ** (np.arange(0, h, 2, dtype=np.float32) / np.float32(h)))
    scaling = None if local else cfg.rope_scaling
    if scaling is None:
        pass
    elif scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    elif scaling.kind == "yarn":
        inv_freq = _yarn_inv_freq(np.float32(theta), h, scaling)
    else:
        raise ValueError(f"unknown rope scaling {scaling.kind!r}")
    return inv_freq.astype(np.float32)


def _yarn_inv_freq(theta: np.float32, h: int, scaling) -> np.ndarray:
    """YaRN (arXiv 2309.00071), as transformers computes it in f32: dimensions that turn more than
    beta_fast times over the pretraining length keep their frequency, those under beta_slow turns are
    divided by `factor`, a linear ramp between."""
    pos_freqs = theta ** (np.arange(0, h, 2, dtype=np.float32) / np.float32(h))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(scaling.factor) * pos_freqs)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the length
        length = scaling.original_max_position_embeddings
        return h * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, h - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(h // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = np.float32(1.0) - ramp.astype(np.float32)  # 1: the frequency extrapolates (unchanged)
    return interpolation * (np.float32(1.0) - keep) + extrapolation * keep


def rope_attention_factor(cfg: ModelConfig, local: bool = False) -> float:
    """What cos and sin are multiplied by (YaRN's attention_factor; 1 otherwise)."""
    scaling = None if local else cfg.rope_scaling
    return scaling.attention_factor if scaling is not None and scaling.kind == "yarn" else 1.0


def rope_cos_sin(positions: jax.Array, cfg: ModelConfig, local: bool = False) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape f32[..., H] for integer positions (halves duplicated, HF's layout)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(cfg, local))
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    scale = rope_attention_factor(cfg, local)
    if scale != 1.0:  # YaRN: both q and k are scaled, so the scores by scale ** 2, as transformers does
        return jnp.cos(emb) * scale, jnp.sin(emb) * scale
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [..., heads, H]; cos/sin: [..., H] broadcast over heads. Rotate-half convention of HF."""
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


# project(x, w, name) -> x @ w for the MLP's "gate", "up" and "down" weights: `matmul`, or with each
# row's LoRA update added (model/lora.py).
Project = Callable[[jax.Array, Weight, str], jax.Array]


def _plain(x: jax.Array, w: Weight, name: str) -> jax.Array:
    return matmul(x, w)


def swiglu(x: jax.Array, w_gate: Weight, w_up: Weight, w_down: Weight, project: Project = _plain) -> jax.Array:
    return project(jax.nn.silu(project(x, w_gate, "gate")) * project(x, w_up, "up"), w_down, "down")


def geglu(x: jax.Array, w_gate: Weight, w_up: Weight, w_down: Weight, project: Project = _plain) -> jax.Array:
    """Gemma's gated MLP: GELU with the tanh approximation (HF's gelu_pytorch_tanh) on the gate."""
    gate = jax.nn.gelu(project(x, w_gate, "gate"), approximate=True)
    return project(gate * project(x, w_up, "up"), w_down, "down")


NO_SLIDING_WINDOW = np.iinfo(np.int32).max  # a window operand that masks nothing


def _layer_pages(
    cache: jax.Array,  # [L, K, NP, S, ...]  one replica's stacked pages (or their scales)
    layer: jax.Array | int,  # i32[]
    table: jax.Array,  # i32[W, P]
) -> jax.Array:  # [K, W, P*S, ...]
    """Pages `table` of one layer, every KV head, in each row's token order: one gather from the
    whole cache (viewed as [L*K*NP, S, ...], a free reshape), never a copy of the layer first."""
    L, K, NP = cache.shape[:3]
    W, P = table.shape
    rows = (layer * K + jnp.arange(K, dtype=jnp.int32)[:, None, None]) * NP + table[None]  # i32[K, W, P]
    pages = as_bytes(cache).reshape(L * K * NP, *cache.shape[3:])[rows]  # [K, W, P, S, ...]; float8 as bytes
    return from_bytes(pages.reshape(K, W, P * cache.shape[3], *cache.shape[4:]), cache.dtype)


def _layer_page_scales(scale: jax.Array, layer: jax.Array | int, table: jax.Array) -> jax.Array:
    """int8 pages' per-slot scales f32[L, K, NP, S] of `layer` at pages `table` i32[W, P] ->
    f32[W, K, 1, 1, P*S], broadcasting over the scores' (group, query) axes."""
    return _layer_pages(scale, layer, table).transpose(1, 0, 2)[:, :, None, None, :]


@dataclasses.dataclass(frozen=True)
class _QueryItems:
    """A ragged batch's tokens cut into work items: tiles of Q consecutive tokens of one row.

    There are at most W = m + (N - m) // Q items with m = min(R, N) (as many rows as can be given
    one partial tile each, the other tokens in whole tiles), a static count; items past the real
    ones (and tokens past their row's end) are marked invalid."""

    count: int  # W
    row: jax.Array  # i32[W]  the item's row (clamped to R - 1 for items of no row)
    real: jax.Array  # bool[W]
    tok: jax.Array  # i32[W, Q]  token index of each query (0 where invalid)
    tok_valid: jax.Array  # bool[W, Q]
    pos: jax.Array  # i32[W, Q]

    @classmethod
    def tile(cls, query_start: jax.Array, positions: jax.Array, N: int, Q: int) -> "_QueryItems":
        R = query_start.shape[0] - 1
        m = min(R, N)
        W = m + (N - m) // Q
        q_len = query_start[1:] - query_start[:-1]  # i32[R]
        n_items = (q_len + Q - 1) // Q  # i32[R]
        item_end = jnp.cumsum(n_items)  # i32[R]
        item = jnp.arange(W, dtype=jnp.int32)
        row = jnp.searchsorted(item_end, item, side="right").astype(jnp.int32)  # i32[W]; R = no row
        real = row < R
        row = jnp.minimum(row, R - 1)
        start = query_start[row] + (item - (item_end[row] - n_items[row])) * Q  # first token of each item
        tok = start[:, None] + jnp.arange(Q, dtype=jnp.int32)
        tok_valid = real[:, None] & (tok < query_start[row + 1][:, None])
        tok = jnp.where(tok_valid, tok, 0)
        return cls(W, row, real, tok, tok_valid, positions[tok])

    def scatter(self, out: jax.Array, q: jax.Array) -> jax.Array:
        """f[W*Q, heads, H] per item query -> f[N, heads, H] per token (zeros for padding tokens):
        each real token is in exactly one item."""
        dest = jnp.where(self.tok_valid, self.tok, q.shape[0]).reshape(-1)
        return jnp.zeros_like(q).at[dest].set(out.astype(q.dtype), mode="drop")


def ragged_attention_reference(
    q: jax.Array,  # f[N, heads, H]  one query per token of the flat ragged batch
    k_cache: jax.Array,  # f[L, K, NP, S, H]  one replica's whole cache (new K/V already written)
    v_cache: jax.Array,  # f[L, K, NP, S, H]
    layer: jax.Array | int,  # i32[]  the layer to attend over
    positions: jax.Array,  # i32[N]
    query_start: jax.Array,  # i32[R+1]  row r's tokens are [query_start[r], query_start[r+1])
    context_lens: jax.Array,  # i32[R]  tokens in each row's cache, this step's included
    page_table: jax.Array,  # i32[R, P]
    sliding_window: jax.Array | int | None = None,  # i32[]: a key is seen while pos - key_pos < window
    sm_scale: jax.Array | float | None = None,  # f32[]; None = H ** -0.5
    k_scale: jax.Array | None = None,  # f32[L, K, NP, S] with int8 pages
    v_scale: jax.Array | None = None,  # f32[L, K, NP, S]
    *,
    query_tile: int | None = None,
) -> jax.Array:  # f[N, heads, H]; zeros for tokens of no row (padding)
    """Causal attention of each token of a ragged batch over its own row's pages (CPU reference).

    Work items, not tokens, meet the keys. A row's tokens are contiguous, so they are cut into
    tiles of Q = query_tile consecutive tokens (default ceil(N / R)); an item is one tile of one row.
    There are at most W = m + (N - m) // Q items with m = min(R, N) (as many rows as can be given
    one partial tile each, the other tokens in whole tiles), a static count. Each item gathers its
    row's pages of `layer` once, in one gather from the whole cache (k, v f[K, W, P*S, H]), and scores
    its Q queries against them (f32[W, K, group, Q, P*S]), and the outputs are scattered back to
    their tokens. With the default Q the memory is O(R * P*S * K * H + N * heads * P*S): W <= 2R
    item gathers and W * Q <= 2N + R score rows, never the [N, heads, P*S, H] (nor the per-token
    [N, K, P*S, H]) a gather of keys per token makes. The arithmetic is at most about 2x the useful
    (tail tiles, padding items); a pure decode step (N = R, Q = 1) is exactly one item per token.

    Keys past the row's context are masked and zeroed in V, so NaN in unused pages never reaches
    the output; GQA groups query heads on their KV head; the softmax is f32; with int8 pages the K
    scales multiply the scores (exact integers in q's dtype enter the matmuls), the V scales the
    probabilities, as the Pallas kernels do; float8 pages are widened to q's dtype (exact) and carry
    no scales here (`kv_cache.attend` applies a float8 cache's). `sliding_window` and `sm_scale` may be traced
    (per-layer operands of a scan).
    """
    N, NH, H = q.shape
    K, PS = k_cache.shape[1], k_cache.shape[3]
    R, P = page_table.shape
    G = NH // K
    Q = query_tile or max(1, -(-N // R))
    window = NO_SLIDING_WINDOW if sliding_window is None else sliding_window
    sm_scale = H**-0.5 if sm_scale is None else sm_scale
    items = _QueryItems.tile(query_start, positions, N, Q)
    W, row, tok, tok_valid, pos = items.count, items.row, items.tok, items.tok_valid, items.pos

    table = page_table[row]  # i32[W, P]
    k = _layer_pages(k_cache, layer, table).astype(q.dtype)  # f[K, W, P*S, H]
    v = _layer_pages(v_cache, layer, table).astype(q.dtype)
    key_pos = jnp.arange(P * PS, dtype=jnp.int32)
    key_valid = key_pos[None, :] < context_lens[row][:, None]  # bool[W, P*S]
    v = jnp.where(key_valid[None, :, :, None], v, jnp.zeros((), v.dtype))
    mask = (
        tok_valid[:, :, None]
        & key_valid[:, None, :]
        & (key_pos[None, None, :] <= pos[:, :, None])
        & (pos[:, :, None] - key_pos[None, None, :] < window)
    )  # bool[W, Q, P*S]
    qg = q[tok].reshape(W, Q, K, G, H)
    scores = jnp.einsum("wqkgh,kwsh->wkgqs", qg, k, preferred_element_type=jnp.float32) * sm_scale
    if k_scale is not None:
        scores = scores * _layer_page_scales(k_scale, layer, table)  # f32[W, K, 1, 1, P*S]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)  # a query of no row has no key: NaN here, zeroed next
    if v_scale is not None:
        probs = probs * _layer_page_scales(v_scale, layer, table)
    probs = jnp.where(mask[:, None, None], probs, 0.0).astype(v.dtype)
    out = jnp.einsum("wkgqs,kwsh->wqkgh", probs, v, preferred_element_type=jnp.float32)
    return items.scatter(out.reshape(W * Q, NH, H), q)


BLOCK_KEYS = 32  # keys per block of the blocked attention (whole pages: at least one)
MAX_PAIRS_PER_ITERATION = 64  # (item, key block) pairs one loop iteration of it scores


def ragged_attention_blocked(
    q: jax.Array,  # f[N, heads, H]
    k_cache: jax.Array,  # f[L, K, NP, S, H]  one replica's whole cache (new K/V already written)
    v_cache: jax.Array,  # f[L, K, NP, S, H]
    layer: jax.Array | int,  # i32[]
    positions: jax.Array,  # i32[N]
    query_start: jax.Array,  # i32[R+1]
    context_lens: jax.Array,  # i32[R]
    page_table: jax.Array,  # i32[R, P]
    sliding_window: jax.Array | int | None = None,
    sm_scale: jax.Array | float | None = None,
    k_scale: jax.Array | None = None,  # f32[L, K, NP, S] with int8 pages
    v_scale: jax.Array | None = None,
    *,
    query_tile: int | None = None,
    block_keys: int = BLOCK_KEYS,
    pairs_per_iteration: int | None = None,
) -> jax.Array:  # f[N, heads, H]; zeros for padding tokens
    """`ragged_attention_reference`'s result at the cost of the keys each item really sees: the
    plain-JAX attention of the engine's ragged step (the CPU's; accelerators run the Pallas kernels).

    The reference scores every item against its whole page table, so a step costs its items times
    the table's width: a 150-token prompt beside decodes of 300 tokens of context attends over 1,024
    keys per query when the table has 64 pages. Here each item (Q <= 8 consecutive tokens of one
    row) lists the key blocks (`block_keys` keys, whole pages) it needs: from its first query's
    sliding-window start to its last query's position, within the row's context. The (item, block)
    pairs are numbered on the device, and a `while_loop` scores `pairs_per_iteration` of them per
    iteration (one gather of their pages from the whole cache, [K, T, B, H]) with an online softmax
    per item (running max, denominator, and output, combined by scatter: several pairs of one item
    may share an iteration). The loop runs as many iterations as the step's pairs need, so the page
    table's width costs nothing and a step costs about its causal work, rounded to blocks and tiles.

    Agrees with the reference to rounding (the same masks, GQA grouping, f32 softmax, int8 scales on
    scores and probabilities); keys past a row's context are zeroed in V, so NaN in unused pages
    never reaches the output.
    """
    N, NH, H = q.shape
    K, PS = k_cache.shape[1], k_cache.shape[3]
    R, P = page_table.shape
    G = NH // K
    Q = query_tile or min(8, max(1, -(-N // R)))
    C = max(1, min(block_keys // PS, P))  # pages per block
    B = C * PS
    window = NO_SLIDING_WINDOW if sliding_window is None else sliding_window
    sm_scale = H**-0.5 if sm_scale is None else sm_scale
    items = _QueryItems.tile(query_start, positions, N, Q)
    W, row, tok_valid, pos = items.count, items.row, items.tok_valid, items.pos
    T = pairs_per_iteration or min(max(2 * W, 4), MAX_PAIRS_PER_ITERATION)

    # The key blocks [b_lo, b_lo + n_blocks) of each item, and the pairs numbered item by item.
    ctx = context_lens[row]  # i32[W]
    last = jnp.max(jnp.where(tok_valid, pos, -1), axis=1)
    first = jnp.min(jnp.where(tok_valid, pos, jnp.iinfo(jnp.int32).max), axis=1)
    key_end = jnp.minimum(last + 1, ctx)  # keys [key_start, key_end) are seen by some query
    key_start = jnp.maximum(first - window + 1, 0)
    b_lo = key_start // B
    n_blocks = jnp.where(items.real & (key_end > 0), jnp.maximum((key_end + B - 1) // B - b_lo, 0), 0)
    pair_end = jnp.cumsum(n_blocks).astype(jnp.int32)  # i32[W]
    total = pair_end[-1]
    q_items = q[items.tok].reshape(W, Q, K, G, H)

    def body(carry):
        i, m, l, acc = carry
        pair = i * T + jnp.arange(T, dtype=jnp.int32)
        live = pair < total
        it = jnp.minimum(jnp.searchsorted(pair_end, pair, side="right").astype(jnp.int32), W - 1)  # i32[T]
        block = b_lo[it] + pair - (pair_end[it] - n_blocks[it])
        page_idx = jnp.minimum(block[:, None] * C + jnp.arange(C, dtype=jnp.int32), P - 1)
        pages = jnp.where(live[:, None], page_table[row[it][:, None], page_idx], 0)  # i32[T, C]
        k = _layer_pages(k_cache, layer, pages).astype(q.dtype)  # f[K, T, B, H]
        v = _layer_pages(v_cache, layer, pages).astype(q.dtype)
        key_pos = block[:, None] * B + jnp.arange(B, dtype=jnp.int32)  # i32[T, B]
        key_valid = live[:, None] & (key_pos < ctx[it][:, None])
        v = jnp.where(key_valid[None, :, :, None], v, jnp.zeros((), v.dtype))
        p = pos[it]  # i32[T, Q]
        mask = (
            tok_valid[it][:, :, None]
            & key_valid[:, None, :]
            & (key_pos[:, None, :] <= p[:, :, None])
            & (p[:, :, None] - key_pos[:, None, :] < window)
        )  # bool[T, Q, B]
        scores = jnp.einsum("tqkgh,ktbh->tkgqb", q_items[it], k, preferred_element_type=jnp.float32) * sm_scale
        if k_scale is not None:
            scores = scores * _layer_page_scales(k_scale, layer, pages)
        scores = jnp.where(mask[:, None, None], scores, -jnp.inf)  # f32[T, K, G, Q, B]
        dest = jnp.where(live, it, W)  # dead pairs are dropped by the scatters
        m_new = m.at[dest].max(scores.max(-1), mode="drop")
        rescale = jnp.where(m_new > -jnp.inf, jnp.exp(m - m_new), 0.0)  # 0 where nothing was seen yet
        probs = jnp.where(mask[:, None, None], jnp.exp(scores - m_new[it][..., None]), 0.0)
        l = (l * rescale).at[dest].add(probs.sum(-1), mode="drop")
        if v_scale is not None:  # masked after the scales: unused pages' scales may be NaN
            probs = jnp.where(mask[:, None, None], probs * _layer_page_scales(v_scale, layer, pages), 0.0)
        pv = jnp.einsum("tkgqb,ktbh->tkgqh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
        acc = (acc * rescale[..., None]).at[dest].add(pv, mode="drop")
        return i + 1, m_new, l, acc

    init = (
        jnp.int32(0),
        jnp.full((W, K, G, Q), -jnp.inf, jnp.float32),
        jnp.zeros((W, K, G, Q), jnp.float32),
        jnp.zeros((W, K, G, Q, H), jnp.float32),
    )
    _, _, l, acc = jax.lax.while_loop(lambda c: c[0] * T < total, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # items of no key (padding) stay zero
    return items.scatter(out.transpose(0, 3, 1, 2, 4).reshape(W * Q, NH, H), q)


def causal_attention(
    q: jax.Array,  # f[B, T, N, H]
    k: jax.Array,  # f[B, T, K, H]
    v: jax.Array,  # f[B, T, K, H]
    sliding_window: jax.Array | int | None = None,  # may be traced (a per-layer operand of a scan)
    sm_scale: float | None = None,  # None = H ** -0.5
) -> jax.Array:  # f[B, T, N, H]
    """Dense causal self-attention over whole sequences (training and scoring; no cache).

    The same GQA grouping and f32 softmax as the paged attention, so a trained model means the
    same thing in both."""
    B, T, N, H = q.shape
    K = k.shape[2]
    pos = jnp.arange(T, dtype=jnp.int32)
    mask = pos[None, :] <= pos[:, None]  # bool[T(query), T(key)]
    if sliding_window is not None:
        mask &= pos[:, None] - pos[None, :] < sliding_window
    qg = q.reshape(B, T, K, N // K, H)
    scale = H**-0.5 if sm_scale is None else sm_scale
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, N, H).astype(q.dtype)
