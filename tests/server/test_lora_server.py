"""LoRA adapters through the server, over the mock engine (no model): a request's `model` selects its
adapter and is echoed, /v1/models lists the adapters with their parent, vLLM's runtime routes load and
unload them (enabled by --allow-runtime-lora-updating or VLLM_ALLOW_RUNTIME_LORA_UPDATING), their
errors, the metrics, and the command line."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from server_testlib import MOCK_ARGS, ServerProcess, parse_metrics, sse_chunks, wait_until

from jaxserve import serve
from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError, LoRAError
from jaxserve.lora.request import LoRARequest
from jaxserve.sampling.params import SamplingParams
from jaxserve.server.engine_protocol import LoRAServingEngine
from jaxserve.server.lora import RUNTIME_UPDATING_ENV, runtime_updating_allowed
from jaxserve.server.metrics import lora_metrics
from jaxserve.testing.mock_engine import MockAsyncLLMEngine, mock_settings

GREEDY = dict(prompt="tell me", max_tokens=12, temperature=0, ignore_eos=True)


def make_adapter(root, name: str, r: int = 8, targets=("q_proj", "v_proj"), **extra) -> str:
    path = root / name
    path.mkdir()
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(targets), **extra}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(autouse=True)
def no_runtime_env(monkeypatch):
    monkeypatch.delenv(RUNTIME_UPDATING_ENV, raising=False)


@pytest.fixture
def adapters(tmp_path):
    return {name: make_adapter(tmp_path, name, r) for name, r in (("a", 8), ("b", 16), ("c", 4))}


@pytest.fixture
def lora_client(make_client, adapters):
    """Adapters a and b loaded at start (ids 1, 2), c on disk; runtime updating on; two device slots."""

    def make(token_delay=0.001, runtime=True, **settings):
        values = dict(enable_lora=True, max_loras=2, lora_modules=(f"a={adapters['a']}", f"b={adapters['b']}"))
        values.update(settings)
        return make_client(token_delay=token_delay, settings=values, allow_runtime_lora_updating=runtime)

    return make


def complete(client, model, **body):
    return client.post("/v1/completions", json={**GREEDY, "model": model, **body})


def assert_error(response, status, *words):
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    for word in words:
        assert word in message, message
    return response.json()["error"]


# ---- selection ---------------------------------------------------------------------------------------


def test_model_names_the_adapter_and_is_echoed(lora_client):
    client = lora_client()
    texts = {}
    for model in ("mock", "a", "b"):
        r = complete(client, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        texts[model] = r.json()["choices"][0]["text"]
        assert len(texts[model]) == 12
    assert len(set(texts.values())) == 3  # each adapter reached the engine: other tokens
    assert complete(client, "a").json()["choices"][0]["text"] == texts["a"]  # deterministic
    chat = client.post(
        "/v1/chat/completions",
        json={
            "model": "b",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert chat.status_code == 200 and chat.json()["model"] == "b"
    chunks = sse_chunks(complete(client, "a", stream=True))
    assert {c["model"] for c in chunks} == {"a"} and "".join(c["choices"][0]["text"] for c in chunks) == texts["a"]
    stats = client.mock_engine.stats()["lora"]
    assert stats["loads_total"] >= 2 and set(stats["resident"]) == {"a", "b"} and stats["max_loras"] == 2


def test_unknown_model_is_404_naming_models_and_adapters(lora_client):
    error = assert_error(complete(lora_client(), "c"), 404, "'c' does not exist", "'mock'", "'a'", "'b'")
    assert error["code"] == "model_not_found" and error["param"] == "model"


def test_models_lists_each_adapter_with_its_parent(adapters):
    from starlette.testclient import TestClient

    from jaxserve.server.api import ServerOptions, create_app

    modules = (
        f"a={adapters['a']}",
        json.dumps({"name": "b", "path": adapters["b"], "base_model_name": "mock-2"}),
        {"name": "c", "path": adapters["c"], "base_model_name": "elsewhere"},
    )
    engine = MockAsyncLLMEngine(mock_settings(enable_lora=True, lora_modules=modules))
    client = TestClient(create_app(ServerOptions(served_model_names=("mock", "mock-2")), engine))
    cards = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert list(cards) == ["mock", "mock-2", "a", "b", "c"]
    assert cards["mock"]["parent"] is None
    assert (cards["a"]["root"], cards["a"]["parent"]) == (adapters["a"], "mock")
    assert cards["b"]["parent"] == "mock-2"  # its base_model_name, a served name
    assert cards["c"]["parent"] == "mock"  # not a served name: the first one (as vLLM)
    assert cards["a"]["object"] == "model" and cards["a"]["max_model_len"] == 512
    lora = client.get("/v1/capabilities").json()["lora"]
    assert lora == {
        "enabled": True,
        "runtime_updating": False,
        "max_loras": 1,
        "max_lora_rank": 16,
        "max_cpu_loras": 1,
        "adapters": ["a", "b", "c"],
    }


def test_mock_engine_meets_the_lora_protocol():
    assert isinstance(MockAsyncLLMEngine(mock_settings(enable_lora=True)), LoRAServingEngine)


# ---- runtime loading and unloading -------------------------------------------------------------------


def test_load_use_unload_at_run_time(lora_client, adapters):
    client = lora_client()
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"]})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' added successfully."
    assert r.headers["content-type"].startswith("text/plain")
    ids = {a.lora_name: a.lora_int_id for a in client.mock_engine.list_loras()}
    assert ids == {"a": 1, "b": 2, "c": 3}
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["mock", "a", "b", "c"]
    first = complete(client, "c")
    assert first.status_code == 200 and first.json()["model"] == "c"
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' removed successfully."
    assert_error(complete(client, "c"), 404, "'c' does not exist")
    assert_error(client.post("/v1/unload_lora_adapter", json={"lora_name": "c"}), 404, "'c' cannot be found")
    assert "c" not in [m["id"] for m in client.get("/v1/models").json()["data"]]
    # loaded again: a new id, above every one handed out; the same adapter, the same tokens
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"]}).status_code == 200
    assert {a.lora_name: a.lora_int_id for a in client.mock_engine.list_loras()}["c"] == 4
    assert complete(client, "c").json()["choices"] == first.json()["choices"]
    # vLLM's older clients unload by id
    assert client.post("/v1/unload_lora_adapter", json={"lora_int_id": 4}).status_code == 200
    assert_error(client.post("/v1/unload_lora_adapter", json={"lora_int_id": 4}), 404, "lora_int_id 4")


def test_load_inplace_replaces_the_adapter(lora_client, adapters, tmp_path):
    client = lora_client()
    other = make_adapter(tmp_path / "..", f"{tmp_path.name}-a2")
    assert_error(
        client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": other}),
        400,
        "has already been loaded",
        "load_inplace",
    )
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": other, "load_inplace": True})
    assert r.status_code == 200, r.text
    assert {m["id"]: m["root"] for m in client.get("/v1/models").json()["data"]}["a"] == other
    # a failed replacement keeps the adapter that was there
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/nowhere", "load_inplace": True})
    assert_error(r, 400, "/nowhere")
    assert {m["id"]: m["root"] for m in client.get("/v1/models").json()["data"]}["a"] == other


@pytest.mark.parametrize(
    "body, words",
    [
        ({"lora_name": "x"}, ["Both 'lora_name' and 'lora_path' must be provided."]),
        ({"lora_path": "/p"}, ["Both 'lora_name' and 'lora_path' must be provided."]),
        ({"lora_name": "", "lora_path": "/p"}, ["Both 'lora_name' and 'lora_path'"]),
        ({"lora_name": 5, "lora_path": "/p"}, ["lora_name"]),
        ({"lora_name": "x", "lora_path": "/p", "load_inplace": "maybe"}, ["load_inplace"]),
        ({"lora_name": "x", "lora_path": "/p", "rank": 8}, ["rank"]),
        ({"lora_name": "x", "lora_path": "/p", "is_3d_lora_weight": True}, ["is_3d_lora_weight"]),
        ({"lora_name": "x", "lora_path": "/does/not/exist"}, ["/does/not/exist"]),
        ({"lora_name": "mock", "lora_path": "ADAPTER"}, ["base model's name"]),
        ({"lora_name": "b", "lora_path": "ADAPTER"}, ["'b' has already been loaded"]),
        ([1, 2], ["invalid request"]),
    ],
)
def test_bad_load_bodies_are_400(lora_client, adapters, body, words):
    if isinstance(body, dict) and body.get("lora_path") == "ADAPTER":
        body = {**body, "lora_path": adapters["c"]}
    assert_error(lora_client().post("/v1/load_lora_adapter", json=body), 400, *words)


def test_adapters_the_engine_refuses_are_400_naming_the_problem(lora_client, tmp_path):
    client = lora_client()
    big = make_adapter(tmp_path, "big", r=64)
    embed = make_adapter(tmp_path, "embed", targets=("q_proj", "embed_tokens"))
    empty = tmp_path / "empty"
    empty.mkdir()
    for name, path, words in (
        ("big", big, ["rank 64", "--max-lora-rank"]),
        ("embed", embed, ["embed_tokens"]),
        ("empty", str(empty), ["adapter_config.json"]),
    ):
        error = assert_error(
            client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}), 400, *words
        )
        assert error["code"] == "invalid_lora_adapter"
    assert [a.lora_name for a in client.mock_engine.list_loras()] == ["a", "b"]
    assert client.post("/v1/load_lora_adapter", content=b"{not json").status_code == 400
    assert_error(client.post("/v1/unload_lora_adapter", json={}), 400, "'lora_name' needs to be provided")


def test_unloading_an_adapter_in_use_lets_its_requests_finish(lora_client):
    client = lora_client(token_delay=0.01)
    body = dict(GREEDY, max_tokens=40)
    expected = complete(client, "a", **body).json()["choices"][0]["text"]
    streamed = {}
    thread = threading.Thread(target=lambda: streamed.update(r=complete(client, "a", stream=True, **body)))
    thread.start()
    assert wait_until(lambda: client.mock_engine.stats()["lora"]["running"].get("a"), timeout=10)
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
    assert_error(complete(client, "a"), 404)  # new requests: gone at once
    thread.join(timeout=30)
    chunks = sse_chunks(streamed["r"])
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected  # the running one: all of it
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_adapter_unloaded_before_reaching_the_engine_is_404(lora_client):
    """The name check passed, then the adapter went (a race): the engine's LoRANotFoundError is a 404."""
    client = lora_client()
    original = client.mock_engine.submit

    async def submit_after_unload(*args, **kwargs):
        await client.mock_engine.remove_lora("a")
        await original(*args, **kwargs)

    client.mock_engine.submit = submit_after_unload
    assert assert_error(complete(client, "a"), 404, "'a' is not loaded")["code"] == "model_not_found"


# ---- enabling ----------------------------------------------------------------------------------------


def test_runtime_routes_are_not_served_unless_allowed(lora_client, adapters):
    client = lora_client(runtime=None)  # neither the option nor the environment variable
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert client.post(route, json={"lora_name": "c", "lora_path": adapters["c"]}).status_code == 404
    capabilities = client.get("/v1/capabilities").json()
    assert "POST /v1/load_lora_adapter" not in capabilities["endpoints"]
    assert capabilities["lora"]["runtime_updating"] is False
    assert complete(client, "a").status_code == 200  # adapters loaded at start still serve


@pytest.mark.parametrize(
    "value, on",
    [
        ("1", True),
        ("true", True),
        ("True", True),
        (" TRUE ", True),
        ("0", False),
        ("false", False),
        ("yes", False),
        ("", False),
    ],
)
def test_vllm_environment_variable(monkeypatch, lora_client, adapters, value, on):
    monkeypatch.setenv(RUNTIME_UPDATING_ENV, value)
    assert runtime_updating_allowed(None) is on
    assert runtime_updating_allowed(False) is False and runtime_updating_allowed(True) is True  # the option wins
    client = lora_client(runtime=None)
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"]})
    assert r.status_code == (200 if on else 404)


def test_without_enable_lora(make_client, adapters):
    client = make_client(allow_runtime_lora_updating=True)
    assert_error(
        client.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"]}), 400, "--enable-lora"
    )
    assert_error(client.post("/v1/unload_lora_adapter", json={"lora_name": "c"}), 400, "--enable-lora")
    assert_error(complete(client, "c"), 404, "does not exist")
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["mock"]
    assert "lora" not in client.mock_engine.stats()
    assert "lora_requests_info" not in client.get("/metrics").text


# ---- metrics -----------------------------------------------------------------------------------------


def test_lora_metrics_shape():
    stats = {
        "lora": {
            "max_loras": 4,
            "running": {"a": 2, "b": 1, "gone": 0},
            "waiting": {"c": 3},
            "resident": ["a", "b"],
            "cpu_cached": ["a", "b", "c"],
            "loads_total": 5,
            "evictions_total": 2,
        }
    }
    families = {f.name: f for f in lora_metrics(stats, now=1234.5)}
    for name in ("vllm:lora_requests_info", "jaxserve:lora_requests_info"):
        (sample,) = families[name].samples
        assert sample.labels == {"max_lora": "4", "running_lora_adapters": "a,b", "waiting_lora_adapters": "c"}
        assert sample.value == 1234.5 and families[name].type == "gauge"
    assert {s.labels["lora_name"]: s.value for s in families["jaxserve:lora_requests_running"].samples} == {
        "a": 2,
        "b": 1,
        "gone": 0,
    }
    assert families["jaxserve:lora_adapters_resident"].samples[0].value == 2
    assert families["jaxserve:lora_adapters_cpu_cached"].samples[0].value == 3
    assert families["jaxserve:lora_loads"].samples[0].value == 5 and families["jaxserve:lora_loads"].type == "counter"
    assert families["jaxserve:lora_evictions"].samples[0].value == 2
    assert list(lora_metrics({})) == []


def test_metrics_show_running_and_waiting_adapters(lora_client):
    """One slot: a request of a runs, one of b waits for the slot."""
    client = lora_client(token_delay=0.005, max_loras=1, max_cpu_loras=2)
    engine = client.mock_engine
    a, b = engine.list_loras()
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    submit = engine.processor.process
    asyncio.run(engine.submit(submit("run-a", None, params, [10, 11], lora_request=a), asyncio.Queue()))
    assert wait_until(lambda: engine.stats()["lora"]["running"].get("a"))
    asyncio.run(engine.submit(submit("wait-b", None, params, [10, 11], lora_request=b), asyncio.Queue()))
    asyncio.run(engine.submit(submit("base", None, params, [10, 11]), asyncio.Queue()))
    assert wait_until(lambda: engine.stats()["num_running"] == 2)  # the base request passes b's
    before = time.time()
    metrics = parse_metrics(client.get("/metrics").text)
    info = {k: v for k, v in metrics.items() if k.startswith("vllm:lora_requests_info")}
    assert list(info) == ['vllm:lora_requests_info{max_lora="1",running_lora_adapters="a",waiting_lora_adapters="b"}']
    assert abs(next(iter(info.values())) - before) < 60
    assert metrics['jaxserve:lora_requests_running{lora_name="a"}'] == 1
    assert metrics['jaxserve:lora_requests_waiting{lora_name="b"}'] == 1
    assert metrics["jaxserve:lora_adapters_resident"] == 1 and metrics["jaxserve:lora_adapters_cpu_cached"] == 2
    assert metrics["jaxserve:lora_loads_total"] == 1 and metrics["jaxserve:lora_evictions_total"] == 0
    engine.abort("run-a")  # b takes the slot: a is swapped out
    assert wait_until(lambda: engine.stats()["lora"]["running"].get("b"))
    metrics = parse_metrics(client.get("/metrics").text)
    assert metrics["jaxserve:lora_loads_total"] == 2 and metrics["jaxserve:lora_evictions_total"] == 1
    for rid in ("wait-b", "base"):
        engine.abort(rid)


# ---- command line ------------------------------------------------------------------------------------


def resolve(argv):
    ns = serve.build_parser().parse_args(argv)
    return ns, serve.resolve_settings(ns)[0]


def test_lora_flags(tmp_path):
    ns, settings = resolve(
        [
            "--mock-engine",
            "--enable-lora",
            "--lora-modules",
            "a=/p/a",
            "b=/p/b",
            '{"name": "c", "path": "/p/c", "base_model_name": "m"}',
            "--max-loras",
            "3",
            "--max-lora-rank",
            "64",
            "--max-cpu-loras",
            "8",
            "--allow-runtime-lora-updating",
        ]
    )
    assert settings.lora_modules == (
        LoRARequest("a", 1, "/p/a"),
        LoRARequest("b", 2, "/p/b"),
        LoRARequest("c", 3, "/p/c", "m"),
    )
    assert (settings.enable_lora, settings.max_loras, settings.max_lora_rank, settings.max_cpu_loras) == (
        True,
        3,
        64,
        8,
    )
    assert ns.allow_runtime_lora_updating is True
    ns, settings = resolve(["--mock-engine", "--enable-lora", "--lora-modules", "a=/p/a", "--lora-modules", "b=/p/b"])
    assert [r.lora_name for r in settings.lora_modules] == ["a", "b"] and ns.allow_runtime_lora_updating is None
    config = tmp_path / "c.yaml"
    config.write_text("enable_lora: true\nlora_modules:\n  - a=/p/a\n  - {name: b, path: /p/b}\n")
    _, settings = resolve(["--mock-engine", "--config", str(config)])
    assert [(r.lora_name, r.lora_path) for r in settings.lora_modules] == [("a", "/p/a"), ("b", "/p/b")]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--lora-modules", "a=/p"], "needs --enable-lora"),
        (["--allow-runtime-lora-updating"], "--allow-runtime-lora-updating needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "mock=/p"], "also a served model name"),
        (["--enable-lora", "--lora-modules", "a=/p", "a=/q"], "unique"),
        (["--enable-lora", "--lora-modules", "nopath"], "NAME=PATH"),
        (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "--max-cpu-loras"),
    ],
)
def test_contradictions_stop_the_start(capsys, argv, words):
    assert serve.main(["--mock-engine", *argv]) == 2
    assert words in capsys.readouterr().err


def test_a_bad_start_adapter_stops_the_engine_start(tmp_path):
    ns, settings = resolve(
        [
            "--mock-engine",
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--lora-modules",
            f"a={make_adapter(tmp_path, 'a', r=16)}",
        ]
    )
    with pytest.raises(LoRAError, match="rank 16"):
        serve.build_engine(ns, settings)
    with pytest.raises(ConfigError, match="lora_modules needs enable_lora"):
        EngineConfig(lora_modules=("a=/p",))


def test_served_over_http_with_the_environment_variable(tmp_path, monkeypatch, adapters):
    """`python -m jaxserve.serve --mock-engine` with vLLM's flags and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1."""
    import httpx

    monkeypatch.setenv(RUNTIME_UPDATING_ENV, "1")
    server = ServerProcess(
        [
            *MOCK_ARGS,
            "--enable-lora",
            "--max-loras",
            "2",
            "--lora-modules",
            f"a={adapters['a']}",
            json.dumps({"name": "b", "path": adapters["b"]}),
        ],
        tmp_path / "server.log",
        startup_timeout=60,
    )
    server.start()
    try:
        url = server.url
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["mock", "a", "b"]
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"]})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' added successfully."
        r = httpx.post(url + "/v1/completions", json={**GREEDY, "model": "c"})
        assert r.status_code == 200 and r.json()["model"] == "c"
        assert 'vllm:lora_requests_info{max_lora="2"' in httpx.get(url + "/metrics").text
    finally:
        assert server.stop() == 0
