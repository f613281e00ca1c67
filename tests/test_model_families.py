"""Qwen3, Gemma 3, Qwen3-MoE and Mixtral: read from their config.json, counted and planned, and served
(tests/model/test_qwen3.py, test_gemma3.py, test_moe_models.py); a Qwen3-MoE with dense layers among its
expert layers is planned but refused for serving. No weights: the shipped configs/models are shapes only."""

import json
import math
import pathlib
import shutil

import pytest

from jaxserve import plan as planner
from jaxserve.config.model_config import (
    PLAN_ONLY_ARCHITECTURES,
    PLANNABLE_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
)
from jaxserve.planning.devices import get_device
from jaxserve.errors import UnsupportedModelError
from jaxserve.planning.roofline import Target, make_plan
from jaxserve.planning.weight_bytes import EXPERT_WEIGHTS, experts_on_busiest_device, param_bytes_per_device

REPO = pathlib.Path(__file__).resolve().parent.parent
MODELS = REPO / "configs" / "models"
NEW = ("qwen3-8b", "gemma-3-12b", "qwen3-30b-a3b", "mixtral-8x7b")
# Published totals (model cards): (total, active) parameters; Gemma-3-12B's text tower only.
PUBLISHED = {
    "qwen3-8b": (8.2e9, 8.2e9),
    "gemma-3-12b": (11.8e9, 11.8e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "mixtral-8x7b": (46.7e9, 12.9e9),
}


def planned(name: str) -> ModelConfig:
    return ModelConfig.from_dir(str(MODELS / name), plan_only=True)


def hf_json(name: str) -> dict:
    return json.loads((MODELS / name / "config.json").read_text())


def test_architecture_lists_are_split():
    assert set(SUPPORTED_ARCHITECTURES).isdisjoint(PLAN_ONLY_ARCHITECTURES)
    assert set(PLANNABLE_ARCHITECTURES) == set(SUPPORTED_ARCHITECTURES) | set(PLAN_ONLY_ARCHITECTURES)


def test_qwen3_parses():
    cfg = planned("qwen3-8b")
    assert (cfg.architecture, cfg.qk_norm, cfg.qkv_bias, cfg.o_bias, cfg.hidden_act) == (
        "Qwen3ForCausalLM",
        True,
        False,
        False,
        "silu",
    )
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.rope_theta, cfg.rms_norm_eps) == (128, 32, 8, 1e6, 1e-6)
    assert cfg.sliding_window is None and not cfg.is_moe and not cfg.tie_word_embeddings


def test_gemma3_nested_text_config_parses():
    cfg = planned("gemma-3-12b")
    assert cfg.architecture == "Gemma3ForConditionalGeneration"
    # the checkpoint's text_config names 7 keys; the rest are Gemma3TextConfig's defaults
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (3840, 48, 16, 8, 256)
    assert (cfg.vocab_size, cfg.tie_word_embeddings, cfg.hidden_act) == (262208, True, "gelu_pytorch_tanh")
    assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (
        1024,
        1e6,
        1e4,
        256.0,
    )
    assert cfg.rope_scaling.kind == "linear" and cfg.rope_scaling.factor == 8.0
    assert cfg.scale_embeddings and cfg.sandwich_norms and cfg.qk_norm and cfg.norm_weight_offset == 1.0
    assert cfg.eos_token_ids == (1, 106) and cfg.bos_token_id == 2
    assert len(cfg.layer_types) == 48 and cfg.num_sliding_layers == 40
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17, 23, 29, 35, 41, 47]


def test_gemma3_flat_and_transformers5_forms_agree():
    nested = hf_json("gemma-3-12b")
    flat = {**nested["text_config"], "architectures": ["Gemma3ForCausalLM"], "eos_token_id": [1, 106]}
    a = ModelConfig.from_hf_dict(nested, plan_only=True)
    b = ModelConfig.from_hf_dict(flat, plan_only=True)
    assert a.num_params() == b.num_params() and a.layer_types == b.layer_types
    assert b.architecture == "Gemma3ForCausalLM"
    # transformers >= 5 writes explicit layer_types and rope_parameters per layer type
    v5 = {
        **flat,
        "layer_types": list(a.layer_types),
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }
    v5.pop("rope_scaling")
    c = ModelConfig.from_hf_dict(v5, plan_only=True)
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling, c.layer_types) == (
        a.rope_theta,
        a.rope_local_theta,
        a.rope_scaling,
        a.layer_types,
    )


def test_moe_families_parse():
    qwen = planned("qwen3-30b-a3b")
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size, qwen.norm_topk_prob) == (
        128,
        8,
        768,
        True,
    )
    assert qwen.qk_norm and qwen.dense_layers == () and qwen.num_moe_layers == 48
    mixtral = planned("mixtral-8x7b")
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 14336)
    assert mixtral.norm_topk_prob and not mixtral.qk_norm and mixtral.num_moe_layers == 32
    sparse = ModelConfig.from_hf_dict(
        {**hf_json("qwen3-30b-a3b"), "decoder_sparse_step": 2, "mlp_only_layers": [1]}, plan_only=True
    )
    assert set(sparse.dense_layers) == {*range(0, 48, 2), 1}  # (i + 1) % step != 0, or listed
    assert sparse.num_moe_layers == 23


def test_dense_configs_keep_their_defaults():
    """The fields added for the new families leave Llama/Mistral/Qwen2 configs as they were."""
    cfg = ModelConfig.from_dir(str(MODELS / "llama3-8b"))
    assert cfg.servable and not cfg.is_moe and not cfg.qk_norm and cfg.layer_types == () and cfg.hidden_act == "silu"
    assert cfg.active_params() == cfg.num_params() == 8_030_261_248
    assert cfg.param_bytes_read(64, 2) == cfg.param_bytes(2) and cfg.expected_experts_read(64) == 0.0
    assert cfg == ModelConfig.from_hf_dict(hf_json("llama3-8b"), plan_only=True)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_moe_families_are_served(name):
    cfg = ModelConfig.from_dir(str(MODELS / name))
    assert cfg.servable and cfg.is_moe and cfg == planned(name)


def test_dense_layers_among_experts_are_planned_not_served():
    hf = {**hf_json("qwen3-30b-a3b"), "mlp_only_layers": [3]}
    cfg = ModelConfig.from_hf_dict(hf, plan_only=True)
    assert cfg.dense_layers == (3,) and not cfg.servable
    with pytest.raises(UnsupportedModelError, match=r"dense MLP layers among the expert layers.*\[3\]"):
        ModelConfig.from_hf_dict(hf)
    # transformers >= 5 writes Qwen3-MoE's expert count as num_local_experts
    v5 = {k: v for k, v in hf_json("qwen3-30b-a3b").items() if k != "num_experts"}
    assert ModelConfig.from_hf_dict({**v5, "num_local_experts": 128}) == planned("qwen3-30b-a3b")


def test_qwen3_is_served():
    cfg = ModelConfig.from_dir(str(MODELS / "qwen3-8b"))
    assert cfg.servable and cfg.qk_norm and cfg == planned("qwen3-8b")


def test_gemma3_is_served():
    cfg = ModelConfig.from_dir(str(MODELS / "gemma-3-12b"))
    assert cfg.servable and cfg.sandwich_norms and cfg == planned("gemma-3-12b")
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_dict(
            {
                **hf_json("gemma-3-12b")["text_config"],
                "architectures": ["Gemma3ForCausalLM"],
                "use_bidirectional_attention": True,
            }
        )


def test_the_engine_refuses_an_unservable_model(hf_model_dir, tmp_path):
    from jaxserve import LLM

    path, _ = hf_model_dir("llama")
    dest = tmp_path / "model"
    shutil.copytree(path, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=2,
    )
    (dest / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="dense MLP layers among the expert layers"):
        LLM(str(dest), warm_up=False)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*is not supported; supported"):
        ModelConfig.from_hf_dict({**config, "architectures": ["GPT2LMHeadModel"]}, plan_only=True)


@pytest.mark.parametrize("name", NEW)
def test_parameter_counts_match_the_published_totals(name):
    cfg, (total, active) = planned(name), PUBLISHED[name]
    assert cfg.num_params() == pytest.approx(total, rel=0.01)
    assert cfg.active_params() == pytest.approx(active, rel=0.02)  # published to 2 digits: 3.3 B, 12.9 B


def test_parameter_counts_equal_transformers_meta_models():
    """transformers' own config classes and a model on the meta device (nothing allocated, no download)
    count exactly what ModelConfig counts; experts included, and the experts' share gives active_params."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for name in NEW + ("llama3-8b",):
        hf = hf_json(name)
        arch = hf["architectures"][0]
        if arch == "Gemma3ForConditionalGeneration":  # the text tower, as jaxserve counts it
            config, cls = transformers.Gemma3Config(**hf).text_config, transformers.Gemma3ForCausalLM
        else:
            config = transformers.AutoConfig.for_model(
                hf["model_type"], **{k: v for k, v in hf.items() if k != "model_type"}
            )
            cls = getattr(transformers, arch)
        with torch.device("meta"):
            model = cls(config)
        cfg = planned(name)
        named = dict(model.named_parameters())
        assert sum(p.numel() for p in named.values()) == cfg.num_params(), name
        experts = sum(p.numel() for n, p in named.items() if ".experts." in n)
        assert experts == cfg.num_moe_layers * cfg.num_experts * cfg.expert_params(), name
        if cfg.is_moe:
            unused = experts * (cfg.num_experts - cfg.num_experts_per_tok) // cfg.num_experts
            assert cfg.active_params() == cfg.num_params() - unused
        if arch == "Gemma3ForCausalLM" or name == "gemma-3-12b":
            assert list(config.layer_types) == list(cfg.layer_types)


def test_expected_experts_read():
    cfg = planned("qwen3-30b-a3b")
    assert cfg.expected_experts_read(1) == 8
    assert cfg.expected_experts_read(64) == pytest.approx(128 * (1 - (1 - 8 / 128) ** 64))
    assert 125 < cfg.expected_experts_read(64) < 128 and cfg.expected_experts_read(4096) == pytest.approx(128)
    per_expert = 3 * 2048 * 768 * 2
    assert cfg.expert_bytes_read(1, 2) == 48 * 8 * per_expert
    assert cfg.param_bytes_read(1, 2) == cfg.param_bytes(2) - 48 * 120 * per_expert
    assert cfg.param_bytes_read(10**6, 2) == pytest.approx(cfg.param_bytes(2))
    int8 = cfg.expert_bytes(2, "int8")
    assert int8 == 3 * 2048 * 768 + (2 * 768 + 2048) * 4


def test_planner_moe_decode_reads_topk_at_batch_1_and_nearly_all_at_large_batch():
    cfg = planned("mixtral-8x7b")
    target = Target.build(get_device("h100"), (1, 2))
    plan = make_plan(cfg, target, context=4096, batch=64)
    by_batch = {d.batch: d for d in plan.decode}
    expert = cfg.expert_bytes(2)
    # tensor-parallel over 2: each device holds half of every expert
    assert by_batch[1].experts_read == 2
    assert by_batch[1].weight_bytes == pytest.approx(plan.param_bytes_per_device - 32 * (8 - 2) * expert / 2)
    assert by_batch[64].experts_read == pytest.approx(8, abs=1e-3)
    assert by_batch[64].weight_bytes == pytest.approx(plan.param_bytes_per_device, rel=1e-6)
    assert by_batch[1].memory_s < 0.4 * by_batch[64].memory_s
    # compute counts only the routed experts: 2 · active matmul params per token
    assert by_batch[1].compute_s == pytest.approx(
        (2 * (cfg.active_params() - cfg.vocab_size * cfg.hidden_size) + 4 * 32 * 128 * 32 * 4096)
        / 2
        / target.peak_flops
    )
    # expert-parallel over 8: at batch 1 the busiest device reads one whole expert per layer (of k = 2)
    ep = make_plan(cfg, Target.build(get_device("h100"), (1, 8)), context=4096, batch=16, expert_parallel=True)
    tp = make_plan(cfg, Target.build(get_device("h100"), (1, 8)), context=4096, batch=16)
    assert ep.param_bytes_per_device == pytest.approx(tp.param_bytes_per_device, rel=1e-3)
    ep1, tp1 = ep.decode[0], tp.decode[0]
    assert ep1.batch == tp1.batch == 1
    assert ep1.weight_bytes - tp1.weight_bytes == pytest.approx(32 * (1 - 2 / 8) * expert, rel=1e-3)


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("size", [1, 2, 4, 8])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_per_device_bytes_split(name, size, expert_parallel):
    cfg = planned(name)
    for quantization in ("none", "int8"):
        per = param_bytes_per_device(cfg, 2, quantization, False, size, expert_parallel and cfg.is_moe)
        assert cfg.param_bytes(2, quantization) / size <= per <= cfg.param_bytes(2, quantization)
    if cfg.is_moe:
        experts = param_bytes_per_device(cfg, 2, "none", False, size, expert_parallel, only=EXPERT_WEIGHTS)
        assert experts == cfg.num_moe_layers * cfg.num_experts * cfg.expert_bytes(2) // size


@pytest.mark.parametrize("name", NEW)
def test_cli_plans_the_new_families(name, capsys):
    path = f"configs/models/{name}"
    cfg = planned(name)
    code = planner.main(["--model", str(REPO / path), "--device", "h100"])
    captured = capsys.readouterr()
    assert code == (0 if cfg.param_bytes(2) < 0.9 * 80 * 2**30 else planner.EXIT_DOES_NOT_FIT), captured.err
    assert f"{cfg.num_params() / 1e9:.2f} B parameters" in captured.out
    assert ("plans it but cannot serve it yet" in captured.out) == (not cfg.servable)
    if cfg.is_moe:
        assert f"{cfg.active_params() / 1e9:.2f} B active per token" in captured.out
    assert planner.main(["--model", str(REPO / path), "--device", "tpu-v5e"]) == planner.EXIT_DOES_NOT_FIT
    assert "the parameters alone need at least" in capsys.readouterr().out
    for device in ("h100", "tpu-v5e"):
        assert (
            planner.main(
                [
                    "--model",
                    str(REPO / path),
                    "--device",
                    device,
                    "--devices",
                    "8",
                    "--context",
                    "8192",
                    "--suggest-mesh",
                ]
            )
            == 0
        )
        captured = capsys.readouterr()
        data, model = map(int, captured.out.strip().split(","))
        assert data * model == 8
        assert ("experts: " in captured.err) == cfg.is_moe
        assert (
            planner.main(
                ["--model", str(REPO / path), "--device", device, "--devices", "8", "--context", "8192", "--json"]
            )
            == 0
        )
        out = json.loads(capsys.readouterr().out)
        assert out["active_params"] == cfg.active_params() and out["fits"]


def test_busiest_expert_parallel_device():
    cfg = planned("qwen3-30b-a3b")
    # batch 1: 8 experts over 8 devices of 16 land unevenly; the busiest reads ~2.5, not 1
    assert 2.2 < experts_on_busiest_device(cfg, 1, 8, True) < 2.8
    assert experts_on_busiest_device(cfg, 1, 8, False) == 8  # slices of each of the k experts
    assert experts_on_busiest_device(cfg, 4096, 8, True) == pytest.approx(16)
    mixtral = planned("mixtral-8x7b")
    assert experts_on_busiest_device(mixtral, 1, 8, True) == 1  # ceil(k / model): one whole expert


def test_suggest_mesh_weighs_expert_against_tensor_parallel(capsys):
    args = ["--device", "tpu-v5e", "--devices", "8", "--context", "8192", "--suggest-mesh"]
    assert planner.main(["--model", str(MODELS / "qwen3-30b-a3b")] + args) == 0
    captured = capsys.readouterr()  # 9 sequences fit per replica: uneven routing makes whole experts cost more
    assert captured.out.strip() == "1,8" and "experts: tensor-parallel" in captured.err
    assert "busiest device would read" in captured.err
    assert planner.main(["--model", str(MODELS / "mixtral-8x7b")] + args) == 0
    captured = capsys.readouterr()  # batch 16 reads ~7.9 of 8 experts: whole experts cost nothing more
    assert captured.out.strip() == "1,8" and "expert-parallel (1 whole expert(s) per device)" in captured.err
    # planned for batch 1, Mixtral's 2 of 8 experts: whole experts would leave the busiest device a whole one
    assert planner.main(["--model", str(MODELS / "mixtral-8x7b"), "--max-num-seqs", "1"] + args) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == "1,8" and "experts: tensor-parallel" in captured.err
    assert math.isfinite(Target.build(get_device("tpu-v5e"), (1, 8)).bandwidth)
