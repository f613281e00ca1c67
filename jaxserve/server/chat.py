"""Chat templates: render a list of messages into the prompt text a checkpoint was trained on.

The template is the checkpoint's own: `chat_template` in `tokenizer_config.json` (or a
`chat_template.jinja` file beside it), as `jaxserve.tokenizer.load_tokenizer` reads it. It is rendered
with Jinja2 in a sandbox, with the variables Hugging Face templates expect: `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, and the helpers `raise_exception` and
`strftime_now`.

Fallback, when the checkpoint has no template (or there is no tokenizer): ChatML,

    <|im_start|>{role}\n{content}<|im_end|>\n   (for each message)
    <|im_start|>assistant\n                      (when add_generation_prompt)

which is what jaxserve's trained byte-level tokenizers carry special tokens for. The rendered text is
tokenized without adding special tokens: a template writes its own BOS.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any, Sequence

import jinja2
import jinja2.sandbox

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template rejected the conversation (raise_exception) or failed to render."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, separators=None,
            sort_keys: bool = False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ChatRenderer:
    """Renders conversations with one tokenizer's template (or the ChatML fallback)."""

    def __init__(self, tokenizer: Any | None):
        template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        self.source = "checkpoint" if template else "fallback-chatml"
        self.template_text = template or CHATML_TEMPLATE
        self.bos_token = self._token_text(tokenizer, getattr(tokenizer, "bos_token_id", None))
        self.eos_token = self._token_text(tokenizer, getattr(tokenizer, "eos_token_id", None))
        try:
            self.template = _compile(self.template_text)
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the checkpoint's chat_template does not compile: {err}") from None

    @staticmethod
    def _token_text(tokenizer: Any, token_id: int | None) -> str:
        if tokenizer is None or token_id is None:
            return ""
        return tokenizer.id_to_token(token_id) or ""

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        try:
            text = self.template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
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
