"""Chat templates as current Hugging Face checkpoints write them, and the start-up check.

The environment (`{% generation %}`, tools, documents, special tokens, chat_template_kwargs), the
chat_template setting (a file or inline), and the errors that stop the server before anything
compiles: a template that does not compile or cannot render [system, user] names where it came from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from server_testlib import record_submits

from jaxserve import serve
from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError
from jaxserve.server.chat import ChatRenderer, ChatTemplateError, build_chat_renderer, load_chat_renderer
from jaxserve.testing.mock_engine import MockTokenizer

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "checkpoints" / "small"
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]

# The shape of SmolLM3 / Qwen3-style templates: a {% generation %} block around assistant turns,
# tools and documents when given, a kwarg (enable_thinking), tojson, strftime_now.
MODERN = (
    "{{ bos_token }}{% if tools %}[TOOLS]{{ tools | tojson }}[/TOOLS]{% endif %}"
    "{% if documents %}{% for d in documents %}[DOC {{ d.title }}]{{ d.text }}[/DOC]{% endfor %}{% endif %}"
    "{% set today = strftime_now('%Y') %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<a>{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}</a>"
    "{% else %}<{{ m.role[0] }}>{{ m.content }}</{{ m.role[0] }}>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<a>{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% endif %}"
)


def test_generation_block_renders_its_body():
    r = ChatRenderer(MockTokenizer(), template=MODERN)
    text = r.render(CONVERSATION)
    assert text == "<|endoftext|><s>Be brief.</s><u>Hi</u><a>Hello.<|endoftext|></a><u>Bye</u><a>"
    assert r.source == "setting"


def test_tools_documents_and_kwargs_reach_the_template():
    r = ChatRenderer(MockTokenizer(), template=MODERN)
    text = r.render(
        CONVERSATION[1:2],
        tools=[{"type": "function", "function": {"name": "f"}}],
        documents=[{"title": "T", "text": "body"}],
        chat_template_kwargs={"enable_thinking": False},
    )
    assert '[TOOLS][{"type": "function", "function": {"name": "f"}}][/TOOLS]' in text
    assert "[DOC T]body[/DOC]" in text and text.endswith("<a><think></think>")
    with pytest.raises(ChatTemplateError, match="messages"):
        r.render(CONVERSATION, chat_template_kwargs={"messages": []})


def test_special_token_variables_of_the_shipped_tokenizer():
    from jaxserve.loading.tokenizer import load_tokenizer

    template = "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}"
    r = ChatRenderer(load_tokenizer(DEFAULT), template=template)
    assert r.render(CONVERSATION) == "<s>|</s>|<pad>|<unk>"


def test_shipped_model_template_is_chatml_plus_tools_and_a_bare_tokenizer_falls_back(tmp_path, caplog):
    r = load_chat_renderer(EngineConfig(model=str(DEFAULT)))
    assert r.source == "checkpoint" and "chat_template.jinja" in r.origin
    chatml = ChatRenderer(None)
    for gen in (True, False):  # without tools exactly the built-in ChatML
        assert r.render(CONVERSATION, add_generation_prompt=gen) == chatml.render(
            CONVERSATION, add_generation_prompt=gen
        )
    assert "<tool_call>" in r.render(CONVERSATION, tools=[{"type": "function", "function": {"name": "f"}}])
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(DEFAULT / name, tmp_path / name)
    bare = load_chat_renderer(EngineConfig(model=str(DEFAULT), tokenizer=str(tmp_path)))
    assert bare.source == "fallback-chatml" and "ships no chat template" in caplog.text


def test_chat_template_setting_file_or_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(MODERN)
    from_file = load_chat_renderer(EngineConfig(model=str(DEFAULT), chat_template=str(path)))
    assert from_file.source == "setting" and str(path) in from_file.origin
    assert from_file.render(CONVERSATION[1:2]).startswith("<s><u>Hi</u>")  # the checkpoint's own BOS
    inline = load_chat_renderer(EngineConfig(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"))
    assert inline.render(CONVERSATION[:2]) == "Be brief.Hi"
    with pytest.raises(ConfigError, match="looks like a file path"):
        load_chat_renderer(EngineConfig(chat_template=str(tmp_path / "missing.jinja")))


def test_a_template_that_refuses_system_messages_still_passes():
    gemma_like = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    assert build_chat_renderer(MockTokenizer(), gemma_like).render(CONVERSATION[1:2]) == "Hi"


@pytest.mark.parametrize(
    "template, message",
    [
        ("{% for m in messages %}{{ m.content }}", "does not compile"),  # no endfor
        ("{{ messages[0].content.upper(1, 2, 3) }}", "cannot render"),
        ("{% generation %}{{ x }}", "does not compile"),
    ],
)
def test_broken_template_file_fails_at_start_up(tmp_path, capsys, template, message):
    path = tmp_path / "broken.jinja"
    path.write_text(template)
    with pytest.raises(ConfigError, match=message) as err:
        build_chat_renderer(MockTokenizer(), str(path))
    assert str(path) in str(err.value)
    assert serve.main(["--mock-engine", "--chat-template", str(path)]) == 2  # returns before any engine exists
    assert str(path) in capsys.readouterr().err


def test_broken_checkpoint_template_names_its_file(tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(DEFAULT, model, ignore=shutil.ignore_patterns("params", "*.py"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if %}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="chat_template in .*tokenizer_config.json does not compile"):
        load_chat_renderer(EngineConfig(model=str(model)))
    assert serve.main(["--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert f"{model / 'tokenizer_config.json'}" in err and "--chat-template" in err


def test_server_renders_with_the_start_up_renderer_and_kwargs(make_client):
    tok = MockTokenizer()
    client = make_client(chat_renderer=build_chat_renderer(tok, MODERN))
    assert client.get("/v1/capabilities").json()["chat_template"] == "setting"
    calls = record_submits(client)
    body = {
        "messages": CONVERSATION[1:2],
        "max_tokens": 2,
        "chat_template_kwargs": {"enable_thinking": False},
        "documents": [{"title": "T", "text": "x"}],
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert (
        tok.decode(calls[-1][1], skip_special_tokens=False) == "<|endoftext|>[DOC T]x[/DOC]<u>Hi</u><a><think></think>"
    )
    bad = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert bad.status_code == 400 and "add_generation_prompt" in bad.json()["error"]["message"]
    tools = client.post("/v1/chat/completions", json={**body, "tools": [{"type": "function"}]})
    assert tools.status_code == 400 and "tools[0].function" in tools.json()["error"]["message"]
