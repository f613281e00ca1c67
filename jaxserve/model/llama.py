"""The Llama-family forward pass as a pure function of (params, cache, batch) for one replica.

Llama 2/3/3.1, Mistral (sliding window), Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms) differ
only in ModelConfig flags.
Each layer writes its new K/V into the pages first, then attends over the pages, so a prefill
chunk, a decode token and a mix of both are the same computation.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxserve import quant
from jaxserve.config import ModelConfig
from jaxserve.kv_cache import KVCache, RaggedBatch, write_kv, write_kv_slots
from jaxserve.model.layers import (
    apply_rope,
    NO_SLIDING_WINDOW,
    causal_attention,
    paged_attention_reference,
    ragged_attention_reference,
    rms_norm,
    rope_cos_sin,
    swiglu,
)
from jaxserve.model.weights import LayerParams, Params

# attention(q f[B,T,N,H], k_pages f[K,NP,S,H], v_pages, page_table i32[B,P], positions i32[B,T],
#           seq_lens i32[B], sliding_window, k_scale=f32[K,NP,S] | None, v_scale=...) -> f[B,T,N,H]
AttentionFn = Callable[..., jax.Array]
# ragged attention(q f[N,N_h,H], k_cache f[L,K,NP,S,H], v_cache, layer i32[], positions i32[N],
#                  query_start i32[R+1], context_lens i32[R], page_table i32[R,P], sliding_window i32[],
#                  sm_scale f32[], k_scale=f32[L,K,NP,S] | None, v_scale=...) -> f[N,N_h,H]
# It gets the whole stacked cache and the layer: a slice cache.k[layer] inside a scan (or an unrolled
# loop) is a copy of that layer's entire cache per layer; the kernels index the stack themselves.
RaggedAttentionFn = Callable[..., jax.Array]


def _linear(x: jax.Array, w: jax.Array | quant.QuantArray, b: jax.Array | None) -> jax.Array:
    y = quant.matmul(x, w)  # a float or an int8 (QuantArray) weight
    return y if b is None else y + b


def _project_qkv(cfg: ModelConfig, lp: LayerParams, x: jax.Array, cos: jax.Array, sin: jax.Array):
    """Pre-norm, q/k/v projections, per-head q/k norms (Qwen3) and rotary embeddings: q f[B,T,N,H],
    k and v f[B,T,K,H]."""
    B, T, _ = x.shape
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
    q = _linear(h, lp.wq, lp.bq).reshape(B, T, N, H)
    k = _linear(h, lp.wk, lp.bk).reshape(B, T, K, H)
    v = _linear(h, lp.wv, lp.bv).reshape(B, T, K, H)
    if lp.q_norm is not None:  # the params decide, so a config and its pytree never disagree
        q = rms_norm(q, lp.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, lp.k_norm, cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _output_and_mlp(cfg: ModelConfig, lp: LayerParams, x: jax.Array, attn: jax.Array) -> jax.Array:
    """Output projection and residual, then the pre-norm SwiGLU block and its residual."""
    B, T, N, H = attn.shape
    x = x + _linear(attn.reshape(B, T, N * H), lp.wo, lp.bo)
    h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
    return x + swiglu(h, lp.w_gate, lp.w_up, lp.w_down)


def _layer(
    cfg: ModelConfig,
    attention: AttentionFn,
    lp: LayerParams,  # one layer's slice
    layer: jax.Array | int,
    x: jax.Array,  # f[B, T, D]
    cache: KVCache,  # one replica: k, v f[L, K, NP, S, H] (+ scales when int8)
    cos: jax.Array,  # f32[B, T, H]
    sin: jax.Array,
    page_table: jax.Array,  # i32[B, P]
    positions: jax.Array,  # i32[B, T]
    valid: jax.Array,  # bool[B, T]
    seq_lens: jax.Array,  # i32[B]
) -> tuple[jax.Array, KVCache]:
    q, k, v = _project_qkv(cfg, lp, x, cos, sin)
    cache = write_kv(cache, layer, k, v, page_table, positions, valid)
    scales = {} if not cache.quantized else dict(k_scale=cache.k_scale[layer], v_scale=cache.v_scale[layer])
    attn = attention(q, cache.k[layer], cache.v[layer], page_table, positions, seq_lens, cfg.sliding_window, **scales)
    return _output_and_mlp(cfg, lp, x, attn), cache


def forward(
    params: Params,
    cache: KVCache,  # one replica: k, v f[L, K, NP, S, H], or i8 with k_scale, v_scale f32[L, K, NP, S]
    tokens: jax.Array,  # i32[B, T]
    start_pos: jax.Array,  # i32[B]
    num_new: jax.Array,  # i32[B]
    page_table: jax.Array,  # i32[B, P]
    *,
    cfg: ModelConfig,
    scan_layers: bool = False,
    all_logits: bool = False,
    attention: AttentionFn = paged_attention_reference,
    matmul: str = "reference",
) -> tuple[jax.Array, KVCache]:
    """Run one chunk for one replica. Returns (logits, cache).

    logits is f32[B, V] at each row's last valid token, or f32[B, T, V] with all_logits (parity tests,
    prompt logprobs). Rows with num_new == 0 yield meaningless logits and write nothing. `matmul`
    (one of quant.MATMUL_IMPLS) is how int8 (QuantArray) weights are multiplied.
    """
    if matmul != "reference":
        params = quant.with_kernel(params, matmul)
    T = tokens.shape[1]
    positions = start_pos[:, None] + jnp.arange(T, dtype=jnp.int32)  # i32[B, T]
    valid = jnp.arange(T, dtype=jnp.int32)[None, :] < num_new[:, None]  # bool[B, T]
    seq_lens = start_pos + num_new
    cos, sin = rope_cos_sin(positions, cfg)
    x = params.embed[tokens]  # f[B, T, D]
    layer_args = (cos, sin, page_table, positions, valid, seq_lens)

    if isinstance(params.layers, tuple):  # per-layer arrays: the fast unrolled form
        for layer, lp in enumerate(params.layers):
            x, cache = _layer(cfg, attention, lp, layer, x, cache, *layer_args)
    elif scan_layers:
        def body(carry, xs):
            x, cache = carry
            lp, layer = xs
            return _layer(cfg, attention, lp, layer, x, cache, *layer_args), None

        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, cache), _ = jax.lax.scan(body, (x, cache), (params.layers, layer_ids))
    else:  # stacked weights, unrolled: correct but slow on CPU (see weights.Params)
        for layer in range(cfg.num_layers):
            lp = jax.tree.map(lambda w: w[layer], params.layers)
            x, cache = _layer(cfg, attention, lp, layer, x, cache, *layer_args)

    if not all_logits:
        last = jnp.maximum(num_new - 1, 0)
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]  # f[B, D]
    return _logits(params, cfg, x), cache


def layer_attention_params(cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Per-layer attention operands (sliding window i32[L], softmax scale f32[L]): arrays scanned
    with the weights, so layers that differ (Gemma 3's local and global ones) share one step."""
    window = NO_SLIDING_WINDOW if cfg.sliding_window is None else cfg.sliding_window
    return (jnp.full((cfg.num_layers,), window, jnp.int32),
            jnp.full((cfg.num_layers,), cfg.head_dim**-0.5, jnp.float32))


def _ragged_layer(
    cfg: ModelConfig,
    attention: RaggedAttentionFn,
    lp: LayerParams,  # one layer's slice
    layer: jax.Array | int,
    window: jax.Array,  # i32[]
    sm_scale: jax.Array,  # f32[]
    x: jax.Array,  # f[1, N, D]
    cache: KVCache,  # one replica
    cos: jax.Array,  # f32[1, N, H]
    sin: jax.Array,
    batch: RaggedBatch,
) -> tuple[jax.Array, KVCache]:
    q, k, v = _project_qkv(cfg, lp, x, cos, sin)  # [1, N, heads, H]: the flat axis as one batch row
    cache = write_kv_slots(cache, layer, k[0], v[0], batch.slots)
    scales = {} if not cache.quantized else dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    attn = attention(q[0], cache.k, cache.v, layer, batch.positions, batch.query_start, batch.context_lens,
                     batch.page_table, window, sm_scale, **scales)
    return _output_and_mlp(cfg, lp, x, attn[None]), cache


def forward_ragged(
    params: Params,
    cache: KVCache,  # one replica: k, v f[L, K, NP, S, H], or i8 with k_scale, v_scale f32[L, K, NP, S]
    batch: RaggedBatch,  # one replica: N tokens of R rows
    *,
    cfg: ModelConfig,
    scan_layers: bool = False,
    attention: RaggedAttentionFn = ragged_attention_reference,
    matmul: str = "reference",
) -> tuple[jax.Array, KVCache]:
    """One ragged step (prompt chunks, decodes, verifications in one flat token axis) for one
    replica. Returns (logits f32[len(logit_index), V] at `batch.logit_index`, cache).

    The same layers as `forward` on a [1, N, D] activation; K/V written by slot (padding dropped),
    attention over each row's pages. Layers scanned (stacked weights, `scan_layers`) or unrolled
    (a tuple of per-layer params, or stacked weights sliced per layer), as in `forward`."""
    if matmul != "reference":
        params = quant.with_kernel(params, matmul)
    cos, sin = rope_cos_sin(batch.positions[None], cfg)  # f32[1, N, H]
    x = params.embed[batch.tokens][None]  # f[1, N, D]
    windows, sm_scales = layer_attention_params(cfg)

    def run(lp, layer, x, cache):
        return _ragged_layer(cfg, attention, lp, layer, windows[layer], sm_scales[layer], x, cache, cos, sin, batch)

    if isinstance(params.layers, tuple):
        for layer, lp in enumerate(params.layers):
            x, cache = run(lp, layer, x, cache)
    elif scan_layers:
        def body(carry, xs):
            lp, layer, window, sm_scale = xs
            x, cache = carry
            return _ragged_layer(cfg, attention, lp, layer, window, sm_scale, x, cache, cos, sin, batch), None

        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, cache), _ = jax.lax.scan(body, (x, cache), (params.layers, layer_ids, windows, sm_scales))
    else:
        for layer in range(cfg.num_layers):
            x, cache = run(jax.tree.map(lambda w: w[layer], params.layers), layer, x, cache)
    return _logits(params, cfg, x[0][batch.logit_index]), cache


def _logits(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    x = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    if params.lm_head is None:  # tied: contract with embed [V, D] directly (a .T materialised a copy)
        return jnp.einsum("...d,vd->...v", x, params.embed, preferred_element_type=jnp.float32)
    return quant.matmul(x, params.lm_head, preferred_element_type=jnp.float32)


def forward_dense(params: Params, tokens: jax.Array, *, cfg: ModelConfig) -> jax.Array:
    """Logits f32[B, T, V] of whole sequences from position 0, without a KV cache (training, scoring).

    The same layers as `forward`, with dense causal attention; `layers` may be stacked (scanned)
    or a tuple (unrolled)."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cos, sin = rope_cos_sin(positions, cfg)
    x = params.embed[tokens]

    def layer(x, lp):
        q, k, v = _project_qkv(cfg, lp, x, cos, sin)
        return _output_and_mlp(cfg, lp, x, causal_attention(q, k, v, cfg.sliding_window))

    if isinstance(params.layers, tuple):
        for lp in params.layers:
            x = layer(x, lp)
    else:
        x, _ = jax.lax.scan(lambda x, lp: (layer(x, lp), None), x, params.layers)
    return _logits(params, cfg, x)
