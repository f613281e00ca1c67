"""Sliding-window page release through the engine, on the tiny Mistral (every layer windowed): a
long generation holds a bounded number of pages, its greedy tokens are those of the same engine
without release and of Hugging Face, and a later prompt sharing the prefix still hits the cache."""

import numpy as np
import pytest

from hf_models import assert_same_greedy, hf_greedy

PAGE = 8
MAX_TOKENS = 80  # prompt + output spans 13 pages; the window (24 tokens) 3


@pytest.fixture(scope="module")
def mistral(hf_model_dir):
    from jaxserve import LLM

    path, model = hf_model_dir("mistral")
    # 15 usable pages: one 100-token sequence fits whole, two do not (without release).
    llm = LLM(
        path,
        dtype="float32",
        page_size=PAGE,
        max_model_len=128,
        max_num_seqs=4,
        num_pages=16,
        max_num_batched_tokens=32,
        warm_up=False,
    )
    assert llm.model_config.num_sliding_layers == llm.model_config.num_layers  # what release requires
    yield llm, model
    llm.close()


def window_of(llm) -> int:
    return llm.model_config.sliding_window


def run(llm, requests, released: bool, on_step=None):
    """Drive the engine step by step; `requests`: (request id, prompt, step to add it at, n);
    `on_step(step)` may return more of them to add at once. Returns {request id: [token ids per
    sample]} and the most pages any sequence held."""
    from jaxserve import SamplingParams
    from jaxserve.engine.output_processor import OutputAccumulator

    eng = llm.engine
    served = eng.blocks.sliding_window
    eng.blocks.sliding_window = window_of(llm) if released else None
    done, most, step, totals = {}, 0, 0, OutputAccumulator()
    pending = sorted(requests, key=lambda r: r[2])
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][2] <= step:
            rid, prompt, _, n = pending.pop(0)
            eng.add_request(
                rid,
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, n=n),
            )
        for out in map(totals.add, eng.step()):
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
        for seq in eng.scheduler.running:
            most = max(most, eng.blocks.num_held_pages(seq.seq_id))
        eng.blocks.check_invariants()
        step += 1
        if on_step is not None:
            pending += on_step(step)
    assert eng.blocks.num_free_pages(0) == llm.memory.num_pages - 1  # every page came back
    eng.blocks.sliding_window = served
    return done, most


def test_the_engine_releases_pages_of_an_all_windowed_model(mistral):
    llm, _ = mistral
    assert llm.engine.blocks.sliding_window == window_of(llm)  # on as served, not only in these tests


def test_long_generation_holds_a_bounded_number_of_pages(mistral):
    llm, model = mistral
    prompt = np.random.RandomState(5).randint(0, 512, size=20).tolist()
    plain, most_plain = run(llm, [("a", prompt, 0, 1)], released=False)
    released_before = llm.blocks.num_window_released_pages
    freed, most = run(llm, [("a", prompt, 0, 1)], released=True)
    assert freed == plain  # same engine, same greedy tokens
    ref, gaps = hf_greedy(model, prompt, MAX_TOKENS)
    assert_same_greedy(freed["a"][0], ref, gaps, "mistral, window pages released")
    assert most_plain == llm.blocks.pages_for(len(prompt) + MAX_TOKENS) == 13
    # The window's pages, the one it starts inside, and the one being written.
    assert most <= -(-window_of(llm) // PAGE) + 2 == 5
    assert llm.blocks.num_window_released_pages - released_before >= 13 - 5


def test_shared_prefix_hits_released_pages_and_forks_release_safely(mistral):
    """B arrives once A's first two pages are released (evictable, still hashed) and reuses them,
    while C (n = 2) forks after its prompt and both its samples release the pages they share."""
    llm, model = mistral
    rng = np.random.RandomState(6)
    a = rng.randint(0, 512, size=20).tolist()
    b = a[: 2 * PAGE] + rng.randint(0, 512, size=5).tolist()
    c = rng.randint(0, 512, size=11).tolist()
    blocks = llm.blocks
    hits_before = blocks.num_prefix_hit_tokens
    seen = {}

    def add_b_once_a_released_two_pages(step):
        seq = next((s for s in llm.engine.scheduler.running if s.request_id == "a"), None)
        if seq is None or "b" in seen or blocks.page_table(seq.seq_id)[:2] != [0, 0]:
            return []
        seen["b"] = (step, blocks.lookup_prefix(0, b))
        return [("b", b, step, 1)]

    got, most = run(llm, [("a", a, 0, 1), ("c", c, 2, 2)], released=True, on_step=add_b_once_a_released_two_pages)
    # A no longer held its first two pages when B came, and they were still cached for it.
    assert seen["b"][1] == 2 * PAGE
    assert blocks.num_prefix_hit_tokens - hits_before >= 2 * PAGE
    for rid, prompt in (("a", a), ("b", b), ("c", c)):
        ref, gaps = hf_greedy(model, prompt, MAX_TOKENS)
        for sample in got[rid]:
            assert_same_greedy(sample, ref, gaps, f"mistral {rid}, window pages released")
    assert len(got["c"]) == 2
    assert most <= -(-window_of(llm) // PAGE) + 2


def test_release_spares_the_preemption_a_full_pool_needs(mistral):
    """Two 100-token sequences need 26 pages of the 15: without release one is preempted and
    recomputed; with it both fit (the same tokens either way, HF's)."""
    llm, model = mistral
    rng = np.random.RandomState(7)
    prompts = [rng.randint(0, 512, size=n).tolist() for n in (20, 13)]
    reqs = [(f"p{i}", p, 0, 1) for i, p in enumerate(prompts)]
    scheduler = llm.engine.scheduler
    before = scheduler.num_preemptions
    plain, _ = run(llm, reqs, released=False)
    assert scheduler.num_preemptions > before
    before = scheduler.num_preemptions
    freed, _ = run(llm, reqs, released=True)
    assert scheduler.num_preemptions == before
    assert freed == plain
    for i, prompt in enumerate(prompts):
        ref, gaps = hf_greedy(model, prompt, MAX_TOKENS)
        assert_same_greedy(freed[f"p{i}"][0], ref, gaps, f"mistral prompt {i}, window pages released")


def test_preempted_after_release_recomputes_the_same_tokens(mistral):
    """Four such sequences overflow 15 pages even with release: the preempted ones give back only the
    pages they still hold and are recomputed from their tokens (HF's tokens all the same)."""
    llm, model = mistral
    rng = np.random.RandomState(8)
    prompts = [rng.randint(0, 512, size=n).tolist() for n in (20, 13, 30, 9)]
    before = llm.engine.scheduler.num_preemptions
    got, most = run(llm, [(f"q{i}", p, 0, 1) for i, p in enumerate(prompts)], released=True)
    assert llm.engine.scheduler.num_preemptions > before
    assert most <= -(-window_of(llm) // PAGE) + 2
    for i, prompt in enumerate(prompts):
        ref, gaps = hf_greedy(model, prompt, MAX_TOKENS)
        assert_same_greedy(got[f"q{i}"][0], ref, gaps, f"mistral prompt {i}, preempted with pages released")
