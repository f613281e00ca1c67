"""Gemma 3 (local and global layers, (1 + weight) norms, GeGLU, scaled embeddings) against Hugging Face.

One tiny random Gemma3ForCausalLM (4 layers: local, global, local, global; sliding window 8, shorter
than every prompt here; RoPE base 10k on the local layers, 100k linearly scaled on the global ones;
query_pre_attn_scalar 24 != head_dim 32; hidden 64, 4 heads, 2 KV heads, tied), saved as safetensors
and read back through jaxserve's loader, serves every test here: logits of the research steps
(prefill, decode; unrolled and scanned), a mixed ragged step and the dense forward, greedy tokens
through the engine (continuous batching, prefix caching), int8 and orbax loading, the multimodal
checkpoint's text tower, final logit soft-capping."""

import json
import pathlib
import shutil

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

from jaxserve import steps
from jaxserve.loading.checkpoint import hf_tensors, load_hf_params, write_safetensors
from jaxserve.config import ModelConfig
from jaxserve.model.kv_cache import init_cache
from jaxserve.model.llama import forward_dense, layer_attention_params
from jaxserve.model.layers import NO_SLIDING_WINDOW
from jaxserve.model.weights import unstack_layers

from hf_models import hf_greedy
from model_checks import check_greedy_through_engine, check_mixed_ragged_step_matches_hf, hf_logits, step_batch

PAGE = 8


@pytest.fixture(scope="session")
def gemma3(hf_model_dir):
    """(model dir, HF model, ModelConfig, params f32 loaded by jaxserve) of the tiny Gemma 3."""
    path, model = hf_model_dir("gemma3")
    cfg = ModelConfig.from_dir(path)
    return path, model, cfg, load_hf_params(path, cfg, jnp.float32)


def test_config_and_weights(gemma3):
    path, model, cfg, params = gemma3
    assert (cfg.architecture, cfg.servable, cfg.hidden_act, cfg.sliding_window) == (
        "Gemma3ForCausalLM",
        True,
        "gelu_pytorch_tanh",
        8,
    )
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling.kind, cfg.query_pre_attn_scalar) == (
        1e5,
        1e4,
        "linear",
        24,
    )
    windows, scales = layer_attention_params(cfg)
    assert windows.tolist() == [8, NO_SLIDING_WINDOW, 8, NO_SLIDING_WINDOW]
    np.testing.assert_allclose(np.asarray(scales), 24**-0.5)
    assert params.lm_head is None and params.layers.post_mlp_norm.shape == (4, 64)
    hf_layer = model.model.layers[2]
    for ours, theirs in [
        (params.layers.mlp_norm, hf_layer.pre_feedforward_layernorm),
        (params.layers.post_attn_norm, hf_layer.post_attention_layernorm),
        (params.layers.post_mlp_norm, hf_layer.post_feedforward_layernorm),
    ]:
        np.testing.assert_array_equal(np.asarray(ours[2]), theirs.weight.detach().numpy())
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_prefill_decode_and_dense_logits_match_hf(gemma3, scan):
    """A 19-token prompt (past the window of 8) prefilled, then 5 decodes, and the dense forward."""
    _, model, cfg, params = gemma3
    prompt = np.random.RandomState(1).randint(0, cfg.vocab_size, size=19).tolist()
    continuation, _ = hf_greedy(model, prompt, 5)
    full = prompt + continuation
    ref = hf_logits(model, full)
    pages = [3, 1, 4, 2][: -(-len(full) // PAGE)]  # out of order, page 0 unused
    cache = init_cache(cfg, num_pages=5, page_size=PAGE, dtype=jnp.float32)
    options = steps.StepOptions(scan_layers=scan)
    logits, cache = steps.prefill(
        params,
        cache,
        step_batch(prompt, 0, pages),
        cfg=cfg,
        options=steps.StepOptions(scan_layers=scan),
        all_logits=True,
    )
    np.testing.assert_allclose(np.asarray(logits[0, 0]), ref[: len(prompt)], atol=1e-4, rtol=0)
    for pos in range(len(prompt), len(full)):
        logits, cache = steps.decode(params, cache, step_batch([full[pos]], pos, pages), cfg=cfg, options=options)
        np.testing.assert_allclose(np.asarray(logits[0, 0]), ref[pos], atol=1e-4, rtol=0, err_msg=f"decode {pos}")
    dense_params = params if scan else unstack_layers(params)  # stacked layers scan, a tuple unrolls
    dense = jax.jit(forward_dense, static_argnames="cfg")(dense_params, jnp.asarray([full], jnp.int32), cfg=cfg)
    np.testing.assert_allclose(np.asarray(dense[0]), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_mixed_ragged_step_matches_hf(gemma3, scan):
    """A ragged step of a chunk after 11 cached tokens (past the window) beside a decode gives HF's logits."""
    _, model, cfg, params = gemma3
    check_mixed_ragged_step_matches_hf(cfg, params, model, scan, PAGE)


@pytest.fixture(scope="module")
def llm(gemma3):
    from jaxserve import LLM

    # 8 usable pages: the first three prompts need 9 (their K/V: 30, 23, 16 tokens), so one is preempted.
    # Layers scanned (the engine's accelerator default; the window and RoPE table as scanned operands):
    # each step shape compiles one layer body, not four.
    with LLM(
        gemma3[0],
        dtype="float32",
        page_size=PAGE,
        num_pages=9,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        scan_layers=True,
        warm_up=False,
    ) as llm:
        yield llm


def test_greedy_through_the_engine_matches_hf(gemma3, llm):
    """Greedy tokens through LLM.generate: three prompts batched together (two longer than the window; the
    pool too small for all three, so one is preempted and recomputed), then two that share the first one's
    prefix (whole pages served from the prefix cache)."""
    _, model, cfg, _ = gemma3
    check_greedy_through_engine(
        llm, model, cfg.vocab_size, "gemma3", PAGE, (2 * PAGE + 3, PAGE + 4, 5), expect_preemption=True
    )


def test_int8_and_orbax_loading(gemma3, tmp_path):
    """int8 quantizes the projections and leaves all six norms float; an orbax round trip restores them."""
    from jaxserve.model import quant
    from jaxserve.config import EngineConfig
    from jaxserve.loading.model_loader import load_model
    from jaxserve.loading.orbax_checkpoint import save_params
    from jaxserve.model.sharding import make_mesh

    path, _, cfg, params = gemma3
    tokens = jnp.asarray(np.random.RandomState(6).randint(0, cfg.vocab_size, size=(1, 13)), jnp.int32)
    ref = forward_dense(params, tokens, cfg=cfg)
    q8 = load_model(EngineConfig(model=path, dtype="float32", quantization="int8"), make_mesh((1, 1))).params
    assert isinstance(q8.layers.w_gate, quant.QuantArray)
    for name in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "q_norm", "k_norm"):
        assert getattr(q8.layers, name).dtype == jnp.float32, name
        np.testing.assert_array_equal(np.asarray(getattr(q8.layers, name)), np.asarray(getattr(params.layers, name)))
    # int8 rounding, not a wrong model (logits up to ~4)
    assert float(jnp.abs(forward_dense(q8, tokens, cfg=cfg) - ref).max()) < 0.3

    out = tmp_path / "orbax"
    shutil.copytree(path, out)
    save_params(str(out), params)
    restored = load_model(EngineConfig(model=str(out), dtype="float32"), make_mesh((1, 2))).params
    assert restored.layers.post_mlp_norm.sharding.is_fully_replicated
    np.testing.assert_allclose(np.asarray(forward_dense(restored, tokens, cfg=cfg)), np.asarray(ref), atol=1e-5)


def test_hf_conditional_generation_matches_hf(tmp_path):
    """A Gemma3ForConditionalGeneration that transformers itself saved (tiny SigLIP tower; 5.24 writes the
    published layout: language_model.model.*, vision_tower.*, multi_modal_projector.*): its text
    tower's logits on a text-only prompt equal HF's."""
    import transformers

    from hf_models import ARCHS, TINY

    text = {**TINY, **ARCHS["gemma3"][2]}
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(
        transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    ).eval()
    model.save_pretrained(str(tmp_path))
    cfg = ModelConfig.from_dir(str(tmp_path))
    assert cfg.architecture == "Gemma3ForConditionalGeneration" and cfg.layer_types == tuple(text["layer_types"])
    ids = np.random.RandomState(8).randint(0, cfg.vocab_size, size=14).tolist()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    got = forward_dense(load_hf_params(str(tmp_path), cfg, jnp.float32), jnp.asarray([ids], jnp.int32), cfg=cfg)
    np.testing.assert_allclose(np.asarray(got[0]), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["transformers5", "published"])
def test_conditional_generation_checkpoint_loads_its_text_tower(gemma3, tmp_path, layout):
    """Gemma3ForConditionalGeneration (4B and larger): the nested text_config and the text tower's
    weights under either prefix (model.language_model.*, as transformers >= 5 names the modules, or
    the published language_model.model.*); the vision tower's tensors are skipped."""
    path, _, cfg, params = gemma3
    text = json.loads((pathlib.Path(path) / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Gemma3ForConditionalGeneration"],
                "model_type": "gemma3",
                "text_config": {**text, "architectures": None},
                "vision_config": {"model_type": "siglip_vision_model"},
                "eos_token_id": [1, 106],
            }
        )
    )
    prefix, head = (
        ("model.language_model.", "lm_head.")
        if layout == "transformers5"
        else ("language_model.model.", "language_model.lm_head.")
    )
    tensors = {
        (prefix + k[len("model.") :] if k.startswith("model.") else head + k[len("lm_head.") :]): v
        for k, v in hf_tensors(params, cfg).items()
    }
    vision = "model.vision_tower." if layout == "transformers5" else "vision_tower."
    tensors[vision + "vision_model.embeddings.patch_embedding.weight"] = np.ones((4, 3, 2, 2), np.float32)
    tensors["multi_modal_projector.mm_soft_emb_norm.weight"] = np.ones(8, np.float32)
    write_safetensors(str(tmp_path / "model.safetensors"), tensors)
    mm_cfg = ModelConfig.from_dir(str(tmp_path))
    assert mm_cfg.architecture == "Gemma3ForConditionalGeneration" and mm_cfg.eos_token_ids == (1, 106)
    assert mm_cfg.layer_types == cfg.layer_types and mm_cfg.query_pre_attn_scalar == 24
    loaded = load_hf_params(str(tmp_path), mm_cfg, jnp.float32)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_final_logit_softcapping_matches_hf(hf_model_dir):
    """final_logit_softcapping (None in the released Gemma 3 configs) caps the logits as HF does."""
    path, model = hf_model_dir("gemma3", final_logit_softcapping=2.0)
    cfg = ModelConfig.from_dir(path)
    assert cfg.final_logit_softcapping == 2.0
    ids = np.random.RandomState(7).randint(0, cfg.vocab_size, size=12).tolist()
    ref = hf_logits(model, ids)
    assert np.abs(ref).max() < 2.0  # every logit bent by the cap (uncapped they reach ~4)
    got = forward_dense(load_hf_params(path, cfg, jnp.float32), jnp.asarray([ids], jnp.int32), cfg=cfg)
    np.testing.assert_allclose(np.asarray(got[0]), ref, atol=1e-4, rtol=0)
