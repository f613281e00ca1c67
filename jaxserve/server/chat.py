"""Chat templates: render a list of messages into the prompt text a checkpoint was trained on.

The template is, in order of preference: the `chat_template` setting (`--chat-template FILE`, or the
template text itself); the checkpoint's own (`chat_template` in `tokenizer_config.json`, or a
`chat_template.jinja` beside it, as `jaxserve.loading.tokenizer.load_tokenizer` reads it); ChatML, only for
models that ship none (with a warning at start-up). It is rendered with Jinja2 in a sandbox, with what
current Hugging Face templates expect: `messages`, `tools`, `documents`, `add_generation_prompt`, the
special-token strings (`bos_token`, `eos_token`, `pad_token`, `unk_token`), the helpers
`raise_exception` and `strftime_now`, the `tojson` filter, loop controls, the `{% generation %}` block
(transformers marks assistant tokens with it for training masks; rendering only needs its body), and
the request's `chat_template_kwargs` (e.g. `enable_thinking`).

ChatML, the fallback:

    <|im_start|>{role}\n{content}<|im_end|>\n   (for each message)
    <|im_start|>assistant\n                      (when add_generation_prompt)

which is what jaxserve's trained byte-level tokenizers carry special tokens for. The rendered text is
tokenized without adding special tokens: a template writes its own BOS.

`load_chat_renderer(settings)` runs at server start-up, before anything compiles: a template that does
not compile, or cannot render a [system, user] conversation, stops the server with an error that
names where the template came from, rather than a fallback noticed only minutes later.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from jaxserve.errors import ConfigError

logger = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
# Variables with a request field of their own: chat_template_kwargs may not replace them.
RESERVED_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")
CHECK_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello!"},
]


class ChatTemplateError(ValueError):
    """The template rejected the conversation (raise_exception) or failed to render."""


class TemplateRaised(ChatTemplateError):
    """The template itself called raise_exception: it refuses this conversation, it is not broken."""


def _raise_exception(message: str):
    raise TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(
    value: Any, indent: int | None = None, ensure_ascii: bool = False, separators=None, sort_keys: bool = False
):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


class GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body, in a scope of its own.

    transformers' AssistantTracker also records where the body lands (the assistant-token mask used in
    training); serving only needs the text, so the block is a plain scope."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_text(tokenizer: Any, token_id: int | None) -> str | None:
    if tokenizer is None or token_id is None:
        return None
    try:
        return tokenizer.id_to_token(token_id) or None
    except Exception:  # noqa: BLE001 - an id the vocabulary lacks: the variable is just empty
        return None


def _config_token(value: Any) -> str | None:
    if isinstance(value, dict):  # older transformers write AddedToken dicts
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def special_tokens(tokenizer: Any) -> dict[str, str]:
    """bos/eos/pad/unk token strings: the tokenizer config's spelling where it names them (as
    transformers' special_tokens_map does), else the text of the tokenizer's ids; "" when unknown."""
    named: dict[str, str] = {}
    path = getattr(tokenizer, "path", None)
    if path:
        directory = Path(path) if Path(path).is_dir() else Path(path).parent
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
            try:
                data = json.loads((directory / name).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(data, dict):
                named.update({k: t for k in SPECIAL_TOKENS if (t := _config_token(data.get(k)))})
    ids = {
        "bos_token": getattr(tokenizer, "bos_token_id", None),
        "eos_token": getattr(tokenizer, "eos_token_id", None),
        "pad_token": getattr(tokenizer, "pad_token_id", None),
    }
    return {k: named.get(k) or _token_text(tokenizer, ids.get(k)) or "" for k in SPECIAL_TOKENS}


class ChatRenderer:
    """Renders conversations with one template: the given one, else the tokenizer's, else ChatML.

    `source` is "setting" (the chat_template setting), "checkpoint" or "fallback-chatml"; `origin` says
    where the template text came from, for error messages."""

    def __init__(self, tokenizer: Any | None, template: str | None = None, origin: str | None = None):
        checkpoint = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        if template is not None:
            self.source, self.template_text = "setting", template
        elif checkpoint:
            self.source, self.template_text = "checkpoint", checkpoint
        else:
            self.source, self.template_text = "fallback-chatml", CHATML_TEMPLATE
        self.origin = (
            origin
            or {
                "setting": "the chat_template setting",
                "checkpoint": "the checkpoint's chat_template",
                "fallback-chatml": "the ChatML fallback",
            }[self.source]
        )
        self.special = special_tokens(tokenizer) if tokenizer is not None else dict.fromkeys(SPECIAL_TOKENS, "")
        try:
            self.template = _compile(self.template_text)
        except jinja2.TemplateError as err:
            where = f" (line {err.lineno})" if getattr(err, "lineno", None) else ""
            raise ChatTemplateError(f"{self.origin} does not compile{where}: {err}") from None

    bos_token = property(lambda self: self.special["bos_token"])
    eos_token = property(lambda self: self.special["eos_token"])

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[dict[str, Any]] | None = None,
        documents: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        kwargs = dict(chat_template_kwargs or {})
        clash = sorted(set(kwargs) & set(RESERVED_VARIABLES))
        if clash:
            raise ChatTemplateError(
                f"chat_template_kwargs may not set {', '.join(clash)}: each is a request field of its own"
            )
        variables = {
            **self.special,
            **kwargs,
            "messages": list(messages),
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            text = self.template.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the chat template failed to render: {err}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
            raise ChatTemplateError(f"the chat template failed to render: {err!r}") from None
        if continue_final_message and messages:
            # Cut everything the template put after the last message's content (end-of-turn markers),
            # so that generation continues that message.
            last = str(messages[-1].get("content") or "")
            if last:
                cut = text.rfind(last)
                if cut < 0:
                    raise ChatTemplateError("continue_final_message: the last message is not in the rendered prompt")
                text = text[: cut + len(last)]
        return text

    def check(self) -> None:
        """Render a [system, user] conversation, or raise ChatTemplateError naming the template's origin.

        A template that refuses system messages on purpose (raise_exception, as Gemma's and older
        Mistral templates do) passes if it renders the user message alone."""
        try:
            self.render(CHECK_CONVERSATION)
            return
        except TemplateRaised as err:
            refused = err
        except ChatTemplateError as err:
            raise ChatTemplateError(
                f"{self.origin} cannot render a [system, user] conversation: "
                f"{str(err).removeprefix('the chat template failed to render: ')}"
            ) from None
        try:
            self.render(CHECK_CONVERSATION[1:])
        except ChatTemplateError as err:
            raise ChatTemplateError(f"{self.origin} cannot render a one-message [user] conversation: {err}") from None
        logger.info("%s refuses a system message (%s); conversations without one render", self.origin, refused)


def read_template_setting(value: str) -> tuple[str, str]:
    """(template text, origin) of the chat_template setting: a file's contents, or the value itself.

    As vLLM decides: a path that exists is read; a value with none of the characters a template needs
    ("{", "}", newline) is taken for a file that is missing."""
    if os.path.isfile(value):
        try:
            return Path(value).read_text(encoding="utf-8"), f"the chat template file {value}"
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"chat_template: cannot read {value}: {err}") from None
    if not any(c in value for c in "{}\n"):
        raise ConfigError(f"chat_template {value!r} looks like a file path, but there is no such file")
    return value, "the inline chat_template setting"


def checkpoint_template_origin(tokenizer: Any) -> str:
    """Where load_tokenizer found the checkpoint's template (tokenizer_config.json, else chat_template.jinja)."""
    path = getattr(tokenizer, "path", None)
    if not path:
        return "the checkpoint's chat_template"
    directory = Path(path) if Path(path).is_dir() else Path(path).parent
    config = directory / "tokenizer_config.json"
    try:
        if "chat_template" in json.loads(config.read_text(encoding="utf-8")):
            return f"the checkpoint's chat_template in {config}"
    except (OSError, ValueError):
        pass
    return f"the checkpoint's chat template {directory / 'chat_template.jinja'}"


def build_chat_renderer(tokenizer: Any | None, template_setting: str | None = None) -> ChatRenderer:
    """A checked renderer for this tokenizer and chat_template setting; ConfigError when it cannot be used."""
    template, origin = read_template_setting(template_setting) if template_setting else (None, None)
    if template is None and getattr(tokenizer, "chat_template", None):
        origin = checkpoint_template_origin(tokenizer)
    try:
        renderer = ChatRenderer(tokenizer, template, origin)
        renderer.check()
    except ChatTemplateError as err:
        hint = "" if template is not None else "; give a working one with --chat-template FILE"
        raise ConfigError(f"{err}{hint}") from None
    if renderer.source == "fallback-chatml" and tokenizer is not None:
        logger.warning(
            "the model ships no chat template: /v1/chat/completions renders ChatML "
            "(<|im_start|>role ... <|im_end|>), which this model may not have been trained on; "
            "give its template with --chat-template FILE"
        )
    elif renderer.source != "fallback-chatml":
        logger.info("chat template: %s", renderer.origin)
    return renderer


def load_chat_renderer(settings: Any) -> ChatRenderer | None:
    """The server's start-up check: load the tokenizer the engine will load, and build a checked renderer.

    None when there is no model to take a tokenizer from and no chat_template setting (the mock
    engine brings its own tokenizer; the server then builds the renderer from it, as without this)."""
    from jaxserve.loading.tokenizer import load_tokenizer

    path = getattr(settings, "tokenizer", None) or getattr(settings, "model", None)
    template_setting = getattr(settings, "chat_template", None)
    if path is None and template_setting is None:
        return None
    tokenizer = None
    if path is not None:
        try:
            tokenizer = load_tokenizer(path)
        except FileNotFoundError as err:
            if getattr(settings, "tokenizer", None) is not None:
                raise ConfigError(f"tokenizer: {err}") from None
            # no tokenizer in the model directory: the engine serves token ids only, chat is refused
    return build_chat_renderer(tokenizer, template_setting)
