"""GGUF files as models: tiny models of every served architecture written as llama.cpp's converter
writes them, loaded back through the engine's loader, give the original model's logits; every
quantization type reads back as the `gguf` library dequantizes it."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

from jaxserve.loading.checkpoint import load_hf_params
from jaxserve.config import ModelConfig
from jaxserve.loading import gguf_model
from jaxserve.loading.gguf_weights import unpermute_rope_rows
from jaxserve.loading.model_source import resolve_model_path
from jaxserve.model.llama import forward_dense

from gguf_model_writer import permute_rope_rows, write_gguf
from hf_models import make_hf_model

# Each family as llama.cpp stores it: Gemma 3 with llama.cpp's fixed layout (every 6th layer global, local
# RoPE base 10000, queries scaled by head_dim), Qwen3-MoE with renormalised top-k, Mistral's window kept.
FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": 12, "head_dim": 16},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"tie_word_embeddings": True, "head_dim": 32},
    "gemma3": {
        "num_hidden_layers": 6,
        "head_dim": 32,
        "sliding_window": 8,
        "query_pre_attn_scalar": 32,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "rope_theta": 100000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    },
    "qwen3_moe": {
        "head_dim": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
}


def hf_state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items() if "rotary_emb" not in k}


def gguf_from_hf(tmp_path, arch: str, qtype: str = "F32", **overrides):
    """(GGUF path, the HF model, the values the file holds by GGUF name)."""
    model = make_hf_model(str(tmp_path / "hf"), arch, **{**FAMILIES.get(arch, {}), **overrides})
    # the settings as given (transformers 5 moves rope_theta and rope_scaling under rope_parameters)
    config = {**model.config.to_dict(), **FAMILIES.get(arch, {}), **overrides, "model_type": model.config.model_type}
    path = str(tmp_path / f"{arch}-{qtype}.gguf")
    held = write_gguf(path, config, hf_state(model), qtype)
    return path, model, held


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_gguf_logits_equal_the_original_model(tmp_path, arch):
    """f32 tensors hold the weights exactly, so the file's model is the original one: the config from
    the metadata, the names, the Q/K permutation and Gemma's norm offset must all be undone."""
    path, model, _ = gguf_from_hf(tmp_path, arch)
    model_dir = resolve_model_path(path)
    assert gguf_model.gguf_source(model_dir) is not None
    cfg = ModelConfig.from_dir(model_dir)
    params = load_hf_params(model_dir, cfg, jnp.float32)
    ids = np.random.RandomState(3).randint(0, cfg.vocab_size, 24).tolist()
    ours = np.asarray(jax.jit(forward_dense, static_argnames="cfg")(params, jnp.asarray([ids]), cfg=cfg)[0])
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


QUANT_TYPES = ["F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_quantized_tensors_read_as_the_library_dequantizes_them(tmp_path, qtype):
    """Rows of 256 so that K-quant super-blocks fit; the loaded weights (ours [in, out], Q/K un-permuted)
    equal the library's dequantization of the bytes in the file."""
    path, _, held = gguf_from_hf(
        tmp_path,
        "llama",
        qtype,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=1,
        head_dim=64,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model_dir = resolve_model_path(path)
    cfg = ModelConfig.from_dir(model_dir)
    params = load_hf_params(model_dir, cfg, jnp.float32, stacked=False)
    layer = params.layers[0]
    np.testing.assert_array_equal(np.asarray(layer.wq), unpermute_rope_rows(held["blk.0.attn_q.weight"], 4).T)
    np.testing.assert_array_equal(np.asarray(layer.wk), unpermute_rope_rows(held["blk.0.attn_k.weight"], 2).T)
    np.testing.assert_array_equal(np.asarray(layer.w_down), held["blk.0.ffn_down.weight"].T)
    np.testing.assert_array_equal(np.asarray(params.embed), held["token_embd.weight"])
    assert np.isfinite(np.asarray(layer.wq)).all()


def test_moe_experts_load_as_int4(tmp_path):
    """A GGUF MoE's expert tensors (read as float) are quantized to int4 as they are read, in the same
    groups as quantizing the loaded float experts."""
    from jaxserve.model import quant

    path, _, _ = gguf_from_hf(tmp_path, "qwen3_moe")
    model_dir = resolve_model_path(path)
    cfg = ModelConfig.from_dir(model_dir)
    floats = load_hf_params(model_dir, cfg, jnp.float32).layers
    q4 = load_hf_params(model_dir, cfg, jnp.float32, quantization="int4").layers
    for field in quant.EXPERT_FIELDS:
        got = getattr(q4, field)
        assert isinstance(got, quant.Int4Array) and got.shape == getattr(floats, field).shape
        want = quant.quantize_int4(getattr(floats, field), got.group_size)
        np.testing.assert_allclose(
            np.asarray(quant.dequantize_int4(got)), np.asarray(quant.dequantize_int4(want)), atol=1e-5, rtol=0
        )


def test_rope_permutation_round_trips():
    w = np.arange(8 * 2 * 4 * 3, dtype=np.float32).reshape(8 * 2 * 4, 3)
    for heads in (1, 2, 8):
        permuted = permute_rope_rows(w, heads)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(unpermute_rope_rows(permuted, heads), w)


# transformers' GGUF loading reads fewer keys than llama.cpp: for Qwen3 not attention.key_length (it takes
# Qwen3Config's head_dim, 128, as the published models have), for Gemma 3 neither the RoPE scaling nor the
# query scale (Gemma3TextConfig's 256, the published 1B's head_dim). The files are written within that.
GEMMA3_AS_TRANSFORMERS_READS = {"head_dim": 256, "query_pre_attn_scalar": 256, "rope_scaling": None}


@pytest.mark.parametrize(
    "arch,overrides", [("qwen3", {"head_dim": 128}), ("gemma3", GEMMA3_AS_TRANSFORMERS_READS)], ids=["qwen3", "gemma3"]
)
def test_quantized_file_greedy_equals_transformers_gguf_loading(tmp_path, arch, overrides):
    """transformers' own GGUF loading of the same Q8_0 file is the referee (its dequantized weights,
    not the original's): greedy tokens through the engine equal it."""
    from transformers import AutoModelForCausalLM

    from hf_models import assert_same_greedy, hf_greedy
    from jaxserve import LLM, SamplingParams

    path, _, _ = gguf_from_hf(tmp_path, arch, "Q8_0", **overrides)
    ref_model = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.rsplit("/", 1)[1], dtype=torch.float32
    ).eval()
    prompt = np.random.RandomState(5).randint(3, 500, 11).tolist()
    ref, gaps = hf_greedy(ref_model, prompt, 8)
    with LLM(
        path,
        dtype="float32",
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        token_buckets="powers-of-two",
        enable_prefix_caching=False,
    ) as llm:
        out = llm.generate(
            prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        )
    assert_same_greedy(out[0].outputs[0].token_ids, ref, gaps, f"{arch} Q8_0")


def test_a_sidecar_generation_config_is_merged_and_its_edits_are_seen(tmp_path):
    """Values of a generation_config.json beside the file go over the file's own (its stop ids stay), and
    editing it gives a new directory, not the cached one."""
    path, _, _ = gguf_from_hf(tmp_path, "llama")
    sidecar = tmp_path / "generation_config.json"
    sidecar.write_text('{"temperature": 0.5}')
    first = resolve_model_path(path)
    assert json.loads((Path(first) / "generation_config.json").read_text())["temperature"] == 0.5
    assert json.loads((Path(first) / "generation_config.json").read_text())["eos_token_id"] == [2]
    sidecar.write_text('{"temperature": 0.7}')
    second = resolve_model_path(path)
    assert second != first and json.loads((Path(second) / "generation_config.json").read_text())["temperature"] == 0.7
    assert resolve_model_path(path) == second  # unchanged: the cached directory


def test_a_broken_sidecar_is_a_clear_error(tmp_path):
    from jaxserve.errors import ModelLoadError

    path, _, _ = gguf_from_hf(tmp_path, "llama")
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="generation_config.json is not valid JSON"):
        resolve_model_path(path)
