"""The params pytree: one description per array (shape, logical axes, init), from which abstract
shapes, dummy weights and shardings are all derived.

Per-layer weights are stacked on a leading `layers` axis so the forward can scan or unroll over
them without changing the pytree. Linear weights are stored as [in, out] (HF stores [out, in]).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig


@flax.struct.dataclass
class LayerParams:
    """Weights of all decoder layers, stacked on axis 0 (L = num_layers)."""

    attn_norm: jax.Array  # f[L, D]
    wq: jax.Array  # f[L, D, N*H]
    wk: jax.Array  # f[L, D, K*H]
    wv: jax.Array  # f[L, D, K*H]
    wo: jax.Array  # f[L, N*H, D]
    mlp_norm: jax.Array  # f[L, D]
    w_gate: jax.Array | None  # f[L, D, F]; None for a mixture of experts (its MLP is the expert_* below)
    w_up: jax.Array | None  # f[L, D, F]
    w_down: jax.Array | None  # f[L, F, D]
    bq: jax.Array | None = None  # f[L, N*H] (Qwen2, Llama attention_bias)
    bk: jax.Array | None = None  # f[L, K*H]
    bv: jax.Array | None = None  # f[L, K*H]
    bo: jax.Array | None = None  # f[L, D] (Llama attention_bias)
    q_norm: jax.Array | None = None  # f[L, H] (Qwen3: RMSNorm weight over each query head, before RoPE)
    k_norm: jax.Array | None = None  # f[L, H]
    # Gemma 3's sandwich norms: RMSNorms of the attention output and of the MLP output, before each
    # residual add (`mlp_norm` is then HF's pre_feedforward_layernorm). None for the other families.
    post_attn_norm: jax.Array | None = None  # f[L, D]
    post_mlp_norm: jax.Array | None = None  # f[L, D]
    # Mixture of experts (Qwen3-MoE, Mixtral; moe.MoEParams per layer): the router and E SwiGLU experts
    # of hidden size F_e = moe_intermediate_size. None for the dense families.
    router: jax.Array | None = None  # f[L, D, E]
    expert_gate: jax.Array | None = None  # f[L, E, D, F_e]
    expert_up: jax.Array | None = None  # f[L, E, D, F_e]
    expert_down: jax.Array | None = None  # f[L, E, F_e, D]
    # LoRA adapters resident on the device (model/lora.py LayerLoRA), set by the runner when the
    # engine serves adapters (runner/lora.py); None otherwise, and in every checkpoint.
    lora: Any = None


@flax.struct.dataclass
class Params:
    """All weights of a Llama-family decoder.

    `layers` is one LayerParams stacked on a leading layer axis (what `lax.scan` and checkpoints
    want), or a tuple of per-layer LayerParams (what the unrolled forward wants: XLA on CPU runs a
    matmul on a slice of a stacked weight about 6x slower than on an array of its own, measured on
    the SmolLM2-135M shape). `unstack_layers` turns the first into the second.
    """

    embed: jax.Array  # f[V, D]
    layers: LayerParams | tuple[LayerParams, ...]
    final_norm: jax.Array  # f[D]
    lm_head: jax.Array | None = None  # f[D, V]; None when tied to `embed`


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """How one array of the params pytree looks: shape, logical axis names, and its dummy init."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str  # "normal" | "ones" | "zeros"


def param_specs(cfg: ModelConfig) -> Params:
    """A Params pytree whose leaves are ArraySpecs: the single description everything else derives from."""
    L, D, F, V, H = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    NH, KH = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    bias, sandwich, moe = cfg.qkv_bias, cfg.sandwich_norms, cfg.is_moe
    E, FE = cfg.num_experts, cfg.moe_intermediate_size
    norm = "zeros" if cfg.norm_weight_offset else "ones"  # Gemma scales by (1 + weight): zeros is the identity
    layers = LayerParams(
        attn_norm=ArraySpec((L, D), ("layers", "embed_replicated"), norm),
        wq=ArraySpec((L, D, NH), ("layers", "embed", "heads"), "normal"),
        wk=ArraySpec((L, D, KH), ("layers", "embed", "kv_heads"), "normal"),
        wv=ArraySpec((L, D, KH), ("layers", "embed", "kv_heads"), "normal"),
        wo=ArraySpec((L, NH, D), ("layers", "heads", "embed"), "normal"),
        mlp_norm=ArraySpec((L, D), ("layers", "embed_replicated"), norm),
        # a dense MLP or experts, never both (config.check_servable)
        w_gate=None if moe else ArraySpec((L, D, F), ("layers", "embed", "mlp"), "normal"),
        w_up=None if moe else ArraySpec((L, D, F), ("layers", "embed", "mlp"), "normal"),
        w_down=None if moe else ArraySpec((L, F, D), ("layers", "mlp", "embed"), "normal"),
        bq=ArraySpec((L, NH), ("layers", "heads"), "zeros") if bias else None,
        bk=ArraySpec((L, KH), ("layers", "kv_heads"), "zeros") if bias else None,
        bv=ArraySpec((L, KH), ("layers", "kv_heads"), "zeros") if bias else None,
        bo=ArraySpec((L, D), ("layers", "embed_replicated"), "zeros") if cfg.o_bias else None,
        q_norm=ArraySpec((L, H), ("layers", "head_dim"), norm) if cfg.qk_norm else None,
        k_norm=ArraySpec((L, H), ("layers", "head_dim"), norm) if cfg.qk_norm else None,
        post_attn_norm=ArraySpec((L, D), ("layers", "embed_replicated"), norm) if sandwich else None,
        post_mlp_norm=ArraySpec((L, D), ("layers", "embed_replicated"), norm) if sandwich else None,
        router=ArraySpec((L, D, E), ("layers", "embed", None), "normal") if moe else None,
        expert_gate=ArraySpec((L, E, D, FE), ("layers", "experts", "embed", "expert_mlp"), "normal") if moe else None,
        expert_up=ArraySpec((L, E, D, FE), ("layers", "experts", "embed", "expert_mlp"), "normal") if moe else None,
        expert_down=ArraySpec((L, E, FE, D), ("layers", "experts", "expert_mlp", "embed"), "normal") if moe else None,
    )
    return Params(
        embed=ArraySpec((V, D), ("vocab", "embed"), "normal"),
        layers=layers,
        final_norm=ArraySpec((D,), ("embed_replicated",), norm),
        lm_head=None if cfg.tie_word_embeddings else ArraySpec((D, V), ("embed", "vocab"), "normal"),
    )


def _is_spec(x: Any) -> bool:
    return isinstance(x, ArraySpec)


def map_specs(fn: Callable[[ArraySpec], Any], cfg: ModelConfig) -> Params:
    return jax.tree.map(fn, param_specs(cfg), is_leaf=_is_spec)


def logical_axes(cfg: ModelConfig) -> Params:
    """Logical axis names per array, for the sharding rules."""
    return map_specs(lambda s: s.axes, cfg)


def init_dummy_params(cfg: ModelConfig, seed: int, dtype: Any, std: float = 0.02) -> Params:
    """Seeded random weights (benchmarks and tests): normal(std) matrices, unit norms, zero biases."""
    specs, treedef = jax.tree.flatten(param_specs(cfg), is_leaf=_is_spec)
    keys = jax.random.split(jax.random.key(seed), len(specs))

    def make(spec: ArraySpec, key: jax.Array) -> jax.Array:
        if spec.init == "ones":
            return jnp.ones(spec.shape, dtype)
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, dtype)
        return (std * jax.random.normal(key, spec.shape, jnp.float32)).astype(dtype)

    return jax.tree.unflatten(treedef, [make(s, k) for s, k in zip(specs, keys)])


def unstack_layers(params: Params) -> Params:
    """Stacked layers -> a tuple of per-layer LayerParams (same values)."""
    layers = params.layers
    if isinstance(layers, tuple):
        return params
    return params.replace(layers=tuple(jax.tree.map(lambda w: w[i], layers) for i in range(layers.wq.shape[0])))


def param_bytes(params: Params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
