"""The engine with int8 weights and an int8 KV cache: settings wired through loading, the memory plan and
the cache; the choice of matmul implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams, steps
from jaxserve.model import quant
from jaxserve.runner.backends import resolve_quantized_matmul
from jaxserve.errors import ConfigError
from jaxserve.model.kv_cache import StepBatch, init_cache
from jaxserve.model.weights import param_bytes


@pytest.mark.parametrize("kv,page_dtype", [("int8", jnp.int8), ("fp8", jnp.float8_e4m3fn)])
def test_engine_serves_int8_weights_and_cache(hf_model_dir, kv, page_dtype):
    path, _ = hf_model_dir("llama")
    llm = LLM(
        path,
        dtype="float32",
        page_size=8,
        max_model_len=32,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        quantization="int8",
        kv_cache_dtype=kv,
        warm_up=False,
    )
    params, cache, cfg = llm.runner.params, llm.runner.cache, llm.model_config
    assert isinstance(params.layers[0].wq, quant.QuantArray) and params.embed.dtype == jnp.float32
    assert cache.k.dtype == page_dtype and cache.k_scale.dtype == jnp.float32
    assert llm.memory.param_bytes == param_bytes(params) == cfg.param_bytes(4, "int8")
    assert llm.memory.kv_bytes_per_token == cfg.kv_bytes_per_token(4, kv)
    assert "more tokens fit than in float32" in llm.memory.describe()

    prompt = np.random.RandomState(0).randint(0, cfg.vocab_size, size=11).tolist()
    greedy = (
        llm.generate(
            prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        )[0]
        .outputs[0]
        .token_ids
    )

    # Greedy tokens are the argmax of the same model's logits over its own output (one prefill, with
    # stacked weights and the same int8 cache arithmetic).
    full = np.asarray(prompt + greedy[:-1], np.int32)
    one = init_cache(cfg, 5, 8, jnp.float32, kv_cache_dtype=kv)
    batch = StepBatch(
        tokens=full[None, None],
        start_pos=np.zeros((1, 1), np.int32),
        num_new=np.full((1, 1), len(full), np.int32),
        page_table=np.arange(1, 5, dtype=np.int32)[None, None],
    )
    stacked = jax.tree.map(lambda *ws: jnp.stack(ws), *params.layers)
    logits, _ = steps.prefill(
        params.replace(layers=stacked),
        one,
        batch,
        cfg=cfg,
        options=steps.StepOptions(scan_layers=True),
        all_logits=True,
    )
    assert np.asarray(logits[0, 0, len(prompt) - 1 :]).argmax(-1).tolist() == greedy


def test_matmul_choice_is_explicit():
    assert resolve_quantized_matmul("auto", "cpu", (1, 1), "int8") == "xla_cpu"
    assert resolve_quantized_matmul("auto", "cpu", (2, 2), "int8") == "reference"
    assert resolve_quantized_matmul("reference", "cpu", (1, 1), "int8") == "reference"
    assert resolve_quantized_matmul("auto", "tpu", (1, 1), "int8") == "pallas_tpu"
    assert resolve_quantized_matmul("auto", "gpu", (1, 1), "int8") == "pallas_gpu"
    assert resolve_quantized_matmul("auto", "gpu", (1, 4), "int8") == "reference"  # GSPMD cannot split a kernel
    assert resolve_quantized_matmul("pallas", "cpu", (1, 1), "int8") == "pallas_interpret"
    assert resolve_quantized_matmul("pallas", "tpu", (1, 1), "none") == "reference"  # nothing quantized
    with pytest.raises(ConfigError, match="single device"):
        resolve_quantized_matmul("pallas", "gpu", (2, 1), "int8")


def test_w8a8_serves_with_per_token_activations(hf_model_dir):
    """activation_quantization=int8: int8 weights with one scale per output channel, each token's activations
    quantized to int8 (quant._w8a8_matmul) in every dense matmul; the greedy tokens are the argmax of that
    model's own prefill, and the start-up line says so."""
    path, _ = hf_model_dir("llama")
    kw = dict(dtype="float32", page_size=8, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, warm_up=False)
    llm = LLM(path, quantization="int8", activation_quantization="int8", **kw)
    params, cfg = llm.runner.params, llm.model_config
    assert params.layers[0].wq.group_size == 0 and llm.runner.options.matmul_backend == "w8a8"
    assert "each matmul's input quantized to int8 per token (W8A8)" in llm.memory.describe()
    assert llm.memory.param_bytes == param_bytes(params) == cfg.param_bytes(4, "int8", group_size=0)
    prompt = np.random.RandomState(1).randint(0, cfg.vocab_size, size=9).tolist()
    greedy = (
        llm.generate(
            prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        )[0]
        .outputs[0]
        .token_ids
    )
    full = np.asarray(prompt + greedy[:-1], np.int32)
    one = init_cache(cfg, 5, 8, jnp.float32)
    batch = StepBatch(
        tokens=full[None, None],
        start_pos=np.zeros((1, 1), np.int32),
        num_new=np.full((1, 1), len(full), np.int32),
        page_table=np.arange(1, 5, dtype=np.int32)[None, None],
    )
    stacked = jax.tree.map(lambda *ws: jnp.stack(ws), *params.layers)
    logits, _ = steps.prefill(
        params.replace(layers=stacked),
        one,
        batch,
        cfg=cfg,
        options=steps.StepOptions(scan_layers=True, matmul_backend="w8a8"),
        all_logits=True,
    )
    assert np.asarray(logits[0, 0, len(prompt) - 1 :]).argmax(-1).tolist() == greedy


def test_w8a8_settings_are_checked():
    from jaxserve.config import EngineConfig

    with pytest.raises(ConfigError, match="needs quantization=int8"):
        EngineConfig(model="x", activation_quantization="int8").validate()
    with pytest.raises(ConfigError, match="a scale per output"):
        EngineConfig(
            model="x", quantization="int8", quantization_group_size=32, activation_quantization="int8"
        ).validate()
    assert resolve_quantized_matmul("auto", "gpu", (1, 4), "int8", "int8") == "w8a8"
    with pytest.raises(ConfigError, match="weight-only"):
        resolve_quantized_matmul("pallas", "gpu", (1, 1), "int8", "int8")
