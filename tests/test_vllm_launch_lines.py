"""vLLM launch lines through `jaxserve serve`'s parser: real lines (tests/data/vllm_launch_lines.yaml) start or stop
with a sentence, never "unrecognized arguments"; vLLM's flags keep vLLM's meaning (config/vllm_flags.py); the
traps of issue 51 are closed. Parsers only: no model is loaded, nothing is downloaded."""

from __future__ import annotations

import json
import logging
import pathlib
import re
import shlex

import pytest
import yaml

from jaxserve import plan as planner
from jaxserve import serve
from jaxserve.errors import ConfigError
from jaxserve.server.errors import APIError
from jaxserve.server.tools import plan_tools

REPO = pathlib.Path(__file__).resolve().parent.parent
LINES = yaml.safe_load((REPO / "tests" / "data" / "vllm_launch_lines.yaml").read_text())
ENTRY_POINTS = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server")


def serve_argv(line: str) -> list[str]:
    """The arguments vLLM's server gets from a published line: after `vllm serve`, `python -m <entry point>`
    or the vllm/vllm-openai image (environment variables and docker's own options dropped)."""
    words = shlex.split(line)
    for i, word in enumerate(words):
        if word == "serve" and i and words[i - 1] == "vllm":
            return words[i + 1 :]
        if word in ENTRY_POINTS and words[i - 1] == "-m":
            return words[i + 1 :]
        if word.startswith("vllm/vllm-openai"):
            return words[i + 1 :]
    raise AssertionError(f"no vLLM server command in {line!r}")


def launch(argv: list[str]):
    """What `jaxserve serve ARGV` decides before loading anything: (namespace, EngineConfig), or SystemExit(2) /
    ConfigError (main's exit 2)."""
    ns = serve.build_parser("jaxserve serve").parse_args(argv)
    return ns, serve.settings_from_flags(ns)


def test_the_collection_is_real_and_large_enough():
    assert len(LINES) >= 20
    for entry in LINES:
        assert entry["source"] and entry["line"] and (entry["expect"] == "ok" or entry["expect"].startswith("exit 2: "))
    assert sum(e["expect"] == "ok" for e in LINES) >= 15  # mostly lines that start


@pytest.mark.parametrize("entry", LINES, ids=[f"{i}" for i in range(len(LINES))])
def test_published_vllm_line(entry, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    argv = serve_argv(entry["line"])
    if entry["expect"] == "ok":
        ns, settings = launch(argv)
        assert settings.model == (ns.model_tag if hasattr(ns, "model_tag") else ns.model)
        return
    reason = entry["expect"].removeprefix("exit 2: ")
    with pytest.raises((SystemExit, ConfigError)) as caught:
        launch(argv)
    message = str(caught.value) if caught.type is ConfigError else capsys.readouterr().err
    if caught.type is SystemExit:
        assert caught.value.code == 2
    assert "unrecognized arguments" not in message
    assert reason in message, message


# ---- vLLM's meaning ---------------------------------------------------------------------------------------


def test_mapped_flags_set_our_settings():
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4})
    ns, s = launch(
        [
            "org/m",
            "--block-size",
            "32",
            "--num-gpu-blocks-override",
            "900",
            "--dtype",
            "half",
            "--enable_expert_parallel",
            "--speculative-config",
            spec,
            "--max-model-len",
            "32K",
            "--max_num_seqs=64",
            "-q",
            "int8",
            "--max-logprobs",
            "5",
            "--enforce-eager",
            "--disable-uvicorn-access-log",
        ]
    )
    assert (s.page_size, s.num_pages, s.dtype, s.moe_parallelism) == (32, 900, "float16", "expert")
    assert (s.speculation, s.num_speculative_tokens, s.prompt_lookup_max) == ("ngram", 5, 4)
    assert (s.max_model_len, s.max_num_seqs, s.quantization, s.max_logprobs) == (32768, 64, "int8", 5)
    assert s.enforce_eager and ns.no_access_log
    _, s = launch(["org/m", "--speculative-config", '{"model": "org/draft", "num_speculative_tokens": 3}'])
    assert (s.speculation, s.speculative_model, s.num_speculative_tokens) == ("draft", "org/draft", 3)
    assert launch(["org/m", "--max-model-len", "32k", "--dtype", "float"])[1].max_model_len == 32000
    assert launch(["org/m", "--kv-cache-memory-bytes", "7516192768"])[1].kv_cache_memory == 7516192768


def test_a_mapped_flag_and_its_setting_must_agree():
    assert launch(["org/m", "--block-size", "16", "--page-size", "16"])[1].page_size == 16
    with pytest.raises(SystemExit):
        launch(["org/m", "--block-size", "32", "--page-size", "16"])


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["--trust-remote-code"], "no remote code runs here"),
        (["--disable-log-requests"], "does not log prompts or outputs"),
        (["--swap-space", "16"], "recomputed, never swapped"),
        (["--pipeline-parallel-size", "1"], "one pipeline stage"),
        (["--no-enable-chunked-prefill"], "always prefilled in chunks"),
        (["-O3"], "XLA compiles every step bucket"),
        (["--task", "generate"], "text generation"),
        (["--calculate-kv-scales"], "k_scale / v_scale"),
    ],
)
def test_no_op_flags_log_one_line_saying_why(argv, reason, monkeypatch, caplog):
    monkeypatch.chdir(REPO)
    ns, _ = launch(["org/m", *argv])
    assert len(ns.vllm_notes) == 1 and reason in ns.vllm_notes[0] and "no effect" in ns.vllm_notes[0]


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["-pp", "2"], "--tensor-parallel-size"),
        (["--quantization", "fp8"], "--quantization int8"),
        (["--quantization", "bitsandbytes"], "--quantization int8"),
        (["--load-format", "pt"], "pickle"),
        (["--cpu-offload-gb", "8"], "-tp N"),
        (["--speculative-config", '{"method": "eagle", "model": "x", "num_speculative_tokens": 2}'], "EAGLE"),
        (["--tokenizer-mode", "mistral"], "tokenizer.json"),
        (["--ssl-keyfile", "k.pem"], "plain HTTP"),
        (["--task", "embed"], "text generation only"),
        (["--api-server-count", "4"], "serve-ray"),
        (["--default-chat-template-kwargs", '{"enable_thinking": false}'], "chat_template_kwargs"),
    ],
)
def test_refused_flags_exit_2_naming_what_to_use(argv, reason, capsys):
    with pytest.raises(SystemExit) as caught:
        launch(["org/m", *argv])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert reason in err and "unrecognized" not in err


def test_max_logprobs_above_what_is_compiled_is_refused():
    with pytest.raises(ConfigError, match="--max-logprobs must be in"):
        launch(["org/m", "--max-logprobs", "21"])


def test_quantization_awq_must_match_the_checkpoint(tmp_path):
    awq, plain = tmp_path / "awq", tmp_path / "plain"
    awq.mkdir(), plain.mkdir()
    (awq / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}})
    )
    (plain / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    ns, settings = launch([str(awq), "--quantization", "awq_marlin"])
    assert settings.quantization == "none"  # the checkpoint's own int4 weights decide (implied_quantization)
    serve.check_checkpoint_quantization(ns, str(awq))
    with pytest.raises(ConfigError, match="not GPTQ"):
        serve.check_checkpoint_quantization(launch([str(awq), "--quantization", "gptq"])[0], str(awq))
    with pytest.raises(ConfigError, match="a float .* checkpoint, not AWQ"):
        serve.check_checkpoint_quantization(launch([str(plain), "-q", "awq"])[0], str(plain))


def test_auto_tool_choice_off_answers_auto_400_as_vllm():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert plan_tools(tools, "auto", None, "hermes").parser == "hermes"
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        plan_tools(tools, None, None, None)  # tools given: tool_choice defaults to auto
    assert plan_tools(tools, "required", None, None).choice == "required"
    ns, _ = launch(["org/m", "--no-enable-auto-tool-choice"])
    assert ns.enable_auto_tool_choice is False
    assert launch(["org/m"])[0].enable_auto_tool_choice is True


# ---- traps ------------------------------------------------------------------------------------------------


def test_model_beside_a_dummy_config_is_refused_unless_load_format_says(monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match="random weights under the model's name"):
        launch(["--config", "llama3-8b-tp8", "--model", "/models/llama"])
    with pytest.raises(ConfigError, match="--load-format auto"):
        launch(["/models/llama", "--config", "llama3-8b-tp8"])
    assert launch(["--config", "llama3-8b-tp8", "--model", "/m", "--load-format", "auto"])[1].load_format == "auto"
    assert launch(["--config", "llama3-8b-tp8", "--model", "/m", "--load-format", "dummy"])[1].load_format == "dummy"
    assert launch(["--config", "llama3-8b-tp8"])[1].load_format == "dummy"  # the config alone: its shape model


def test_main_exits_2_on_a_trap(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert serve.main(["--config", "llama3-8b-tp8", "--model", "/models/llama"]) == 2
    assert "load_format: dummy" in capsys.readouterr().err


def test_serve_ray_help_hides_what_it_refuses():
    from jaxserve.serving.ray.cli import REFUSED_FLAGS, build_parser

    text = build_parser().format_help()
    for flag in REFUSED_FLAGS:
        assert not re.search(rf"^  {re.escape(flag)}\b", text, re.M) and f"[{flag}" not in text, flag
    assert "--num-replicas" in text and "--enable-auto-tool-choice" in text


def test_plan_sizes_by_gpu_memory_utilization(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    argv = ["--model", "configs/models/llama3-8b", "--device", "h100", "--devices", "1", "--context", "8192", "--json"]
    usable = {}
    for fraction in ("0.9", "0.5"):
        assert planner.main(argv + ["--gpu-memory-utilization", fraction]) == 0
        usable[fraction] = json.loads(capsys.readouterr().out)["usable_bytes_per_device"]
    assert usable["0.5"] == pytest.approx(usable["0.9"] * 5 / 9, rel=1e-6)
    assert planner.main(argv + ["--memory-fraction", "0.5"]) == 1
    assert "--gpu-memory-utilization" in capsys.readouterr().err


def test_plan_does_not_say_the_engine_takes_2_gib(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert planner.main(["--model", "configs/models/llama3-8b", "--device", "h100", "--context", "8192"]) == 0
    out = capsys.readouterr().out
    assert "default is a 2 GiB cache" not in out and "sizes its cache from --gpu-memory-utilization" in out


def test_no_op_notes_reach_the_log(monkeypatch, caplog):
    """main logs each accepted no-op flag once, after logging is set up (the parser only collects them)."""
    monkeypatch.chdir(REPO)
    caplog.set_level(logging.INFO, logger="jaxserve.serve")
    assert serve.main(["--config", "llama3-8b-tp8", "--model", "/nowhere", "--trust-remote-code"]) == 2
    assert any("--trust-remote-code: accepted, no effect" in r.getMessage() for r in caplog.records)


def test_max_logprobs_is_enforced_per_request():
    """--max-logprobs N: a request asking for more top logprobs is a 400 naming the limit (vLLM's check)."""
    from fastapi.testclient import TestClient

    from jaxserve.server.api import ServerOptions, create_app
    from jaxserve.testing.mock_engine import MockAsyncLLMEngine, mock_settings

    engine = MockAsyncLLMEngine(mock_settings(max_logprobs=2), token_delay=0.0)
    engine.start()
    try:
        client = TestClient(create_app(ServerOptions(served_model_names=("mock",)), engine))
        body = {"model": "mock", "prompt": "hi", "max_tokens": 2}
        assert client.post("/v1/completions", json={**body, "logprobs": 2}).status_code == 200
        refused = client.post("/v1/completions", json={**body, "logprobs": 3})
        assert refused.status_code == 400 and "max_logprobs=2" in refused.json()["error"]["message"]
        chat = {"model": "mock", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
        assert client.post("/v1/chat/completions", json={**chat, "top_logprobs": 3}).status_code == 400
    finally:
        engine.shutdown()
