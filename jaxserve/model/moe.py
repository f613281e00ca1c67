"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral): top-k routing and the experts' grouped matmul.

Experts multiply parameters, not FLOPs per token: each token runs only its top-k experts. So the
token-expert assignments are sorted by expert and the experts' SwiGLU runs as three grouped
matmuls (`jax.lax.ragged_dot`: rows of group e meet expert e's weights), with no per-token Python
and shapes fixed by the token count alone (T * k assignment rows), so one executable serves every
routing. The outputs are weighted by the router and summed back onto their tokens. When a step
has no more assignments than experts (decode), each assignment instead gathers its expert's
weights, so a batch-1 step reads top-k experts, not all of them.

On accelerators `ragged_dot` lowers to grouped GEMMs; XLA:CPU computes it densely (every expert
for every row), so on a CPU a prefill through the grouped path costs E times the routed FLOPs.

`llama.py`'s MLP calls this where a config has experts (LayerParams.router and expert_*). int8
experts are QuantArrays (one scale per expert and output channel): the grouped path multiplies by
the int8 values widened to x's dtype and scales each assignment row by its expert's scales. int4
experts are Int4Arrays (a scale and bias per group of each expert's input rows, which do not commute
with the sum over `in`): the grouped path dequantizes the layer's whole expert stack in x's dtype
before its ragged_dot. The gathered path dequantizes only the gathered experts, either way.

On a mesh the experts are tensor-parallel (every device holds every expert, split on its hidden
dimension; GSPMD partitions the code below as it does a dense MLP) or expert-parallel (the
`moe_parallelism="expert"` setting: E / model whole experts per device; `sharding.ExpertParallel`
runs `moe_local` once per device on its own experts under shard_map and one psum adds the devices'
partial outputs; see `moe_mlp`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp

from jaxserve.model.quant import Int4Array, QuantArray, dequantize_int4

Weight = jax.Array | QuantArray | Int4Array


@flax.struct.dataclass
class MoEParams:
    """One layer's experts: the router and each expert's SwiGLU weights, stacked on the expert axis E."""

    router: jax.Array  # f[D, E]
    w_gate: Weight  # f[E, D, F] (or int8 values with f32[E, 1, F] scales, or int4: quant.Int4Array)
    w_up: Weight  # f[E, D, F]
    w_down: Weight  # f[E, F, D]

    @classmethod
    def from_hf(cls, router: Any, gate_up_proj: Any, down_proj: Any) -> "MoEParams":
        """From Hugging Face's fused expert tensors (transformers 5: `gate.weight [E, D]`,
        `experts.gate_up_proj [E, 2F, D]` with the gate half first, `experts.down_proj [E, D, F]`)."""
        router, gate_up, down = (jnp.asarray(x) for x in (router, gate_up_proj, down_proj))
        F = gate_up.shape[1] // 2
        return cls(
            router=router.T,
            w_gate=jnp.swapaxes(gate_up[:, :F], 1, 2),
            w_up=jnp.swapaxes(gate_up[:, F:], 1, 2),
            w_down=jnp.swapaxes(down, 1, 2),
        )


def route(x: jax.Array, router: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights f32[T, k], experts i32[T, k]): softmax over all experts in float32, the k largest,
    renormalised to sum to 1 when `normalize` (Mixtral always; Qwen3-MoE's norm_topk_prob)."""
    logits = jnp.einsum("td,de->te", x, router, preferred_element_type=jnp.float32)
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


# expert_parallel(local) -> fn(x f[T, D], p: MoEParams) -> f[T, D]: runs local(x, p_here, first_expert)
# once per device on that device's experts and sums the partial outputs (sharding.ExpertParallel).
ExpertParallelFn = Callable[[Callable[..., jax.Array]], Callable[[jax.Array, MoEParams], jax.Array]]


def moe_mlp(
    x: jax.Array,
    p: MoEParams,
    *,
    top_k: int,
    normalize: bool,
    act: Callable[[jax.Array], jax.Array] = jax.nn.silu,
    expert_parallel: ExpertParallelFn | None = None,
) -> jax.Array:
    """The MoE MLP of tokens x f[T, D] -> f[T, D].

    Under `jax.vmap` over x alone (the engine's step maps its forward over replicas, the weights
    shared) the batch's tokens are routed as one [B * T, D] set: jax's ragged_dot batches only when
    every operand, the weights too, is mapped (jax 0.10: "ragged_dot vmap over any dim but 0").
    Tensor-parallel (expert_parallel None), that sort spans the data axis's devices on a mesh
    (correct). With `expert_parallel` (sharding.ExpertParallel) each device keeps its replicas' tokens
    and its own experts: it routes its tokens over all E experts (the router is replicated), computes
    only the assignments to its experts (`moe_local`) and one psum over the expert devices adds the
    partial outputs (the tokens are already on every device of the model axis: the attention's
    all-reduce left them there, so dispatching is a local selection and combining the one collective).
    Not differentiable in reverse mode (custom_vmap)."""
    return _batchable(top_k, normalize, act, expert_parallel)(x, p)


@functools.lru_cache(maxsize=None)
def _batchable(
    top_k: int, normalize: bool, act: Callable[[jax.Array], jax.Array], expert_parallel: ExpertParallelFn | None
):
    """`_moe_tokens` (or its expert-parallel form) with a vmap rule that flattens a mapped x's batch
    into its tokens."""
    if expert_parallel is None:
        tokens_fn = lambda x, p: _moe_tokens(x, p, top_k, normalize, act)  # noqa: E731
    else:
        local = functools.partial(moe_local, top_k=top_k, normalize=normalize, act=act)
        tokens_fn = expert_parallel(local)
    fn = jax.custom_batching.custom_vmap(tokens_fn)

    @fn.def_vmap
    def _flatten_batch(axis_size, in_batched, x, p):
        x_batched, p_batched = in_batched
        if any(jax.tree.leaves(p_batched)):
            raise NotImplementedError("moe_mlp under vmap with mapped expert weights (only x may be mapped)")
        if not x_batched:
            return fn(x, p), False
        return fn(x.reshape(-1, x.shape[-1]), p).reshape(x.shape), True

    return fn


def _moe_tokens(x: jax.Array, p: MoEParams, top_k: int, normalize: bool, act) -> jax.Array:
    E = p.router.shape[-1]
    weights, experts = route(x, p.router, top_k, normalize)
    if x.shape[0] * top_k <= E:  # few assignments (decode): read only the chosen experts' weights
        return _gathered_experts(x, p, weights, experts, act).astype(x.dtype)
    return _grouped_experts(x, p, weights, experts, E, act).astype(x.dtype)


def moe_local(
    x: jax.Array, p: MoEParams, first_expert: jax.Array, *, top_k: int, normalize: bool, act=jax.nn.silu
) -> jax.Array:
    """One device's share of the MoE MLP of x f[T, D] under expert parallelism: f32[T, D], the sum over
    each token's assignments to experts first_expert .. first_expert + E_here - 1 only.

    `p` holds the router of all E experts f[D, E] and this device's E_here experts' weights
    [E_here, ...]; adding every device's result gives `moe_mlp`. The assignments to other devices'
    experts are weighted 0 and sorted after this device's groups, where ragged_dot leaves their rows
    zero (rows past the groups' sum), so the grouped matmuls cover this device's experts alone."""
    here = p.w_gate.shape[0]
    weights, experts = route(x, p.router, top_k, normalize)
    local = experts - first_expert  # i32[T, k]
    mine = (local >= 0) & (local < here)
    weights = jnp.where(mine, weights, 0.0)
    if x.shape[0] * top_k <= here:  # few assignments: gather (others' assignments read expert 0, weighted 0)
        return _gathered_experts(x, p, weights, jnp.where(mine, local, 0), act)
    return _grouped_experts(x, p, weights, jnp.where(mine, local, here), here, act)


def _grouped_experts(x, p: MoEParams, weights, experts, num_groups: int, act) -> jax.Array:
    """f32[T, D]: the assignments experts i32[T, k] sorted into `num_groups` groups (ids >= num_groups
    last, in no group: zero rows), three ragged_dots, weighted and summed back onto their tokens."""
    T, D = x.shape
    top_k = experts.shape[1]
    flat = experts.reshape(-1)  # i32[T * k]: assignment a is token a // k's (a % k)-th expert
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    token = order // top_k
    group_sizes = jnp.zeros(num_groups, jnp.int32).at[flat].add(1, mode="drop")
    rows = x[token]  # f[T * k, D]
    row_expert = jnp.minimum(flat[order], num_groups - 1)  # i32[T * k]: each sorted row's expert (int8 scales)
    gate = _grouped(rows, p.w_gate, group_sizes, row_expert)
    up = _grouped(rows, p.w_up, group_sizes, row_expert)
    out = _grouped((act(gate) * up).astype(x.dtype), p.w_down, group_sizes, row_expert)  # f[T * k, D]
    scale = weights.reshape(-1)[order].astype(jnp.float32)[:, None]
    return jnp.zeros((T, D), jnp.float32).at[token].add(out.astype(jnp.float32) * scale)


def _grouped(rows: jax.Array, w: Weight, group_sizes: jax.Array, row_expert: jax.Array) -> jax.Array:
    """rows f[A, in] (sorted by expert) times their experts' w [E, in, out]: one ragged_dot.

    int4 experts are dequantized whole (all E of the layer, in rows' dtype) first: their group biases
    do not factor out of the product as int8's channel scales do. That widened stack is E experts'
    float bytes per layer, paid once per prefill step, not per row."""
    if isinstance(w, Int4Array):
        return jax.lax.ragged_dot(rows, dequantize_int4(w, rows.dtype), group_sizes)
    if not isinstance(w, QuantArray):
        return jax.lax.ragged_dot(rows, w, group_sizes)
    # The int8 -> rows.dtype convert is exact; a row's scales (its expert's) commute with the sum over `in`.
    y = jax.lax.ragged_dot(rows, w.values.astype(rows.dtype), group_sizes, preferred_element_type=jnp.float32)
    return (y * w.scales[row_expert, 0]).astype(rows.dtype)  # experts: one scale row (per channel)


def _take(w: Weight, experts: jax.Array, dtype) -> jax.Array:
    """The weights of experts i32[T, k]: f[T, k, in, out] (quantized ones dequantized after the gather,
    so only the routed experts are widened)."""
    if isinstance(w, Int4Array):  # values, scales, biases (and perm) all lead with the expert axis
        gathered = jax.tree.map(lambda a: a[experts], w)
        return dequantize_int4(gathered, dtype)
    if not isinstance(w, QuantArray):
        return w[experts]
    return w.values[experts].astype(dtype) * w.scales[experts].astype(dtype)  # [T, k, 1, out]: per channel


def _gathered_experts(x, p: MoEParams, weights, experts, act) -> jax.Array:
    """Each assignment multiplies by its own expert's weights, gathered: T * k experts' bytes read,
    never all E (XLA:CPU's ragged_dot computes every expert for every row: measured 54 ms for 8
    experts against 4 ms for one, 512 x 512 x 1024, this CPU, 2026-12-01)."""
    gate = jnp.einsum("td,tkdf->tkf", x, _take(p.w_gate, experts, x.dtype), preferred_element_type=jnp.float32)
    up = jnp.einsum("td,tkdf->tkf", x, _take(p.w_up, experts, x.dtype), preferred_element_type=jnp.float32)
    h = (act(gate) * up).astype(x.dtype)
    out = jnp.einsum("tkf,tkfd->tkd", h, _take(p.w_down, experts, x.dtype), preferred_element_type=jnp.float32)
    return jnp.einsum("tkd,tk->td", out, weights)  # f32[T, D]
