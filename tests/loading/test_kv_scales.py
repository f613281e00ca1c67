"""A checkpoint's KV cache scales (vLLM's self_attn.k_scale / v_scale): read for an fp8 cache, skipped by
the weight loader, and what the cache stores and reads with."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.loading.kv_scales import read_kv_scales
from jaxserve.loading.model_loader import load_model
from jaxserve.model.kv_cache import init_cache, write_kv_slots
from jaxserve.model.sharding import make_mesh


def with_tensors(src: str, dst: str, tensors: dict[str, np.ndarray]) -> str:
    """A copy of the model directory `src` whose safetensors file also holds `tensors`."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    save_file({**load_file(path), **tensors}, path)
    return dst


def test_checkpoint_scales_reach_the_fp8_cache(hf_model_dir, tmp_path):
    path, _ = hf_model_dir("llama")
    cfg = ModelConfig.from_dir(path)
    L, K = cfg.num_layers, cfg.num_kv_heads
    k = np.linspace(0.25, 0.5, L, dtype=np.float32)
    v = np.linspace(2.0, 3.0, L, dtype=np.float32)
    tensors = {f"model.layers.{i}.self_attn.k_scale": np.asarray(k[i]) for i in range(L)}  # vLLM's scalars
    tensors |= {f"model.layers.{i}.self_attn.v_scale": np.full(K, v[i], np.float32) for i in range(L)}  # per head
    scaled = with_tensors(path, str(tmp_path / "scaled"), tensors)
    assert read_kv_scales(path, cfg) is None  # none given: the cache uses 1.0

    loaded = load_model(EngineConfig(model=scaled, dtype="float32", kv_cache_dtype="fp8"), make_mesh((1, 1)))
    np.testing.assert_array_equal(loaded.kv_scales[0], np.repeat(k[:, None], K, 1))
    np.testing.assert_array_equal(loaded.kv_scales[1], np.repeat(v[:, None], K, 1))
    cache = init_cache(cfg, 3, 4, jnp.float32, kv_cache_dtype="fp8", kv_scales=loaded.kv_scales)
    np.testing.assert_array_equal(np.asarray(cache.v_scale[0, :, :, 0, 0]), loaded.kv_scales[1])

    # Layer 1's K/V of 3 tokens written to slots 4..6: the pages hold x / scale, read back as x.
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, K, cfg.head_dim)) * 3, jnp.float32)
    write = jax.jit(
        lambda c, x: jax.tree.map(
            lambda a: a[None], write_kv_slots(jax.tree.map(lambda a: a[0], c), 1, x, 10 * x, jnp.asarray([4, 5, 6]))
        )
    )
    out = jax.tree.map(lambda a: np.asarray(a, np.float32), write(cache, x))
    stored_k = out.k[0, 1, :, 1, :3].transpose(1, 0, 2)  # slots 4..6 = page 1, slots 0..2
    stored_v = out.v[0, 1, :, 1, :3].transpose(1, 0, 2)
    np.testing.assert_allclose(stored_k, np.asarray(x) / k[1], rtol=2**-4)  # E4M3: 3 mantissa bits
    np.testing.assert_allclose(stored_v * v[1], 10 * np.asarray(x), rtol=2**-4)
    assert np.all(out.k[0, 0] == 0) and np.all(out.k[0, 1, :, 0] == 0)  # nothing else written
    assert np.all(np.abs(stored_v) <= 448)  # saturation: tests/quant/test_quant.py, the cache write test


def test_one_scale_for_both_and_refused_scales(hf_model_dir, tmp_path):
    path, _ = hf_model_dir("llama")
    cfg = ModelConfig.from_dir(path)
    one = lambda x: {
        f"model.layers.{i}.self_attn.kv_scale": np.asarray(x, np.float32)  # noqa: E731
        for i in range(cfg.num_layers)
    }
    both = with_tensors(path, str(tmp_path / "both"), one(0.5))
    k, v = read_kv_scales(both, cfg)  # "kv_scale": one scale for K and V
    assert np.all(k == 0.5) and np.all(v == 0.5)
    half = with_tensors(path, str(tmp_path / "half"), {"model.layers.0.self_attn.k_scale": np.ones((), np.float32)})
    with pytest.raises(ModelLoadError, match="incomplete"):
        read_kv_scales(half, cfg)
    bad = with_tensors(path, str(tmp_path / "bad"), one(-1.0))
    with pytest.raises(ModelLoadError, match="positive"):
        read_kv_scales(bad, cfg)
