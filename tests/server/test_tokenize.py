"""POST /tokenize and /detokenize (vLLM's shapes) and the logit_bias field's 400s, in-process over the mock engine."""

from __future__ import annotations

import pytest

from jaxserve.testing.mock_engine import VOCAB_SIZE, MockTokenizer


def assert_error(r, status, *needles):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    for needle in needles:
        assert needle in err["message"] or needle == err["param"], (needle, err)
    return err


def test_tokenize_detokenize_round_trip(client):
    text = "The quick brown fox <|im_end|> jumps"
    r = client.post("/tokenize", json={"prompt": text, "model": "mock"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens"] == MockTokenizer().encode(text) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 512
    back = client.post("/detokenize", json={"tokens": out["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_tokenize_chat_renders_the_chat_template_as_chat_completions_does(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = client.post("/tokenize", json={"messages": messages, "return_token_strs": True}).json()
    want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert out["tokens"] == MockTokenizer().encode(want) and out["count"] == len(out["tokens"])
    assert "".join(out["token_strs"]) == want
    chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == out["count"]
    no_gen = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_gen["count"] == out["count"] - len(MockTokenizer().encode("<|im_start|>assistant\n"))


def test_capabilities_list_the_endpoints(client):
    caps = client.get("/v1/capabilities").json()
    assert {"POST /tokenize", "POST /detokenize"} <= set(caps["endpoints"])
    assert "logit_bias" in caps["completions"]["fields"] and "logit_bias" in caps["chat_completions"]["fields"]
    assert caps["limits"]["max_logit_bias"] == 300


@pytest.mark.parametrize(
    "path,body,status,needle",
    [
        ("/detokenize", {"tokens": [5, VOCAB_SIZE]}, 400, "vocabulary"),
        ("/detokenize", {"tokens": [-1]}, 400, "vocabulary"),
        ("/detokenize", {"tokens": []}, 400, "empty"),
        ("/tokenize", {"prompt": ""}, 400, "empty"),
        ("/tokenize", {}, 400, "exactly one of prompt or messages"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "exactly one"),
        ("/tokenize", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_bad_tokenize_input_is_a_named_error(client, path, body, status, needle):
    assert_error(client.post(path, json=body), status, needle)
    assert client.post("/tokenize", json={"prompt": "still serving"}).status_code == 200


def test_without_a_tokenizer_tokenize_is_a_400(make_client):
    client = make_client()
    client.app.state.jaxserve.engine.engine.tokenizer = None
    assert_error(client.post("/tokenize", json={"prompt": "x"}), 400, "no tokenizer")
    assert_error(client.post("/detokenize", json={"tokens": [5]}), 400, "no tokenizer")


@pytest.mark.parametrize(
    "bias,needle",
    [
        ({"5": 100.5}, "[-100, 100]"),
        ({"5": -101}, "[-100, 100]"),
        ({"x": 1}, "token ids"),
        ({"-3": 1}, "negative"),
        ({str(VOCAB_SIZE): 1}, "vocabulary"),
        ({str(i): 1 for i in range(301)}, "300"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_logit_bias_is_a_400_naming_it(client, path, bias, needle):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    err = assert_error(client.post(path, json={**body, "max_tokens": 2, "logit_bias": bias}), 400, needle)
    assert "logit_bias" in err["message"]
    ok = client.post(path, json={**body, "max_tokens": 2, "logit_bias": {"5": 100, "6": -100}})
    assert ok.status_code == 200, ok.text
