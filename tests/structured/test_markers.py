"""held_back: the tail withheld while it may still become a marker, for text and for bytes."""

import pytest

from jaxserve.structured.markers import held_back


@pytest.mark.parametrize(
    "text, markers, want",
    [
        ("hello", ["</think>"], 0),
        ("hello <", ["</think>"], 1),
        ("hello </thi", ["</think>"], 5),
        ("hello </think>", ["</think>"], 0),  # a whole marker is the caller's to find, not withheld
        ("", ["STOP"], 0),
        ("ST", ["STOP"], 2),
        ("abc", ["x"], 0),  # a one-character marker has no proper prefix
        ("the en", ["end", "the end"], 6),  # the longest tail over all markers
        ("the en", ["the end", "end"], 6),
        ("ab", [], 0),
    ],
)
def test_held_back_text(text, markers, want):
    assert held_back(text, markers) == want


def test_held_back_bytes():
    assert held_back(b"reasoning </th", (b"</think>",)) == 4
    assert held_back(b"reasoning", (b"</think>",)) == 0


def test_held_back_matches_every_tail():
    """Against the definition: the largest k < len(marker) with text ending in marker[:k]."""
    markers = ["<tool_call>", "aab", "abab"]
    for text in ["", "a", "aa", "aab", "xaba", "<tool", "ab<tool_ca", "aaba"]:
        want = max(
            (k for m in markers for k in range(1, min(len(m) - 1, len(text)) + 1) if text.endswith(m[:k])), default=0
        )
        assert held_back(text, markers) == want, text
