"""On-device batched sampling, per-row parameters as arrays: logit_bias, penalties, temperature, top-k/p,
min-p, logprobs."""

from __future__ import annotations

import math
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling import fields as sampling_fields
from jaxserve.sampling.fields import DEVICE_FIELDS

# logit_bias entries a row may carry (OpenAI's 300, which SamplingParams enforces): the static width
# of the bias arrays, so a biased request needs no new executable. Unbiased rows carry padding.
from jaxserve.sampling.params import MAX_LOGIT_BIAS
from jaxserve.sampling.row import RowSampling

# Temperatures below this are greedy (vLLM's threshold): dividing by a smaller one overflows the logits.
SAMPLING_EPS = 1e-5
# The static top-N the engine compiles for when any row asks for top logprobs (OpenAI's maximum is 20).
MAX_LOGPROBS = sampling_fields.MAX_LOGPROBS

# SamplingTensors' per-row scalars, name -> (dtype, value of padding rows): the table's device fields
# (SamplingParams values: temperature, top_k, top_p, min_p, the penalties), then the row's own state.
ROW_SCALARS: dict[str, tuple[str, float | int]] = {
    **{f.name: (f.device.dtype, f.device.idle) for f in DEVICE_FIELDS},
    "seed": ("uint32", 0),  # the engine's seed of the sample (from the request's seed, or random)
    "step": ("int32", 0),
    "prompt_len": ("int32", 0),
    "num_top_logprobs": ("int32", 0),  # from SamplingParams.logprobs (None: 0)
}


@flax.struct.dataclass
class SamplingTensors:
    """Per-row sampling parameters as arrays, so one compiled step serves any mix of requests.

    B may be any batch shape (e.g. [R, B] in the runner); `sample` flattens it.
    """

    temperature: jax.Array  # f32[B]  < SAMPLING_EPS = greedy
    top_k: jax.Array  # i32[B]  0 = no limit
    top_p: jax.Array  # f32[B]  1 = no limit
    min_p: jax.Array  # f32[B]  0 = no limit
    repetition_penalty: jax.Array  # f32[B]  1 = off
    presence_penalty: jax.Array  # f32[B]  0 = off
    frequency_penalty: jax.Array  # f32[B]  0 = off
    seed: jax.Array  # u32[B]
    step: jax.Array  # i32[B]  output index: the PRNG stream is keyed by (seed, step) only
    history: jax.Array  # i32[B, Lh]  prompt ids then output ids, -1 padding; all -1 for unpenalised rows
    prompt_len: jax.Array  # i32[B]  how many leading history entries are prompt (not output) tokens
    bias_ids: jax.Array  # i32[B, MAX_LOGIT_BIAS]  logit_bias token ids, -1 padding
    bias_values: jax.Array  # f32[B, MAX_LOGIT_BIAS]  what each adds to its logit, 0 padding
    num_top_logprobs: jax.Array  # i32[B]  top logprobs the row returns; 0 in every row: the top-k is skipped

    @classmethod
    def pack(
        cls,
        rows: Sequence[RowSampling | None],
        batch: int | tuple[int, ...],
        history_len: int = 1,
        steps: Sequence[int] | None = None,
    ) -> SamplingTensors:
        """NumPy tensors for `rows` laid out row-major over `batch`; missing or None rows are padding.

        `history_len` (Lh) is part of the compiled shape, so it should come from a fixed bucket. The
        history of rows without penalties is left empty: nothing reads it. `steps`: each row's
        output index, in place of `row.step` (the engine keeps one RowSampling per sequence and
        gives the step apart, rather than building a RowSampling per row per step).
        """
        shape = (batch,) if isinstance(batch, int) else tuple(batch)
        n = math.prod(shape)
        if len(rows) > n:
            raise ValueError(f"{len(rows)} rows do not fit a batch of {shape}")
        st = {name: np.full(n, idle, dtype) for name, (dtype, idle) in ROW_SCALARS.items()}
        st["history"] = np.full((n, history_len), -1, np.int32)
        st["bias_ids"] = np.full((n, MAX_LOGIT_BIAS), -1, np.int32)
        st["bias_values"] = np.zeros((n, MAX_LOGIT_BIAS), np.float32)
        for i, row in enumerate(rows):
            if row is None:
                continue
            for f in DEVICE_FIELDS:
                st[f.name][i] = getattr(row, f.name)
            st["top_k"][i] = max(row.top_k, 0)  # -1 means no limit too
            st["seed"][i] = row.seed
            st["step"][i] = row.step if steps is None else steps[i]
            st["num_top_logprobs"][i] = row.logprobs
            if row.uses_penalties:
                length = len(row.prompt_ids) + len(row.output_ids)
                if length > history_len:
                    raise ValueError(f"row {i}: {length} history tokens exceed history_len={history_len}")
                st["history"][i, : len(row.prompt_ids)] = row.prompt_ids
                st["history"][i, len(row.prompt_ids) : length] = row.output_ids
                st["prompt_len"][i] = len(row.prompt_ids)
            if row.logit_bias:
                if len(row.logit_bias) > MAX_LOGIT_BIAS:
                    raise ValueError(f"row {i}: {len(row.logit_bias)} logit_bias entries exceed {MAX_LOGIT_BIAS}")
                st["bias_ids"][i, : len(row.logit_bias)] = list(row.logit_bias.keys())
                st["bias_values"][i, : len(row.logit_bias)] = list(row.logit_bias.values())
        return cls(**{k: v.reshape(shape + v.shape[1:]) for k, v in st.items()})

    @classmethod
    def spec(cls, batch: tuple[int, ...], history_len: int) -> SamplingTensors:
        """ShapeDtypeStructs of packed tensors, for ahead-of-time lowering."""

        def s(dtype, extra=()):
            return jax.ShapeDtypeStruct(tuple(batch) + extra, np.dtype(dtype))

        return cls(
            **{name: s(dtype) for name, (dtype, _) in ROW_SCALARS.items()},
            history=s(np.int32, (history_len,)),
            bias_ids=s(np.int32, (MAX_LOGIT_BIAS,)),
            bias_values=s(np.float32, (MAX_LOGIT_BIAS,)),
        )

    def advanced(self, tokens: jax.Array) -> SamplingTensors:
        """The tensors of the next output index after sampling `tokens` (i32[*B]), on device: the step
        moves on (the PRNG stream is keyed by it) and penalised rows append the token to their history,
        so several decode steps can run in one call (num_scheduler_steps) and sample exactly as
        single steps would."""
        penalised = self.history[..., 0] >= 0  # unpenalised rows keep an all -1 (unread) history
        position = self.prompt_len + self.step  # the history holds prompt ids, then output ids
        at = (jnp.arange(self.history.shape[-1]) == position[..., None]) & penalised[..., None]
        return self.replace(step=self.step + 1, history=jnp.where(at, tokens[..., None], self.history))


@flax.struct.dataclass
class SampleOutput:
    tokens: jax.Array  # i32[B]
    logprobs: jax.Array  # f32[B]  log_softmax(raw logits) at the chosen token
    top_ids: jax.Array  # i32[B, N]  N = want_logprobs; the N most likely tokens of the raw distribution
    # f32[B, N]  their logprobs, descending. -inf where a grammar mask (applied before `sample`) allows
    # fewer than N tokens: those entries name arbitrary masked ids, and the host drops them
    # (`output_processor.top_entry`), so no caller sees a -inf alternative.
    top_logprobs: jax.Array


def apply_penalties(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """Repetition (prompt + output tokens, HF/vLLM) then frequency and presence (output only, OpenAI)."""
    B, V = logits.shape
    Lh = st.history.shape[-1]
    valid = st.history >= 0
    # -1 padding becomes V, which mode="drop" discards (a negative index would wrap to the last token).
    ids = jnp.where(valid, st.history, V)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, Lh))
    is_output = valid & (jnp.arange(Lh)[None, :] >= st.prompt_len[:, None])
    seen = jnp.zeros((B, V), jnp.bool_).at[rows, ids].set(True, mode="drop")
    counts = jnp.zeros((B, V), jnp.int32).at[rows, ids].add(is_output.astype(jnp.int32), mode="drop")
    rep = st.repetition_penalty[:, None]
    # Dividing a positive logit and multiplying a negative one both make the token less likely.
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - st.frequency_penalty[:, None] * counts.astype(logits.dtype)
    return logits - st.presence_penalty[:, None] * (counts > 0).astype(logits.dtype)


def _topk_topp_threshold(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """f32[B, 1]: the smallest scaled logit kept by top-k then top-p (on the renormalised top-k mass).

    Keeping everything >= a value keeps ties at the boundary, as vLLM's top-k does.
    """
    V = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # f32[B, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    in_k = jnp.arange(V)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, sorted_desc, -jnp.inf), axis=-1)
    # Mass of this token and every less likely one, summed from the tail (vLLM's ascending cumsum):
    # with top_p = 1 rounding can then never drop a token of nonzero probability.
    tail = jnp.flip(jnp.cumsum(jnp.flip(probs, -1), axis=-1), -1)
    keep = in_k & ((tail > 1 - top_p[:, None]) | (top_p[:, None] >= 1))
    num_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)  # the kept set is a prefix; the top token always stays
    return jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)


def apply_logit_bias(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """f32[B, V]: each row's logit_bias added to its logits (one scatter; -1 padding is dropped)."""
    B, V = logits.shape
    ids = jnp.where(st.bias_ids >= 0, st.bias_ids, V)  # V: out of range, dropped (-1 would wrap)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], ids.shape)
    return logits.at[rows, ids].add(st.bias_values.astype(logits.dtype), mode="drop")


def penalise(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """f32[B, V]: logit_bias, then the penalties, for the rows that ask (vLLM's order), each under a
    cond: batches that use neither skip the scatters. Every sampler (normal steps, multi-step decode,
    speculative verification) takes its processed logits from here."""
    biased = jnp.any(st.bias_ids >= 0)
    logits = jax.lax.cond(biased, lambda: apply_logit_bias(logits, st), lambda: logits)
    penalised = jnp.any((st.repetition_penalty != 1) | (st.presence_penalty != 0) | (st.frequency_penalty != 0))
    return jax.lax.cond(penalised, lambda: apply_penalties(logits, st), lambda: logits)


def filter_logits(logits: jax.Array, st: SamplingTensors, sampled: jax.Array) -> jax.Array:
    """f32[B, V]: temperature, then top-k/top-p/min-p as -inf; softmax of it is the distribution a
    sampled row draws from (shared by normal sampling and speculative verification)."""
    scaled = logits / jnp.where(sampled, st.temperature, 1.0)[:, None]
    V = logits.shape[-1]
    # The sort is the only expensive part; skip it when no sampled row limits top-k or top-p.
    needs_sort = jnp.any(sampled & (((st.top_k > 0) & (st.top_k < V)) | (st.top_p < 1)))
    threshold = jax.lax.cond(
        needs_sort,
        lambda: _topk_topp_threshold(scaled, st.top_k, st.top_p),
        lambda: jnp.full((logits.shape[0], 1), -jnp.inf, scaled.dtype),
    )
    # min-p needs no sort: p / p_max = exp(l - l_max), and keeping p >= min_p * p_max is a logit bound.
    min_p_bound = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(st.min_p)[:, None]
    return jnp.where((scaled >= threshold) & (scaled >= min_p_bound), scaled, -jnp.inf)


def step_keys(seed: jax.Array, step: jax.Array) -> jax.Array:
    """The PRNG key of each row's output index: keyed by (seed, step) only, never by the batch."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seed, step)


def _draw(logits: jax.Array, st: SamplingTensors, sampled: jax.Array) -> jax.Array:
    """i32[B]: temperature, then top-k/top-p/min-p filtering, then a draw keyed by (seed, step)."""
    filtered = filter_logits(logits, st, sampled)
    return jax.vmap(jax.random.categorical)(step_keys(st.seed, st.step), filtered).astype(jnp.int32)


def sample(
    logits: jax.Array, st: SamplingTensors, *, want_logprobs: int = 0, logprobs_mode: str = "raw_logprobs"
) -> SampleOutput:
    """Sample one token per row of logits f32[*B, V]; `want_logprobs` (static) is the top-N to return
    (computed when a row's `num_top_logprobs` is above 0, else zeros).

    Order as vLLM: logit_bias -> penalties -> temperature -> top-k/top-p/min-p -> sample (greedy rows
    take the argmax of the biased, penalised logits). Logprobs are of the raw model distribution,
    log_softmax(logits), before bias, penalties and temperature: vLLM's default (logprobs_mode="raw_logprobs").
    `logprobs_mode="processed_logprobs"` (static): of the distribution the row draws from instead, after
    bias, penalties, temperature and top-k/top-p/min-p (a greedy row: bias and penalties only).
    """
    batch, V = logits.shape[:-1], logits.shape[-1]
    raw = logits.reshape(-1, V).astype(jnp.float32)
    st = jax.tree.map(lambda x: x.reshape((raw.shape[0],) + x.shape[len(batch) :]), st)

    processed = penalise(raw, st)

    greedy = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    sampled = st.temperature >= SAMPLING_EPS
    tokens = jax.lax.cond(
        jnp.any(sampled),
        lambda: jnp.where(sampled, _draw(processed, st, sampled), greedy),
        lambda: greedy,
    )

    if logprobs_mode == "processed_logprobs":  # what the row samples from: the logprobs a trainer's policy has
        raw = filter_logits(processed, st, sampled)
    # Only the logsumexp is needed for the chosen token; the full log_softmax only for top-N.
    lse = jax.nn.logsumexp(raw, axis=-1)
    chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0] - lse
    if want_logprobs:
        # A vocabulary-wide top-k, under a cond: only steps in which some row asks for top logprobs
        # pay for it (the others return zeros, which no caller reads).
        def top():
            values, ids = jax.lax.top_k(raw, want_logprobs)
            return values - lse[:, None], ids

        def none():
            return jnp.zeros((raw.shape[0], want_logprobs), jnp.float32), jnp.zeros(
                (raw.shape[0], want_logprobs), jnp.int32
            )

        top_logprobs, top_ids = jax.lax.cond(jnp.any(st.num_top_logprobs > 0), top, none)
    else:
        top_ids = jnp.zeros((raw.shape[0], 0), jnp.int32)
        top_logprobs = jnp.zeros((raw.shape[0], 0), jnp.float32)
    return SampleOutput(
        tokens=tokens.reshape(batch),
        logprobs=chosen.reshape(batch),
        top_ids=top_ids.astype(jnp.int32).reshape(batch + (-1,)),
        top_logprobs=top_logprobs.reshape(batch + (-1,)),
    )
