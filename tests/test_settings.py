"""The one settings schema: Python keywords, YAML keys and CLI flags round-trip to the same config."""

import pytest
import yaml

from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError

CUSTOM = dict(
    model="/models/x",
    tokenizer="/tok",
    dtype="bfloat16",
    load_format="dummy",
    seed=7,
    page_size=32,
    kv_cache_memory="4GiB",
    max_model_len=4096,
    max_num_seqs=64,
    max_num_batched_tokens=1024,
    mesh_shape=[2, 4],
    scan_layers=True,
    attention_backend="reference",
)


def test_keywords_yaml_and_cli_round_trip(tmp_path):
    cfg = EngineConfig(**CUSTOM)
    assert cfg.kv_cache_memory == 4 * 2**30 and cfg.mesh_shape == (2, 4)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert EngineConfig.from_yaml(str(path)) == cfg
    assert (
        EngineConfig.from_cli(
            [
                "--model",
                "/models/x",
                "--tokenizer",
                "/tok",
                "--dtype",
                "bfloat16",
                "--load-format",
                "dummy",
                "--seed",
                "7",
                "--page-size",
                "32",
                "--kv-cache-memory",
                "4GiB",
                "--max-model-len",
                "4096",
                "--max-num-seqs",
                "64",
                "--max-num-batched-tokens",
                "1024",
                "--mesh-shape",
                "2,4",
                "--scan-layers",
                "--attention-backend",
                "reference",
            ]
        )
        == cfg
    )
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg


def test_cli_flags_override_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("page_size: 8\nmesh_shape: [1, 4]\nmax_num_seqs: 3\n")
    cfg = EngineConfig.from_cli(["--config", str(path), "--page-size", "64", "--scan-layers", "false"])
    assert (cfg.page_size, cfg.mesh_shape, cfg.max_num_seqs, cfg.scan_layers) == (64, (1, 4), 3, False)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"pages_size": 8}, "unknown setting"),
        ({"page_size": 12}, "power of two"),
        ({"mesh_shape": "1,2,3"}, "two positive sizes"),
        ({"kv_cache_memory": "4 parsecs"}, "cannot read"),
        ({"num_pages": 10, "kv_cache_memory": "1GiB"}, "not both"),
        ({"load_format": "dummy"}, "needs model"),
        ({"dtype": "float8"}, "not one of"),
        ({"max_num_seqs": 0}, "at least 1"),
        ({"max_num_seqs": "many"}, "expected an integer"),
    ],
)
def test_bad_settings_name_the_problem(values, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_dict(values)


def test_yaml_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("page_sise: 8\n")
    with pytest.raises(ConfigError, match="bad.yaml.*page_sise"):
        EngineConfig.from_yaml(str(path))
    with pytest.raises(ConfigError, match="does not exist"):
        EngineConfig.from_yaml(str(tmp_path / "missing.yaml"))


def test_boolean_flags_bare_negated_or_with_a_value():
    cfg = EngineConfig.from_cli(["--no-enable-prefix-caching", "--enable-prompt-logprobs", "--scan-layers", "true"])
    assert (cfg.enable_prefix_caching, cfg.enable_prompt_logprobs, cfg.scan_layers) == (False, True, True)
    cfg = EngineConfig.from_cli(["--enable-prefix-caching", "false", "--no-scan-layers", "--quantize-lm-head"])
    assert (cfg.enable_prefix_caching, cfg.scan_layers, cfg.quantize_lm_head) == (False, False, True)
    assert EngineConfig.from_cli(["--scan-layers", "none"]).scan_layers is None  # back to the backend's default
    # the explicit values, as YAML prints them, are accepted too
    cfg = EngineConfig(enable_prefix_caching=False, enable_prompt_logprobs=True)
    assert EngineConfig.from_cli(["--enable-prefix-caching", "False", "--enable-prompt-logprobs", "True"]) == cfg


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
        (["--max-num-seqs", "many"], "--max-num-seqs: expected an integer"),
        (["--page-size", "12"], "--page-size must be a power of two"),
        (["--num-processes", "2"], "--num-processes=2 needs --coordinator-address=HOST:PORT"),
        (["--load-format", "dummy"], "needs --model="),
        (["--enable-prefix-caching", "maybe"], "--enable-prefix-caching: cannot read 'maybe' as a boolean"),
    ],
)
def test_cli_errors_spell_settings_as_flags(argv, message):
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_cli(argv)
    assert message in str(err.value)


def test_cli_spelling_leaves_prose_alone():
    from jaxserve.config.settings import cli_spelling

    names = ["model", "max_model_len", "seed"]
    assert cli_spelling("the model directory 'x' has no config", names) == "the model directory 'x' has no config"
    assert (
        cli_spelling("max_model_len (4096) exceeds the model's limit", names)
        == "--max-model-len (4096) exceeds the model's limit"
    )
    assert cli_spelling("setting 'seed': expected an integer", names) == "--seed: expected an integer"


def test_help_is_grouped():
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    titles = [g.title for g in parser._action_groups]
    for title in ("model", "cache", "scheduling", "parallelism", "speculative decoding"):
        assert title in titles
    assert "other" not in titles  # every setting names its group


# ---- vLLM's spellings: tensor_parallel_size / data_parallel_size fold into mesh_shape ---------------------
def test_parallel_sizes_are_mesh_shape():
    cfg = EngineConfig(tensor_parallel_size=4)
    assert (
        cfg.mesh_shape == (1, 4)
        and cfg == EngineConfig(mesh_shape=(1, 4))
        and hash(cfg) == hash(EngineConfig(mesh_shape=(1, 4)))
    )
    assert cfg.tensor_parallel_size is None  # folded: mesh_shape is the one source of truth
    assert EngineConfig(tensor_parallel_size=2, data_parallel_size=3).mesh_shape == (3, 2)
    assert EngineConfig(mesh_shape=(2, 4), tensor_parallel_size=4).mesh_shape == (2, 4)  # agreeing is fine
    for argv in (
        ["-tp", "4", "-dp", "2"],
        ["--tensor-parallel-size", "4", "--data-parallel-size=2"],
        ["-tp=4", "-dp=2"],
    ):
        assert EngineConfig.from_cli(argv).mesh_shape == (2, 4)


def test_parallel_size_conflicting_with_mesh_shape_names_both():
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 conflicts with mesh_shape=\(2, 2\)"):
        EngineConfig(mesh_shape=(2, 2), tensor_parallel_size=4)
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_cli(["--mesh-shape", "1,2", "-dp", "2"])
    assert "--data-parallel-size=2 conflicts with --mesh-shape=(1, 2)" in str(err.value)
    with pytest.raises(ConfigError, match="--tensor-parallel-size: must be at least 1, got 0"):
        EngineConfig.from_cli(["-tp", "0"])


def test_parallel_sizes_in_yaml_and_flags_over_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("tensor_parallel_size: 8\n")
    assert EngineConfig.from_yaml(str(path)).mesh_shape == (1, 8)
    assert EngineConfig.from_cli(["--config", str(path), "--mesh-shape", "2,4"]).mesh_shape == (2, 4)  # flag wins
    path.write_text("mesh_shape: [2, 8]\n")
    assert EngineConfig.from_cli(["--config", str(path), "-tp", "4"]).mesh_shape == (2, 4)  # the flag's element


def test_parallel_sizes_round_trip_as_mesh_shape(tmp_path):
    cfg = EngineConfig(tensor_parallel_size=4, data_parallel_size=2)
    assert "tensor_parallel_size" not in cfg.to_dict() and cfg.to_dict()["mesh_shape"] == [2, 4]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert EngineConfig.from_yaml(str(path)) == cfg and EngineConfig.from_cli(["--mesh-shape", "2,4"]) == cfg
    assert EngineConfig.from_cli(["-tp", "4", "-dp", "2"]) == cfg
    assert cfg.replace(tensor_parallel_size=8).mesh_shape == (2, 8)  # the other axis kept
    assert cfg.replace(mesh_shape=(1, 1)).mesh_shape == (1, 1)


def test_hub_and_memory_settings():
    cfg = EngineConfig.from_cli(
        ["--revision", "refs/pr/3", "--download-dir", "/cache", "--gpu-memory-utilization", "0.8"]
    )
    assert (cfg.revision, cfg.download_dir, cfg.gpu_memory_utilization) == ("refs/pr/3", "/cache", 0.8)
    assert (
        EngineConfig().gpu_memory_utilization == 0.9
        and EngineConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1
    )
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ConfigError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
            EngineConfig(gpu_memory_utilization=bad)
    assert "Hugging Face model ID" in EngineConfig.__dataclass_fields__["model"].metadata["help"]


def test_list_setting_takes_several_values_after_its_flag(tmp_path):
    """--lora-modules (vLLM's spelling): several NAME=PATH or JSON values after one flag, a repeated flag
    adds to them, and flags replace the YAML's list."""
    cfg = EngineConfig.from_cli(
        [
            "--enable-lora",
            "--lora-modules",
            "a=/p/a",
            "b=/p/b",
            '{"name": "c", "path": "/p/c", "base_model_name": "base"}',
            "--lora-modules",
            "d=/p/d",
            "--max-loras",
            "2",
        ]
    )
    assert [(r.lora_name, r.lora_int_id, r.lora_path, r.base_model_name) for r in cfg.lora_modules] == [
        ("a", 1, "/p/a", None),
        ("b", 2, "/p/b", None),
        ("c", 3, "/p/c", "base"),
        ("d", 4, "/p/d", None),
    ]
    assert cfg.max_loras == 2
    path = tmp_path / "c.yaml"
    path.write_text("enable_lora: true\nlora_modules: [x=/p/x, {name: y, path: /p/y}]\n")
    assert [r.lora_name for r in EngineConfig.from_cli(["--config", str(path)]).lora_modules] == ["x", "y"]
    assert [
        r.lora_name for r in EngineConfig.from_cli(["--config", str(path), "--lora-modules", "z=/p/z"]).lora_modules
    ] == ["z"]
    with pytest.raises(SystemExit):  # a list flag needs at least one value
        EngineConfig.from_cli(["--enable-lora", "--lora-modules"])
