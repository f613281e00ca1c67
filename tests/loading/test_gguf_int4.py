"""GGUF Q4_0 / Q4_1 linear weights load straight into int4 (quant.Int4Array, groups of 32): the same
weights and logits as the gguf library's dequantization of the file, with no float detour."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.loading.checkpoint import load_hf_params
from jaxserve.loading.gguf_weights import unpermute_rope_rows
from jaxserve.loading.model_source import resolve_model_path
from jaxserve.model import quant
from jaxserve.model.llama import forward_dense

from test_gguf_model import gguf_from_hf

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    head_dim=16,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_tensors_load_into_int4_exactly(tmp_path, qtype):
    path, _, held = gguf_from_hf(tmp_path, "llama", qtype, **SMALL)
    model_dir = resolve_model_path(path)
    cfg = ModelConfig.from_dir(model_dir)
    q4 = load_hf_params(model_dir, cfg, jnp.float32, stacked=False, quantization="int4")
    layer = q4.layers[1]
    assert isinstance(layer.wq, quant.Int4Array) and layer.wq.group_size == 32
    # Q4_1: q * d + m is the library's own formula; Q4_0's (q - 8) * d may differ from q * d - 8d by an ulp
    tol = dict(rtol=0, atol=0) if qtype == "Q4_1" else dict(rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        np.asarray(quant.dequantize_int4(layer.wq)), unpermute_rope_rows(held["blk.1.attn_q.weight"], 4).T, **tol
    )
    np.testing.assert_allclose(
        np.asarray(quant.dequantize_int4(layer.wk)), unpermute_rope_rows(held["blk.1.attn_k.weight"], 2).T, **tol
    )
    np.testing.assert_allclose(np.asarray(quant.dequantize_int4(layer.w_down)), held["blk.1.ffn_down.weight"].T, **tol)

    float_params = load_hf_params(model_dir, cfg, jnp.float32)
    stacked = load_hf_params(model_dir, cfg, jnp.float32, quantization="int4")
    ids = jnp.asarray([np.random.RandomState(3).randint(0, cfg.vocab_size, 24).tolist()])
    forward = jax.jit(forward_dense, static_argnames="cfg")
    want = np.asarray(forward(float_params, ids, cfg=cfg))
    np.testing.assert_allclose(np.asarray(forward(stacked, ids, cfg=cfg)), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_tied_table_quantized_at_load_equals_quantizing_the_float_model(tmp_path, quantization):
    path, _, _ = gguf_from_hf(tmp_path, "qwen2", "Q4_1", **SMALL)  # tied embeddings
    model_dir = resolve_model_path(path)
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.tie_word_embeddings
    got = load_hf_params(model_dir, cfg, jnp.float32, quantization=quantization, quantize_lm_head=True)
    float_params = load_hf_params(model_dir, cfg, jnp.float32)
    assert quant.is_quant(got.embed) and got.lm_head is None
    if quantization == "int4":  # Q4_1 blocks of a row are groups of 32 of the head's column: copied as they are
        np.testing.assert_array_equal(np.asarray(quant.dequantize_int4(got.embed)), np.asarray(float_params.embed).T)
    else:
        want = quant.quantize_params(float_params, True, quantization)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_default_model_int4_is_the_file():
    """The default model (SmolLM2-135M-Instruct, Q4_1): every dense weight loaded into int4 dequantizes
    to exactly the gguf library's float32, and the logits equal the float32 model's."""
    from jaxserve.loading import resources

    path = resources.default_model_file()
    if path is None:
        pytest.skip(f"the default model is not installed: {resources.DEFAULT_MODEL_INSTALL}")
    model_dir = resolve_model_path(str(path))
    cfg = ModelConfig.from_dir(model_dir)
    float_params = load_hf_params(model_dir, cfg, jnp.float32)
    q4 = load_hf_params(model_dir, cfg, jnp.float32, quantization="int4")
    for field in quant.DENSE_FIELDS:
        w = getattr(q4.layers, field)
        assert isinstance(w, quant.Int4Array), field
        np.testing.assert_array_equal(
            np.asarray(quant.dequantize_int4(w)), np.asarray(getattr(float_params.layers, field)), err_msg=field
        )
    ids = jnp.asarray([np.random.RandomState(0).randint(0, cfg.vocab_size, 12).tolist()])
    forward = jax.jit(forward_dense, static_argnames="cfg")
    np.testing.assert_allclose(
        np.asarray(forward(q4, ids, cfg=cfg)), np.asarray(forward(float_params, ids, cfg=cfg)), atol=1e-4, rtol=0
    )
