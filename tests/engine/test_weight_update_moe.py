"""update_weights of a mixture of experts by Hugging Face names (issue 53, part 2): Qwen3-MoE's
experts come one tensor per expert (`mlp.experts.{e}.gate_proj.weight`), gathered into each layer's
f[E, D, F] weight; the served params must equal a fresh load of the new checkpoint, the layers
stacked (scanned) or a tuple (unrolled), float32 or int8. The updater alone, on loaded params: no
engine to compile."""

import os
import shutil

import jax
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.loading.checkpoint import iter_safetensors, load_hf_params, write_safetensors
from jaxserve.runner.weight_update import LAYER_FIELDS, TOP_FIELDS, WeightUpdater


@pytest.fixture(scope="module")
def moe_models(hf_model_dir, tmp_path_factory):
    a, _ = hf_model_dir("qwen3_moe")
    b = str(tmp_path_factory.mktemp("moe") / "b")  # every weight moved by noise
    shutil.copytree(a, b)
    rng = np.random.default_rng(1)
    tensors = {
        n: x + rng.normal(0, 0.05, x.shape).astype(x.dtype) for n, x in iter_safetensors(f"{a}/model.safetensors")
    }
    write_safetensors(os.path.join(b, "model.safetensors"), tensors)
    assert any(".mlp.experts.1.down_proj." in n for n in tensors)  # one tensor per expert
    return a, b, tensors


@pytest.mark.parametrize("stacked, quantization", [(True, "none"), (False, "none"), (True, "int8")])
def test_experts_by_hf_name_equal_a_fresh_load(moe_models, stacked, quantization):
    """int8: the experts requantized as they are placed, as a fresh int8 load quantizes them."""
    a, b, tensors = moe_models
    cfg = ModelConfig.from_dir(a)
    served = [load_hf_params(a, cfg, np.float32, stacked=stacked, quantization=quantization)]
    updater = WeightUpdater(lambda: served[0], lambda p: served.__setitem__(0, p), cfg)
    report = updater.update(iter_safetensors(os.path.join(b, "model.safetensors")))  # chunks, as streamed
    fresh = load_hf_params(b, cfg, np.float32, stacked=stacked, quantization=quantization)
    assert report.quantized == (0 if quantization == "none" else report.tensors - report.copied)
    layer = fresh.layers if stacked else fresh.layers[0]
    per_layer = sum(getattr(layer, f) is not None for f in LAYER_FIELDS)  # the experts' three among them
    assert report.tensors == sum(getattr(fresh, f) is not None for f in TOP_FIELDS) + cfg.num_layers * per_layer
    for got, want in zip(jax.tree.leaves(served[0]), jax.tree.leaves(fresh), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    some = {n: x for n, x in tensors.items() if ".mlp.experts.0." in n}  # one expert of each layer
    with pytest.raises(ModelLoadError, match="experts"):
        updater.update(some)
