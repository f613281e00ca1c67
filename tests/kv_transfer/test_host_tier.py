"""The prefix cache's host tier through the engine (tiny llama, float32 and int8 KV, and a cache split
over two devices' KV heads): greedy outputs are
those of the same engine without the tier, while pages really leave the device pool and come back
(counters), under preemption and prefix caching, with the block manager's invariants after every step,
no page leaked, and no compile after warm-up (the page read and write are two executables per replica)."""

import numpy as np
import pytest

PAGE = 8
SHARED = 40  # tokens of each shared prefix: 5 pages
ENGINE = dict(
    dtype="float32",
    page_size=PAGE,
    max_model_len=128,
    max_num_seqs=4,
    num_pages=24,  # 23 usable: about four prompts' worth, so later prefixes evict earlier ones
    max_num_batched_tokens=32,
)


def workload():
    """(request id, prompt, max_tokens, wave): four shared prefixes, asked in turns (each wave runs to
    its end before the next starts, so the device pool evicts what came before), then a wave of
    long outputs at once, which preempts."""
    rng = np.random.RandomState(7)
    shared = [rng.randint(0, 500, size=SHARED).tolist() for _ in range(4)]
    out = []
    for i in range(6):
        out.append((f"t{i}", shared[i % 4] + rng.randint(0, 500, size=6).tolist(), 4, i))
    for i in range(4):
        out.append((f"p{i}", shared[i % 4] + rng.randint(0, 500, size=6).tolist(), 32, 6))
    return out


def run(llm):
    """Each wave's requests added at once and stepped to their end, checking the bookkeeping after every
    step; returns {request id: token ids}."""
    from jaxserve import SamplingParams
    from jaxserve.engine.output_processor import OutputAccumulator

    eng, done, totals = llm.engine, {}, OutputAccumulator()
    waves = sorted({w for *_, w in workload()})
    for wave in waves:
        for rid, prompt, max_tokens, w in workload():
            if w == wave:
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                eng.add_request(rid, prompt_token_ids=prompt, sampling_params=params)
        while eng.has_unfinished_requests():
            for out in map(totals.add, eng.step()):
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            eng.blocks.check_invariants()
    assert eng.blocks.num_free_pages(0) == llm.memory.num_pages - 1  # every page came back
    assert not eng.scheduler.kv or not (eng.scheduler.kv.loading or eng.scheduler.kv.saving)
    return done


@pytest.fixture(scope="module")
def tiny(hf_model_dir):
    path, _ = hf_model_dir("llama")
    return path


@pytest.mark.parametrize(
    "kv_cache_dtype, mesh_shape", [("auto", (1, 1)), ("int8", (1, 1)), ("auto", (1, 2))], ids=["f32", "int8", "tp2"]
)
def test_greedy_outputs_equal_with_and_without_the_host_tier(tiny, kv_cache_dtype, mesh_shape):
    from jaxserve import LLM

    engine = dict(ENGINE, kv_cache_dtype=kv_cache_dtype, mesh_shape=mesh_shape)  # tp2: KV heads split in two
    with LLM(tiny, warm_up=False, **engine) as llm:
        plain = run(llm)
        plain_stats = llm.engine.stats()
    # The float32 engine is warmed up and counts its compiles; the others compile as they go (cheaper).
    warm = kv_cache_dtype == "auto" and mesh_shape == (1, 1)
    with LLM(tiny, kv_offloading_size=0.01, warm_up=warm, **engine) as llm:
        if mesh_shape != (1, 1):
            assert len(llm.engine.runner.cache.k.sharding.device_set) == 2
        tiered = run(llm)
        stats = llm.engine.stats()
        io = llm.engine.runner.page_io
        if warm:
            assert stats["compiles_after_warmup"] == 0  # the page read and write were compiled at start-up
            runner = llm.engine.runner  # its steps, the fork copy and the page read and write
            assert io.num_executables == 2 and stats["executables"] == len(runner.table) + 1 + 2
        assert io.leaf_names == (("k", "v") if kv_cache_dtype == "auto" else ("k", "v", "k_scale", "v_scale"))
    assert tiered == plain
    # Pages went out and came back, and the tier saved prompt work the plain engine redid.
    assert stats["kv_offload_pages_to_host_total"] > 0 and stats["kv_offload_pages_to_device_total"] > 0
    assert stats["kv_offload_bytes_to_device_total"] == stats["kv_offload_pages_to_device_total"] * io.page_bytes
    assert stats["external_prefix_cache_hits"] == stats["kv_offload_pages_to_device_total"] * PAGE
    assert stats["num_preemptions"] > 0 and plain_stats["num_preemptions"] > 0
    assert stats["prefill_tokens_computed"] < plain_stats["prefill_tokens_computed"]
    assert stats["num_waiting_for_kv"] == 0


def test_a_reset_prefix_cache_empties_the_host_tier(tiny):
    from jaxserve import LLM, SamplingParams

    with LLM(tiny, kv_offloading_size=0.01, warm_up=False, **ENGINE) as llm:
        rng = np.random.RandomState(3)
        prompts = [rng.randint(0, 500, size=60).tolist() for _ in range(5)]  # 5 x 8 pages > 23
        llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=2, temperature=0.0))
        assert llm.engine.stats()["kv_offload_host_pages"] > 0
        llm.engine.blocks.reset_prefix_cache()  # what a weight update does
        assert llm.engine.stats()["kv_offload_host_pages"] == 0
