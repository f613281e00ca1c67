"""The planner's weight arithmetic: which weights multiply activations, how they are split over the
`model` axis (`sharding.logical_rules`, so the plan cannot drift from what the engine allocates), the
bytes each device holds and reads a step, and how the KV heads split."""

from __future__ import annotations

import math

from jaxserve.config import ModelConfig
from jaxserve.config.model_config import int4_bytes, resolved_group_size

# The weights int8 quantization replaces (ModelConfig.linear_params); lm_head only with quantize_lm_head.
LINEAR_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "expert_gate", "expert_up", "expert_down")
EXPERT_WEIGHTS = ("expert_gate", "expert_up", "expert_down")


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that multiply activations each token: all but the input embedding, which is a gather
    (when tied, the same table is the LM head and does multiply). For a mixture of experts only the
    top-k experts a token is routed to (`ModelConfig.active_params`)."""
    return cfg.active_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)


def planned_arrays(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], tuple[str | None, ...]]]:
    """(name, shape, logical axes) of every parameter array: the engine's `weights.param_specs` for the
    architectures it serves; for those it only plans (ModelConfig.servable False) the layout their
    forward is expected to take: per-head q/k norms, Gemma's extra norms, experts stacked [L, E, ...]
    on an "experts" axis with their hidden dimension on "expert_mlp", a replicated router [L, D, E]."""
    import jax

    from jaxserve.model.weights import ArraySpec, param_specs

    if cfg.servable:
        leaves = jax.tree_util.tree_flatten_with_path(param_specs(cfg), is_leaf=lambda x: isinstance(x, ArraySpec))[0]
        return [(getattr(path[-1], "name", str(path[-1])), spec.shape, spec.axes) for path, spec in leaves]
    L, D, F, V, H = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    NH, KH = cfg.num_heads * H, cfg.num_kv_heads * H
    out = [
        ("embed", (V, D), ("vocab", "embed")),
        ("final_norm", (D,), ("embed_replicated",)),
        ("attn_norm", (L, D), ("layers", "embed_replicated")),
        ("mlp_norm", (L, D), ("layers", "embed_replicated")),
        ("wq", (L, D, NH), ("layers", "embed", "heads")),
        ("wk", (L, D, KH), ("layers", "embed", "kv_heads")),
        ("wv", (L, D, KH), ("layers", "embed", "kv_heads")),
        ("wo", (L, NH, D), ("layers", "heads", "embed")),
    ]
    if not cfg.tie_word_embeddings:
        out.append(("lm_head", (D, V), ("embed", "vocab")))
    if cfg.qkv_bias:
        out += [
            ("bq", (L, NH), ("layers", "heads")),
            ("bk", (L, KH), ("layers", "kv_heads")),
            ("bv", (L, KH), ("layers", "kv_heads")),
        ]
    if cfg.o_bias:
        out.append(("bo", (L, D), ("layers", "embed_replicated")))
    if cfg.qk_norm:
        out += [("q_norm", (L, H), ("layers", None)), ("k_norm", (L, H), ("layers", None))]
    if cfg.sandwich_norms:
        out += [
            ("post_attn_norm", (L, D), ("layers", "embed_replicated")),
            ("post_mlp_norm", (L, D), ("layers", "embed_replicated")),
        ]
    dense = len(cfg.dense_layers) if cfg.is_moe else L
    if dense:
        out += [
            ("w_gate", (dense, D, F), ("layers", "embed", "mlp")),
            ("w_up", (dense, D, F), ("layers", "embed", "mlp")),
            ("w_down", (dense, F, D), ("layers", "mlp", "embed")),
        ]
    if cfg.is_moe:
        M, E, FE = cfg.num_moe_layers, cfg.num_experts, cfg.moe_intermediate_size
        out += [
            ("router", (M, D, E), ("layers", "embed", None)),
            ("expert_gate", (M, E, D, FE), ("layers", "experts", "embed", "expert_mlp")),
            ("expert_up", (M, E, D, FE), ("layers", "experts", "embed", "expert_mlp")),
            ("expert_down", (M, E, FE, D), ("layers", "experts", "expert_mlp", "embed")),
        ]
    return out


def sharding_rules(cfg: ModelConfig, model_size: int, expert_parallel: bool = False) -> dict[str, str | None]:
    """The engine's logical-axis rules (raises ConfigError when the model axis does not divide the heads).

    For a mixture of experts, the planner's rule for the expert arrays: tensor-parallel splits every
    expert's hidden dimension over the model axis ("expert_mlp"); expert_parallel puts E / model_size
    whole experts on each device ("experts"). Either way activations stay replicated, so the layer
    ends in one all-reduce of [T, D] as a dense MLP does. These are `sharding.logical_rules` with the
    engine's `moe_parallelism` setting ("expert" or "tensor")."""
    from jaxserve.model.sharding import logical_rules

    return dict(logical_rules(cfg, model_size, "expert" if expert_parallel else "tensor"))


def param_bytes_per_device(
    cfg: ModelConfig,
    bytes_per_element: int,
    quantization: str = "none",
    quantize_lm_head: bool = False,
    model_size: int = 1,
    expert_parallel: bool = False,
    only: tuple[str, ...] | None = None,
    group_size: int | None = None,
) -> int:
    """Bytes of parameters on each device of a model axis of `model_size` devices.

    Each array of `weights.param_specs` is split over the model axis when one of its logical axes maps
    to it (`sharding.logical_rules`), else replicated; int8 weights take 1 byte per element plus an f32
    scale per group of `group_size` inputs (split as the weight is) or, per channel (group 0, and the
    experts), per output channel (split when the output axis is); int4 ones, experts included, half a
    byte plus an f32 scale and bias per group (split as the weight is). With model_size=1 this equals
    `ModelConfig.param_bytes` (checked below). `only`: count just the arrays of these names (e.g.
    EXPERT_WEIGHTS); expert_parallel: see `sharding_rules`."""
    from jaxserve.model.sharding import MODEL

    g = resolved_group_size(cfg, quantization, group_size, model_size)

    def count(size: int, names: tuple[str, ...] | None) -> int:
        rules = sharding_rules(cfg, size, expert_parallel)
        total = 0
        for name, shape, axes in planned_arrays(cfg):
            if names is not None and name not in names:
                continue
            elements = math.prod(shape)
            split = size if any(a is not None and rules.get(a) == MODEL for a in axes) else 1
            head = quantize_lm_head and name == ("embed" if cfg.tie_word_embeddings else "lm_head")
            if head and name == "embed":  # the tied table, quantized as the head [D, V]
                shape, axes = shape[::-1], axes[::-1]
            quantized = quantization == "int8" and (name in LINEAR_WEIGHTS or head)
            if quantization == "int4" and (name in LINEAR_WEIGHTS or head):  # experts too
                total += int4_bytes(elements, g) // split  # packed values, scales and biases keep the weight's axes
            elif quantized and g and name not in EXPERT_WEIGHTS:  # group scales keep the weight's axes
                total += (elements + elements // g * 4) // split
            elif quantized:  # one f32 scale per output channel, split when any axis but the input one is
                out_channels = elements // shape[-2]
                scale_split = (
                    size
                    if any(rules.get(a) == MODEL for i, a in enumerate(axes) if a is not None and i != len(axes) - 2)
                    else 1
                )
                total += elements // split + out_channels * 4 // scale_split
            else:
                total += elements * bytes_per_element // split
        return total

    expected = cfg.param_bytes(bytes_per_element, quantization, quantize_lm_head, g)
    if count(1, None) != expected:  # the planner's view of the arrays must be ModelConfig's
        raise AssertionError(f"planner counts {count(1, None)} parameter bytes, ModelConfig.param_bytes {expected}")
    return count(model_size, only)


def experts_on_busiest_device(cfg: ModelConfig, batch: float, model_size: int, expert_parallel: bool) -> float:
    """Experts per MoE layer whose weights the busiest device of a replica reads in a step of `batch`
    rows, in units of the slice of one expert that device holds.

    Tensor-parallel: every device holds 1/model_size of every expert and reads its slice of each of
    the E·(1 − (1 − k/E)^B) experts read (`ModelConfig.expected_experts_read`, uniform routing).
    Expert-parallel: whole experts, E / model_size per device, each read with probability
    p = (experts read) / E; the step waits for the busiest device, so this is the expected maximum over
    the model_size devices of Binomial(E / model_size, p) (independent experts, uniform routing), and
    at least ceil(k / model_size) (one row's k distinct experts spread over model_size devices). Both
    are expectations under uniform routing, not bounds: a skewed router reads fewer distinct experts
    and loads expert-parallel devices less evenly."""
    read = cfg.expected_experts_read(batch)
    if not expert_parallel or model_size == 1:
        return read
    n, p = cfg.num_experts // model_size, read / cfg.num_experts
    cdf, busiest = 0.0, 0.0
    for x in range(n):  # E[max] = sum over x of P(max > x) = 1 - F(x)^m
        cdf += math.comb(n, x) * p**x * (1 - p) ** (n - x)
        busiest += 1.0 - min(cdf, 1.0) ** model_size
    return max(busiest, float(math.ceil(cfg.num_experts_per_tok / model_size)))


def param_bytes_read_per_device(
    cfg: ModelConfig, batch: float, per_device: int, experts_per_device: int, model_size: int, expert_parallel: bool
) -> float:
    """Parameter bytes the busiest device reads in a step of `batch` rows: everything it holds but the
    experts no row is routed to. `experts_per_device`: bytes of the expert arrays it holds."""
    if not cfg.is_moe:
        return per_device
    held = cfg.num_experts // model_size if expert_parallel and model_size > 1 else cfg.num_experts
    each = experts_per_device / (cfg.num_moe_layers * held)  # one (slice of an) expert of one layer
    read = experts_on_busiest_device(cfg, batch, model_size, expert_parallel)
    return per_device - experts_per_device + cfg.num_moe_layers * read * each


def kv_split(cfg: ModelConfig, model_size: int) -> int:
    """Devices the KV heads are split over: the model axis when it divides them, else 1 (replicated)."""
    from jaxserve.model.sharding import MODEL

    return model_size if sharding_rules(cfg, model_size)["kv_heads"] == MODEL else 1
