"""Every shipped YAML config validates into the settings schema."""

import pathlib

import pytest

from jaxserve.config import EngineConfig

CONFIGS = sorted((pathlib.Path(__file__).parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates(path):
    cfg = EngineConfig.from_yaml(str(path))
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg


def test_default_config_is_shipped():
    assert any(p.name == "default.yaml" for p in CONFIGS)
