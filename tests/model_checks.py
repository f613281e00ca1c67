"""Checks every served model family's tests share: HF logits, a one-row rectangle batch for the
research steps, and a mixed ragged step against HF (tests/model/test_<family>.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxserve.model.kv_cache import KVCache, RaggedBatch, StepBatch, cache_shape
from jaxserve.model.llama import forward_ragged
from jaxserve.model.weights import unstack_layers
from jaxserve.model.ragged import RaggedRow


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()  # f32[len, V]


def step_batch(tokens, start, pages):
    """One row of `tokens` from position `start` on `pages`, as the rectangle steps take it."""
    n = len(tokens)
    return StepBatch(
        tokens=jnp.asarray(np.asarray(tokens, np.int32)[None, None]),
        start_pos=jnp.full((1, 1), start, jnp.int32),
        num_new=jnp.full((1, 1), n, jnp.int32),
        page_table=jnp.asarray(np.asarray(pages, np.int32)[None, None]),
    )


def check_paged_and_dense_logits_match(cfg, params, full, prompt_len: int, ref, pages, page_size: int) -> None:
    """The prompt prefilled on `pages`, then each later token of `full` decoded, and the dense
    forward over all of `full`: each gives the HF logits `ref` f32[len(full), V] (atol 1e-4)."""
    from jaxserve import steps
    from jaxserve.model.kv_cache import init_cache
    from jaxserve.model.llama import forward_dense

    prompt = full[:prompt_len]
    cache = init_cache(cfg, num_pages=max(pages) + 1, page_size=page_size, dtype=jnp.float32)
    logits, cache = steps.prefill(params, cache, step_batch(prompt, 0, pages), cfg=cfg, all_logits=True)
    np.testing.assert_allclose(np.asarray(logits[0, 0]), ref[:prompt_len], atol=1e-4, rtol=0)
    for pos in range(prompt_len, len(full)):
        logits, cache = steps.decode(
            params, cache, step_batch([full[pos]], pos, pages), cfg=cfg, options=steps.StepOptions()
        )
        np.testing.assert_allclose(np.asarray(logits[0, 0]), ref[pos], atol=1e-4, rtol=0, err_msg=f"decode {pos}")
    dense = jax.jit(forward_dense, static_argnames="cfg")(params, jnp.asarray([full], jnp.int32), cfg=cfg)
    np.testing.assert_allclose(np.asarray(dense[0]), ref, atol=1e-4, rtol=0)


def check_mixed_ragged_step_matches_hf(cfg, params, model, scan: bool, page_size: int, assert_close=None) -> None:
    """A ragged step mixing two rows (a 6-token chunk after 11 cached tokens and a decode after 9,
    padded to 32 tokens and 4 rows) gives HF's logits at every token of the chunk and at the
    decode. The history is written by an earlier ragged step on pages out of order, and the cache
    starts NaN, so a stray read or a write to the wrong slot shows. `assert_close(got, want, ids,
    label)` compares one position's logits (default: atol 1e-4)."""
    if assert_close is None:

        def assert_close(got, want, ids, label):
            np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0, err_msg=label)

    params = params if scan else unstack_layers(params)
    rng = np.random.RandomState(4)
    seqs = [rng.randint(0, cfg.vocab_size, 17).tolist(), rng.randint(0, cfg.vocab_size, 10).tolist()]
    cached = [11, 9]
    need = [-(-len(s) // page_size) for s in seqs]
    ids = rng.permutation(np.arange(1, 1 + sum(need))).tolist()  # page 0 unused
    pages = [ids[: need[0]], ids[need[0] :]]
    shape = cache_shape(cfg, 1 + sum(need), page_size)[1:]  # one replica
    cache = KVCache(k=jnp.full(shape, jnp.nan, jnp.float32), v=jnp.full(shape, jnp.nan, jnp.float32))
    step = jax.jit(forward_ragged, static_argnames=("cfg", "scan_layers"))

    def run(rows, cache):
        batch = RaggedBatch.build(
            rows, page_size=page_size, num_tokens=32, num_rows=4, max_pages=max(need), num_logits=8
        )
        return step(params, cache, batch, cfg=cfg, scan_layers=scan)

    _, cache = run([RaggedRow(s[:c], 0, pg, 0) for s, c, pg in zip(seqs, cached, pages)], cache)
    logits, _ = run([RaggedRow(s[c:], c, pg, len(s) - c) for s, c, pg in zip(seqs, cached, pages)], cache)
    logits = np.asarray(logits)
    at = 0
    for s, c in zip(seqs, cached):
        ref = hf_logits(model, s)
        for pos in range(c, len(s)):
            assert_close(logits[at], ref[pos], s[: pos + 1], f"row of {len(s)} tokens, position {pos}")
            at += 1


def check_greedy_through_engine(
    llm, model, vocab_size: int, label: str, page_size: int, first_lengths, expect_preemption: bool
) -> None:
    """Greedy tokens through `llm.generate` equal HF's (near-ties excused): prompts of `first_lengths`
    batched together (`expect_preemption`: the pool is too small for all, so one is preempted and
    recomputed, asserted), then two that share the first one's first two pages (served from the
    prefix cache, asserted); every page comes back."""
    from hf_models import assert_same_greedy, hf_greedy
    from jaxserve import SamplingParams

    rng = np.random.RandomState(2)
    first = [rng.randint(0, vocab_size, size=n).tolist() for n in first_lengths]
    shared = [first[0][: 2 * page_size] + rng.randint(0, vocab_size, size=n).tolist() for n in (1, 7)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for prompts in (first, shared):
        hits_before = llm.blocks.num_prefix_hit_tokens
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        for prompt, out in zip(prompts, outputs):
            ref, gaps = hf_greedy(model, prompt, 12)
            assert out.prompt_token_ids == prompt and out.outputs[0].finish_reason == "length"
            assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"{label} prompt len {len(prompt)}")
        if prompts is first and expect_preemption:
            assert llm.engine.scheduler.num_preemptions > 0
    assert llm.blocks.num_prefix_hit_tokens - hits_before >= 2 * 2 * page_size  # both shared prompts hit 2 pages
    assert llm.blocks.num_free_pages(0) == llm.memory.num_pages - 1
