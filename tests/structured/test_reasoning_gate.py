"""The reasoning gate: free tokens (but EOS) until the output holds `</think>`, then exactly the grammar's masks."""

from __future__ import annotations

import json

import llguidance
import numpy as np
import pytest

from jaxserve.structured import GrammarMatcher, ReasoningGatedMatcher, StructuredSpec, allowed_tokens, fill_bitmasks
from jaxserve.structured.bitmask import allocate_bitmask

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


def _spec():
    return StructuredSpec.json_schema(SCHEMA).after_reasoning("</think>")


def _ids(compiler, text):
    """`text`'s tokens as a continuation (no sentencepiece dummy prefix)."""
    return compiler.ll_tokenizer.tokenize_str(text)


def test_spec_key_and_plain_matcher_without_a_marker(compiler):
    assert _spec() != StructuredSpec.json_schema(SCHEMA) and hash(_spec()) == hash(_spec())
    assert isinstance(compiler.compile(StructuredSpec.json_schema(SCHEMA)).matcher(), GrammarMatcher)
    assert isinstance(compiler.compile(_spec()).matcher(), ReasoningGatedMatcher)


def test_free_until_the_marker_then_the_grammar(any_compiler):
    compiler, tok = any_compiler
    g = compiler.compile(_spec())
    m = g.matcher()
    eos = set(g.eos_token_ids)
    free = set(allowed_tokens(m.allowed_bitmask(), g.vocab_size).tolist())
    assert not free & eos and len(free) >= g.vocab_size - len(eos) - 50  # everything but EOS (and a few marker tokens)
    reasoning = "<think>\nThe user wants a and b. </thi no, not yet.\n"
    for t in _ids(compiler, reasoning):
        assert m.advance(t) and m.in_reasoning and not m.is_finished and not m.is_accepting
    for t in _ids(compiler, "</think>"):
        assert m.advance(t)
    assert not m.in_reasoning
    plain = compiler.compile(StructuredSpec.json_schema(SCHEMA)).matcher()
    answer = '{"a":12,"b":"hey"}'
    # After the marker the gated matcher's masks are the grammar's, token by token.
    ids = _answer_ids(compiler, tok, answer)
    for t in ids:
        assert np.array_equal(m.allowed_bitmask(), plain.allowed_bitmask())
        assert m.advance(t) and plain.advance(t)
    assert m.is_accepting and json.loads(compiler.ll_tokenizer.decode_str(ids)) == {"a": 12, "b": "hey"}
    assert m.num_tokens == len(_ids(compiler, reasoning)) + len(_ids(compiler, "</think>")) + len(ids)


def _answer_ids(compiler, tok, answer):
    """The answer's tokens as a masked decoder would pick them: greedy by the grammar, preferring the text."""
    m = compiler.compile(StructuredSpec.json_schema(SCHEMA)).matcher()
    ids, done = [], ""
    while done != answer:
        allowed = allowed_tokens(m.allowed_bitmask(), compiler.vocab_size).tolist()
        text = {t: compiler.ll_tokenizer.decode_str([t]) for t in allowed}
        best = max((t for t in allowed if text[t] and answer.startswith(done + text[t])), key=lambda t: len(text[t]))
        ids.append(best)
        done += text[best]
        assert m.advance(best)
    return ids


def test_marker_split_over_tokens_and_in_one_token_with_the_answer(any_compiler):
    compiler, tok = any_compiler
    g = compiler.compile(_spec())
    gate = g.gate
    # A token that would end the marker and go on with answer text is masked out, whatever was written before.
    m = g.matcher()
    for t in _ids(compiler, "hmm </th"):
        m.advance(t)
    row = m.allowed_bitmask()
    for t in allowed_tokens(row, g.vocab_size).tolist():
        b = b"</th" + gate.token_bytes[t]
        p = b.find(b"</think>")
        assert p < 0 or not b[p + 8 :].strip()
    # Forced anyway ("ink>{" as tokens after "</th"), the answer bytes go to the grammar.
    for t in _ids(compiler, 'ink>{"a":'):
        m.advance(t)
    assert not m.in_reasoning and not m.is_error


def test_fill_bitmasks_copy_rollback(any_compiler):
    compiler, tok = any_compiler
    g = compiler.compile(_spec())
    plain = compiler.compile(StructuredSpec.json_schema(SCHEMA))
    thinking, answering, free = g.matcher(), g.matcher(), plain.matcher()
    for t in _ids(compiler, "<think>ok</think>"):
        answering.advance(t)
    fork = answering.copy()
    out = allocate_bitmask(3, g.vocab_size)
    out[:] = 0  # stale rows: every row must be written
    fill_bitmasks([(thinking, 0), (answering, 1), (free, 2)], out, llguidance.LLExecutor())
    assert np.array_equal(out[0], thinking.allowed_bitmask())
    assert np.array_equal(out[1], out[2])  # after the marker: the grammar's first mask
    assert np.array_equal(fork.allowed_bitmask(), out[1])
    n = answering.num_tokens
    answering.rollback(n - 1)  # back into the reasoning
    assert answering.in_reasoning and answering.num_tokens == 1
    assert not fork.in_reasoning  # the fork is independent
    with pytest.raises(ValueError):
        answering.rollback(5)


def test_gate_masks_are_built_once_per_marker(compiler):
    a = compiler.compile(_spec())
    b = compiler.compile(StructuredSpec.regex("[0-9]+").after_reasoning("</think>"))
    assert a.gate is b.gate and a.gate.masks.shape == (len("</think>"), (compiler.vocab_size + 31) // 32)
