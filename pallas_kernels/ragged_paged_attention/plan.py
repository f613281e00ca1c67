"""Work list of the ragged kernels: the flat token batch cut into per-sequence query blocks."""

# A work item is up to `bq` consecutive query tokens of ONE sequence, so a kernel
# step never straddles two sequences and needs no per-row sequence lookup.  The
# list has a static length (an upper bound); surplus items have q_len 0 and the
# kernels skip them.  Queries are gathered into item order before the kernel and
# the outputs scattered back after it (one extra pass over q and the output,
# small next to attention itself).

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels._common import pad_axis


def max_work_items(num_tokens: int, max_seqs: int, bq: int) -> int:
    """Static bound on sum_i cdiv(q_len_i, bq) given sum_i q_len_i <= num_tokens."""
    busy = min(max_seqs, num_tokens)  # sequences with at least one query token
    return max(1, (num_tokens + busy * (bq - 1)) // bq)


def _seq_bounds(
    query_start_loc,  # i32[max_seqs + 1]
    num_seqs,  # i32[] | i32[1]
    max_seqs: int,
):
    """query_start_loc with entries past num_seqs pushed to +inf so searchsorted ignores them."""
    n = jnp.reshape(num_seqs, ()).astype(jnp.int32)
    idx = jnp.arange(max_seqs + 1)
    big = jnp.iinfo(jnp.int32).max
    return jnp.where(idx <= n, query_start_loc, big), n


def token_sequence(
    query_start_loc,  # i32[max_seqs + 1]
    num_seqs,  # i32[] | i32[1]
    max_seqs: int,
    num_tokens: int,
):
    """(seq id i32[num_tokens], valid bool[num_tokens]) of every flat query row."""
    bounds, n = _seq_bounds(query_start_loc, num_seqs, max_seqs)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(bounds, t, side="right").astype(jnp.int32) - 1
    valid = (seq >= 0) & (seq < n) & (t >= query_start_loc[0])
    return jnp.clip(seq, 0, max_seqs - 1), valid


@dataclasses.dataclass(frozen=True)
class WorkPlan:
    seq: jax.Array  # i32[W] sequence of each item
    q_start: jax.Array  # i32[W] first flat query row of the item
    q_len: jax.Array  # i32[W] rows in the item (0 = idle item)
    first_pos: jax.Array  # i32[W] cache position of the item's first query token
    cum_blocks: jax.Array  # i32[max_seqs + 1] first item of each sequence
    bq: int
    num_items: int


def make_plan(
    context_lens,  # i32[max_seqs]
    query_start_loc,  # i32[max_seqs + 1]
    num_seqs,  # i32[] | i32[1]
    *,
    num_tokens: int,
    max_seqs: int,
    bq: int,
) -> WorkPlan:
    n = jnp.reshape(num_seqs, ()).astype(jnp.int32)
    active = jnp.arange(max_seqs) < n
    q_lens = jnp.where(active, jnp.maximum(query_start_loc[1:] - query_start_loc[:-1], 0), 0)
    nblk = (q_lens + bq - 1) // bq
    cum = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nblk).astype(jnp.int32)])
    num_items = max_work_items(num_tokens, max_seqs, bq)
    w = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cum, w, side="right").astype(jnp.int32) - 1, 0, max_seqs - 1)
    live = w < cum[-1]
    q_off = (w - cum[seq]) * bq
    q_len = jnp.where(live, jnp.clip(q_lens[seq] - q_off, 0, bq), 0)
    q_start = query_start_loc[seq] + q_off
    first_pos = context_lens[seq] - q_lens[seq] + q_off
    return WorkPlan(
        seq=seq,
        q_start=q_start,
        q_len=q_len.astype(jnp.int32),
        first_pos=first_pos,
        cum_blocks=cum,
        bq=bq,
        num_items=num_items,
    )


def gather_queries(
    q,  # [num_tokens, num_q_heads, head_dim]
    plan: WorkPlan,
):
    """q [T, Hq, D] -> [W, bq, Hq, D]: each item's rows, zeros past its q_len."""
    t_total, hq, dim = q.shape
    r = jnp.arange(plan.bq, dtype=jnp.int32)
    rows = plan.q_start[:, None] + r[None, :]  # [W, bq]
    live = r[None, :] < plan.q_len[:, None]
    return jnp.where(live[..., None, None], q[jnp.clip(rows, 0, t_total - 1)], 0)


def arrange_queries(
    qw,  # [W, bq, num_q_heads, head_dim]
    num_kv_heads: int,
    group: int,
    group_padded: int,
):
    """[W, bq, Hq, D] -> [W, Hkv, bq * gp, D]; rows token-major (row = token * gp + head-in-group)."""
    w, bq, hq, dim = qw.shape
    qw = pad_axis(qw.reshape(w, bq, num_kv_heads, group, dim), 3, group_padded)
    qw = jnp.transpose(qw, (0, 2, 1, 3, 4))  # [W, Hkv, bq, gp, D]
    return qw.reshape(w, num_kv_heads, bq * group_padded, dim)


def scatter_outputs(
    ow,  # [W, num_kv_heads, bq * group_padded, head_dim] kernel output in work order
    plan: WorkPlan,
    query_start_loc,  # i32[max_seqs + 1]
    num_seqs,  # i32[] | i32[1]
    *,
    num_tokens: int,
    max_seqs: int,
    num_kv_heads: int,
    group: int,
    group_padded: int,
    dtype,
):
    """Kernel output [W, Hkv, bq * gp, D] back to flat rows [T, Hq, D]; rows of no sequence are 0."""
    w, hkv, _, dim = ow.shape
    ow = ow.reshape(w, hkv, plan.bq, group_padded, dim)[:, :, :, :group]
    ow = jnp.transpose(ow, (0, 2, 1, 3, 4)).reshape(w * plan.bq, hkv * group, dim)
    seq, valid = token_sequence(query_start_loc, num_seqs, max_seqs, num_tokens)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    off = t - query_start_loc[seq]
    item = plan.cum_blocks[seq] + off // plan.bq
    flat = jnp.clip(item * plan.bq + off % plan.bq, 0, w * plan.bq - 1)
    out = jnp.where(valid[:, None, None], ow[flat], 0)
    return out.astype(dtype)
