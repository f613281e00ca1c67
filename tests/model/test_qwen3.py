"""Qwen3 (per-head q/k RMSNorm, explicit head_dim, tied embeddings) against Hugging Face transformers.

One tiny random Qwen3ForCausalLM (2 layers, hidden 64, 4 heads of head_dim 32 != 64 / 4, 2 KV heads),
saved as safetensors and read back through jaxserve's loader, serves every test here: logits of the
research steps (prefill, decode), a mixed ragged step and the dense forward, greedy tokens through
the engine (continuous batching, prefix caching), and the int8 and orbax loading paths."""

import numpy as np
import pytest

import jax.numpy as jnp

from jaxserve.loading.checkpoint import load_hf_params
from jaxserve.config import ModelConfig
from jaxserve.model.llama import forward_dense

from hf_models import hf_greedy
from model_checks import (
    check_greedy_through_engine,
    check_mixed_ragged_step_matches_hf,
    check_paged_and_dense_logits_match,
    hf_logits,
)

PAGE = 8


@pytest.fixture(scope="session")
def qwen3(hf_model_dir):
    """(model dir, HF model, ModelConfig, params f32 loaded by jaxserve) of the tiny Qwen3."""
    path, model = hf_model_dir("qwen3")
    cfg = ModelConfig.from_dir(path)
    return path, model, cfg, load_hf_params(path, cfg, jnp.float32)


def test_config_and_weights(qwen3):
    path, model, cfg, params = qwen3
    assert (cfg.architecture, cfg.servable, cfg.qk_norm, cfg.qkv_bias, cfg.tie_word_embeddings) == (
        "Qwen3ForCausalLM",
        True,
        True,
        False,
        True,
    )
    assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_heads
    assert params.lm_head is None and params.layers.bq is None
    assert params.layers.q_norm.shape == params.layers.k_norm.shape == (2, 32)
    np.testing.assert_array_equal(
        np.asarray(params.layers.k_norm[1]), model.model.layers[1].self_attn.k_norm.weight.detach().numpy()
    )
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())


def test_prefill_decode_and_dense_logits_match_hf(qwen3):
    _, model, cfg, params = qwen3
    prompt = np.random.RandomState(1).randint(0, cfg.vocab_size, size=19).tolist()
    continuation, _ = hf_greedy(model, prompt, 5)
    full = prompt + continuation
    ref = hf_logits(model, full)
    pages = [3, 1, 4, 2][: -(-len(full) // PAGE)]  # out of order, page 0 unused
    check_paged_and_dense_logits_match(cfg, params, full, len(prompt), ref, pages, PAGE)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_mixed_ragged_step_matches_hf(qwen3, scan):
    """A ragged step of a chunk after cached history beside a decode gives HF's logits for both."""
    _, model, cfg, params = qwen3
    check_mixed_ragged_step_matches_hf(cfg, params, model, scan, PAGE)


@pytest.fixture(scope="module")
def llm(qwen3):
    from jaxserve import LLM

    with LLM(
        qwen3[0],
        dtype="float32",
        page_size=PAGE,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        warm_up=False,
    ) as llm:
        yield llm


def test_greedy_through_the_engine_matches_hf(qwen3, llm):
    """Greedy tokens through LLM.generate: three prompts batched together, then two that share the first
    one's prefix (whole pages served from the prefix cache)."""
    _, model, cfg, _ = qwen3
    check_greedy_through_engine(
        llm, model, cfg.vocab_size, "qwen3", PAGE, (2 * PAGE + 3, PAGE, 5), expect_preemption=False
    )


def test_int8_and_orbax_loading(qwen3, tmp_path):
    """int8 quantizes the projections and leaves the q/k norms float; an orbax round trip restores them."""
    from jaxserve.model import quant
    from jaxserve.config import EngineConfig
    from jaxserve.loading.model_loader import load_model
    from jaxserve.model.sharding import make_mesh

    path, _, cfg, params = qwen3
    tokens = jnp.asarray(np.random.RandomState(6).randint(0, cfg.vocab_size, size=(1, 9)), jnp.int32)
    ref = forward_dense(params, tokens, cfg=cfg)
    q8 = load_model(EngineConfig(model=path, dtype="float32", quantization="int8"), make_mesh((1, 1))).params
    assert isinstance(q8.layers.wq, quant.QuantArray) and q8.layers.q_norm.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(q8.layers.q_norm), np.asarray(params.layers.q_norm))
    # int8 rounding (measured 0.09, logits up to 3), not a wrong model
    assert float(jnp.abs(forward_dense(q8, tokens, cfg=cfg) - ref).max()) < 0.2

    import shutil

    from jaxserve.loading.orbax_checkpoint import save_params

    out = tmp_path / "orbax"
    shutil.copytree(path, out)
    save_params(str(out), params)
    restored = load_model(EngineConfig(model=str(out), dtype="float32"), make_mesh((1, 2))).params
    assert restored.layers.k_norm.sharding.is_fully_replicated
    np.testing.assert_allclose(np.asarray(forward_dense(restored, tokens, cfg=cfg)), np.asarray(ref), atol=1e-5)
