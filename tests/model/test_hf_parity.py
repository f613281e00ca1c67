"""Parity with Hugging Face transformers (PyTorch CPU) on tiny random models of every supported architecture."""

import numpy as np
import pytest
import torch

import jax.numpy as jnp

from jaxserve import steps
from jaxserve.loading.checkpoint import load_hf_params
from jaxserve.config import ModelConfig
from jaxserve.model.kv_cache import StepBatch, init_cache

from hf_models import assert_same_greedy, hf_greedy

ARCHS = ["llama", "llama3_rope", "mistral", "qwen2", "qwen2_window"]
PAGE = 8


def step_batch(tokens, start, pages):
    n = len(tokens)
    return StepBatch(
        tokens=jnp.asarray(np.asarray(tokens, np.int32)[None, None]),
        start_pos=jnp.full((1, 1), start, jnp.int32),
        num_new=jnp.full((1, 1), n, jnp.int32),
        page_table=jnp.asarray(np.asarray(pages, np.int32)[None, None]),
    )


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scan"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_logits_match_hf(hf_model_dir, arch, scan_layers):
    path, model = hf_model_dir(arch)
    cfg = ModelConfig.from_dir(path)
    params = load_hf_params(path, cfg, jnp.float32)
    prompt = np.random.RandomState(1).randint(0, cfg.vocab_size, size=21).tolist()
    continuation, _ = hf_greedy(model, prompt, 12)
    full = prompt + continuation
    with torch.no_grad():
        ref = model(torch.tensor([full])).logits[0].numpy()  # f32[len, V]

    # Pages deliberately out of order, and page 0 left unused, to catch page-table mistakes.
    pages = [5, 2, 7, 1, 3, 6, 4, 0][: -(-len(full) // PAGE)]
    cache = init_cache(cfg, num_pages=8, page_size=PAGE, dtype=jnp.float32)
    opts = steps.StepOptions(scan_layers=scan_layers)
    logits, cache = steps.prefill(params, cache, step_batch(prompt, 0, pages), cfg=cfg, options=opts, all_logits=True)
    np.testing.assert_allclose(np.asarray(logits[0, 0]), ref[: len(prompt)], atol=1e-4, rtol=0)

    decode_opts = steps.StepOptions(scan_layers=scan_layers)
    for pos in range(len(prompt), len(full)):  # feed token `pos`, compare the logits it predicts
        logits, cache = steps.decode(params, cache, step_batch([full[pos]], pos, pages), cfg=cfg, options=decode_opts)
        np.testing.assert_allclose(
            np.asarray(logits[0, 0]), ref[pos], atol=1e-4, rtol=0, err_msg=f"decode step at position {pos}"
        )


@pytest.fixture(scope="module")
def llms(hf_model_dir):
    from jaxserve import LLM

    made = {}

    def get(arch):
        if arch not in made:
            path, _ = hf_model_dir(arch)
            made[arch] = LLM(
                path,
                dtype="float32",
                page_size=PAGE,
                max_model_len=64,
                max_num_seqs=4,
                max_num_batched_tokens=32,
                warm_up=False,
            )
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_hf(hf_model_dir, llms, arch):
    """32 greedy tokens, each prompt alone in HF (no padding); prompts at and across page boundaries."""
    from jaxserve import SamplingParams

    path, model = hf_model_dir(arch)
    llm = llms(arch)
    rng = np.random.RandomState(2)
    prompts = [rng.randint(0, 512, size=n).tolist() for n in (PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 3)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert len(outputs) == len(prompts)
    for prompt, out in zip(prompts, outputs):
        ref, gaps = hf_greedy(model, prompt, 32)
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].finish_reason == "length"
        assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"{arch} prompt len {len(prompt)}")
    assert llm.blocks.num_free_pages(0) == llm.memory.num_pages - 1  # every page returned


def test_bfloat16_top1_agreement_with_hf(hf_model_dir):
    """Teacher-forced top-1 agreement with HF bfloat16 of at least 99% where HF's own choice is decisive.

    HF's logits are bfloat16: a top-2 gap within two bf16 spacings of the top logit is a tie after
    rounding (on these tiny models HF bf16 agrees with HF f32 only ~90% overall), so such positions
    are the bf16 form of the near-tie rule: counted and reported, not compared.
    """
    path, model = hf_model_dir("llama", dtype="bfloat16")
    cfg = ModelConfig.from_dir(path)
    params = load_hf_params(path, cfg, jnp.bfloat16)
    rng = np.random.RandomState(3)
    agree = decisive = total = 0
    for n in (40, 56, 63, 63, 63):
        ids = rng.randint(0, cfg.vocab_size, size=n).tolist()
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].float().numpy()
        pages = list(range(1, 1 + -(-n // PAGE)))
        cache = init_cache(cfg, num_pages=9, page_size=PAGE, dtype=jnp.bfloat16)
        logits, _ = steps.prefill(params, cache, step_batch(ids, 0, pages), cfg=cfg, all_logits=True)
        ours = np.asarray(logits[0, 0], np.float32)
        top2 = np.sort(ref, axis=-1)[:, -2:]
        spacing = 2.0 ** (np.floor(np.log2(np.abs(top2[:, 1]) + 1e-30)) - 7)  # bf16 ulp at the top logit
        keep = top2[:, 1] - top2[:, 0] > 2 * spacing
        agree += int((ours.argmax(-1) == ref.argmax(-1))[keep].sum())
        decisive += int(keep.sum())
        total += n
    print(f"bf16: {decisive}/{total} decisive positions, top-1 agreement {agree}/{decisive}")
    assert decisive >= 0.5 * total
    assert agree / decisive >= 0.99, f"top-1 agreement {agree}/{decisive}"


def test_qwen2_sliding_window_through_the_engine_with_preemption(hf_model_dir):
    """Qwen2 with use_sliding_window (a global and a windowed layer): greedy tokens through the engine
    equal HF's with the pool too small for the batch (one sequence preempted and recomputed) and the
    prefix cache serving two later prompts; its pages stay held (mixed layers: no window release)."""
    from jaxserve import LLM

    from model_checks import check_greedy_through_engine

    path, model = hf_model_dir("qwen2_window")
    with LLM(
        path,
        dtype="float32",
        page_size=PAGE,
        num_pages=9,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        warm_up=False,
    ) as llm:
        assert llm.model_config.num_sliding_layers == 1 and llm.blocks.sliding_window is None
        check_greedy_through_engine(
            llm,
            model,
            llm.model_config.vocab_size,
            "qwen2_window",
            PAGE,
            (2 * PAGE + 3, PAGE + 4, 5),
            expect_preemption=True,
        )
