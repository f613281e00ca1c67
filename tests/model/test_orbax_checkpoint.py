"""The orbax checkpoint format: HF -> orbax -> HF round trip, restore onto a mesh, layout version check."""

import json
import os
import sys

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.model.llama import forward_dense
from jaxserve.loading.model_loader import load_model
from jaxserve.loading.orbax_checkpoint import MANIFEST
from jaxserve.model.sharding import make_mesh

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from convert_hf_to_orbax import convert  # noqa: E402
from export_orbax_to_hf import export  # noqa: E402

TOKENS = np.random.RandomState(5).randint(0, 64, size=(2, 13))


@pytest.fixture(scope="module")
def converted(hf_model_dir, tmp_path_factory):
    """(HF dir, HF model, orbax dir) for the tiny Qwen2 model (biases included), stored in bfloat16."""
    path, model = hf_model_dir("qwen2")
    out = tmp_path_factory.mktemp("orbax") / "ckpt"
    convert(path, str(out), dtype="bfloat16")
    return path, model, str(out)


def logits_of(model_dir, mesh_shape=(1, 1), stacked=True, **settings):
    loaded = load_model(EngineConfig(model=model_dir, dtype="float32", **settings), make_mesh(mesh_shape), stacked)
    fwd = jax.jit(forward_dense, static_argnames="cfg")
    return np.asarray(fwd(loaded.params, jnp.asarray(TOKENS % loaded.cfg.vocab_size), cfg=loaded.cfg)), loaded


def test_orbax_restores_what_was_saved_in_the_requested_dtype(converted):
    hf_dir, _, orbax_dir = converted
    ours, loaded = logits_of(orbax_dir)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(loaded.params))
    # The same weights rounded to bf16 on the safetensors path give the same logits.
    params_bf16 = load_model(EngineConfig(model=hf_dir, dtype="bfloat16"), make_mesh((1, 1))).params
    ref = forward_dense(
        jax.tree.map(lambda x: x.astype(jnp.float32), params_bf16),
        jnp.asarray(TOKENS % loaded.cfg.vocab_size),
        cfg=loaded.cfg,
    )
    np.testing.assert_allclose(ours, np.asarray(ref), atol=1e-5, rtol=0)


def test_restore_onto_a_mesh_gives_the_same_logits(converted):
    _, _, orbax_dir = converted
    single, _ = logits_of(orbax_dir)
    for shape, stacked in (((1, 2), True), ((1, 2), False), ((2, 2), False)):
        sharded, loaded = logits_of(orbax_dir, shape, stacked)
        leaf = jax.tree.leaves(loaded.params)[1]
        assert len(leaf.sharding.device_set) == shape[0] * shape[1]
        np.testing.assert_allclose(sharded, single, atol=2e-5, rtol=0)


def test_export_to_hf_loads_in_transformers_with_the_same_logits(converted, tmp_path):
    from transformers import AutoModelForCausalLM

    _, _, orbax_dir = converted
    ours, _ = logits_of(orbax_dir)
    hf_out = export(orbax_dir, str(tmp_path / "hf"), "float32")
    model = AutoModelForCausalLM.from_pretrained(str(hf_out), dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor(TOKENS % model.config.vocab_size)).logits.numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_a_different_layout_version_is_refused(converted, tmp_path):
    import shutil

    _, _, orbax_dir = converted
    copy = tmp_path / "copy"
    shutil.copytree(orbax_dir, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["layout_version"] = 999
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ModelLoadError, match="layout version 999"):
        load_model(EngineConfig(model=str(copy)), make_mesh((1, 1)))
    bare = tmp_path / "bare"  # a config.json alone, forced to load as orbax
    bare.mkdir()
    shutil.copy(copy / "config.json", bare / "config.json")
    with pytest.raises(ModelLoadError, match="jaxserve_checkpoint.json"):  # names the missing manifest
        load_model(EngineConfig(model=str(bare), load_format="orbax"), make_mesh((1, 1)))
