"""GGUF Q8_0 weights load straight into int8 (quant.QuantArray) when the group size is Q8_0's block (32):
the same weights and logits as the gguf library's dequantization of the file, with no float detour;
another group size requantizes them from the file's values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.loading.checkpoint import load_hf_params
from jaxserve.loading.model_source import resolve_model_path
from jaxserve.model import quant
from jaxserve.model.llama import forward_dense

from test_gguf_model import gguf_from_hf

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    head_dim=16,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("q8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXSERVE_CACHE", str(tmp / "cache"))
        path, _, held = gguf_from_hf(tmp, "qwen2", "Q8_0", **SMALL)  # tied embeddings: the table is Q8_0 too
        model_dir = resolve_model_path(path)
    return model_dir, ModelConfig.from_dir(model_dir), held


def test_q8_0_tensors_load_into_int8_groups_of_32_exactly(q8_model):
    model_dir, cfg, held = q8_model
    q8 = load_hf_params(
        model_dir, cfg, jnp.float32, stacked=False, quantization="int8", quantize_lm_head=True, group_size=32
    )
    layer = q8.layers[1]
    assert isinstance(layer.wq, quant.QuantArray) and layer.wq.group_size == 32
    assert layer.wq.scales.shape == (cfg.hidden_size // 32, cfg.num_heads * cfg.head_dim)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(layer.w_down)), held["blk.1.ffn_down.weight"].T)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(layer.wv)), held["blk.1.attn_v.weight"].T)
    # the tied table, quantized as the head [D, V]: its Q8_0 blocks run along D, the head's input rows
    np.testing.assert_array_equal(np.asarray(quant.dequantize(q8.embed)), held["token_embd.weight"].T)

    float_params = load_hf_params(model_dir, cfg, jnp.float32)
    stacked = load_hf_params(model_dir, cfg, jnp.float32, quantization="int8", quantize_lm_head=True, group_size=32)
    ids = jnp.asarray([np.random.RandomState(3).randint(0, cfg.vocab_size, 24).tolist()])
    forward = jax.jit(forward_dense, static_argnames="cfg")
    want = np.asarray(forward(float_params, ids, cfg=cfg))
    for kernel in ("reference", "xla_cpu"):
        got = forward(quant.with_kernel(stacked, kernel), ids, cfg=cfg)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0, err_msg=kernel)


@pytest.mark.parametrize("group", [64, 0])
def test_other_group_sizes_requantize_the_file(q8_model, group):
    """Groups of 64, or a scale per channel, cannot hold Q8_0's blocks: the file's values are quantized
    again, exactly as quantizing the float model read from the file would."""
    model_dir, cfg, _ = q8_model
    got = load_hf_params(model_dir, cfg, jnp.float32, quantization="int8", quantize_lm_head=True, group_size=group)
    want = quant.quantize_params(load_hf_params(model_dir, cfg, jnp.float32), True, "int8", group)
    assert got.layers.wq.group_size == group
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
