"""The draft model's proposals: k autoregressive draft steps in one jitted loop over its paged cache.

The draft's cache uses the target's page ids and page tables (one block manager): only the arrays
differ. Its first step takes what its cache lacks up to the pending token (one token, or two after a
fully accepted run whose last draft it never consumed); each later step feeds the previous draft.
Draft j is written at position pos + j only while j < the row's draft count, so a row never writes
past the pages it was given.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.kv_cache import KVCache, StepBatch
from jaxserve.model.weights import Params
from jaxserve.sampling import SAMPLING_EPS, SamplingTensors, apply_logit_bias, filter_logits
from jaxserve.spec_decode.rejection import DRAFT, purpose_keys
from jaxserve.steps import StepOptions, model_step


def _draw(logits: jax.Array, st: SamplingTensors, j: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Draft token i32[N] and the distribution it was drawn from f32[N, V] (zeros for greedy rows:
    verification never reads them). The draft takes the row's logit_bias and temperature / top-k /
    top-p / min-p, not its penalties: any q keeps the target's distribution exact, and a close one is
    accepted more (a +100 bias the draft ignored would have every draft rejected)."""
    logits = jax.lax.cond(jnp.any(st.bias_ids >= 0), lambda: apply_logit_bias(logits, st), lambda: logits)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = st.temperature >= SAMPLING_EPS

    def draw():
        filtered = filter_logits(logits, st, sampled)
        token = jax.vmap(jax.random.categorical)(purpose_keys(st.seed, st.step + j, DRAFT), filtered)
        return jnp.where(sampled, token.astype(jnp.int32), greedy), jax.nn.softmax(filtered, axis=-1)

    return jax.lax.cond(jnp.any(sampled), draw, lambda: (greedy, jnp.zeros_like(logits)))


def propose(
    params: Params,
    cache: KVCache,
    first: StepBatch,  # [R, B]: the tokens the draft lacks, ending at the pending token (num_new 1 or 2)
    num_draft: jax.Array,  # i32[R, B]  drafts wanted per row (<= num_tokens)
    st: SamplingTensors,  # [R * B] rows, step = output index of draft 1
    *,
    cfg: ModelConfig,
    options: StepOptions,
    num_tokens: int,  # K, static: the compiled width's draft count
) -> tuple[jax.Array, jax.Array, KVCache]:
    """Returns drafts i32[R, B, K], their distributions f32[R, B, K, V] and the draft cache.

    The K draft steps are unrolled (K is small and static per compiled width): under a `while` loop
    XLA:CPU copied the loop-carried cache every iteration, which made each draft step ~3x dearer.
    Rows wanting fewer drafts compute the later steps but write nothing."""
    R, B = num_draft.shape
    V = cfg.vocab_size

    def draw(logits, j):  # logits f32[R, B, V]
        token, q = _draw(logits.reshape(R * B, V), st, j)
        return token.reshape(R, B), q.reshape(R, B, V)

    logits, cache = model_step(params, cache, first, cfg, options)
    token, q = draw(logits, 0)
    tokens, probs = [token], [q]
    pos = first.start_pos + first.num_new - 1  # i32[R, B]: the pending token's position
    for j in range(1, num_tokens):
        batch = StepBatch(tokens=tokens[-1][..., None], start_pos=pos + j,
                          num_new=(j < num_draft).astype(jnp.int32), page_table=first.page_table)
        logits, cache = model_step(params, cache, batch, cfg, options)
        token, q = draw(logits, j)
        tokens.append(token)
        probs.append(q)
    return jnp.stack(tokens, axis=-1), jnp.stack(probs, axis=2), cache
