"""Every shipped YAML config validates into the settings schema and plans; bad configs fail by name."""

import pathlib
import sys

import pytest

from jaxserve import plan as planner
from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError

REPO = pathlib.Path(__file__).parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
SWEEPS = sorted((REPO / "configs" / "sweeps").glob("*.yaml"))
sys.path.insert(0, str(REPO / "scripts"))


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(REPO)  # configs name model directories relative to the repository


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates(path):
    cfg = EngineConfig.from_yaml(str(path))
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_plans(path, capsys):
    """Each config fits on the devices its mesh names (an H100 each, the planner's default device)."""
    assert planner.main(["--config", str(path)]) == 0, capsys.readouterr().err
    assert "fits." in capsys.readouterr().out


def test_shipped_configs():
    names = {p.name for p in CONFIGS}
    assert {"default.yaml", "smollm2-135m-dummy.yaml", "llama3-8b-tp8.yaml", "llama3-70b-tp8-int8.yaml"} <= names
    assert [p.name for p in SWEEPS] == ["mesh.yaml"]


def write(tmp_path, text: str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return str(path)


def test_unknown_key_is_named(tmp_path):
    path = write(tmp_path, "model: configs/models/smollm2-135m\nmax_num_seq: 8\n")
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) 'max_num_seq'") as err:
        EngineConfig.from_yaml(path)
    assert path in str(err.value) and "max_num_seqs" in str(err.value)  # the file, and the known keys


@pytest.mark.parametrize(
    "line,setting",
    [
        ("page_size: 12", "page_size"),
        ("dtype: fp8", "dtype"),
        ("mesh_shape: [1, 0]", "mesh_shape"),
        ("kv_cache_memory: lots", "kv_cache_memory"),
        ("quantization: int3", "quantization"),
    ],
)
def test_bad_value_is_named(tmp_path, line, setting):
    with pytest.raises(ConfigError, match=setting):
        EngineConfig.from_yaml(write(tmp_path, line + "\n"))


def test_planner_reports_a_bad_config(tmp_path, capsys):
    assert planner.main(["--config", write(tmp_path, "max_num_seq: 8\n")]) == 1
    assert "'max_num_seq'" in capsys.readouterr().err


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_sweep_validates(path):
    from sweep_mesh import load_sweep

    sweep = load_sweep(str(path))
    assert sweep.meshes and sweep.workloads
    assert all(len(mesh) == 2 for mesh in sweep.meshes)
    assert sweep.base.model is not None


@pytest.mark.parametrize(
    "text,named",
    [
        ("meshes: [[1, 1]]\nmeshs: [[1, 2]]\n", "'meshs'"),
        ("base: {max_num_seq: 4}\n", "'max_num_seq'"),
        ("workloads: [{num_request: 4}]\n", "'num_request'"),
        ("meshes: [[1, 2, 3]]\n", "two positive sizes"),
    ],
)
def test_bad_sweep_is_named(tmp_path, text, named):
    from sweep_mesh import load_sweep

    with pytest.raises(ConfigError, match=named):
        load_sweep(write(tmp_path, text))
