"""The KV cache sized as vLLM sizes it (memory_plan): gpu_memory_utilization of an accelerator's memory less
the weights and a reserve, tested with fake device figures; the CPU's fixed pool; the overrides; the
start-up line; and JAX's allocator fraction set before its backend starts."""

from __future__ import annotations

import logging
import subprocess
import sys

import jax.numpy as jnp
import pytest

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.errors import ConfigError
from jaxserve.planning.memory import (
    CPU,
    DEFAULT_KV_CACHE_MEMORY,
    FIXED_RESERVE,
    DeviceMemory,
    activation_reserve,
    apply_memory_utilization,
    plan_memory,
    query_device_memory,
)

GIB = 2**30
LLAMA_8B = ModelConfig.from_dir("configs/models/llama3-8b")
WEIGHTS_8B = LLAMA_8B.param_bytes(2)  # bf16: 14.96 GiB


def gpu(total_gib=80, in_use=WEIGHTS_8B, fraction=0.9):
    """A GPU as JAX reports it after loading the weights, its allocator started at `fraction`."""
    return DeviceMemory(total=total_gib * GIB, in_use=in_use, limit=int(fraction * total_gib * GIB))


def test_8b_on_an_80gb_gpu_gets_vllms_pool_not_16k_tokens():
    settings = EngineConfig(max_model_len=8192)
    plan = plan_memory(LLAMA_8B, settings, jnp.bfloat16, device_memory=gpu())
    # 0.9 x 80 GiB - 14.96 GiB of weights - ~1.2 GiB reserve = ~55.9 GiB of 128 KiB tokens
    assert 440_000 < plan.tokens_that_fit < 470_000
    assert plan.num_pages == (int(0.9 * 80 * GIB) - WEIGHTS_8B - activation_reserve(LLAMA_8B, settings, 2)) // (
        LLAMA_8B.kv_bytes_per_token(2) * 16
    )
    line = plan.capacity_line()
    assert line == (
        f"KV cache: {plan.tokens_that_fit:,} tokens; maximum concurrency for 8,192 tokens per request: "
        f"{plan.tokens_that_fit / 8192:.2f}x"
    )
    assert "maximum concurrency for 8,192 tokens per request: 55." in line
    assert "0.9 x 80.00 GiB of gpu memory - 14.96 GiB in use (weights)" in plan.describe()


def test_the_utilization_scales_the_pool():
    low = plan_memory(
        LLAMA_8B,
        EngineConfig(max_model_len=8192, gpu_memory_utilization=0.5),
        jnp.bfloat16,
        device_memory=gpu(fraction=0.5),
    )
    high = plan_memory(LLAMA_8B, EngineConfig(max_model_len=8192), jnp.bfloat16, device_memory=gpu())
    per_page = LLAMA_8B.kv_bytes_per_token(2) * 16
    assert high.num_pages - low.num_pages in range(
        int(0.4 * 80 * GIB) // per_page - 1, int(0.4 * 80 * GIB) // per_page + 2
    )


def test_jax_allocators_smaller_pool_caps_it():
    """JAX started with its default 75% (the user's XLA_PYTHON_CLIENT_MEM_FRACTION, or a backend initialised
    before the server could set it): the pool fits in what the allocator will hand out."""
    plan = plan_memory(LLAMA_8B, EngineConfig(max_model_len=8192), jnp.bfloat16, device_memory=gpu(fraction=0.75))
    reserve = activation_reserve(LLAMA_8B, EngineConfig(max_model_len=8192), 2)
    assert plan.num_pages == (int(0.75 * 80 * GIB) - WEIGHTS_8B - reserve) // (LLAMA_8B.kv_bytes_per_token(2) * 16)
    assert "capped at JAX's allocator pool of 60.00 GiB (0.75 of the device" in plan.describe()
    # the same pool at the utilization it was started with: no cap mentioned
    assert (
        "capped"
        not in plan_memory(LLAMA_8B, EngineConfig(max_model_len=8192), jnp.bfloat16, device_memory=gpu()).describe()
    )


def test_tensor_parallel_splits_weights_and_kv_heads():
    one = plan_memory(LLAMA_8B, EngineConfig(max_model_len=8192), jnp.bfloat16, device_memory=gpu())
    settings = EngineConfig(max_model_len=8192, tensor_parallel_size=8)
    eight = plan_memory(LLAMA_8B, settings, jnp.bfloat16, device_memory=gpu(in_use=WEIGHTS_8B // 8))
    budget = int(0.9 * 80 * GIB) - WEIGHTS_8B // 8 - activation_reserve(LLAMA_8B, settings, 2)
    assert eight.num_pages == budget * 8 // (LLAMA_8B.kv_bytes_per_token(2) * 16)  # 8 KV heads over 8 devices
    assert eight.num_pages > 8 * one.num_pages
    # 16 devices do not divide 8 KV heads: each device of the replica holds them all
    sixteen = plan_memory(
        LLAMA_8B,
        EngineConfig(max_model_len=8192, tensor_parallel_size=16),
        jnp.bfloat16,
        device_memory=gpu(in_use=WEIGHTS_8B // 16),
    )
    assert sixteen.num_pages < eight.num_pages / 7


def test_data_parallel_replicas_each_get_the_pool():
    plan = plan_memory(
        LLAMA_8B, EngineConfig(max_model_len=8192, data_parallel_size=2), jnp.bfloat16, device_memory=gpu()
    )
    assert (
        plan.num_pages
        == plan_memory(LLAMA_8B, EngineConfig(max_model_len=8192), jnp.bfloat16, device_memory=gpu()).num_pages
    )
    assert f"(per data-parallel replica; 2 replicas hold {2 * plan.tokens_that_fit:,} tokens)" in plan.capacity_line()


def test_weights_count_even_when_read_before_loading_and_across_hosts():
    before = plan_memory(LLAMA_8B, EngineConfig(max_model_len=8192), jnp.bfloat16, device_memory=gpu(in_use=0))
    after = plan_memory(LLAMA_8B, EngineConfig(max_model_len=8192), jnp.bfloat16, device_memory=gpu())
    assert before.num_pages == after.num_pages
    busy = plan_memory(
        LLAMA_8B, EngineConfig(max_model_len=8192), jnp.bfloat16, device_memory=gpu(in_use=WEIGHTS_8B + 4 * GIB)
    )  # something else holds 4 GiB
    assert after.num_pages - busy.num_pages == 4 * GIB // (LLAMA_8B.kv_bytes_per_token(2) * 16)
    # several processes must allocate the same pages: the weights' share stands in for the measured use
    hosts = EngineConfig(max_model_len=8192, num_processes=2, coordinator_address="h:1")
    assert (
        plan_memory(LLAMA_8B, hosts, jnp.bfloat16, device_memory=gpu(in_use=WEIGHTS_8B + 4 * GIB)).num_pages
        == after.num_pages
    )


def test_a_tpu_limit_is_its_memory():
    tpu = DeviceMemory(total=95 * GIB, in_use=WEIGHTS_8B, limit=95 * GIB, platform="tpu")
    plan = plan_memory(LLAMA_8B, EngineConfig(max_model_len=8192), jnp.bfloat16, device_memory=tpu)
    assert "0.9 x 95.00 GiB of tpu memory" in plan.describe() and "capped" not in plan.describe()


def test_too_little_memory_says_what_to_do():
    with pytest.raises(ConfigError, match="no device memory is left for the KV cache.*gpu_memory_utilization"):
        plan_memory(
            LLAMA_8B, EngineConfig(max_model_len=8192), jnp.bfloat16, device_memory=gpu(total_gib=16, fraction=0.9)
        )
    with pytest.raises(ConfigError, match="fewer than one sequence of max_model_len=8192"):
        plan_memory(
            LLAMA_8B,
            EngineConfig(max_model_len=8192),
            jnp.bfloat16,
            device_memory=DeviceMemory(int(18.5 * GIB), WEIGHTS_8B, platform="tpu"),
        )


def test_num_pages_and_kv_cache_memory_override_the_device():
    pages = plan_memory(LLAMA_8B, EngineConfig(max_model_len=8192, num_pages=100), jnp.bfloat16, device_memory=gpu())
    assert pages.num_pages == 100 and "num_pages as set" in pages.describe()
    sized = plan_memory(
        LLAMA_8B, EngineConfig(max_model_len=8192, kv_cache_memory="4GiB"), jnp.bfloat16, device_memory=gpu()
    )
    assert sized.num_pages == 4 * GIB // (LLAMA_8B.kv_bytes_per_token(2) * 16)


def test_cpu_keeps_the_fixed_pool_and_says_the_utilization_is_ignored():
    small = ModelConfig.from_dir("configs/models/smollm2-135m")
    settings = EngineConfig(max_model_len=2048, max_num_seqs=4, gpu_memory_utilization=0.5)
    plan = plan_memory(small, settings, jnp.float32, device_memory=CPU)
    assert plan.num_pages == 4 * 2048 // 16 + 1  # capped at max_num_seqs x max_model_len (+ the padding page)
    assert "gpu_memory_utilization applies to accelerators only and is ignored here" in plan.describe()
    roomy = plan_memory(small, settings.replace(max_num_seqs=1000), jnp.float32, device_memory=CPU)
    assert roomy.num_pages == DEFAULT_KV_CACHE_MEMORY // (small.kv_bytes_per_token(4) * 16)
    # the engine's call, with no figures given, reads this machine's CPU devices: the same plan
    assert plan_memory(small, settings, jnp.float32).num_pages == plan.num_pages
    assert query_device_memory() == CPU


def test_an_accelerator_without_figures_falls_back_loudly(caplog):
    small = ModelConfig.from_dir("configs/models/smollm2-135m")
    with caplog.at_level(logging.WARNING):
        plan = plan_memory(
            small,
            EngineConfig(max_model_len=2048, max_num_seqs=4),
            jnp.bfloat16,
            device_memory=DeviceMemory(None, platform="gpu"),
        )
    assert plan.num_pages == 4 * 2048 // 16 + 1
    assert "reports no memory figures" in caplog.text and "XLA_PYTHON_CLIENT_ALLOCATOR=platform" in caplog.text


def test_the_reserve_covers_the_largest_step():
    base = activation_reserve(LLAMA_8B, EngineConfig(), 2)
    assert FIXED_RESERVE < base < FIXED_RESERVE + GIB // 2
    assert activation_reserve(LLAMA_8B, EngineConfig(max_num_batched_tokens=8192), 2) > base + GIB
    assert activation_reserve(LLAMA_8B, EngineConfig(enable_prompt_logprobs=True), 2) > base  # logits of every row


def test_the_allocator_fraction_is_set_before_the_backend_starts(monkeypatch):
    import jaxserve.planning.memory as memory_plan

    monkeypatch.setattr(memory_plan, "backend_initialized", lambda: False)
    env: dict[str, str] = {}
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.85" in apply_memory_utilization(0.85, env)
    assert env == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.85"}
    # the user's setting, under either name, is kept (jax refuses both names at once)
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        env = {name: "0.5"}
        assert "set by the user" in apply_memory_utilization(0.9, env) and env == {name: "0.5"}
    monkeypatch.setattr(memory_plan, "backend_initialized", lambda: True)
    env = {}
    assert "already initialised" in apply_memory_utilization(0.9, env) and env == {}


def test_backend_initialized_is_a_cheap_check():
    """It neither imports jax nor starts a backend, and tells the two states apart."""
    code = (
        "import sys; from jaxserve.planning.memory import backend_initialized as b; r = [b(), 'jax' in sys.modules]; "
        "import jax; r.append(b()); jax.devices(); r.append(b()); print(r)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    assert out.stdout.strip() == "[False, False, False, True]", out.stderr
