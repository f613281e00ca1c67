"""Chat templates: the checkpoint's own (tokenizer_config.json), rendered with Jinja2; ChatML as fallback."""

from __future__ import annotations

import json
import shutil

import pytest

from jaxserve.server.chat import CHATML_TEMPLATE, ChatRenderer, ChatTemplateError
from jaxserve.testing.mock_engine import MockTokenizer

MESSAGES = [
    {"role": "system", "content": "Be kind."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Again?"},
]

# A Hugging Face style template: BOS, role alternation enforced with raise_exception, loop controls.
HF_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '[SYS]' + message['content'] + '[/SYS]' }}{% continue %}{% endif %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 1) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)


def test_chatml_fallback():
    r = ChatRenderer(None)
    assert r.source == "fallback-chatml" and r.template_text == CHATML_TEMPLATE
    text = r.render(MESSAGES[:2])
    assert text == "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    assert not r.render(MESSAGES[:2], add_generation_prompt=False).endswith("assistant\n")


def test_checkpoint_template_and_its_errors():
    r = ChatRenderer(MockTokenizer(chat_template=HF_TEMPLATE))
    assert r.source == "checkpoint"
    text = r.render(MESSAGES)
    assert text == "<|endoftext|>[SYS]Be kind.[/SYS][INST] Hi! [/INST] Hello.<|endoftext|>[INST] Again? [/INST]"
    with pytest.raises(ChatTemplateError, match="alternate"):
        r.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_continue_final_message():
    r = ChatRenderer(None)
    text = r.render(
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "The answer is"}],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert text.endswith("<|im_start|>assistant\nThe answer is")


def test_template_is_sandboxed():
    r = ChatRenderer(MockTokenizer(chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}"))
    with pytest.raises(ChatTemplateError):
        r.render(MESSAGES)


def test_server_uses_the_checkpoint_template(make_client):
    tok = MockTokenizer(chat_template=HF_TEMPLATE)
    client = make_client(tokenizer=tok)
    assert client.get("/v1/capabilities").json()["chat_template"] == "checkpoint"
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == 200, r.text
    expected = tok.encode(ChatRenderer(tok).render(MESSAGES), add_special_tokens=False)
    assert r.json()["usage"]["prompt_tokens"] == len(expected)
    bad = client.post("/v1/chat/completions", json={"messages": [MESSAGES[1], MESSAGES[1]], "max_tokens": 2})
    assert bad.status_code == 400 and "alternate" in bad.json()["error"]["message"]
    parts = client.post(
        "/v1/chat/completions",
        json={
            "max_tokens": 2,
            "messages": [
                MESSAGES[0],
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]},
            ],
        },
    )
    plain = client.post("/v1/chat/completions", json={"max_tokens": 2, "messages": MESSAGES[:2]})
    assert parts.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]


def test_template_from_tokenizer_config(bytelevel_tokenizer_dir, tmp_path):
    """The template a checkpoint ships in tokenizer_config.json is the one used."""
    from jaxserve.loading.tokenizer import load_tokenizer

    tok_dir = tmp_path / "tok"
    shutil.copytree(bytelevel_tokenizer_dir, tok_dir)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = HF_TEMPLATE
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tok_dir)
    r = ChatRenderer(tok)
    assert r.source == "checkpoint" and r.bos_token == "<|endoftext|>"
    text = r.render(MESSAGES[:2])
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=False) == text
    # the trained tokenizer without a template falls back to ChatML, whose markers are single tokens
    plain = load_tokenizer(bytelevel_tokenizer_dir)
    fallback = ChatRenderer(plain)
    assert fallback.source == "fallback-chatml"
    ids = plain.encode(fallback.render(MESSAGES[1:2]), add_special_tokens=False)
    assert ids[0] == plain.token_to_id("<|im_start|>")
