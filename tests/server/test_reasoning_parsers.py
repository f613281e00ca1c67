"""Reasoning parsers on canned model outputs: whole, and streamed with the text split at every character.

The streamed pieces must add up to the non-streamed (reasoning, content), and nothing may be sent
that a longer text takes back."""

from __future__ import annotations

import pytest

from jaxserve.server.reasoning_parsers import REASONING_PARSERS, ReasoningStream, get_reasoning_parser

CASES = [
    # (model output, the prompt left the reasoning open, reasoning, content)
    ("<think>\nLet me think: 2 + 2.\n</think>\n\nIt is 4.", True, "Let me think: 2 + 2.\n", "It is 4."),
    ("Let me think: 2 + 2.\n</think>\n\nIt is 4.", True, "Let me think: 2 + 2.\n", "It is 4."),  # <think> in the prompt
    (
        '  <think>a < b and </thinking> is not the tag</think>{"x":1}',
        True,
        "a < b and </thinking> is not the tag",
        '{"x":1}',
    ),
    ("<think>\nstill going when max_tokens cut it </thi", True, "still going when max_tokens cut it </thi", ""),
    ("no tags at all", True, "no tags at all", ""),  # a reasoning that never ends: all reasoning
    ("<thinkish> is text", True, "<thinkish> is text", ""),
    ("Ünïcödé ✓</think>🎉 ü", True, "Ünïcödé ✓", "🎉 ü"),
    ("<think></think>", True, "", ""),
    ("It is 4. </think> stays", False, "", "It is 4. </think> stays"),  # the prompt closed the think block
    ("", True, "", ""),
]


def _stream(name: str, text: str, open_: bool, cuts) -> tuple[str, str]:
    stream = ReasoningStream(get_reasoning_parser(name), open_)
    reasoning = content = ""
    sent_r, sent_c = [], []
    for end in sorted(set(cuts) | {len(text)}):
        r, c = stream.update(text[:end], final=end == len(text))
        reasoning += r
        content += c
        sent_r.append(reasoning)
        sent_c.append(content)
        # never ahead of what the whole text gives
        whole_r, whole_c = stream.parser.split(text, True, open_)
        assert whole_r.startswith(reasoning) and whole_c.startswith(content), (text, end)
    return reasoning, content


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("text,open_,reasoning,content", CASES)
def test_whole_and_split_at_every_character(name, text, open_, reasoning, content):
    parser = get_reasoning_parser(name)
    assert parser.split(text, True, open_) == (reasoning, content)
    for cut in range(len(text) + 1):
        assert _stream(name, text, open_, [cut]) == (reasoning, content), cut
    assert _stream(name, text, open_, range(len(text) + 1)) == (reasoning, content)


def test_the_prompt_decides_where_the_output_starts():
    p = get_reasoning_parser("qwen3")
    assert p.reasoning_in_prompt_closed("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking=False
    assert not p.reasoning_in_prompt_closed("<|im_start|>assistant\n<think>\n")
    assert not p.reasoning_in_prompt_closed("<|im_start|>assistant\n")
    assert not p.reasoning_in_prompt_closed(None)


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_parser("nope")
