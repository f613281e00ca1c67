"""The start-up memory plan's figure for sliding-window layers: the cache bytes no query reads at
max_model_len (Gemma 3's local layers in the one pool; Mistral's pages behind the window)."""

import dataclasses

import jax.numpy as jnp
import pytest

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.planning.memory import plan_memory
from jaxserve.loading.resources import shipped_model_shape


def test_gemma3_local_layers_leave_their_share_behind_the_window():
    cfg = ModelConfig.from_dir(str(shipped_model_shape("gemma-3-12b")))
    assert (cfg.num_sliding_layers, cfg.num_layers, cfg.sliding_window) == (40, 48, 1024)
    plan = plan_memory(cfg, EngineConfig(page_size=16, max_model_len=8192, num_pages=4097), jnp.bfloat16)
    # 40 of 48 layers read only 1024 of each 8192-token sequence's keys.
    expected = plan.kv_cache_bytes * 40 / 48 * (8192 - 1024) / 8192
    assert plan.window_unread_bytes == pytest.approx(expected, abs=1)
    # The same figure as a per-layer-group pool would save: KV per sequence, full against windowed.
    full, windowed = (cfg.kv_bytes_per_token(2) * 8192, cfg.kv_bytes_per_sequence(8192, 2))
    assert plan.window_unread_bytes / plan.kv_cache_bytes == pytest.approx((full - windowed) / full, rel=1e-9)
    text = plan.describe()
    assert "40 of 48 layers see only the last 1024 tokens" in text and "one pool for local and global" in text


def test_all_windowed_and_unwindowed_models():
    cfg = ModelConfig.from_dir(str(shipped_model_shape("llama3-8b")))
    plan = plan_memory(cfg, EngineConfig(page_size=16, max_model_len=8192, num_pages=64), jnp.bfloat16)
    assert plan.window_unread_bytes == 0 and "only the last" not in plan.describe()
    mistral = dataclasses.replace(cfg, sliding_window=4096, architecture="MistralForCausalLM")
    plan = plan_memory(mistral, EngineConfig(page_size=16, max_model_len=8192, num_pages=64), jnp.bfloat16)
    assert plan.window_unread_bytes == plan.kv_cache_bytes // 2
    assert "every layer sees only the last 4096 tokens" in plan.describe()
    short = plan_memory(mistral, EngineConfig(page_size=16, max_model_len=4096, num_pages=64), jnp.bfloat16)
    assert short.window_unread_bytes == 0  # the window covers the whole context
