"""The Llama-family forward passes: `forward_ragged` (one replica's step over the paged KV cache,
the only cached forward: the engine's and the research steps') and `forward_dense` (no cache).

Llama 2/3/3.1, Mistral (sliding window), Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms), Gemma 3
((1 + weight) norms, four per layer, GeGLU, scaled embeddings, local and global layers with their own
RoPE bases, window and softmax scale), Qwen3-MoE and Mixtral (the MLP a mixture of experts, moe.py)
differ only in ModelConfig flags.
Each layer writes its new K/V into the pages first, then attends over the pages, so a prefill
chunk, a decode token, a verification and a mix of them are the same computation.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model import lora as lora_ops, quant
from jaxserve.config import ModelConfig
from jaxserve.model.hidden_states import HiddenOutput, HiddenStates, check_layers, sum_rows
from jaxserve.model.kv_cache import KVCache, RaggedBatch, attend, write_kv_slots
from jaxserve.model.layers import (
    apply_rope,
    NO_SLIDING_WINDOW,
    causal_attention,
    geglu,
    ragged_attention_blocked,
    rms_norm,
    rope_cos_sin,
    swiglu,
)
from jaxserve.model.moe import ExpertParallelFn, MoEParams, moe_mlp
from jaxserve.model.weights import LayerParams, Params

# ragged attention(q f[N,N_h,H], k_cache f[L,K,NP,S,H], v_cache, layer i32[], positions i32[N],
#                  query_start i32[R+1], context_lens i32[R], page_table i32[R,P], sliding_window i32[],
#                  sm_scale f32[], k_scale=f32[L,K,NP,S] | None, v_scale=...) -> f[N,N_h,H]
# It gets the whole stacked cache and the layer: a slice cache.k[layer] inside a scan (or an unrolled
# loop) is a copy of that layer's entire cache per layer; the kernels index the stack themselves.
RaggedAttentionFn = Callable[..., jax.Array]


def _linear(x: jax.Array, w: jax.Array | quant.QuantArray, b: jax.Array | None) -> jax.Array:
    y = quant.matmul(x, w)  # a float or an int8 (QuantArray) weight
    return y if b is None else y + b


def _norm(cfg: ModelConfig, x: jax.Array, weight: jax.Array) -> jax.Array:
    return rms_norm(x, weight, cfg.rms_norm_eps, cfg.norm_weight_offset)


def _project_qkv(
    cfg: ModelConfig,
    lp: LayerParams,
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    lora_columns: jax.Array | None = None,
):
    """Pre-norm, q/k/v projections (each with its rows' LoRA updates, `model/lora.py`), per-head q/k
    norms (Qwen3, Gemma 3) and rotary embeddings: q f[B,T,N,H], k and v f[B,T,K,H]."""
    B, T, _ = x.shape
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    h = _norm(cfg, x, lp.attn_norm)

    def project(w, bias, name):
        return lora_ops.apply(_linear(h, w, bias), h, lp.lora, name, lora_columns)

    q = project(lp.wq, lp.bq, "q").reshape(B, T, N, H)
    k = project(lp.wk, lp.bk, "k").reshape(B, T, K, H)
    v = project(lp.wv, lp.bv, "v").reshape(B, T, K, H)
    if lp.q_norm is not None:  # the params decide, so a config and its pytree never disagree
        q = _norm(cfg, q, lp.q_norm)
        k = _norm(cfg, k, lp.k_norm)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _output_and_mlp(
    cfg: ModelConfig,
    lp: LayerParams,
    x: jax.Array,
    attn: jax.Array,
    expert_parallel: ExpertParallelFn | None = None,
    lora_columns: jax.Array | None = None,
) -> jax.Array:
    """Output projection and residual, then the pre-norm gated MLP (SwiGLU, Gemma's GeGLU, or a mixture
    of SwiGLU experts over the flattened tokens) and its residual; with Gemma 3's sandwich norms each block's output is normalised before its residual add."""
    B, T, N, H = attn.shape
    attn = attn.reshape(B, T, N * H)
    out = lora_ops.apply(_linear(attn, lp.wo, lp.bo), attn, lp.lora, "o", lora_columns)
    if lp.post_attn_norm is not None:
        out = _norm(cfg, out, lp.post_attn_norm)
    x = x + out
    h = _norm(cfg, x, lp.mlp_norm)
    if lp.router is not None:  # a mixture of experts: every token (padding too: harmless) routed on its own
        experts = MoEParams(router=lp.router, w_gate=lp.expert_gate, w_up=lp.expert_up, w_down=lp.expert_down)
        out = moe_mlp(
            h.reshape(B * T, -1),
            experts,
            top_k=cfg.num_experts_per_tok,
            normalize=cfg.norm_topk_prob,
            expert_parallel=expert_parallel,
        ).reshape(h.shape)
    else:
        mlp = geglu if cfg.hidden_act == "gelu_pytorch_tanh" else swiglu
        if lp.lora is None or lora_columns is None:
            out = mlp(h, lp.w_gate, lp.w_up, lp.w_down)
        else:  # each projection with its rows' LoRA updates
            out = mlp(
                h,
                lp.w_gate,
                lp.w_up,
                lp.w_down,
                lambda x, w, name: lora_ops.apply(quant.matmul(x, w), x, lp.lora, name, lora_columns),
            )
    if lp.post_mlp_norm is not None:
        out = _norm(cfg, out, lp.post_mlp_norm)
    return x + out


def _embed(params: Params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    if quant.is_quant(params.embed):  # a quantized tied table (quantize_lm_head): [D, V], as the head
        x = quant.embed_rows(params.embed, tokens, params.final_norm.dtype)
    else:
        x = params.embed[tokens]
    if cfg.scale_embeddings:  # Gemma: sqrt(hidden_size) rounded to the embedding dtype first, as HF does
        x = x * jnp.asarray(np.float32(cfg.hidden_size**0.5), x.dtype)
    return x


def _layer_kinds(cfg: ModelConfig) -> np.ndarray | None:
    """i32[L]: 1 for a local (sliding-window) layer, 0 for a global one, when the layers differ
    (Gemma 3's layer_types); None when every layer is alike."""
    if not cfg.layer_types:
        return None
    return np.asarray([t == "sliding_attention" for t in cfg.layer_types], np.int32)


def _layer_window(cfg: ModelConfig, layer: int) -> int | None:
    """The sliding window of layer `layer` as a static value (None: sees every key)."""
    kinds = _layer_kinds(cfg)
    return cfg.sliding_window if kinds is None or kinds[layer] else None


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array, np.ndarray | None]:
    """(cos, sin, kinds): cos, sin f32[..., H] shared by every layer and kinds None; or, with local
    and global layers (Gemma 3: `rope_local_theta` for the local ones, `rope_theta` and its scaling
    for the global), f32[2, ..., H] (global, local) and `_layer_kinds` i32[L] choosing each layer's.
    Both tables are computed once per step, so a scanned step stays one scan with `kinds` an operand."""
    cos, sin = rope_cos_sin(positions, cfg)
    kinds = _layer_kinds(cfg)
    if kinds is None or cfg.rope_local_theta is None:
        return cos, sin, None
    local_cos, local_sin = rope_cos_sin(positions, cfg, local=True)
    return jnp.stack([cos, local_cos]), jnp.stack([sin, local_sin]), kinds


def _layer_rope(cos: jax.Array, sin: jax.Array, kind: jax.Array | int | None) -> tuple[jax.Array, jax.Array]:
    """One layer's table from `rope_tables` (`kind` static when unrolled, a scanned operand otherwise)."""
    return (cos, sin) if kind is None else (cos[kind], sin[kind])


def layer_attention_params(cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Per-layer attention operands (sliding window i32[L], softmax scale f32[L]): arrays scanned
    with the weights, so layers that differ (Gemma 3's local and global ones) share one step.
    Gemma 3: the window on its local layers only, the scale query_pre_attn_scalar ** -0.5."""
    window = NO_SLIDING_WINDOW if cfg.sliding_window is None else cfg.sliding_window
    scale = (cfg.head_dim if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar) ** -0.5
    if not cfg.layer_types:  # every layer alike: the program the other families have always had
        windows = jnp.full((cfg.num_layers,), window, jnp.int32)
    else:
        windows = jnp.asarray(
            np.asarray(
                [window if _layer_window(cfg, i) is not None else NO_SLIDING_WINDOW for i in range(cfg.num_layers)],
                np.int32,
            )
        )
    return windows, jnp.full((cfg.num_layers,), scale, jnp.float32)


def decoder_layer(
    cfg: ModelConfig,
    lp: LayerParams,  # one layer's slice
    x: jax.Array,  # f[B, T, D]
    cos: jax.Array,  # this layer's RoPE table
    sin: jax.Array,
    attend_fn: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
    expert_parallel: ExpertParallelFn | None = None,
    lora_columns: jax.Array | None = None,
) -> jax.Array:
    """The one decoder layer both forwards run (serving's cached ragged step and training's dense
    forward), so rollouts and the trainer compute the same function: pre-norm, q/k/v with RoPE,
    `attend_fn(q, k, v) -> f[B, T, N, H]` (the forward's attention: dense and causal, or the paged
    cache's, which first writes k and v into it), then the output projection and the MLP."""
    q, k, v = _project_qkv(cfg, lp, x, cos, sin, lora_columns)
    return _output_and_mlp(cfg, lp, x, attend_fn(q, k, v), expert_parallel, lora_columns)


def layer_loop(
    layers: tuple | LayerParams,
    num_layers: int,
    x: jax.Array,
    carry,
    body: Callable,
    *,
    scan: bool,
    observe: Callable[[jax.Array], jax.Array] | None = None,
    observed: tuple[int, ...] | None = None,
):
    """The one layer loop both forwards drive: `body(lp, layer, x, carry) -> (x, carry)` per layer.
    Unrolled over a tuple of per-layer params, or over stacked ones sliced per layer when not `scan`
    (`layer` a Python int); `lax.scan` over stacked ones otherwise (`layer` a traced i32). `observe(x)`:
    what to keep of each layer's input (hidden states for EAGLE-3 and pooling), stacked
    [num_layers, ...], or [len(observed), ...] in `observed`'s order for the layers it names (an
    unrolled loop then keeps only those). Returns (x, carry, kept or None)."""
    if scan and not isinstance(layers, tuple):

        def step(state, xs):
            lp, layer = xs
            x, carry = state
            seen = None if observe is None else observe(x)
            return body(lp, layer, x, carry), seen

        (x, carry), kept = jax.lax.scan(step, (x, carry), (layers, jnp.arange(num_layers, dtype=jnp.int32)))
        if kept is not None and observed is not None:
            kept = kept[jnp.asarray(observed, jnp.int32)]
        return x, carry, kept
    kept = {}
    for layer in range(num_layers):
        lp = layers[layer] if isinstance(layers, tuple) else jax.tree.map(lambda w, i=layer: w[i], layers)
        if observe is not None and (observed is None or layer in observed):
            kept[layer] = observe(x)
        x, carry = body(lp, layer, x, carry)
    if observe is None:
        return x, carry, None
    return x, carry, jnp.stack([kept[i] for i in (observed if observed is not None else range(num_layers))])


def _ragged_layer(
    cfg: ModelConfig,
    attention: RaggedAttentionFn,
    lp: LayerParams,  # one layer's slice
    layer: jax.Array | int,
    window: jax.Array,  # i32[]
    sm_scale: jax.Array,  # f32[]
    x: jax.Array,  # f[1, N, D]
    cache: KVCache,  # one replica
    cos: jax.Array,  # f32[1, N, H]  this layer's table
    sin: jax.Array,
    batch: RaggedBatch,
    expert_parallel: ExpertParallelFn | None = None,
    lora_columns: jax.Array | None = None,  # f[N, M * R]: each token's adapter slot (model/lora.py)
) -> tuple[jax.Array, KVCache]:
    """`decoder_layer` over the paged cache: the flat token axis as one batch row, K/V written by
    slot, then attention over each row's pages (int8 / float8 pages read as stored)."""
    written = []

    def paged(q, k, v):
        written.append(write_kv_slots(cache, layer, k[0], v[0], batch.slots))
        return attend(attention, q[0], written[0], layer, batch, window, sm_scale)[None]

    x = decoder_layer(cfg, lp, x, cos, sin, paged, expert_parallel, lora_columns)
    return x, written[0]


# Unrolled layers call one layer's function as a nested jit: JAX traces and lowers it once per step
# shape, not once per layer, and XLA inlines the calls, so the compiled step is the same.
_ragged_layer_traced_once = jax.jit(_ragged_layer, static_argnums=(0, 1, 11))


def forward_ragged(
    params: Params,
    cache: KVCache,  # one replica: k, v f[L, K, NP, S, H]; i8 with scales f32[L, K, NP, S]; float8, f32[L, K, 1, 1]
    batch: RaggedBatch,  # one replica: N tokens of R rows
    *,
    cfg: ModelConfig,
    scan_layers: bool = False,
    attention: RaggedAttentionFn = ragged_attention_blocked,
    matmul: str = "reference",
    expert_parallel: ExpertParallelFn | None = None,
    hidden: bool = False,
    states: HiddenStates | None = None,
    state_index: jax.Array | None = None,  # i32[M]: tokens of the flat axis whose states `states` returns
) -> tuple[jax.Array, KVCache]:
    """One ragged step (prompt chunks, decodes, verifications in one flat token axis) for one
    replica. Returns (logits f32[len(logit_index), V] at `batch.logit_index`, cache); with `hidden`,
    the final-normed hidden states there instead (f[len(logit_index), D]: `lm_head` makes them
    logits), so that a caller can decide on the device which of them are worth the vocabulary matmul.
    With `states` (`model/hidden_states.py`: chosen layers' states, the final-normed state at
    `state_index`, per-row sums), a `HiddenOutput` in place of the logits.

    The layers run on a [1, N, D] activation (the flat token axis as one batch row); K/V written by
    slot (padding dropped), attention over each row's pages. Layers scanned (stacked weights,
    `scan_layers`) or unrolled (a tuple of per-layer params, or stacked weights sliced per layer)."""
    if matmul != "reference":
        params = quant.with_kernel(params, matmul)
    cos, sin, kinds = rope_tables(cfg, batch.positions[None])  # f32[1, N, H], or [2, 1, N, H] (Gemma 3)
    x = _embed(params, cfg, batch.tokens)[None]  # f[1, N, D]
    windows, sm_scales = layer_attention_params(cfg)
    lora_columns = _lora_columns(params, batch, x.dtype)
    if states is not None:
        check_layers(states, cfg.num_layers)
    kinds_array = None if kinds is None else jnp.asarray(kinds)

    def body(lp, layer, x, cache):
        unrolled = isinstance(layer, int)
        kind = None if kinds is None else int(kinds[layer]) if unrolled else kinds_array[layer]
        run = _ragged_layer_traced_once if unrolled else _ragged_layer
        return run(
            cfg,
            attention,
            lp,
            layer,
            windows[layer],
            sm_scales[layer],
            x,
            cache,
            *_layer_rope(cos, sin, kind),
            batch,
            expert_parallel,
            lora_columns,
        )

    observe = (lambda x: x[0][state_index]) if states is not None and states.layers else None
    observed = states.layers if observe is not None else None
    x, cache, chosen = layer_loop(
        params.layers, cfg.num_layers, x, cache, body, scan=scan_layers, observe=observe, observed=observed
    )
    kept = {} if chosen is None else dict(zip(states.layers, chosen))
    if states is not None:
        return _hidden_output(params, cfg, x[0], batch, states, state_index, kept), cache
    x = _norm(cfg, x[0][batch.logit_index], params.final_norm)
    return (x if hidden else lm_head(params, cfg, x)), cache


def _hidden_output(
    params: Params,
    cfg: ModelConfig,
    x: jax.Array,  # f[N, D]: the last layer's output, every token
    batch: RaggedBatch,
    states: HiddenStates,
    state_index: jax.Array | None,
    kept: dict[int, jax.Array],
) -> HiddenOutput:
    """The `HiddenOutput` a step with `states` returns (`model/hidden_states.py`)."""
    logits = None
    if states.logits:
        logits = lm_head(params, cfg, _norm(cfg, x[batch.logit_index], params.final_norm))
    layers = jnp.stack([kept[i] for i in states.layers]) if states.layers else None
    final = _norm(cfg, x[state_index], params.final_norm) if states.final else None
    sums = None
    if states.row_sums:
        sums = sum_rows(_norm(cfg, x, params.final_norm), batch.token_row, batch.context_lens.shape[-1])
    return HiddenOutput(logits=logits, layers=layers, final=final, row_sums=sums)


def _lora_columns(params: Params, batch: RaggedBatch, dtype) -> jax.Array | None:
    """Each token's adapter columns (`lora.token_columns`), or None when the params hold no adapters
    or the batch names none (a draft model's step, the research steps)."""
    lora = (params.layers[0] if isinstance(params.layers, tuple) else params.layers).lora
    if lora is None or batch.row_lora is None:
        return None
    return lora_ops.token_columns(batch.row_lora, batch.token_row, lora.slots, lora.rank, dtype)


def _logits(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    return lm_head(params, cfg, _norm(cfg, x, params.final_norm))


def lm_head(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Logits f32[..., V] of final-normed hidden states x f[..., D] (softcapped where the model does).
    int8 heads multiply by `params`' kernel (`quant.with_kernel`, as the forward applies it)."""
    if params.lm_head is None and quant.is_quant(params.embed):  # tied and quantized: stored as the head
        logits = quant.matmul(x, params.embed, preferred_element_type=jnp.float32)
    elif params.lm_head is None:  # tied: contract with embed [V, D] directly (a .T materialised a copy)
        logits = jnp.einsum("...d,vd->...v", x, params.embed, preferred_element_type=jnp.float32)
    else:
        logits = quant.matmul(x, params.lm_head, preferred_element_type=jnp.float32)
    cap = cfg.final_logit_softcapping
    return logits if cap is None else jnp.tanh(logits / cap) * cap


def forward_dense(
    params: Params,
    tokens: jax.Array,
    *,
    cfg: ModelConfig,
    expert_parallel: ExpertParallelFn | None = None,
    logits_at: jax.Array | None = None,
) -> jax.Array:
    """Logits f32[B, T, V] of whole sequences from position 0, without a KV cache (training, scoring).

    The same layers as `forward_ragged`, with dense causal attention; `layers` may be stacked (scanned)
    or a tuple (unrolled). `logits_at` i32[B, K]: only those positions' logits, f32[B, K, V] (a trainer
    scoring completions skips the vocabulary-wide head over their prompts)."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cos, sin, kinds = rope_tables(cfg, positions)
    x = _embed(params, cfg, tokens)
    sm_scale = None if cfg.query_pre_attn_scalar is None else float(cfg.query_pre_attn_scalar**-0.5)

    windows = layer_attention_params(cfg)[0] if cfg.layer_types else None
    kinds_array = None if kinds is None else jnp.asarray(kinds)

    def body(lp, layer, x, carry):
        if isinstance(layer, int):  # unrolled: the layer's window and table as static values
            window, kind = _layer_window(cfg, layer), None if kinds is None else int(kinds[layer])
        elif windows is None:  # scanned, every layer alike
            window, kind = cfg.sliding_window, None
        else:  # scanned local and global layers: window and table chosen by the layer
            window, kind = windows[layer], None if kinds is None else kinds_array[layer]
        attend_fn = lambda q, k, v: causal_attention(q, k, v, window, sm_scale)  # noqa: E731
        return decoder_layer(cfg, lp, x, *_layer_rope(cos, sin, kind), attend_fn, expert_parallel), carry

    x, _, _ = layer_loop(params.layers, cfg.num_layers, x, None, body, scan=True)
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[..., None], axis=1)
    return _logits(params, cfg, x)
