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

Not yet wired into the model's layers (issue 24): `llama.py`'s MLP calls this where a config has
experts, and the mesh shards `experts` for expert parallelism.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class MoEParams:
    """One layer's experts: the router and each expert's SwiGLU weights, stacked on the expert axis E."""

    router: jax.Array  # f[D, E]
    w_gate: jax.Array  # f[E, D, F]
    w_up: jax.Array  # f[E, D, F]
    w_down: jax.Array  # f[E, F, D]

    @classmethod
    def from_hf(cls, router: Any, gate_up_proj: Any, down_proj: Any) -> "MoEParams":
        """From Hugging Face's fused expert tensors (transformers 5: `gate.weight [E, D]`,
        `experts.gate_up_proj [E, 2F, D]` with the gate half first, `experts.down_proj [E, D, F]`)."""
        router, gate_up, down = (jnp.asarray(x) for x in (router, gate_up_proj, down_proj))
        F = gate_up.shape[1] // 2
        return cls(router=router.T, w_gate=jnp.swapaxes(gate_up[:, :F], 1, 2),
                   w_up=jnp.swapaxes(gate_up[:, F:], 1, 2), w_down=jnp.swapaxes(down, 1, 2))


def route(x: jax.Array, router: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights f32[T, k], experts i32[T, k]): softmax over all experts in float32, the k largest,
    renormalised to sum to 1 when `normalize` (Mixtral always; Qwen3-MoE's norm_topk_prob)."""
    logits = jnp.einsum("td,de->te", x, router, preferred_element_type=jnp.float32)
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def moe_mlp(x: jax.Array, p: MoEParams, *, top_k: int, normalize: bool,
            act: Callable[[jax.Array], jax.Array] = jax.nn.silu) -> jax.Array:
    """The MoE MLP of tokens x f[T, D] -> f[T, D]."""
    T, D = x.shape
    E = p.router.shape[-1]
    weights, experts = route(x, p.router, top_k, normalize)
    if T * top_k <= E:  # few assignments (decode): read only the chosen experts' weights
        return _gathered_experts(x, p, weights, experts, act)
    flat = experts.reshape(-1)  # i32[T * k]: assignment a is token a // k's (a % k)-th expert
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    token = order // top_k
    group_sizes = jnp.zeros(E, jnp.int32).at[flat].add(1)
    rows = x[token]  # f[T * k, D]
    gate = jax.lax.ragged_dot(rows, p.w_gate, group_sizes)
    up = jax.lax.ragged_dot(rows, p.w_up, group_sizes)
    out = jax.lax.ragged_dot((act(gate) * up).astype(x.dtype), p.w_down, group_sizes)  # f[T * k, D]
    scale = weights.reshape(-1)[order].astype(jnp.float32)[:, None]
    return jnp.zeros((T, D), jnp.float32).at[token].add(out.astype(jnp.float32) * scale).astype(x.dtype)


def _gathered_experts(x, p: MoEParams, weights, experts, act) -> jax.Array:
    """Each assignment multiplies by its own expert's weights, gathered: T * k experts' bytes read,
    never all E (XLA:CPU's ragged_dot computes every expert for every row: measured 54 ms for 8
    experts against 4 ms for one, 512 x 512 x 1024, this CPU, 2026-12-01)."""
    gate = jnp.einsum("td,tkdf->tkf", x, p.w_gate[experts], preferred_element_type=jnp.float32)
    up = jnp.einsum("td,tkdf->tkf", x, p.w_up[experts], preferred_element_type=jnp.float32)
    h = (act(gate) * up).astype(x.dtype)
    out = jnp.einsum("tkf,tkfd->tkd", h, p.w_down[experts], preferred_element_type=jnp.float32)
    return jnp.einsum("tkd,tk->td", out, weights).astype(x.dtype)
