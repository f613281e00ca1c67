"""Reasoning parsers (`--reasoning-parser`): a reasoning model's output -> reasoning_content and content.

Models that think before they answer write `<think> ... </think>` and then the answer (Qwen3,
DeepSeek-R1, QwQ). A parser reads the cumulative text of one choice (`split(text, final)`) and
returns (reasoning, content); every value a prefix of the text produces is a prefix of what a
longer text produces (a tail that may still become `</think>`, or an output start that may still
become `<think>`, is held back until it is decided), so `ReasoningStream` streams by difference
and the streamed `delta.reasoning_content` pieces add up to the non-streamed `reasoning_content`.

Where the reasoning starts is decided by the prompt, not guessed from the output: the output is
reasoning from its first token (its own `<think>`, if it writes one, dropped) unless the prompt
already closed the think block (`reasoning_in_prompt_closed`: Qwen3's template with
`enable_thinking=False` ends the prompt with an empty `<think>\\n\\n</think>`), in which case it is
all content. An output that never writes `</think>` is all reasoning (content None). Tool-call
parsing and the grammar of a constrained request apply to the content only.

Names: `qwen3` and `deepseek_r1` (vLLM's), both this `<think>`/`</think>` format.
"""

from __future__ import annotations

import dataclasses

from jaxserve.structured.markers import held_back

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStream", "get_reasoning_parser"]

_WS = " \t\r\n"


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    """One `<think>`-style format; stateless (every call reads the whole text so far)."""

    name: str
    start: str = "<think>"
    end: str = "</think>"

    def reasoning_in_prompt_closed(self, prompt: str | None) -> bool:
        """The prompt ends with a closed think block: the output is the answer, with no reasoning."""
        return prompt is not None and prompt.rstrip(_WS).endswith(self.end)

    def split(self, text: str, final: bool, reasoning: bool = True) -> tuple[str, str]:
        """(reasoning, content) of `text`; `reasoning` False: the prompt closed the think block."""
        if not reasoning:
            return "", text
        i = len(text) - len(text.lstrip(_WS))
        body = 0
        if text.startswith(self.start, i):
            body = i + len(self.start)
        elif not final and self.start.startswith(text[i:]):
            return "", ""  # (only whitespace, or) the start of `<think>` so far: undecided
        close = text.find(self.end, body)
        if close < 0:
            part = text[body:]
            if not final:
                part = part[: len(part) - held_back(part, (self.end,))]
            return part.lstrip(_WS), ""
        return text[body:close].lstrip(_WS), text[close + len(self.end) :].lstrip(_WS)


REASONING_PARSERS: dict[str, ReasoningParser] = {
    p.name: p for p in (ReasoningParser("qwen3"), ReasoningParser("deepseek_r1"))
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r} (expected one of {', '.join(REASONING_PARSERS)})"
        ) from None


class ReasoningStream:
    """One choice's reasoning and content, streamed: cumulative text in, new pieces out."""

    def __init__(self, parser: ReasoningParser, reasoning: bool = True):
        self.parser = parser
        self.reasoning = reasoning  # False: the prompt closed the think block (all content)
        self.reasoning_sent = 0
        self.content_sent = 0

    def split(self, text: str, final: bool = False) -> tuple[str, str]:
        return self.parser.split(text, final, self.reasoning)

    def update(self, text: str, final: bool = False) -> tuple[str, str]:
        """(new reasoning, new content) since the last call."""
        reasoning, content = self.split(text, final)
        new_r, new_c = reasoning[self.reasoning_sent :], content[self.content_sent :]
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        self.content_sent = max(self.content_sent, len(content))
        return new_r, new_c
