"""Qwen3-MoE and Mixtral (mixture-of-experts MLPs) end to end against Hugging Face transformers.

Two tiny random models, each saved by transformers (per-expert tensors) and read back through
jaxserve's loader, serve every test here (one session fixture per family): a Qwen3-MoE (2 layers,
hidden 64, 8 experts of 32, top-2 weighted by the softmax over all 8 (norm_topk_prob False), head_dim
32 with q/k norms) and a Mixtral (2 layers, 4 experts of 128, top-2 renormalised, no window). Logits
of the research steps (prefill, decode; unrolled and scanned), a mixed ragged step and the dense
forward, greedy tokens through the engine (continuous batching, prefix caching), the fused-expert
checkpoint layout, int8 and int4 experts, and the experts tensor-parallel on a model axis of 4.

A prompt of T tokens makes 2T assignments: more than the experts in a prefill (the grouped
ragged_dot path) and at most the experts in a decode (each assignment's expert gathered), so both
paths of moe.moe_mlp meet HF's here. A router near-tie that flips an expert choice would move the
logits past 1e-4: `assert_logits_close` then accepts it only at a top-k gap below ROUTER_TIE, logged.
"""

import shutil

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

from jaxserve import steps
from jaxserve.loading.checkpoint import hf_tensors, load_hf_params, write_safetensors
from jaxserve.config import ModelConfig
from jaxserve.model.kv_cache import init_cache
from jaxserve.model.llama import forward_dense
from jaxserve.model.weights import unstack_layers

from hf_models import hf_greedy
from model_checks import check_greedy_through_engine, check_mixed_ragged_step_matches_hf, hf_logits, step_batch

PAGE = 8
FAMILIES = ["qwen3_moe", "mixtral"]
ROUTER_TIE = 1e-4  # gap between the k-th and (k+1)-th router probability below which a flip is excused


def _load(hf_model_dir, arch):
    path, model = hf_model_dir(arch)
    cfg = ModelConfig.from_dir(path)
    return path, model, cfg, load_hf_params(path, cfg, jnp.float32)


@pytest.fixture(scope="session")
def qwen3_moe(hf_model_dir):
    """(model dir, HF model, ModelConfig, params f32 loaded by jaxserve) of the tiny Qwen3-MoE."""
    return _load(hf_model_dir, "qwen3_moe")


@pytest.fixture(scope="session")
def mixtral(hf_model_dir):
    """(model dir, HF model, ModelConfig, params f32 loaded by jaxserve) of the tiny Mixtral."""
    return _load(hf_model_dir, "mixtral")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, request.getfixturevalue(request.param)


def router_gap(model, ids, top_k):
    """The smallest gap, over every token and layer of HF's forward on `ids`, between the k-th and
    the (k+1)-th router probability: how near a routing decision came to flipping."""
    inputs, hooks = [], []
    for layer in model.model.layers:
        hooks.append(layer.mlp.gate.register_forward_hook(lambda m, args, out: inputs.append((m, args[0]))))
    try:
        hf_logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    gaps = []
    with torch.no_grad():
        for module, x in inputs:
            probs = torch.softmax(x.reshape(-1, x.shape[-1]).double() @ module.weight.double().T, dim=-1)
            top = torch.topk(probs, top_k + 1, dim=-1).values
            gaps.append(float((top[:, top_k - 1] - top[:, top_k]).min()))
    return min(gaps)


def assert_logits_close(got, ref, model, ids, cfg, label, atol=1e-4):
    """Within atol of HF, or off only where a router near-tie (gap < ROUTER_TIE) may have flipped an expert."""
    err = float(np.abs(np.asarray(got) - ref).max())
    if err <= atol:
        return
    gap = router_gap(model, ids, cfg.num_experts_per_tok)
    assert gap < ROUTER_TIE, f"{label}: logits {err:.2e} from HF, smallest router top-k gap {gap:.2e}"
    print(f"{label}: logits {err:.2e} from HF at a router near-tie (top-k gap {gap:.2e}); accepted")


def test_config_and_weights(family):
    name, (path, model, cfg, params) = family
    want = {
        "qwen3_moe": ("Qwen3MoeForCausalLM", 8, 32, False, True),
        "mixtral": ("MixtralForCausalLM", 4, 128, True, False),
    }[name]
    assert (cfg.architecture, cfg.num_experts, cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.qk_norm) == want
    assert cfg.servable and cfg.num_experts_per_tok == 2 and cfg.dense_layers == () and cfg.sliding_window is None
    E, D, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    lp = params.layers
    assert lp.w_gate is None and lp.w_up is None and lp.w_down is None
    assert lp.router.shape == (2, D, E) and lp.expert_gate.shape == lp.expert_up.shape == (2, E, D, F)
    assert lp.expert_down.shape == (2, E, F, D)
    hf_mlp = model.model.layers[1].mlp
    gate_up = hf_mlp.experts.gate_up_proj.detach().numpy()  # f[E, 2F, D], gate half first
    np.testing.assert_array_equal(np.asarray(lp.expert_up[1, 3]), gate_up[3, F:].T)
    np.testing.assert_array_equal(np.asarray(lp.expert_down[1, 2]), hf_mlp.experts.down_proj.detach().numpy()[2].T)
    np.testing.assert_array_equal(np.asarray(lp.router[1]), hf_mlp.gate.weight.detach().numpy().T)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_prefill_decode_and_dense_logits_match_hf(family, scan):
    """A 19-token prompt prefilled (38 assignments: the grouped path), then 5 decodes (2 assignments:
    the gathered path), and the dense forward."""
    name, (_, model, cfg, params) = family
    prompt = np.random.RandomState(1).randint(0, cfg.vocab_size, size=19).tolist()
    continuation, _ = hf_greedy(model, prompt, 5)
    full = prompt + continuation
    ref = hf_logits(model, full)
    # measured: 9.3e-4 (Qwen3-MoE), 1.5e-3 (Mixtral): no routing decision near a flip
    print(f"{name}: smallest router top-k gap {router_gap(model, full, cfg.num_experts_per_tok):.1e}")
    pages = [3, 1, 4, 2][: -(-len(full) // PAGE)]  # out of order, page 0 unused
    cache = init_cache(cfg, num_pages=5, page_size=PAGE, dtype=jnp.float32)
    logits, cache = steps.prefill(
        params,
        cache,
        step_batch(prompt, 0, pages),
        cfg=cfg,
        options=steps.StepOptions(scan_layers=scan),
        all_logits=True,
    )
    assert_logits_close(logits[0, 0], ref[: len(prompt)], model, prompt, cfg, f"{name} prefill")
    for pos in range(len(prompt), len(full)):
        logits, cache = steps.decode(
            params, cache, step_batch([full[pos]], pos, pages), cfg=cfg, options=steps.StepOptions(scan_layers=scan)
        )
        assert_logits_close(logits[0, 0], ref[pos], model, full[: pos + 1], cfg, f"{name} decode {pos}")
    dense_params = params if scan else unstack_layers(params)  # stacked layers scan, a tuple unrolls
    dense = jax.jit(forward_dense, static_argnames="cfg")(dense_params, jnp.asarray([full], jnp.int32), cfg=cfg)
    assert_logits_close(dense[0], ref, model, full, cfg, f"{name} dense")


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_mixed_ragged_step_matches_hf(family, scan):
    """A ragged step of a chunk after cached history beside a decode (padding tokens routed too)
    gives HF's logits for both."""
    name, (_, model, cfg, params) = family
    check_mixed_ragged_step_matches_hf(
        cfg,
        params,
        model,
        scan,
        PAGE,
        lambda got, want, ids, label: assert_logits_close(got, want, model, ids, cfg, f"{name} {label}"),
    )


@pytest.fixture(scope="module")
def llm(family):
    from jaxserve import LLM

    # 8 usable pages: the first three prompts need 9 (their K/V: 30, 19, 16 tokens), so one is preempted.
    # Layers scanned: each step shape compiles one layer body.
    with LLM(
        family[1][0],
        dtype="float32",
        page_size=PAGE,
        num_pages=9,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        scan_layers=True,
        warm_up=False,
    ) as llm:
        yield llm


def test_greedy_through_the_engine_matches_hf(family, llm):
    """Greedy tokens through LLM.generate: three prompts batched together (the pool too small for all
    three, so one is preempted and recomputed), then two that share the first one's prefix (whole pages
    served from the prefix cache)."""
    name, (_, model, cfg, _) = family
    check_greedy_through_engine(llm, model, cfg.vocab_size, name, PAGE, (2 * PAGE + 3, PAGE, 5), expect_preemption=True)


def test_fused_expert_checkpoint_loads(family, tmp_path):
    """transformers 5's module layout (mlp.experts.gate_up_proj / down_proj fused over the experts, what
    `state_dict()` holds) loads to the same params as the per-expert files transformers writes, and
    `hf_tensors` gives back exactly the per-expert file."""
    from jaxserve.loading.checkpoint import iter_safetensors, safetensors_files

    _, (path, model, cfg, params) = family
    saved = dict(kv for f in safetensors_files(path) for kv in iter_safetensors(f))
    ours = hf_tensors(params, cfg)
    assert set(ours) == set(saved)
    for k, v in saved.items():
        np.testing.assert_array_equal(ours[k], v, err_msg=k)
    fused = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    write_safetensors(str(tmp_path / "model.safetensors"), fused)
    loaded = load_hf_params(str(tmp_path), cfg, jnp.float32)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_int8_experts_and_orbax(qwen3_moe, tmp_path):
    """int8 quantizes the experts (a scale per expert and output channel) and leaves the router float;
    the grouped (prefill) and gathered (decode-sized) paths both stay near the float model. An orbax
    round trip restores the experts onto a (1, 2) mesh, split on their hidden dimension."""
    from jaxserve.model import quant
    from jaxserve.config import EngineConfig
    from jaxserve.loading.model_loader import load_model
    from jaxserve.model.sharding import make_mesh

    path, _, cfg, params = qwen3_moe
    q8 = load_model(EngineConfig(model=path, dtype="float32", quantization="int8"), make_mesh((1, 1))).params
    lp = q8.layers
    assert isinstance(lp.expert_gate, quant.QuantArray) and lp.expert_gate.scales.shape == (2, 8, 1, 32)
    assert lp.router.dtype == jnp.float32 and lp.w_gate is None
    dense = jax.jit(forward_dense, static_argnames="cfg")
    for n in (13, 2):  # 26 assignments (grouped) and 4 (gathered: <= 8 experts)
        tokens = jnp.asarray(np.random.RandomState(6).randint(0, cfg.vocab_size, size=(1, n)), jnp.int32)
        ref = dense(params, tokens, cfg=cfg)
        err = float(jnp.abs(dense(q8, tokens, cfg=cfg) - ref).max())
        print(f"int8, {n} tokens: logits {err:.3f} from float (max {float(jnp.abs(ref).max()):.2f})")
        # int8 rounding, not a wrong model (measured 0.12 and 0.11, logits up to 8)
        assert err < 0.25 * float(jnp.abs(ref).max()), (n, err)

    from jaxserve.loading.orbax_checkpoint import save_params

    out = tmp_path / "orbax"
    shutil.copytree(path, out)
    save_params(str(out), params)
    restored = load_model(EngineConfig(model=str(out), dtype="float32"), make_mesh((1, 2))).params
    assert restored.layers.w_gate is None and tuple(restored.layers.expert_up.sharding.spec) == (
        None,
        None,
        None,
        "model",
    )
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_int4_experts(qwen3_moe):
    """int4 quantizes the experts too (a scale and bias per 32 input rows of each expert) as the loader
    reads them, stacked or per layer. The grouped (prefill: whole expert stack dequantized) and gathered
    (decode-sized: only the routed experts dequantized) paths give the logits of the dequantized
    weights, and stay near the float model."""
    from jaxserve.model import quant

    path, _, cfg, params = qwen3_moe
    q4 = load_hf_params(path, cfg, jnp.float32, quantization="int4")
    lp = q4.layers
    assert isinstance(lp.expert_gate, quant.Int4Array) and lp.expert_gate.group_size == 32
    assert lp.expert_gate.values.shape == (2, 8, 32, 32) and lp.expert_down.scales.shape == (2, 8, 1, 64)
    assert lp.router.dtype == jnp.float32
    per_layer = load_hf_params(path, cfg, jnp.float32, stacked=False, quantization="int4")
    for a, b in zip(jax.tree.leaves(per_layer.layers[1].expert_up), jax.tree.leaves(lp.expert_up)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[1])
    widened = jax.tree.map(lambda w: quant.dequantize_int4(w) if quant.is_quant(w) else w, q4, is_leaf=quant.is_quant)
    dense = jax.jit(forward_dense, static_argnames="cfg")
    for n in (13, 2):  # 26 assignments (grouped) and 4 (gathered: <= 8 experts)
        tokens = jnp.asarray(np.random.RandomState(6).randint(0, cfg.vocab_size, size=(1, n)), jnp.int32)
        got = dense(q4, tokens, cfg=cfg)
        np.testing.assert_allclose(np.asarray(got), np.asarray(dense(widened, tokens, cfg=cfg)), atol=1e-4, rtol=0)
        ref = dense(params, tokens, cfg=cfg)
        err = float(jnp.abs(got - ref).max())
        print(f"int4, {n} tokens: logits {err:.3f} from float (max {float(jnp.abs(ref).max()):.2f})")
        assert err < 0.4 * float(jnp.abs(ref).max()), (n, err)


def test_engine_serves_int4_experts(qwen3_moe):
    """Through LLM: the experts load as int4, the memory plan counts their bytes (equal to the arrays')
    and says so, and greedy generation runs."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.model import quant
    from jaxserve.model.weights import param_bytes

    path, _, cfg, _ = qwen3_moe
    with LLM(
        path,
        quantization="int4",
        dtype="float32",
        page_size=PAGE,
        max_model_len=32,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        scan_layers=True,
        warm_up=False,
    ) as llm:
        params = llm.runner.params
        assert isinstance(params.layers.expert_up, quant.Int4Array)
        assert llm.memory.param_bytes == param_bytes(params) == cfg.param_bytes(4, "int4")
        assert "int4 linear layers (experts included)" in llm.memory.describe()
        prompt = np.random.RandomState(0).randint(0, cfg.vocab_size, size=11).tolist()
        out = llm.generate(
            prompt_token_ids=[prompt, prompt[:5]],
            sampling_params=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
        )
        assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]


def test_experts_tensor_parallel_on_a_mesh(qwen3_moe):
    """On a model axis of 4 the experts split on their hidden dimension (sharding.logical_rules): the
    dense forward (a grouped and a gathered step) equals one device's, and no all-gather brings expert
    weights together (the MLP ends in an all-reduce of activations, as a dense one does)."""
    import re

    from jaxserve.model.sharding import make_mesh, make_shardings

    _, _, cfg, params = qwen3_moe
    shardings = make_shardings(cfg, make_mesh((1, 4)))
    assert tuple(shardings.params.layers.expert_gate.spec) == (None, None, None, "model")
    assert tuple(shardings.params.layers.expert_down.spec) == (None, None, "model", None)
    sharded = jax.device_put(params, shardings.params)
    dense = jax.jit(forward_dense, static_argnames="cfg")
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    for n in (13, 2):  # 26 assignments (grouped), 4 (gathered, <= experts)
        tokens = jnp.asarray(np.random.RandomState(9).randint(0, cfg.vocab_size, size=(1, n)), jnp.int32)
        np.testing.assert_allclose(
            np.asarray(dense(sharded, tokens, cfg=cfg)), np.asarray(dense(params, tokens, cfg=cfg)), atol=1e-4, rtol=0
        )  # sum order
        hlo = dense.lower(sharded, tokens, cfg=cfg).compile().as_text()
        gathered = [tuple(int(d) for d in m.split(",")) for m in re.findall(r"= \w+\[([\d,]+)\]\S* all-gather\(", hlo)]
        assert not [s for s in gathered if {D, F} <= set(s)], gathered
        assert "all-reduce(" in hlo
