"""The cache-free forward used for training and scoring equals Hugging Face on every architecture."""

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

from jaxserve.loading.checkpoint import load_hf_params
from jaxserve.config import ModelConfig
from jaxserve.model.llama import forward_dense
from jaxserve.model.weights import unstack_layers


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_forward_dense_matches_hf(hf_model_dir, arch):
    path, model = hf_model_dir(arch)
    cfg = ModelConfig.from_dir(path)
    params = load_hf_params(path, cfg, jnp.float32)
    tokens = np.random.RandomState(3).randint(0, cfg.vocab_size, size=(2, 19))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    fwd = jax.jit(forward_dense, static_argnames="cfg")
    for form in (params, unstack_layers(params)):  # scanned and unrolled
        logits = fwd(form, jnp.asarray(tokens, jnp.int32), cfg=cfg)
        np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-4, rtol=0)
