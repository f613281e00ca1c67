"""Tensor- and data-parallel meshes on 4 virtual CPU devices give the same greedy tokens as one device."""

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import ModelConfig
from jaxserve.errors import ConfigError
from jaxserve.sharding import make_mesh, make_shardings

SETTINGS = dict(dtype="float32", page_size=8, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                warm_up=False)
PROMPTS = [np.random.RandomState(i).randint(0, 512, size=5 + 7 * i).tolist() for i in range(5)]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def single_device_tokens(hf_model_dir):
    path, _ = hf_model_dir("llama")
    llm = LLM(path, **SETTINGS)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]


# The tiny model has 4 query heads and 2 KV heads: on a model axis of 4 the KV heads are replicated.
@pytest.mark.parametrize("mesh_shape", [(1, 4), (2, 2), (4, 1)])
def test_mesh_matches_single_device(hf_model_dir, single_device_tokens, mesh_shape):
    assert len(jax.devices()) >= 4
    path, _ = hf_model_dir("llama")
    llm = LLM(path, mesh_shape=mesh_shape, **SETTINGS)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
    assert tokens == single_device_tokens
    data, model = mesh_shape
    cache = llm.runner.cache.k  # f[R, L, K, NP, S, H]
    assert cache.shape[0] == data  # one page pool per replica
    kv_split = model if llm.model_config.num_kv_heads % model == 0 else 1
    assert cache.addressable_shards[0].data.shape[2] == llm.model_config.num_kv_heads // kv_split
    wq = llm.runner.params.layers[0].wq  # f[D, N*H] (per-layer arrays on CPU), column-parallel
    assert wq.addressable_shards[0].data.shape[1] == wq.shape[1] // model
    for r in range(data):  # requests were spread over the replicas
        assert llm.blocks.num_free_pages(r) == llm.plan.num_pages - 1


def test_kv_heads_split_when_divisible(hf_model_dir):
    path, _ = hf_model_dir("llama")
    cfg = ModelConfig.from_dir(path)
    sh = make_shardings(cfg, make_mesh((1, 2)))
    assert sh.cache.spec[2] == "model" and sh.params.layers.wk.spec[2] == "model"
    assert sh.params.layers.wo.spec[1] == "model"  # row-parallel
    sh4 = make_shardings(cfg, make_mesh((1, 4)))
    assert sh4.cache.spec[2] is None and sh4.params.layers.wk.spec[2] is None  # replicated


def test_mesh_that_does_not_divide_heads_is_refused(hf_model_dir):
    path, _ = hf_model_dir("llama")
    with pytest.raises(ConfigError, match="must divide the 4 query heads"):
        LLM(path, mesh_shape=(1, 3), **SETTINGS)
    with pytest.raises(ConfigError, match="needs 8 devices"):
        LLM(path, mesh_shape=(2, 4), **SETTINGS)
