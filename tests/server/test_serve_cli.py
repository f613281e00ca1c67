"""`python -m jaxserve.serve` command line: settings from YAML + flags, the default model, failures."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxserve import serve
from jaxserve.config import EngineConfig


def resolve(argv):
    return serve.resolve_settings(serve.build_parser().parse_args(argv))


def test_every_engine_setting_is_a_flag():
    text = serve.build_parser().format_help()
    for name in EngineConfig.field_names():
        assert "--" + name.replace("_", "-") in text
    for flag in ("--host", "--port", "--api-key", "--max-waiting", "--served-model-name", "--max-body-bytes",
                 "--grace-seconds", "--mock-engine", "--config"):
        assert flag in text


def test_default_model_is_loudly_dummy(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(serve, "DEFAULT_CHECKPOINT", tmp_path / "absent")
    settings, name, note = resolve([])
    assert settings.model == str(serve.DUMMY_DEFAULT_MODEL) and settings.load_format == "dummy"
    assert name == serve.DUMMY_DEFAULT_NAME and "dummy" in note
    assert "DUMMY RANDOM WEIGHTS" in caplog.text
    (tmp_path / "default").mkdir()
    monkeypatch.setattr(serve, "DEFAULT_CHECKPOINT", tmp_path / "default")
    settings, name, note = resolve([])
    assert settings.model == str(tmp_path / "default") and name == "jaxserve-default" and note is None


def test_yaml_then_flags(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: /models/x\nmax_num_seqs: 4\npage_size: 32\nmesh_shape: [1, 1]\n")
    settings, name, _ = resolve(["--config", str(cfg), "--max-num-seqs", "8"])
    assert (settings.model, settings.max_num_seqs, settings.page_size) == ("/models/x", 8, 32)
    assert name == "/models/x"


def test_mock_settings_default_small():
    settings, name, _ = resolve(["--mock-engine", "--max-num-seqs", "3"])
    assert name == "mock" and settings.max_num_seqs == 3 and settings.max_model_len == serve.MOCK_DEFAULTS["max_model_len"]


def test_bad_settings_exit_2(capsys):
    assert serve.main(["--page-size", "3"]) == 2
    assert "page_size" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--model", "/nonexistent/model/dir"]])
def test_engine_failure_exits_1(argv, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jaxserve.serve", "--port", "0", *argv], capture_output=True,
                          text=True, timeout=120, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "does not exist" in proc.stderr
