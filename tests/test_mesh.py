"""Tensor- and data-parallel meshes on 4 virtual CPU devices give the same greedy tokens as one device,
with the reference attention and with the Pallas kernels run per device under shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import ModelConfig
from jaxserve.errors import ConfigError
from jaxserve.model.attention_dispatch import ragged_attention_impl, shard_ragged_attention
from jaxserve.model.layers import ragged_attention_reference
from jaxserve.model.sharding import make_mesh, make_shardings

SETTINGS = dict(
    dtype="float32", page_size=8, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, warm_up=False
)
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
        assert llm.blocks.num_free_pages(r) == llm.memory.num_pages - 1


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


# ---------------------------------------------------------------- Pallas kernels per device (shard_map)
# Interpret mode is slow on CPU: two short prompts, a few tokens, a single prefill bucket.
PALLAS_SETTINGS = dict(
    dtype="float32", page_size=8, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, warm_up=False
)
PALLAS_PROMPTS = [np.random.RandomState(10 + i).randint(0, 512, size=n).tolist() for i, n in enumerate((5, 9))]
PALLAS_GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _greedy(llm):
    outputs = llm.generate(prompt_token_ids=PALLAS_PROMPTS, sampling_params=PALLAS_GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def small_reference_tokens(hf_model_dir):
    path, _ = hf_model_dir("llama")
    return _greedy(LLM(path, attention_backend="reference", **PALLAS_SETTINGS))


@pytest.mark.parametrize("mesh_shape", [(1, 2), (2, 2)])
def test_pallas_mesh_matches_reference(hf_model_dir, small_reference_tokens, mesh_shape):
    path, _ = hf_model_dir("llama")
    llm = LLM(path, mesh_shape=mesh_shape, attention_backend="pallas", **PALLAS_SETTINGS)
    assert llm.runner.options.attention_backend == "pallas_interpret"
    assert _greedy(llm) == small_reference_tokens


def _dequantizing_reference(
    q,
    k_cache,
    v_cache,
    layer,
    positions,
    query_start,
    context_lens,
    page_table,
    sliding_window=None,
    sm_scale=None,
    *,
    k_scale=None,
    v_scale=None,
):
    # Stands in for a kernel taking int8-style scales [L, K, NP, S]: checks they follow their KV heads.
    return ragged_attention_reference(
        q,
        k_cache * k_scale[..., None],
        v_cache * v_scale[..., None],
        layer,
        positions,
        query_start,
        context_lens,
        page_table,
        sliding_window,
        sm_scale,
    )


# (query heads, KV heads) on a (1, 4) mesh: KV heads replicated; one KV head per device (4, 2), or a device's
# query heads spanning two KV heads (12, 3: the per-query-head gather).
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,impl",
    [
        (4, 2, "pallas_interpret"),
        (4, 2, "scaled_reference"),
        (12, 3, "scaled_reference"),
    ],
)
def test_shard_ragged_attention_with_replicated_kv_heads(num_heads, num_kv_heads, impl):
    from jax.sharding import NamedSharding, PartitionSpec as P

    R, N, H, S, NP, L = 1, 2, 16, 8, 6, 2  # two decode rows, layer 1 of 2 attended
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((R, N, num_heads, H)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((R, L, num_kv_heads, NP, S, H)), jnp.float32) for _ in range(2))
    scales = {
        n: jnp.asarray(rng.uniform(0.5, 2.0, (R, L, num_kv_heads, NP, S)), jnp.float32) for n in ("k_scale", "v_scale")
    }
    page_table = jnp.asarray([[[1, 4], [2, 5]]], jnp.int32)
    context_lens = jnp.asarray([[11, 6]], jnp.int32)
    positions = context_lens - 1
    query_start = jnp.asarray([[0, 1, 2]], jnp.int32)
    if impl == "pallas_interpret":
        inner, extra = ragged_attention_impl(impl), {}
    else:
        inner, extra = _dequantizing_reference, scales
    mesh = make_mesh((1, 4))

    def run(fn, spmd):
        def per_replica(q, k, v, pos, qs, cl, pt, ex):
            return fn(q, k, v, jnp.int32(1), pos, qs, cl, pt, jnp.int32(64), jnp.float32(H**-0.5), **ex)

        return jax.jit(jax.vmap(per_replica, spmd_axis_name=spmd))(
            q, k, v, positions, query_start, context_lens, page_table, extra
        )

    want = run(inner, None)
    q = jax.device_put(q, NamedSharding(mesh, P("data", None, "model")))
    got = run(shard_ragged_attention(inner, mesh), "data")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
