"""YaRN RoPE scaling (Qwen3's long-context checkpoints) against Hugging Face transformers: the
frequencies and attention factor for several rope_scaling dicts, and a tiny random Qwen3 with
rope_scaling yarn end to end (paged prefill and decode, dense forward, greedy tokens)."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxserve.loading.checkpoint import load_hf_params
from jaxserve.config import ModelConfig
from jaxserve.model.layers import rope_attention_factor, rope_inv_freq
from jaxserve.model.llama import forward_dense

from hf_models import TINY, assert_same_greedy, hf_greedy, make_hf_model
from model_checks import check_paged_and_dense_logits_match, hf_logits

PAGE = 8
# A pretraining length of 16 tokens scaled 4x: the test prompts (~30 tokens) run past it, and most
# of the 16 frequency pairs are interpolated, so a model ignoring the scaling fails by far.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
VARIANTS = {
    "plain": YARN,
    "betas": {**YARN, "beta_fast": 8.0, "beta_slow": 0.5},
    "no truncate": {**YARN, "beta_fast": 8.0, "beta_slow": 0.5, "truncate": False},
    "attention factor": {**YARN, "attention_factor": 0.8},
    "mscale": {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0},
    "factor from lengths": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 128},
}


def qwen3_config(rope_scaling, **extra):
    import transformers

    return transformers.Qwen3Config(
        **{**TINY, "head_dim": 32, "rope_theta": 10000.0, **extra}, rope_scaling=dict(rope_scaling)
    )


@pytest.mark.parametrize("name", VARIANTS)
def test_frequencies_and_attention_factor_match_transformers(tmp_path, name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = qwen3_config(VARIANTS[name])
    hf_cfg.save_pretrained(tmp_path)
    cfg = ModelConfig.from_dir(str(tmp_path))
    assert cfg.rope_scaling.kind == "yarn"
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    np.testing.assert_allclose(rope_inv_freq(cfg), inv_freq.numpy(), rtol=1e-6, atol=0)
    assert rope_attention_factor(cfg) == pytest.approx(attention, rel=1e-12)
    assert rope_attention_factor(cfg, local=True) == 1.0


@pytest.fixture(scope="module")
def yarn_qwen3(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf-qwen3-yarn"))
    model = make_hf_model(path, "qwen3", rope_scaling=dict(YARN))
    cfg = ModelConfig.from_dir(path)
    return path, model, cfg, load_hf_params(path, cfg, jnp.float32)


def test_yarn_qwen3_logits_match_hf(yarn_qwen3):
    _, model, cfg, params = yarn_qwen3
    assert cfg.rope_scaling.kind == "yarn" and cfg.rope_scaling.attention_factor > 1
    prompt = np.random.RandomState(1).randint(0, cfg.vocab_size, size=27).tolist()
    continuation, _ = hf_greedy(model, prompt, 6)
    full = prompt + continuation
    ref = hf_logits(model, full)
    pages = [3, 1, 4, 2, 5][: -(-len(full) // PAGE)]
    check_paged_and_dense_logits_match(cfg, params, full, len(prompt), ref, pages, PAGE)
    # Not vacuous: the same weights without the scaling are far from HF.
    import dataclasses

    plain = jax.jit(forward_dense, static_argnames="cfg")(
        params, jnp.asarray([full], jnp.int32), cfg=dataclasses.replace(cfg, rope_scaling=None)
    )
    assert np.abs(np.asarray(plain[0]) - ref).max() > 1e-2


def test_yarn_qwen3_greedy_through_engine_matches_hf(yarn_qwen3):
    from jaxserve import LLM, SamplingParams

    path, model, cfg, _ = yarn_qwen3
    rng = np.random.RandomState(3)
    prompts = [rng.randint(0, cfg.vocab_size, size=n).tolist() for n in (5, 19)]
    with LLM(
        path,
        dtype="float32",
        page_size=PAGE,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        warm_up=False,
    ) as llm:
        outputs = llm.generate(
            prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        )
    for prompt, out in zip(prompts, outputs):
        ref, gaps = hf_greedy(model, prompt, 16)
        assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"qwen3 yarn prompt len {len(prompt)}")
