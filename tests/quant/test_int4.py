"""int4 weight-only quantization (quant.Int4Array): the packed layout, the error bound, the matmul paths
against the dequantized weight, the byte arithmetic, the sharded layout and the engine serving it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import ModelConfig
from jaxserve.model import quant
from jaxserve.model.sharding import make_mesh, make_shardings
from jaxserve.model.weights import init_dummy_params, param_bytes


def test_layout_and_round_trip_error_bound():
    w = jax.random.normal(jax.random.PRNGKey(0), (3, 128, 48)) * jnp.linspace(0.1, 4, 48)
    q = quant.quantize_int4(w, 32)
    assert q.values.shape == (3, 64, 48) and q.values.dtype == jnp.uint8
    assert q.scales.shape == q.biases.shape == (3, 4, 48) and q.shape == w.shape
    err = jnp.abs(quant.dequantize_int4(q) - w)
    bound = jnp.repeat(q.scales, 32, axis=-2) / 2 * (1 + 1e-5) + 1e-6
    assert bool((err <= bound).all())
    # row 2i is the low nibble, row 2i + 1 the high one; w = q * scale + bias per 32 rows
    codes = np.asarray(jnp.round((w - jnp.repeat(q.biases, 32, -2)) / jnp.repeat(q.scales, 32, -2))).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(q.values), codes[..., 0::2, :] | (codes[..., 1::2, :] << 4))


def test_constant_group_is_exact():
    w = jnp.full((64, 8), 0.25).at[32:].set(-3.0)
    np.testing.assert_array_equal(np.asarray(quant.dequantize_int4(quant.quantize_int4(w))), np.asarray(w))


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (64, 49152 // 64)])
def test_matmul_paths_equal_the_dequantized_weight(rows, shape):
    w = jax.random.normal(jax.random.PRNGKey(1), shape)
    q = quant.quantize_int4(w)
    x = jax.random.normal(jax.random.PRNGKey(2), (rows, shape[0]))
    want = np.asarray(jnp.matmul(x, quant.dequantize_int4(q), precision="highest"))
    for kernel in ("reference", "xla_cpu"):
        got = jax.jit(quant.matmul)(x, q.replace(kernel=kernel))
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-3, rtol=1e-4, err_msg=kernel)
    # decode rows loop over one group at a time; more rows dequantize the weight once
    assert quant._int4_chunk_rows(x, q) == (0 if rows > quant.CHUNK_MAX_ROWS else q.group_size // 2)


@pytest.mark.parametrize("rows", [1, 5])
def test_the_pallas_kernel_serves_quant_matmul(rows):
    """kernel="pallas_interpret": quant.matmul runs pallas_kernels.int4_matmul (the GPU kernel,
    interpreted), leading axes and all, and equals the dequantized weight's product."""
    w = jax.random.normal(jax.random.PRNGKey(3), (256, 192))
    q = quant.quantize_int4(w)
    x = jax.random.normal(jax.random.PRNGKey(4), (2, rows, 256))
    want = np.asarray(jnp.matmul(x, quant.dequantize_int4(q), precision="highest"))
    got = jax.jit(quant.matmul)(x, q.replace(kernel="pallas_interpret"))
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("lead,kernels", [((), ("reference", "xla_cpu", "pallas_interpret")), ((3,), ("reference",))])
def test_a_row_permutation_applies_to_the_activation(lead, kernels):
    """An act-order weight (GPTQ g_idx; `perm`: stored row j is the weight's row perm[j]) dequantizes
    to the weight in its own row order, and every matmul path equals x @ that weight (stacked perms
    batch with the stacked weight)."""
    k, n = 256, 96
    rng = np.random.RandomState(0)
    w = np.asarray(jax.random.normal(jax.random.PRNGKey(5), (*lead, k, n)))
    perm = np.stack([rng.permutation(k) for _ in range(int(np.prod(lead)))]).reshape(*lead, k).astype(np.int32)
    stored = quant.quantize_int4(jnp.asarray(np.take_along_axis(w, perm[..., None], axis=-2)), 32)
    q = stored.replace(perm=jnp.asarray(perm))
    deq = np.asarray(quant.dequantize_int4(q))
    np.testing.assert_array_equal(
        np.take_along_axis(deq, perm[..., None], axis=-2), np.asarray(quant.dequantize_int4(stored))
    )
    assert np.abs(deq - w).max() <= float(stored.scales.max()) / 2 * (1 + 1e-5)  # each row near its own weight
    x = jax.random.normal(jax.random.PRNGKey(6), (*lead, 3, k))
    want = np.asarray(jnp.matmul(x, deq, precision="highest"))
    for kernel in kernels:
        got = jax.jit(quant.matmul)(x, q.replace(kernel=kernel))
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-3, rtol=1e-4, err_msg=kernel)


def test_int4_axes_of_a_permuted_weight():
    axes = quant.int4_axes(("layers", "mlp", "embed"), permuted=True)
    assert axes.perm == ("layers", "mlp") and axes.values == axes.scales == ("layers", "mlp", "embed")
    assert quant.int4_axes(("embed", "heads")).perm is None


@pytest.mark.parametrize("tied,lm_head", [(True, False), (False, False), (False, True)])
def test_param_bytes_match_the_config_arithmetic(tied, lm_head):
    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=tied,
        qkv_bias=True,
    )
    params = jax.eval_shape(lambda: init_dummy_params(cfg, 0, jnp.float32))
    quantized = jax.eval_shape(lambda p: quant.quantize_params(p, lm_head, "int4"), params)
    assert isinstance(quantized.layers.wq, quant.Int4Array)
    assert param_bytes(quantized) == cfg.param_bytes(4, "int4", lm_head) < cfg.param_bytes(4, "int8", lm_head)


def test_sharded_layout_follows_the_weight():
    cfg = ModelConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
    )
    mesh = make_mesh((1, 2))
    sh = make_shardings(cfg, mesh, quantization="int4")
    assert isinstance(sh.params.layers.w_up, quant.Int4Array)
    assert sh.params.layers.w_up.scales.spec == sh.params.layers.w_up.values.spec  # column-parallel
    assert sh.params.layers.w_down.biases.spec == sh.params.layers.w_down.values.spec  # row-parallel
    params = jax.jit(lambda: quant.quantize_params(init_dummy_params(cfg, 0, jnp.float32), quantization="int4"))()
    placed = jax.device_put(params, sh.params)
    assert placed.layers.w_down.values.addressable_shards[0].data.shape[-2] == cfg.intermediate_size // 4


def test_engine_serves_int4_weights(hf_model_dir):
    path, _ = hf_model_dir("llama")
    kw = dict(dtype="float32", page_size=8, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16)
    llm = LLM(path, quantization="int4", **kw)
    params, cfg = llm.runner.params, llm.model_config
    assert isinstance(params.layers[0].wq, quant.Int4Array) and params.embed.dtype == jnp.float32
    assert llm.memory.param_bytes == param_bytes(params) == cfg.param_bytes(4, "int4")
    assert "int4 dense linear layers" in llm.memory.describe()
    prompt = np.random.RandomState(0).randint(0, cfg.vocab_size, size=11).tolist()
    out = llm.generate(
        prompt_token_ids=[prompt, prompt[:5]],
        sampling_params=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
    )
    assert [len(o.outputs[0].token_ids) for o in out] == [8, 8]


def _dequantized(params):
    deq = jax.tree.map(
        lambda x: (
            (quant.dequantize_int4(x) if isinstance(x, quant.Int4Array) else quant.dequantize(x))
            if quant.is_quant(x)
            else x
        ),
        params,
        is_leaf=quant.is_quant,
    )
    return deq.replace(embed=deq.embed.T) if params.lm_head is None and quant.is_quant(params.embed) else deq


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_tied_table_quantized_as_the_head(quantization):
    """quantize_lm_head on a tied model quantizes the embedding table as the head [D, V]: the logits (head
    and gathered rows) are the dequantized model's, on every matmul path; the bytes are the config's."""
    from jaxserve.model.llama import forward_dense
    from jaxserve.planning.weight_bytes import param_bytes_per_device

    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    params = init_dummy_params(cfg, 0, jnp.float32)
    params = params.replace(embed=params.embed * 20)  # a spread of logits
    q = quant.quantize_params(params, True, quantization)
    assert quant.is_quant(q.embed) and q.embed.shape == (64, 96) and q.lm_head is None
    assert (
        param_bytes(q) == cfg.param_bytes(4, quantization, True) == param_bytes_per_device(cfg, 4, quantization, True)
    )
    ids = jnp.asarray([[1, 5, 7, 90, 3, 3, 2]])
    want = np.asarray(forward_dense(_dequantized(q), ids, cfg=cfg))
    for kernel in ("reference", "xla_cpu"):
        got = forward_dense(quant.with_kernel(q, kernel), ids, cfg=cfg)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0, err_msg=kernel)


@pytest.mark.parametrize(
    "quantized", [dict(quantization="int4"), dict(quantization="int8", activation_quantization="int8")]
)
def test_quantized_engine_compiles_nothing_after_warm_up(hf_model_dir, quantized):
    """As tests/test_compilation.py for float32: the same executables (one per bucket), and a varied
    workload afterwards compiles nothing, with int4 weights (or W8A8) and a quantized tied head."""
    from jaxserve.runner.compilation import CompileCounter

    path, _ = hf_model_dir("llama")
    kw = dict(
        dtype="float32",
        page_size=8,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        compilation_cache_dir="none",
    )
    llm = LLM(path, quantize_lm_head=True, **quantized, **kw)
    assert len(llm.runner.step_shapes()) == len(llm.runner.table.executables)
    before = CompileCounter.requests
    rng = np.random.RandomState(0)
    for batch in (1, 3, 4, 2):
        prompts = [rng.randint(0, 512, size=rng.randint(1, 40)).tolist() for _ in range(batch)]
        params = [
            SamplingParams(max_tokens=int(rng.randint(1, 20)), temperature=float(rng.choice([0, 0.8])))
            for _ in range(batch)
        ]
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert CompileCounter.requests == before and llm.runner.unplanned_compiles == 0
    shapes = len(llm.runner.step_shapes())
    llm.close()
    float_llm = LLM(path, **kw)
    assert len(float_llm.runner.step_shapes()) == shapes  # quantization adds no executable
    float_llm.close()


def test_moe_param_bytes_count_int4_experts():
    """int4 covers the experts (groups along each expert's input rows): the arrays' bytes are
    ModelConfig's, which the planner checks its per-device count against."""
    from jaxserve.planning.weight_bytes import param_bytes_per_device

    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=0,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    params = jax.eval_shape(lambda: init_dummy_params(cfg, 0, jnp.float32))
    quantized = jax.eval_shape(lambda p: quant.quantize_params(p, quantization="int4"), params)
    assert isinstance(quantized.layers.expert_down, quant.Int4Array)
    assert quantized.layers.expert_down.scales.shape == (2, 4, 1, 64)  # 32 rows of each expert: one group
    assert param_bytes(quantized) == cfg.param_bytes(4, "int4") < cfg.param_bytes(4, "int8")
    assert param_bytes_per_device(cfg, 4, "int4", model_size=1) == cfg.param_bytes(4, "int4")
    assert cfg.expert_bytes(4, "int4") == cfg.expert_params() // 2 + cfg.expert_params() // 32 * 8  # groups of 32
