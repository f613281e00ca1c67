"""The one settings schema: Python keywords, YAML keys and CLI flags round-trip to the same config."""

import pytest
import yaml

from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError

CUSTOM = dict(
    model="/models/x", tokenizer="/tok", dtype="bfloat16", load_format="dummy", seed=7, page_size=32,
    kv_cache_memory="4GiB", max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=1024,
    mesh_shape=[2, 4], scan_layers=True, attention_backend="reference",
)


def test_keywords_yaml_and_cli_round_trip(tmp_path):
    cfg = EngineConfig(**CUSTOM)
    assert cfg.kv_cache_memory == 4 * 2**30 and cfg.mesh_shape == (2, 4)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert EngineConfig.from_yaml(str(path)) == cfg
    assert EngineConfig.from_cli(cfg.to_cli_args()) == cfg
    assert "--mesh-shape" in cfg.to_cli_args() and "2,4" in cfg.to_cli_args()
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
    # a round trip through to_cli_args keeps explicit values, which every spelling accepts
    cfg = EngineConfig(enable_prefix_caching=False, enable_prompt_logprobs=True)
    assert EngineConfig.from_cli(cfg.to_cli_args()) == cfg


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
    from jaxserve.settings import cli_spelling

    names = ["model", "max_model_len", "seed"]
    assert cli_spelling("the model directory 'x' has no config", names) == "the model directory 'x' has no config"
    assert cli_spelling("max_model_len (4096) exceeds the model's limit", names) == \
        "--max-model-len (4096) exceeds the model's limit"
    assert cli_spelling("setting 'seed': expected an integer", names) == "--seed: expected an integer"


def test_help_is_grouped():
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    titles = [g.title for g in parser._action_groups]
    for title in ("model", "cache", "scheduling", "parallelism", "speculative decoding"):
        assert title in titles
    assert "other" not in titles  # every setting names its group
