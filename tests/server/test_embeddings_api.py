"""POST /v1/embeddings over the fake pooling engine (jaxserve/testing/fake_pooling.py: the real host
state machine and HTTP layer, no model): the official `openai` client (base64 by default, and
float), every input form, usage, the 400s naming the problem, a generation server's 400, and
schemathesis over the route. Parity with sentence-transformers on real models:
tests/model/test_embeddings_parity.py."""

from __future__ import annotations

import numpy as np
import pytest
from starlette.testclient import TestClient

from jaxserve.engine.pooling_config import PoolerConfig
from jaxserve.server.api import ServerOptions, create_app
from jaxserve.testing.fake_pooling import fake_pooling_engine, token_states

import openai


class WordTokenizer:
    """'w5 w17' -> [5, 17]; any other word, its length."""

    def encode(self, text, add_special_tokens=True):
        return [int(w[1:]) if w[:1] == "w" and w[1:].isdigit() else len(w) % 512 for w in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


def expected(ids, dims=None):
    v = token_states(ids, 16).mean(0)[:dims]
    return v / np.linalg.norm(v)


@pytest.fixture(scope="module")
def served():
    pooler = PoolerConfig(pooling_type="MEAN", matryoshka=True, matryoshka_dimensions=(8, 16))
    engine = fake_pooling_engine(pooler, tokenizer=WordTokenizer(), max_tokens=16, max_rows=4)
    engine.start()
    client = TestClient(create_app(ServerOptions(served_model_names=("emb",)), engine, shutdown_engine=True))
    with client:
        yield client, engine


def test_openai_client_base64_and_float(served):
    client, _ = served
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)
    texts = ["w1 w2 w3", "w7", " ".join(f"w{i}" for i in range(40))]  # the last runs in three chunks
    got = oai.embeddings.create(model="emb", input=texts)  # the client asks for base64
    assert [d.index for d in got.data] == [0, 1, 2]
    for text, d in zip(texts, got.data):
        np.testing.assert_allclose(d.embedding, expected([int(w[1:]) for w in text.split()]), rtol=1e-5, atol=1e-6)
    assert got.usage.prompt_tokens == got.usage.total_tokens == 44 and got.model == "emb"
    floats = oai.embeddings.create(model="emb", input=[[3, 4], [5]], encoding_format="float", dimensions=8)
    np.testing.assert_allclose(floats.data[1].embedding, expected([5], 8), rtol=1e-5, atol=1e-6)
    assert len(floats.data[0].embedding) == 8


@pytest.mark.parametrize(
    "body",
    [{"input": "w9 w10"}, {"input": ["w9 w10"]}, {"input": [9, 10]}, {"input": [[9, 10]]}],
)
def test_every_input_form(served, body):
    client, _ = served
    r = client.post("/v1/embeddings", json={**body, "user": "u1"})
    assert r.status_code == 200, r.text
    (item,) = r.json()["data"]
    np.testing.assert_allclose(item["embedding"], expected([9, 10]), rtol=1e-5, atol=1e-6)
    assert r.json()["usage"] == {"prompt_tokens": 2, "total_tokens": 2}


@pytest.mark.parametrize(
    "body, says",
    [
        ({"input": []}, "input is empty"),
        ({"input": ""}, "input is an empty string"),
        ({"input": [[1], []]}, "input[1]: the prompt is empty"),
        ({"input": list(range(65))}, "maximum context length is 64"),
        ({"input": [1, 512]}, "token id 512 is outside the vocabulary"),
        ({"input": [[1], [-3]]}, "input[1]: token id -3"),
        ({"input": 5}, "invalid request"),
        ({"input": [1.5]}, "invalid request"),
        ({"input": ["a", 3]}, "invalid request"),
        ({"input": [True]}, "invalid request"),
        ({"input": "w1", "dimensions": 6}, "not one this model was trained for"),
        ({"input": "w1", "dimensions": 0}, "at least 1"),
        ({"input": "w1", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "w1", "temperature": 1}, "unsupported parameter 'temperature'"),
        ({}, "input"),
    ],
)
def test_bad_input_is_a_400_naming_it(served, body, says):
    client, engine = served
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]
    assert not engine.core.has_unfinished_requests()


def test_pooling_server_refuses_generation(served):
    client, _ = served
    for route, body in [
        ("/v1/completions", {"prompt": "w1", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}]}),
        ("/v1/responses", {"input": "w1"}),
    ]:
        r = client.post(route, json=body)
        assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"], route
    assert client.post("/v1/embeddings", json={"input": "w1", "model": "other"}).status_code == 404


def test_generation_server_says_how_to_serve_embeddings(client):
    r = client.post("/v1/embeddings", json={"input": "hello"})
    assert r.status_code == 400
    assert "--runner pooling" in r.json()["error"]["message"]


# ---- schemathesis over the route, on the fake pooling engine --------------------------------------

import schemathesis  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error, status_code_conformance  # noqa: E402

_fuzzed = fake_pooling_engine(PoolerConfig(pooling_type="LAST"), tokenizer=WordTokenizer())
_fuzzed.start()
_app = create_app(ServerOptions(served_model_names=("emb",), max_body_bytes=64 * 1024), _fuzzed)
schema = schemathesis.openapi.from_asgi("/openapi.json", _app).include(path="/v1/embeddings")


@pytest.fixture(scope="module", autouse=True)
def _stop_fuzzed():
    yield
    _fuzzed.shutdown()


@schema.parametrize()
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_fuzz_embeddings_route(case):
    response = case.call()
    case.validate_response(response, checks=[not_a_server_error, status_code_conformance])
    assert response.status_code in (200, 400, 404, 405, 413), response.text  # 404: a model not served
    if response.status_code >= 400:
        assert "error" in response.json()
