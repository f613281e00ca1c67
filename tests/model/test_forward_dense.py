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


def test_the_dense_and_the_ragged_forward_run_the_one_decoder_layer(hf_model_dir, monkeypatch):
    """Training's forward and serving's are two drivers of one layer (`llama.decoder_layer`, looped by
    `llama.layer_loop`): a change to that layer changes both the same way. Here each layer's residual
    update is doubled: the dense and the ragged forward (scanned and unrolled) still agree with each
    other, and no longer with the unpatched model."""
    from jaxserve.model import llama
    from jaxserve.model.kv_cache import KVCache, RaggedBatch, cache_shape
    from jaxserve.model.ragged import RaggedRow

    path, _ = hf_model_dir("llama")
    cfg = ModelConfig.from_dir(path)
    params = load_hf_params(path, cfg, jnp.float32)
    tokens = np.random.RandomState(5).randint(0, cfg.vocab_size, size=11).tolist()
    batch = RaggedBatch.build(
        [RaggedRow(tokens, 0, [1, 2], 1)], page_size=8, num_tokens=16, num_rows=2, max_pages=2, num_logits=1
    )
    batch = jax.tree.map(jnp.asarray, batch)
    shape = cache_shape(cfg, 3, 8)[1:]  # one replica
    cache = KVCache(k=jnp.zeros(shape, jnp.float32), v=jnp.zeros(shape, jnp.float32))

    def forwards():
        dense = llama.forward_dense(params, jnp.asarray([tokens], jnp.int32), cfg=cfg)[0, -1]
        out = [np.asarray(dense)]
        for form, scan in ((params, True), (unstack_layers(params), False)):
            logits, _ = llama.forward_ragged(form, cache, batch, cfg=cfg, scan_layers=scan)
            out.append(np.asarray(logits[0]))
        return out

    plain = forwards()
    layer = llama.decoder_layer

    def doubled(cfg, lp, x, *args, **kwargs):
        return 2 * layer(cfg, lp, x, *args, **kwargs) - x

    monkeypatch.setattr(llama, "decoder_layer", doubled)
    jax.clear_caches()  # the unrolled layers' nested jit would replay its trace of the unpatched layer
    changed = forwards()
    for got in plain[1:]:
        np.testing.assert_allclose(got, plain[0], atol=1e-4, rtol=0)
    for got in changed[1:]:
        np.testing.assert_allclose(got, changed[0], atol=1e-4, rtol=0)
    assert np.abs(changed[0] - plain[0]).max() > 1e-2
