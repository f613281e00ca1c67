"""A quantized orbax checkpoint (scripts/quantize.py): saved once, restored as int8 without quantizing again."""

import json
import os
import sys

import jax
import numpy as np
import pytest

from jaxserve.model import quant
from jaxserve.config import EngineConfig
from jaxserve.errors import ModelLoadError
from jaxserve.loading.model_loader import load_model
from jaxserve.loading.orbax_checkpoint import MANIFEST
from jaxserve.model.sharding import make_mesh

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from quantize import quantize_checkpoint  # noqa: E402


def test_quantized_checkpoint_round_trip(hf_model_dir, tmp_path, monkeypatch):
    path, _ = hf_model_dir("llama")
    out = str(quantize_checkpoint(path, str(tmp_path / "int8"), dtype="float32"))
    manifest = json.load(open(os.path.join(out, MANIFEST)))
    assert manifest["quantization"] == "int8" and manifest["quantize_lm_head"] is False
    assert manifest["quantization_group_size"] == quant.INT8_GROUP_SIZE

    settings = dict(dtype="float32", quantization="int8")
    fresh = load_model(EngineConfig(model=path, **settings), make_mesh((1, 1)), stacked=True).params

    def no_requantize(*_, **__):
        raise AssertionError("an int8 checkpoint must not be quantized again")

    monkeypatch.setattr(quant, "quantize_params_placed", no_requantize)
    restored = load_model(EngineConfig(model=out, **settings), make_mesh((1, 1)), stacked=True).params
    assert isinstance(restored.layers.w_down, quant.QuantArray)
    assert jax.tree.structure(restored) == jax.tree.structure(fresh)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(fresh)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))  # bit for bit

    # Per-layer form on a (1, 2) mesh: restored stacked onto the mesh, then unstacked shard by shard.
    per_layer = load_model(EngineConfig(model=out, **settings), make_mesh((1, 2)), stacked=False).params
    wq = per_layer.layers[1].wq
    groups, out_channels = wq.scales.shape  # column-parallel: the groups whole, the channels split
    assert wq.scales.addressable_shards[0].data.shape == (groups, out_channels // 2)
    assert np.array_equal(np.asarray(wq.values), np.asarray(fresh.layers.wq.values[1]))

    with pytest.raises(ModelLoadError, match="quantization='int8'"):
        load_model(EngineConfig(model=out, dtype="float32"), make_mesh((1, 1)))
    with pytest.raises(ModelLoadError, match="quantization_group_size=32"):
        load_model(EngineConfig(model=out, quantization_group_size=16, **settings), make_mesh((1, 1)))
