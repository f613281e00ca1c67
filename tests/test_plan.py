"""The memory planner against hand-computed cases, the engine's own shardings, and its refusals."""

import math
import pathlib

import jax
import jax.numpy as jnp
import pytest

from jaxserve import plan as planner
from jaxserve.config import ModelConfig
from jaxserve.planning.devices import DEVICES, cpu_spec, get_device, spec_for_device_kind
from jaxserve.errors import ConfigError
from jaxserve.model.kv_cache import cache_shape
from jaxserve.model.weights import init_dummy_params
from jaxserve.planning import roofline
from jaxserve.planning.roofline import Target, make_plan
from jaxserve.planning.weight_bytes import param_bytes_per_device
from jaxserve.model.sharding import make_mesh, make_shardings

REPO = pathlib.Path(__file__).resolve().parent.parent
GiB = 2**30


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(REPO)  # the shipped configs name model directories relative to the repository


def model(name: str) -> ModelConfig:
    return ModelConfig.from_dir(str(REPO / "configs" / "models" / name))


def test_llama3_8b_kv_bytes_per_token():
    cfg = model("llama3-8b")
    assert cfg.num_params() == 8_030_261_248
    assert cfg.kv_bytes_per_token(2) == 2 * 2 * 128 * 8 * 32 == 128 * 1024  # 128 KiB in bf16
    plan = make_plan(cfg, Target.build(get_device("h100"), (1, 8)), dtype="bfloat16", context=8192)
    assert plan.kv_split == 8 and plan.kv_bytes_per_token_per_device == 16 * 1024
    assert plan.fits


def test_llama3_70b_int8_on_8_x_80gb():
    cfg = model("llama3-70b")
    target = Target.build(get_device("h100"), (1, 8), device_memory=80 * GiB)
    plan = make_plan(cfg, target, dtype="bfloat16", quantization="int8", context=8192, page_size=16)
    # By hand. V=128256, D=8192, F=28672, L=80, N=64, K=8, H=128, untied.
    per_layer_linear = 8192 * 128 * (2 * 64 + 2 * 8) + 3 * 8192 * 28672  # q, k, v, o; gate, up, down
    scales = 80 * per_layer_linear // 32  # one f32 scale per 32 input rows (the int8 default group)
    norms = 2 * 80 * 8192 + 8192
    embed_and_head = 2 * 128256 * 8192
    total = 80 * per_layer_linear * 1 + scales * 4 + (norms + embed_and_head) * 2
    assert plan.param_bytes_total == total == 81_212_751_872
    # Split 8 ways except the norms (group scales are split as their weight is).
    replicated = norms * 2
    assert plan.param_bytes_per_device == (total - replicated) // 8 + replicated == 10_153_902_080  # 9.46 GiB
    # KV: 320 KiB per token in bf16, split over the 8 devices by KV head -> 40 KiB.
    assert plan.kv_bytes_per_token_per_device == 2 * 2 * 128 * 8 * 80 // 8 == 40 * 1024
    # Largest batch at 8k: pages of 16 tokens in 0.9 x 80 GiB minus the parameters, less the padding page.
    pages = (int(0.9 * 80 * GiB) - 10_153_902_080) // (40 * 1024 * 16) - 1
    assert plan.pages_per_replica == pages == 102_470
    assert plan.max_batch == pages // (8192 // 16) == 200
    # Decode at batch 1 is bound by reading the parameters and one sequence's KV at 3.35 TB/s.
    one = plan.decode[0]
    assert one.batch == 1
    assert one.memory_s == pytest.approx((10_153_902_080 + 8192 * 40 * 1024) / 3.35e12)
    assert one.seconds >= one.memory_s and plan.fits


@pytest.mark.parametrize("kv,per_head", [("int8", 128 + 4), ("fp8", 128), ("fp8_e5m2", 128)])
def test_8bit_kv_cache_halves_kv_and_fits_more(kv, per_head):
    """int8: a byte per element + an f32 scale per head and token; float8: a byte per element (its
    scales are per layer)."""
    cfg = model("llama3-70b")
    target = Target.build(get_device("h100"), (1, 8))
    bf16 = make_plan(cfg, target, quantization="int8", context=8192)
    small = make_plan(cfg, target, quantization="int8", kv_cache_dtype=kv, context=8192)
    assert small.kv_bytes_per_token_per_device == 2 * per_head * 8 * 80 // 8
    assert small.max_batch > 1.9 * bf16.max_batch


def test_planner_names_the_fp8_cache(capsys):
    assert (
        planner.main(
            [
                "--model",
                "configs/models/llama3-70b",
                "--device",
                "h100",
                "--devices",
                "8",
                "--kv-cache-dtype",
                "fp8_e5m2",
                "--context",
                "8192",
            ]
        )
        == 0
    )
    assert "KV cache float8 e5m2 (+ f32 scales per layer)" in capsys.readouterr().out


def test_refuses_parameters_that_do_not_fit(capsys):
    code = planner.main(
        [
            "--model",
            "configs/models/llama3-70b",
            "--device",
            "h100",
            "--devices",
            "1",
            "--dtype",
            "bfloat16",
            "--context",
            "8192",
        ]
    )
    assert code == planner.EXIT_DOES_NOT_FIT
    err = capsys.readouterr().err
    # 70.55 B parameters x 2 bytes = 131.42 GiB against 0.9 x 80 GiB = 72 GiB usable.
    assert "does not fit" in err and "short by 59.42 GiB per device" in err


def test_refuses_a_batch_that_does_not_fit(capsys):
    code = planner.main(["--config", "configs/llama3-70b-tp8-int8.yaml", "--device", "h100", "--batch", "300"])
    assert code == planner.EXIT_DOES_NOT_FIT
    assert "at most 200 fit" in capsys.readouterr().err


def test_refuses_a_context_longer_than_the_cache():
    # SmolLM2-135M in bf16 on a 300 MiB device: 256.6 MiB of parameters leave 13.4 MiB of the 270 MiB
    # usable, and one 8192-token sequence needs 512 pages x 16 tokens x 22.5 KiB = 180 MiB.
    plan = make_plan(
        model("smollm2-135m"),
        Target.build(get_device("h100"), (1, 1), device_memory=300 * 2**20),
        dtype="bfloat16",
        context=8192,
    )
    assert not plan.fits and plan.max_batch == 0 and not plan.decode
    assert "one sequence of 8192 tokens needs 180.00 MiB of KV per device" in plan.problems[0]
    budget = int(0.9 * 300 * 2**20) - plan.param_bytes_per_device
    assert f"short by {roofline.fmt_bytes(513 * 16 * 23040 - budget)}" in plan.problems[0]


def test_model_axis_must_divide_the_heads():
    with pytest.raises(ConfigError, match="must divide the 9 query heads"):
        make_plan(model("smollm2-135m"), Target.build(get_device("h100"), (1, 2)))


@pytest.mark.parametrize("quantization,quantize_lm_head", [("none", False), ("int8", False), ("int8", True)])
@pytest.mark.parametrize("name", ["smollm2-135m", "llama3-8b"])
def test_one_device_holds_model_config_param_bytes(name, quantization, quantize_lm_head):
    cfg = model(name)
    assert param_bytes_per_device(cfg, 2, quantization, quantize_lm_head, 1) == cfg.param_bytes(
        2, quantization, quantize_lm_head
    )


# A tiny model with 4 query heads and 2 KV heads: on a model axis of 4 its KV heads are replicated.
TINY = ModelConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
)


@pytest.mark.parametrize("quantization,quantize_lm_head", [("none", False), ("int8", False), ("int8", True)])
@pytest.mark.parametrize("mesh_shape", [(1, 1), (1, 2), (1, 4), (2, 2)])
def test_bytes_per_device_match_the_engine_shardings(mesh_shape, quantization, quantize_lm_head):
    """What the planner says lands on a device is what the engine's shardings put there: shard shapes of
    the NamedShardings the engine allocates with, over the abstract (eval_shape) params; nothing compiles."""
    from jaxserve.config.model_config import default_group_size
    from jaxserve.model import quant

    group = default_group_size(TINY, quantization, mesh_shape[1])  # what the engine picks for this mesh

    def abstract_params():
        params = init_dummy_params(TINY, 0, jnp.float32)
        return quant.quantize_params(params, quantize_lm_head, "int8", group) if quantization == "int8" else params

    shapes = jax.tree.leaves(jax.eval_shape(abstract_params))
    shardings = make_shardings(
        TINY, make_mesh(mesh_shape), quantization=quantization, quantize_lm_head=quantize_lm_head
    )
    on_device = sum(
        x.dtype.itemsize * math.prod(sh.shard_shape(x.shape))
        for x, sh in zip(shapes, jax.tree.leaves(shardings.params), strict=True)
    )
    data, size = mesh_shape
    assert on_device == param_bytes_per_device(TINY, 4, quantization, quantize_lm_head, model_size=size)
    num_pages, page_size = 8, 4
    cache_on_device = 2 * 4 * math.prod(shardings.cache.shard_shape(cache_shape(TINY, num_pages, page_size, data)))
    kv_per_device = TINY.kv_bytes_per_token(4) // roofline.kv_split(TINY, size)
    assert cache_on_device == num_pages * page_size * kv_per_device
    assert roofline.kv_split(TINY, size) == (1 if size == 4 else size)


def test_roofline_functions_by_hand():
    assert roofline.ring_allreduce_seconds(1e6, 1, 1e9) == 0
    assert roofline.ring_allreduce_seconds(1e6, 8, 1e9) == pytest.approx(2 * 7 / 8 * 1e-3)
    # Two all-reduces of [B, D] per layer: 32 layers x 2 x ring(16 x 4096 x 2 bytes) over 8 devices.
    assert roofline.tp_allreduce_seconds(16, 4096, 2, 32, 8, 450e9) == pytest.approx(
        64 * 2 * 7 / 8 * 16 * 4096 * 2 / 450e9
    )
    assert roofline.matmul_flops(8e9, 4) == 6.4e10
    assert roofline.attention_flops(32, 128, 32, 2, 1000) == 4 * 32 * 128 * 32 * 2 * 1000
    assert roofline.step_seconds(2.0, 1.0, 0.5) == 2.5
    # $8 per device-hour on 8 devices at 1000 tokens/s: $64/h / 3.6 M tokens/h = $17.78 per M tokens.
    assert roofline.cost_per_million_tokens(8.0, 8, 1000.0) == pytest.approx(64 / 3.6)


def test_cost_override_scales_cost_only():
    cfg = model("llama3-8b")
    base = make_plan(cfg, Target.build(get_device("h100"), (1, 8)), context=4096, batch=32)
    cheap = make_plan(cfg, Target.build(get_device("h100"), (1, 8), cost_per_hour=2.0), context=4096, batch=32)
    assert [d.seconds for d in base.decode] == [d.seconds for d in cheap.decode]
    assert cheap.decode[-1].usd_per_million_tokens == pytest.approx(base.decode[-1].usd_per_million_tokens / 4)


def test_virtual_cpu_devices_share_the_host():
    spec = cpu_spec(bandwidth=40e9, peak_flops=200e9)  # given, so nothing is measured
    one, four = Target.build(spec, (1, 1)), Target.build(spec, (4, 1))
    assert four.bandwidth == one.bandwidth / 4 and four.memory_bytes == one.memory_bytes // 4
    plan = make_plan(model("smollm2-135m"), four, dtype="float32", context=1024)
    assert plan.fits and plan.decode[0].memory_s > 0


def test_device_table():
    assert {"tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "a100", "h100", "h200", "cpu"} <= set(DEVICES)
    for spec in DEVICES.values():
        assert spec.cost_per_hour > 0
    assert spec_for_device_kind("NVIDIA H100 80GB HBM3").name == "h100"
    assert spec_for_device_kind("TPU v5 lite").name == "tpu-v5e"
    assert spec_for_device_kind("TPU v5").name == "tpu-v5p"
    assert spec_for_device_kind("TPU v6 lite").name == "tpu-v6e"
    # Variants whose kind contains another's pattern: the table orders them, patterns match whole words.
    assert spec_for_device_kind("NVIDIA H100 PCIe").name == "h100-pcie"
    assert spec_for_device_kind("NVIDIA A100-SXM4-80GB").name == "a100"
    assert spec_for_device_kind("NVIDIA A100 80GB PCIe").name == "a100-pcie"
    assert spec_for_device_kind("NVIDIA A100-PCIE-40GB").name == "a100-40gb"
    assert spec_for_device_kind("NVIDIA L4").name == "l4" and spec_for_device_kind("NVIDIA L40S") is None
    with pytest.raises(ValueError, match="unknown device"):
        get_device("tpu-v9")


def test_cli_prints_the_plan(capsys):
    assert planner.main(["--config", "configs/llama3-70b-tp8-int8.yaml", "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert "9.46 GiB" in out and "40.00 KiB" in out and "200" in out and "$/M tokens" in out
    assert (
        planner.main(
            [
                "--model",
                "configs/models/llama3-8b",
                "--device",
                "tpu-v6e",
                "--devices",
                "4",
                "--context",
                "8192",
                "--json",
            ]
        )
        == 0
    )
    assert '"fits": true' in capsys.readouterr().out
    assert planner.main(["--model", "configs/models/llama3-8b", "--device", "nope"]) == 1
    assert "unknown device" in capsys.readouterr().err
    assert math.isfinite(Target.build(get_device("h100"), (1, 1)).bandwidth)


@pytest.mark.parametrize(
    "argv,mesh",
    [
        (["--model", "configs/models/smollm2-135m", "--device", "tpu-v5e", "--devices", "8"], "8,1"),  # 9 heads: DP
        (
            [
                "--model",
                "configs/models/llama3-70b",
                "--quantization",
                "int8",
                "--device",
                "tpu-v5e",
                "--devices",
                "8",
                "--context",
                "8192",
            ],
            "1,8",
        ),
        (["--model", "configs/models/llama3-70b", "--device", "tpu-v5e", "--devices", "8", "--context", "8192"], None),
    ],
)
def test_suggest_mesh(argv, mesh, capsys):
    code = planner.main(argv + ["--suggest-mesh"])
    out = capsys.readouterr().out
    if mesh is None:
        assert code == planner.EXIT_DOES_NOT_FIT and out == ""
    else:
        assert code == 0 and out.strip() == mesh


def test_readme_planner_commands_run(capsys):
    """The planner commands the README shows run as written (bar the bandwidth measurement)."""
    import shlex

    readme = (REPO / "README.md").read_text()
    commands = [
        line.split("python -m jaxserve.plan", 1)[1]
        for line in readme.splitlines()
        if line.startswith("python -m jaxserve.plan") and "--measure-bandwidth" not in line
    ]
    assert len(commands) >= 3
    for command in commands:
        assert planner.main(shlex.split(command)) == 0, command
    capsys.readouterr()
