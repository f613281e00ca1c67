"""Mixture of experts on a (1, 4) mesh of virtual CPU devices, expert- and tensor-parallel, against one device.

The tiny Qwen3-MoE (8 experts: 2 whole experts per device when expert-parallel) and Mixtral (4: one
per device) of tests/hf_models.py, built once per session by `hf_model_dir`. Checked: the paged
steps (a 19-token prefill: the grouped path; decodes: the gathered path) and the dense forward give
one device's logits; expert parallelism's lowered program holds only each device's experts, computes
them with a ragged_dot over those experts alone, gathers no expert weights and ends in one psum
(all-reduce) of the tokens' partial outputs; int8 experts expert-parallel; greedy tokens through the
engine (LLM with mesh_shape (1, 4)) in both modes equal one device's.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import steps
from jaxserve.model import quant
from jaxserve.loading.checkpoint import load_hf_params
from jaxserve.config import ModelConfig
from jaxserve.errors import ConfigError
from jaxserve.model.kv_cache import init_cache
from jaxserve.model.llama import forward_dense
from jaxserve.model.sharding import ExpertParallel, make_mesh, make_shardings

from model_checks import step_batch

PAGE = 8
MODES = ["tensor", "expert"]
FAMILIES = ["qwen3_moe", "mixtral"]
# Tensor parallelism of the dense forward is tests/model/test_moe_models.py's; the paged steps and the
# engine run both modes on Qwen3-MoE (two experts per device) and expert-parallel on Mixtral too.
PAGED = [("qwen3_moe", "tensor"), ("qwen3_moe", "expert"), ("mixtral", "expert")]


@pytest.fixture(scope="module")
def models(hf_model_dir):
    """name -> (name, model dir, ModelConfig, params f32 on one device), each loaded once."""
    loaded = {}

    def get(name):
        if name not in loaded:
            path, _ = hf_model_dir(name)
            cfg = ModelConfig.from_dir(path)
            loaded[name] = (name, path, cfg, load_hf_params(path, cfg, jnp.float32))
        return loaded[name]

    return get


@pytest.fixture(scope="module")
def mesh():
    assert len(jax.devices()) >= 4
    return make_mesh((1, 4))


def _paged_logits(params, cfg, options, prompt, decodes):
    """Logits of a prefill of `prompt` (all its positions) and of each decode token after it."""
    pages = [3, 1, 4, 2]
    cache = init_cache(cfg, num_pages=5, page_size=PAGE, dtype=jnp.float32)
    if options.mesh is not None:
        cache = jax.device_put(cache, jax.sharding.NamedSharding(options.mesh, jax.sharding.PartitionSpec()))
    logits, cache = steps.prefill(
        params, cache, step_batch(prompt, 0, pages), cfg=cfg, options=options, all_logits=True
    )
    out = [logits[0, 0]]
    for i, token in enumerate(decodes):
        logits, cache = steps.decode(
            params, cache, step_batch([token], len(prompt) + i, pages), cfg=cfg, options=options
        )
        out.append(logits[0, 0])
    return out


@pytest.mark.parametrize("name, mode", PAGED)
def test_paged_steps_on_a_mesh_equal_one_device(models, mesh, name, mode):
    """A 19-token prefill (all its logits) and 3 decodes through steps.prefill / steps.decode (the
    replica vmap, layers scanned) on the mesh equal one device's."""
    _, _, cfg, params = models(name)
    rng = np.random.RandomState(1)
    prompt, decodes = rng.randint(0, cfg.vocab_size, 19).tolist(), rng.randint(0, cfg.vocab_size, 3).tolist()
    want = _paged_logits(params, cfg, steps.StepOptions(scan_layers=True), prompt, decodes)
    shardings = make_shardings(cfg, mesh, moe_parallelism=mode)
    options = steps.StepOptions(scan_layers=True, mesh=mesh, moe_parallelism=mode)
    got = _paged_logits(jax.device_put(params, shardings.params), cfg, options, prompt, decodes)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=0, err_msg=f"{name} {mode} {i}")
    assert [int(np.argmax(g[-1] if g.ndim > 1 else g)) for g in got] == [
        int(np.argmax(w[-1] if w.ndim > 1 else w)) for w in want
    ]


def _ragged_dots(closed_jaxpr, inside=()):
    """(rhs shape, enclosing primitives) of every ragged_dot in a jaxpr, nested ones included."""
    for eqn in getattr(closed_jaxpr, "jaxpr", closed_jaxpr).eqns:
        if eqn.primitive.name.startswith("ragged_dot"):
            yield eqn.invars[1].aval.shape, inside
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
                    yield from _ragged_dots(sub, inside + (eqn.primitive.name,))


def _collectives(hlo: str, op: str) -> list[tuple[int, ...]]:
    """The result shapes of every `op` (all-gather, all-reduce, all-to-all) in compiled HLO text."""
    return [tuple(int(d) for d in m.split(",") if d) for m in re.findall(rf"= \w+\[([\d,]*)\]\S* {op}\(", hlo)]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("tokens", [13, 1])  # 26 assignments (grouped), 2 (gathered when <= the local experts)
def test_expert_parallel_program(models, mesh, name, tokens):
    """The dense forward expert-parallel equals one device's, and its program is expert-parallel: each
    device's parameters are its own E/4 whole experts (no weight of all E), no all-gather brings expert
    weights (or anything) together, the grouped matmul runs on the local experts only, and the MoE
    layer's one collective is the psum (all-reduce) of the [T, D] partial outputs over the model axis."""
    _, _, cfg, params = models(name)
    E, D, F, L = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_layers
    here = E // 4
    sharded = jax.device_put(params, make_shardings(cfg, mesh, moe_parallelism="expert").params)
    assert sharded.layers.expert_gate.addressable_shards[0].data.shape == (L, here, D, F)
    ep = ExpertParallel(cfg, mesh)
    ids = jnp.asarray(np.random.RandomState(9).randint(0, cfg.vocab_size, size=(1, tokens)), jnp.int32)
    dense = jax.jit(forward_dense, static_argnames=("cfg", "expert_parallel"))
    np.testing.assert_allclose(
        np.asarray(dense(sharded, ids, cfg=cfg, expert_parallel=ep)),
        np.asarray(dense(params, ids, cfg=cfg)),
        atol=1e-4,
        rtol=0,
    )

    jaxpr = jax.make_jaxpr(lambda p, t: forward_dense(p, t, cfg=cfg, expert_parallel=ep))(sharded, ids)
    assert "shard_map" in str(jaxpr)
    grouped = list(_ragged_dots(jaxpr))
    if tokens * cfg.num_experts_per_tok > here:  # the grouped path: 3 ragged_dots on this device's experts
        assert sorted(shape for shape, _ in grouped) == sorted([(here, D, F), (here, D, F), (here, F, D)]), grouped
        assert all("shard_map" in inside for _, inside in grouped), grouped
    else:  # each assignment gathers its expert among the local ones
        assert grouped == []
    hlo = dense.lower(sharded, ids, cfg=cfg, expert_parallel=ep).compile().as_text()
    entry = hlo[hlo.index("ENTRY") :]
    weight_params = [tuple(int(d) for d in s.split(",")) for s in re.findall(r"f32\[([\d,]+)\]\S* parameter\(", entry)]
    assert (L, here, D, F) in weight_params and (L, E, D, F) not in weight_params, weight_params
    assert _collectives(hlo, "all-gather") == [], f"{name}: an all-gather in the expert-parallel program"
    assert (tokens, D) in _collectives(hlo, "all-reduce"), _collectives(hlo, "all-reduce")  # the experts' psum


def _assert_expert_parallel_matches_one_device(cfg, mesh, sharded, params) -> None:
    """Expert-parallel logits of `sharded` equal one device's of `params`: a grouped (13 tokens) and a
    gathered (1 token) step."""
    dense = jax.jit(forward_dense, static_argnames=("cfg", "expert_parallel"))
    ep = ExpertParallel(cfg, mesh)
    for n in (13, 1):
        ids = jnp.asarray(np.random.RandomState(6).randint(0, cfg.vocab_size, size=(1, n)), jnp.int32)
        np.testing.assert_allclose(
            np.asarray(dense(sharded, ids, cfg=cfg, expert_parallel=ep)),
            np.asarray(dense(params, ids, cfg=cfg)),
            atol=1e-4,
            rtol=0,
        )


def test_int8_experts_expert_parallel(models, mesh):
    """int8 experts (values and per-expert scales split on the expert axis) expert-parallel give one
    device's int8 logits, on the grouped and the gathered paths."""
    _, _, cfg, params = models("qwen3_moe")
    q8 = quant.quantize_params(params)
    shardings = make_shardings(cfg, mesh, quantization="int8", moe_parallelism="expert")
    assert tuple(shardings.params.layers.expert_gate.scales.spec) == (None, "model", None, None)  # [L, E, 1, out]
    _assert_expert_parallel_matches_one_device(cfg, mesh, jax.device_put(q8, shardings.params), q8)


def test_int4_experts_expert_parallel(models, mesh):
    """int4 experts (packed values, group scales and biases, each split on the expert axis as the
    values are) expert-parallel give one device's int4 logits, on the grouped and the gathered paths,
    and each device holds only its experts' bytes."""
    _, _, cfg, params = models("qwen3_moe")
    q4 = quant.quantize_params(params, quantization="int4")
    assert isinstance(q4.layers.expert_gate, quant.Int4Array)
    shardings = make_shardings(cfg, mesh, quantization="int4", moe_parallelism="expert")
    gate = shardings.params.layers.expert_gate
    assert tuple(gate.values.spec) == tuple(gate.scales.spec) == tuple(gate.biases.spec) == (None, "model", None, None)
    sharded = jax.device_put(q4, shardings.params)
    here = cfg.num_experts // mesh.shape["model"]
    assert sharded.layers.expert_down.biases.addressable_shards[0].data.shape[1] == here
    _assert_expert_parallel_matches_one_device(cfg, mesh, sharded, q4)


def test_expert_parallel_needs_the_model_axis_to_divide_the_experts(models):
    from jaxserve.model.sharding import logical_rules

    _, _, cfg, _ = models("mixtral")
    with pytest.raises(ConfigError, match="must divide the 4 experts"):
        logical_rules(cfg, 8, "expert")
    assert logical_rules(cfg, 4, "tensor")["experts"] is None


# ---------------------------------------------------------------- through the engine
SETTINGS = dict(
    dtype="float32",
    page_size=PAGE,
    max_model_len=64,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    scan_layers=True,
    warm_up=False,
)


def _engine_tokens(path, **settings):
    from jaxserve import LLM, SamplingParams

    prompts = [np.random.RandomState(20 + i).randint(0, 256, size=n).tolist() for i, n in enumerate((19, 6, 11))]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(path, **SETTINGS, **settings) as llm:
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
        layout = llm.runner.params.layers.expert_gate.addressable_shards[0].data.shape  # [L, E_here, D, F_here]
        return [o.outputs[0].token_ids for o in outputs], layout, llm.runner.options.moe_parallelism


@pytest.fixture(scope="module")
def qwen3_moe_one_device_tokens(models):
    return _engine_tokens(models("qwen3_moe")[1])[0]


@pytest.mark.parametrize("mode", MODES)
def test_greedy_through_the_engine_on_a_mesh(models, qwen3_moe_one_device_tokens, mode):
    """Three prompts batched (19, 6 and 11 tokens: prefill chunks and decodes in the same steps), 8
    greedy tokens each, on the (1, 4) mesh: the same tokens as one device, the experts laid out as
    the mode says (per device: all 8 experts at a quarter of their hidden size, or 2 whole experts)."""
    _, path, cfg, _ = models("qwen3_moe")
    tokens, layout, options_mode = _engine_tokens(path, mesh_shape=(1, 4), moe_parallelism=mode)
    assert options_mode == mode
    E, F = cfg.num_experts, cfg.moe_intermediate_size
    assert layout[1:] == ((E // 4, cfg.hidden_size, F) if mode == "expert" else (E, cfg.hidden_size, F // 4))
    assert tokens == qwen3_moe_one_device_tokens
