"""The model's own sampling defaults (generation_config.json) for requests that leave them unset.

Unit checks of jaxserve.config.generation_config, the server's plumbing over the mock engine (which values
reach SamplingParams), then the shipped model (checkpoints/small, `do_sample: false`) through the
offline API and the HTTP app: greedy by default, sampling when a request (or the settings) ask for it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_testlib import record_submits

from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError
from jaxserve.config.generation_config import load_generation_defaults

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = str(ROOT / "checkpoints" / "small")
QWEN_LIKE = {
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.05,
    "max_new_tokens": 64,
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
}


def defaults(**settings):
    return load_generation_defaults(EngineConfig(**settings), log=False).values


@pytest.fixture
def qwen_like(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN_LIKE))
    return str(tmp_path)


# ---- the settings and the file ---------------------------------------------------------------------


def test_shipped_model_is_greedy_and_vllm_ignores_the_file():
    assert defaults(model=DEFAULT) == {"temperature": 0.0}  # do_sample: false
    assert defaults(model=DEFAULT, generation_config="vllm") == {}
    assert defaults(model=None) == {}  # nothing to read: the built-in defaults


def test_file_values_become_sampling_params_fields(qwen_like):
    assert defaults(generation_config=qwen_like) == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 64,
    }
    assert defaults(model=qwen_like) == defaults(generation_config=qwen_like)  # auto reads the model's
    assert defaults(generation_config=qwen_like + "/generation_config.json")["top_k"] == 20  # the file itself


def test_override_is_merged_over_the_file(qwen_like):
    assert defaults(model=DEFAULT, override_generation_config='{"temperature": 0.5}') == {"temperature": 0.5}
    assert defaults(model=DEFAULT, override_generation_config={"do_sample": True}) == {}
    assert defaults(model=DEFAULT, override_generation_config={"top_k": 5}) == {"temperature": 0.0, "top_k": 5}
    got = defaults(generation_config=qwen_like, override_generation_config={"do_sample": False, "max_new_tokens": 8})
    assert got["temperature"] == 0.0 and got["max_tokens"] == 8 and got["top_p"] == 0.8
    assert defaults(generation_config="vllm", override_generation_config={"temperature": 0.2}) == {"temperature": 0.2}


def test_do_sample_false_overrules_the_files_temperature(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"do_sample": false, "temperature": 0.6, "top_p": 0.9}')
    assert defaults(model=str(tmp_path)) == {"temperature": 0.0, "top_p": 0.9}


def test_flags_and_yaml_spellings(tmp_path):
    s = EngineConfig.from_cli(["--generation-config", "vllm", "--override-generation-config", '{"temperature": 0.5}'])
    assert s.generation_config == "vllm" and json.loads(s.override_generation_config) == {"temperature": 0.5}
    hash(s)  # still hashable: a static jit argument
    (tmp_path / "c.yaml").write_text("override_generation_config: {top_p: 0.9}\n")
    assert json.loads(EngineConfig.from_yaml(str(tmp_path / "c.yaml")).override_generation_config) == {"top_p": 0.9}


@pytest.mark.parametrize(
    "override, message",
    [
        ('{"temprature": 1}', "unknown key"),
        ("temperature=1", "JSON object"),
        ('{"top_p": 0}', "top_p"),
        ('{"max_new_tokens": 0}', "max_new_tokens"),
        ("[1]", "JSON object"),
        ('{"do_sample": "no"}', "do_sample"),
    ],
)
def test_bad_override_is_a_settings_error(override, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(override_generation_config=override)


def test_bad_file_or_dir_fails_at_start_up(tmp_path):
    with pytest.raises(ConfigError, match="no generation_config.json"):
        defaults(generation_config=str(tmp_path / "absent"))
    (tmp_path / "generation_config.json").write_text('{"top_p": 1.5}')
    with pytest.raises(ConfigError, match="generation_config.json: top_p out of range"):
        defaults(model=str(tmp_path))


# ---- the server's plumbing (mock engine: which SamplingParams the engine is handed) ---------------


def test_server_fills_unset_fields_from_the_defaults(make_client, qwen_like):
    gen = load_generation_defaults(EngineConfig(generation_config=qwen_like), log=False)
    client = make_client(generation_defaults=gen)
    calls = record_submits(client)
    assert client.post("/v1/completions", json={"prompt": "ab"}).status_code == 200
    p = calls[-1][0]
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (0.7, 0.8, 20, 1.05, 16)
    r = client.post("/v1/completions", json={"prompt": "ab", "temperature": 1.0, "top_k": 0, "max_tokens": 100})
    assert r.status_code == 200
    p = calls[-1][0]
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (1.0, 0, 0.8, 100)  # explicit values win
    assert (
        client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    )
    assert calls[-1][0].max_tokens == 64  # chat: max_new_tokens (the context has room for it)
    caps = client.get("/v1/capabilities").json()["generation_defaults"]
    assert caps["source"].endswith("generation_config.json") and caps["values"]["top_k"] == 20


def test_completions_default_max_tokens_follows_vllm(make_client):
    """/v1/completions: min(16, max_new_tokens); chat: min(max_new_tokens, what is left of the context)."""
    few = load_generation_defaults(EngineConfig(override_generation_config={"max_new_tokens": 5}), log=False)
    client = make_client(generation_defaults=few)
    calls = record_submits(client)
    client.post("/v1/completions", json={"prompt": "ab"})
    assert calls[-1][0].max_tokens == 5
    plain = make_client()
    calls = record_submits(plain)
    plain.post("/v1/completions", json={"prompt": "ab"})
    assert calls[-1][0].max_tokens == 16 and calls[-1][0].temperature == 1.0  # the built-in defaults
    many = make_client(
        generation_defaults=load_generation_defaults(
            EngineConfig(override_generation_config={"max_new_tokens": 10_000}), log=False
        )
    )
    calls = record_submits(many)
    many.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    max_len = many.app.state.jaxserve.max_model_len
    assert calls[-1][0].max_tokens == max_len - len(calls[-1][1])


# ---- the shipped model: greedy by default ---------------------------------------------------------

SMALL = dict(
    dtype="float32",
    page_size=16,
    num_pages=64,
    max_model_len=128,
    max_num_seqs=2,
    max_num_batched_tokens=64,
    warm_up=False,
)
PROMPT = "def is_valid(self, value):\n"


@pytest.fixture(scope="module")
def default_llm():
    """The shipped model with small limits and no warm-up: only the few shapes these tests use compile."""
    from jaxserve import LLM

    return LLM(DEFAULT, **SMALL)


@pytest.fixture(scope="module")
def served(default_llm):
    """Factory: a TestClient over the shipped model's engine with the given generation-config settings."""
    from starlette.testclient import TestClient

    from jaxserve.engine.async_engine import AsyncLLMEngine
    from jaxserve.server.api import ServerOptions, create_app

    engine = AsyncLLMEngine(default_llm.engine)
    engine.start()
    clients = []

    def make(**settings):
        gen = load_generation_defaults(default_llm.config.replace(**settings))
        client = TestClient(create_app(ServerOptions(generation_defaults=gen), engine), raise_server_exceptions=False)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()
    engine.shutdown()


def texts(client, seeds, **fields) -> list[str]:
    out = []
    for seed in seeds:
        r = client.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "seed": seed, "ignore_eos": True, **fields}
        )
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def test_offline_default_is_the_models_greedy(default_llm):
    from jaxserve import SamplingParams

    assert default_llm.get_default_sampling_params().temperature == 0.0
    a, b = (default_llm.generate([PROMPT], use_tqdm=False)[0].outputs[0] for _ in range(2))
    assert a.token_ids == b.token_ids and len(a.token_ids) <= 16
    greedy = default_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert greedy[0].outputs[0].token_ids[: len(a.token_ids)] == a.token_ids


def test_server_requests_without_temperature_are_greedy(served):
    client = served()
    greedy = texts(client, [1, 2])
    assert greedy[0] == greedy[1] and greedy[0]
    assert texts(client, [1], temperature=0) == greedy[:1]
    sampled = texts(client, [1, 2, 3, 4], temperature=1.0)  # an explicit temperature still samples
    assert len(set(sampled)) > 1


def test_generation_config_vllm_and_override_restore_sampling(served):
    assert len(set(texts(served(generation_config="vllm"), [1, 2, 3, 4]))) > 1
    assert len(set(texts(served(override_generation_config='{"temperature": 1.0}'), [1, 2, 3, 4]))) > 1
