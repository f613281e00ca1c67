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
