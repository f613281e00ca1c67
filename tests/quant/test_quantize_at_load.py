"""int8 weights quantized tensor by tensor as a checkpoint is read equal the float model quantized after
loading (values and scales bit for bit), stacked and per layer, dense and mixture of experts, for
safetensors and GGUF alike (one loader)."""

import jax
import numpy as np
import pytest

import jax.numpy as jnp

from jaxserve.model import quant
from jaxserve.loading.checkpoint import load_hf_params
from jaxserve.config import ModelConfig
from jaxserve.model.weights import unstack_layers


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-layer"])
@pytest.mark.parametrize("arch,lm_head", [("llama", True), ("qwen3_moe", False)])
def test_int8_at_load_equals_quantizing_the_loaded_float_model(hf_model_dir, arch, lm_head, stacked):
    path, _ = hf_model_dir(arch)
    cfg = ModelConfig.from_dir(path)
    float_params = load_hf_params(path, cfg, jnp.float32)
    want = quant.quantize_params(float_params if stacked else unstack_layers(float_params), lm_head)
    got = load_hf_params(path, cfg, jnp.float32, stacked=stacked, quantization="int8", quantize_lm_head=lm_head)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(leaves(got), leaves(want)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert isinstance(got.lm_head, quant.QuantArray) == (lm_head and not cfg.tie_word_embeddings)
