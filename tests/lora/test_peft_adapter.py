"""load_peft_adapter against PEFT itself: adapters PEFT saved on the tiny Llama load as PEFT's weights in
jaxserve's [in, out] orientation with the scaling folded into B, x @ A @ B is PEFT's own LoRA delta, and
every adapter jaxserve cannot serve exactly is refused with a message naming the problem and the path."""

import dataclasses
import json
import math
import os
import re
import shutil

import numpy as np
import pytest
import torch
from peft_adapters import ALL_MODULES, make_peft_adapter, peft_greedy, peft_layer
from safetensors.numpy import load_file, save_file

from jaxserve.config import ModelConfig
from jaxserve.errors import LoRAError
from jaxserve.lora.peft_adapter import LORA_MODULES, PeftAdapter, load_peft_adapter, lora_module_dims

WEIGHTS = "adapter_model.safetensors"
# name -> (LoraConfig fields, {module: (rank, scaling)} expected per targeted module)
ADAPTERS = {
    "qv_r4": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), {"q": (4, 2.0), "v": (4, 2.0)}),
    "all_r8_rslora": (
        dict(r=8, lora_alpha=16, target_modules=ALL_MODULES, use_rslora=True),
        {m: (8, 16 / math.sqrt(8)) for m in LORA_MODULES},
    ),
    # v_proj of rank 4 (padded to 8), q_proj of alpha 4, layer 1 only
    "patterns": (
        dict(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "v_proj", "down_proj"],
            rank_pattern={"v_proj": 4},
            alpha_pattern={"q_proj": 4},
            layers_to_transform=[1],
        ),
        {"q": (8, 0.5), "v": (4, 4.0), "down": (8, 2.0)},
    ),
}


@pytest.fixture(scope="module")
def base(hf_model_dir):
    """(ModelConfig, transformers model) of the tiny random Llama."""
    path, model = hf_model_dir("llama")
    return ModelConfig.from_dir(path), model


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """name -> (directory, PeftModel) of each of ADAPTERS, saved by PEFT."""
    out = {}
    for seed, (name, (options, _)) in enumerate(ADAPTERS.items()):
        path = str(tmp_path_factory.mktemp(name))
        out[name] = (path, make_peft_adapter(base[1], path, seed=seed, **options))
    return out


@pytest.mark.parametrize("name", ADAPTERS)
def test_loads_peft_weights_transposed_with_scaling_in_b(name, base, adapters):
    cfg, _ = base
    path, model = adapters[name]
    options, expected = ADAPTERS[name]
    adapter = load_peft_adapter(path, cfg, max_rank=8)
    rank = max(r for r, _ in expected.values())
    assert isinstance(adapter, PeftAdapter) and adapter.path == path and adapter.rank == rank
    assert adapter.target_modules == tuple(m for m in LORA_MODULES if m in expected) == tuple(adapter.modules)
    alpha, r = options["lora_alpha"], options["r"]
    assert adapter.scaling == pytest.approx(alpha / math.sqrt(r) if options.get("use_rslora") else alpha / r)
    layers = options.get("layers_to_transform", range(cfg.num_layers))
    for module, (r_m, scaling) in expected.items():
        d_in, d_out = lora_module_dims(cfg)[module]
        a, b = adapter.modules[module]
        assert a.shape == (cfg.num_layers, d_in, rank) and b.shape == (cfg.num_layers, rank, d_out)
        assert a.dtype == b.dtype == np.float32
        for layer in range(cfg.num_layers):
            if layer not in layers:
                assert not a[layer].any() and not b[layer].any()
                continue
            peft_module = peft_layer(model, layer, module)
            assert peft_module.scaling["default"] == pytest.approx(scaling)
            lora_a = peft_module.lora_A["default"].weight.detach().numpy()  # [r, in]
            lora_b = peft_module.lora_B["default"].weight.detach().numpy()  # [out, r]
            np.testing.assert_array_equal(a[layer, :, :r_m], lora_a.T)
            np.testing.assert_allclose(b[layer, :r_m], lora_b.T * scaling, rtol=1e-6)
            assert not a[layer, :, r_m:].any() and not b[layer, r_m:].any()  # the padding to the adapter's rank
    assert adapter.nbytes == sum(a.nbytes + b.nbytes for a, b in adapter.modules.values())


@pytest.mark.parametrize("name", ADAPTERS)
def test_x_a_b_is_pefts_lora_delta(name, base, adapters):
    """x @ A[l] @ B[l] against what PEFT's LoRA layer adds to its base layer's output: orientation and scaling."""
    cfg, _ = base
    path, model = adapters[name]
    adapter = load_peft_adapter(path, cfg, max_rank=8)
    rng = np.random.default_rng(0)
    for module, (a, b) in adapter.modules.items():
        for layer in range(cfg.num_layers):
            x = rng.normal(size=(5, a.shape[1])).astype(np.float32)
            peft_module = peft_layer(model, layer, module)
            with torch.no_grad():
                xt = torch.from_numpy(x)
                base_layer = getattr(peft_module, "base_layer", peft_module)  # untouched layers: plain Linear
                delta = (peft_module(xt) - base_layer(xt)).numpy()
            np.testing.assert_allclose(x @ a[layer] @ b[layer], delta, atol=2e-5, rtol=1e-4)


def test_adapter_moves_greedy_tokens_and_leaves_the_base_model_alone(base, adapters):
    _, hf = base
    prompt = [5, 17, 300, 42, 9, 77, 128, 3]
    before = [type(m).__name__ for m in hf.modules()]
    ours = peft_greedy(adapters["qv_r4"][1], prompt, 8)
    assert len(ours) == 8 and ours != peft_greedy(hf, prompt, 8)
    assert [type(m).__name__ for m in hf.modules()] == before  # no LoRA layers injected into the caller's model


def test_accepts_unprefixed_names_named_adapters_all_linear_and_bf16(base, adapters, tmp_path):
    cfg, _ = base
    src = adapters["all_r8_rslora"][0]
    want = load_peft_adapter(src, cfg, max_rank=8)
    tensors = load_file(os.path.join(src, WEIGHTS))
    renamed = {n.removeprefix("base_model.model.").replace(".weight", ".default.weight"): t for n, t in tensors.items()}
    path = _copy(src, tmp_path / "renamed", config={"target_modules": "all-linear"}, tensors=renamed)
    got = load_peft_adapter(path, cfg, max_rank=8)
    for m in LORA_MODULES:
        np.testing.assert_array_equal(got.modules[m][0], want.modules[m][0])
        np.testing.assert_array_equal(got.modules[m][1], want.modules[m][1])
    from safetensors.torch import save_file as save_torch

    bf16 = _copy(src, tmp_path / "bf16")
    save_torch({n: torch.from_numpy(t).bfloat16() for n, t in tensors.items()}, os.path.join(bf16, WEIGHTS))
    got = load_peft_adapter(bf16, cfg, max_rank=8)
    np.testing.assert_allclose(got.modules["q"][1], want.modules["q"][1], rtol=1e-2, atol=1e-3)


# ---- refusals ----


def _copy(src, dest, config=None, tensors=None) -> str:
    """A copy of adapter directory `src` at `dest`, its adapter_config.json updated with `config` and
    its tensors replaced by `tensors` (name -> array), when given."""
    shutil.copytree(src, dest)
    if config:
        with open(os.path.join(dest, "adapter_config.json")) as f:
            conf = json.load(f)
        with open(os.path.join(dest, "adapter_config.json"), "w") as f:
            json.dump({**conf, **config}, f)
    if tensors is not None:
        save_file(tensors, os.path.join(dest, WEIGHTS))
    return str(dest)


def _refused(path, cfg, message, max_rank=8):
    with pytest.raises(LoRAError, match=re.escape(str(path)) + ".*" + message):
        load_peft_adapter(str(path), cfg, max_rank=max_rank)


Q0_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q0_B = Q0_A.replace("lora_A", "lora_B")

CONFIG_REFUSALS = {
    "peft_type": ({"peft_type": "LOHA"}, "peft_type 'LOHA' is not LORA"),
    "dora": ({"use_dora": True}, r"DoRA adapters \(use_dora: true\) are not supported"),
    "fan_in_fan_out": ({"fan_in_fan_out": True}, r"fan_in_fan_out: true \(GPT-2's Conv1D layers\)"),
    "bias": ({"bias": "lora_only"}, "bias 'lora_only' is not supported"),
    "lora_bias": ({"lora_bias": True}, r"lora_bias: true \(a bias on lora_B\) is not supported"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, r"modules_to_save \['lm_head'\] is not supported"),
    "layer_replication": ({"layer_replication": [[0, 2]]}, r"layer_replication is not supported \(it repeats"),
    "embed_tokens": (
        {"target_modules": ["q_proj", "embed_tokens"]},
        r"target_modules \['embed_tokens'\] are not supported; jaxserve adapts only q_proj",
    ),
    "lm_head": ({"target_modules": ["lm_head", "q_proj", "v_proj"]}, r"target_modules \['lm_head'\] are not"),
    "mixtral_names": ({"target_modules": ["q_proj", "w1"]}, r"target_modules \['w1'\] are not supported"),
    "regex_lm_head": (
        {"target_modules": r".*(q_proj|v_proj|lm_head)"},
        r"target_modules '\.\*\(q_proj\|v_proj\|lm_head\)' also selects lm_head",
    ),
    "rank_pattern": ({"rank_pattern": {"q_proj": "four"}}, "rank_pattern must map module patterns to numbers"),
    "r": ({"r": 0}, "needs a positive integer r and a number lora_alpha, got r=0"),
}


@pytest.mark.parametrize("case", CONFIG_REFUSALS)
def test_refuses_config(case, base, adapters, tmp_path):
    config, message = CONFIG_REFUSALS[case]
    _refused(_copy(adapters["qv_r4"][0], tmp_path / "bad", config=config), base[0], message)


def test_refuses_missing_files(base, adapters, tmp_path):
    cfg = base[0]
    nowhere = str(tmp_path / "nowhere")
    with pytest.raises(LoRAError, match=f"LoRA adapter directory {re.escape(nowhere)} does not exist"):
        load_peft_adapter(nowhere, cfg, max_rank=8)
    no_config = _copy(adapters["qv_r4"][0], tmp_path / "no_config")
    os.remove(os.path.join(no_config, "adapter_config.json"))
    _refused(no_config, cfg, "has no adapter_config.json: not a PEFT adapter directory")
    pickle = _copy(adapters["qv_r4"][0], tmp_path / "pickle")
    os.rename(os.path.join(pickle, WEIGHTS), os.path.join(pickle, "adapter_model.bin"))
    _refused(pickle, cfg, r"holds only adapter_model.bin \(a pickle.*convert it to safetensors")
    os.remove(os.path.join(pickle, "adapter_model.bin"))
    _refused(pickle, cfg, "has no adapter_model.safetensors")
    with open(os.path.join(pickle, WEIGHTS), "wb") as f:
        f.write(b"\x05\x00")
    _refused(pickle, cfg, "adapter_model.safetensors is not a valid safetensors file")


def _edited(adapters, edit):
    tensors = dict(load_file(os.path.join(adapters["qv_r4"][0], WEIGHTS)))
    edit(tensors)
    return tensors


def _put(tensors):
    return lambda t: t.update(tensors)


def _zeros(*shape):
    return np.zeros(shape, np.float32)


def _move_to_layer_2(t):
    for name in (Q0_A, Q0_B):
        t[name.replace("layers.0", "layers.2")] = t.pop(name)


LAYER0 = "base_model.model.model.layers.0"
TENSOR_REFUSALS = {
    "lm_head": (
        _put(
            {
                "base_model.model.lm_head.lora_A.weight": _zeros(4, 64),
                "base_model.model.lm_head.lora_B.weight": _zeros(512, 4),
            }
        ),
        r"tensor base_model\.model\.lm_head\.lora_A\.weight adapts a module jaxserve cannot",
    ),
    "embeddings": (
        _put({"base_model.model.model.embed_tokens.lora_embedding_A": _zeros(4, 512)}),
        r"tensor base_model\.model\.model\.embed_tokens\.lora_embedding_A adapts a module",
    ),
    "wrong_block": (
        _put({f"{LAYER0}.mlp.q_proj.lora_A.weight": _zeros(4, 64)}),
        r"mlp\.q_proj\.lora_A\.weight adapts a module",
    ),
    "shape": (
        _put({Q0_A: _zeros(4, 48)}),
        rf"tensor {re.escape(Q0_A)} has shape \[4, 48\], but the base model and the adapter's rank need "
        r"\[4, 64\]",
    ),
    "rank_vs_config": (_put({Q0_B: _zeros(64, 2)}), rf"tensor {re.escape(Q0_B)} has shape \[64, 2\].* need \[64, 4\]"),
    "layer": (
        _move_to_layer_2,
        r"layers\.2\.self_attn\.q_proj\.lora_[AB]\.weight is for layer 2, but the base model has 2 layers "
        r"\(0\.\.1\)",
    ),
    "no_b": (lambda t: t.pop(Q0_B), rf"tensor {re.escape(Q0_A)} has no lora_B beside it"),
    "no_a": (lambda t: t.pop(Q0_A), rf"tensor {re.escape(Q0_B)} has no lora_A beside it"),
    "twice": (
        lambda t: t.update({Q0_A.replace(".weight", ".default.weight"): t[Q0_A]}),
        r"lora_A of model\.layers\.0\.self_attn\.q_proj is stored twice",
    ),
    "empty": (lambda t: t.clear(), "adapter_model.safetensors holds no lora_A / lora_B tensors"),
    "int": (
        lambda t: t.update({Q0_A: t[Q0_A].astype(np.int32)}),
        f"tensor {re.escape(Q0_A)} has dtype I32, not a float",
    ),
}


@pytest.mark.parametrize("case", TENSOR_REFUSALS)
def test_refuses_tensors(case, base, adapters, tmp_path):
    edit, message = TENSOR_REFUSALS[case]
    _refused(_copy(adapters["qv_r4"][0], tmp_path / "bad", tensors=_edited(adapters, edit)), base[0], message)


def test_refuses_a_rank_above_max_lora_rank(base, adapters):
    _refused(
        adapters["all_r8_rslora"][0],
        base[0],
        r"adapter rank 8 \(.*\) is above --max-lora-rank 4; start "
        r"the server with --max-lora-rank 8 or more",
        max_rank=4,
    )
    _refused(adapters["patterns"][0], base[0], "adapter rank 8", max_rank=4)
    assert load_peft_adapter(adapters["qv_r4"][0], base[0], max_rank=4).rank == 4


def test_refuses_mlp_targets_on_a_mixture_of_experts(base, adapters, tmp_path):
    moe = dataclasses.replace(
        base[0], architecture="Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    )
    message = r"the adapter targets the MLP \({}\) of a mixture-of-experts model \(Qwen3MoeForCausalLM, 4 experts\)"
    _refused(adapters["all_r8_rslora"][0], moe, message.format("down_proj, gate_proj, up_proj"))
    all_linear = _copy(adapters["all_r8_rslora"][0], tmp_path / "all_linear", config={"target_modules": "all-linear"})
    _refused(all_linear, moe, message.format(re.escape(f"{LAYER0}.mlp.down_proj.lora_A.weight")))
    expert = f"{LAYER0}.mlp.experts.1.gate_proj.lora_A.weight"
    tensors = _edited(adapters, _put({expert: _zeros(4, 64)}))
    experts = _copy(adapters["qv_r4"][0], tmp_path / "experts", tensors=tensors)
    _refused(experts, moe, message.format(re.escape(expert)))
    assert load_peft_adapter(adapters["qv_r4"][0], moe, max_rank=8).target_modules == ("q", "v")
