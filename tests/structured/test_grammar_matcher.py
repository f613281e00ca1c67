"""GrammarMatcher on the shipped tokenizers: random walks under JSON schemas, regexes and choices
produce text that parses and validates; compact JSON; EOS after the end; copy, rollback, reset; batches."""

import json
import re

import llguidance
import numpy as np
import pytest
from structured_walk import random_walk

from jaxserve.structured import (
    GrammarMatcher,
    StructuredSpec,
    allocate_bitmask,
    allowed_tokens,
    fill_bitmasks,
)
from jaxserve.structured.tokenizer_bridge import sentencepiece_token_bytes

# The acceptance schema: nested object, array with maxItems, enum, bounded integer, string
# with maxLength, optional fields (address, score, nickname).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "floor": {"type": "integer", "minimum": -2, "maximum": 30},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "score": {"type": "integer", "minimum": 0, "maximum": 5},
        "nickname": {"type": "string", "maxLength": 4},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


def check(schema: dict, value) -> None:
    """A validator for the keywords SCHEMA uses (jsonschema_rs, when installed, checks it too)."""
    if "enum" in schema:
        assert value in schema["enum"], value
        return
    t = schema["type"]
    if t == "object":
        assert isinstance(value, dict)
        assert set(schema.get("required", ())) <= value.keys(), value
        if schema.get("additionalProperties") is False:
            assert value.keys() <= schema["properties"].keys(), value
        for k, v in value.items():
            check(schema["properties"][k], v)
    elif t == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
        for v in value:
            check(schema["items"], v)
    elif t == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), value
    elif t == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", len(value)), value
    else:
        raise AssertionError(f"check() does not know type {t!r}")


def validator(schema):
    try:
        import jsonschema_rs
    except ImportError:
        return lambda v: None
    v = jsonschema_rs.validator_for(schema)
    return v.validate


@pytest.mark.parametrize("seed", range(12))
def test_json_schema_random_walk_parses_and_validates(any_compiler, seed):
    compiler, tok = any_compiler
    g = compiler.compile(StructuredSpec.json_schema(SCHEMA))
    ids = random_walk(g, np.random.default_rng(seed))
    text = tok.decode(ids)
    value = json.loads(text)
    check(SCHEMA, value)
    validator(SCHEMA)(value)
    # Compact: no whitespace outside string literals.
    assert not re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', '""', text)), text


def test_optional_fields_are_sometimes_written(any_compiler):
    compiler, tok = any_compiler
    g = compiler.compile(StructuredSpec.json_schema(SCHEMA))
    keys = set()
    for seed in range(40):
        keys |= json.loads(tok.decode(random_walk(g, np.random.default_rng(100 + seed)))).keys()
    assert keys == SCHEMA["properties"].keys()


def test_compact_json_allows_no_whitespace(compiler, sp_tokenizer):
    g = compiler.compile(StructuredSpec.json_object())
    m = g.matcher()
    assert m.advance(sp_tokenizer.token_to_id("{"))
    allowed = allowed_tokens(m.allowed_bitmask(), g.vocab_size)
    texts = [sp_tokenizer.decode([sp_tokenizer.token_to_id("a"), int(t)])[1:] for t in allowed]
    assert texts and not any(s[:1].isspace() for s in texts)
    # With compact_json=False JSON's optional whitespace is allowed there.
    loose = compiler.compile(StructuredSpec.json_object(compact_json=False)).matcher()
    assert loose.advance(sp_tokenizer.token_to_id("{"))
    space = sp_tokenizer.token_to_id("\u2581")
    assert space in allowed_tokens(loose.allowed_bitmask(), g.vocab_size) and space not in allowed


def test_json_object_accepts_a_document_and_then_only_eos(compiler):
    g = compiler.compile(StructuredSpec.json_object())
    m = g.matcher()
    doc = '{"a":[1,2.5,{"b":null}],"c":"x y","d":true}'
    assert m.advance_many(compiler.ll_tokenizer.tokenize_str(doc))
    assert m.is_finished and m.is_accepting
    assert allowed_tokens(m.allowed_bitmask(), g.vocab_size).tolist() == list(g.eos_token_ids)
    assert m.advance(g.eos_token_ids[0])


@pytest.mark.parametrize("seed", range(10))
def test_regex_random_walk_matches(any_compiler, seed):
    compiler, tok = any_compiler
    pattern = r"[A-Z][a-z]{1,6}-\d{2,4}(\.(txt|json))?"  # \d: ASCII digits only
    g = compiler.compile(StructuredSpec.regex(pattern))
    text = tok.decode(random_walk(g, np.random.default_rng(seed)))
    assert re.fullmatch(pattern, text, re.ASCII), text


@pytest.mark.parametrize("seed", range(10))
def test_choice_random_walk_is_one_of_the_choices(any_compiler, seed):
    compiler, tok = any_compiler
    choices = ["positive", "negative", "neutral", "positive but unsure", 'say "no"']
    g = compiler.compile(StructuredSpec.choice(choices))
    assert tok.decode(random_walk(g, np.random.default_rng(seed))) in choices


def test_grammar_random_walk(compiler, sp_tokenizer):
    g = compiler.compile(StructuredSpec.grammar('start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'))
    for seed in range(5):
        text = sp_tokenizer.decode(random_walk(g, np.random.default_rng(seed)))
        assert re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", text), text


def test_forbidden_token_puts_the_matcher_in_error_and_forces_eos(compiler, sp_tokenizer):
    g = compiler.compile(StructuredSpec.choice(["yes", "no"]))
    m = g.matcher()
    assert not m.advance(sp_tokenizer.token_to_id("{"))
    assert m.is_error and m.error
    assert allowed_tokens(m.allowed_bitmask(), g.vocab_size).tolist() == list(g.eos_token_ids)
    m.reset()
    assert not m.is_error and m.num_tokens == 0


def test_copy_forks_independent_states(compiler, sp_tokenizer):
    g = compiler.compile(StructuredSpec.choice(["yes", "no"]))
    a = g.matcher()
    b = a.copy()
    assert a.advance(sp_tokenizer.token_to_id("y"))
    assert np.array_equal(b.allowed_bitmask(), g.matcher().allowed_bitmask())  # b did not move
    assert b.advance(sp_tokenizer.token_to_id("n")) and b.num_tokens == 1
    c = a.copy()
    assert c.num_tokens == 1 and np.array_equal(c.allowed_bitmask(), a.allowed_bitmask())


def test_rollback_restores_earlier_masks(compiler):
    g = compiler.compile(StructuredSpec.json_schema(SCHEMA))
    ids = random_walk(g, np.random.default_rng(7))
    m = g.matcher()
    masks = []
    for t in ids:
        masks.append(m.allowed_bitmask())
        assert m.advance(t)
    assert m.is_finished
    m.rollback(5)
    assert m.num_tokens == len(ids) - 5 and not m.is_finished
    assert np.array_equal(m.allowed_bitmask(), masks[-5])
    assert m.advance_many(ids[-5:]) and m.is_finished
    m.rollback(len(ids))  # the whole output
    assert np.array_equal(m.allowed_bitmask(), masks[0])
    with pytest.raises(ValueError, match="cannot roll back 1 tokens; 0 were consumed"):
        m.rollback(1)


def test_validate_tokens_does_not_consume(compiler):
    g = compiler.compile(StructuredSpec.json_schema(SCHEMA))
    ids = random_walk(g, np.random.default_rng(3))
    m = g.matcher()
    bad = ids[:4] + [compiler.ll_tokenizer.tokenize_str("}")[0]] + ids[5:]
    assert m.validate_tokens(ids) == len(ids)
    assert m.validate_tokens(bad) == 4
    assert m.num_tokens == 0 and np.array_equal(m.allowed_bitmask(), g.matcher().allowed_bitmask())


def test_fill_bitmasks_batch_matches_one_by_one(compiler):
    specs = [StructuredSpec.json_schema(SCHEMA), StructuredSpec.regex(r"\d+"), StructuredSpec.choice(["a", "bc"])]
    matchers: list[GrammarMatcher] = []
    for i, s in enumerate(specs * 2):
        g = compiler.compile(s)
        m = g.matcher()
        m.advance_many(random_walk(g, np.random.default_rng(i))[:i])
        matchers.append(m)
    rows = [(m, 2 * i) for i, m in enumerate(matchers)]  # odd rows: unconstrained
    expected = allocate_bitmask(12, 8192)
    for m, i in rows:
        m.fill_bitmask(expected[i])
    for executor in (None, llguidance.LLExecutor(2)):
        out = allocate_bitmask(12, 8192)
        fill_bitmasks(rows, out, executor)
        assert np.array_equal(out, expected)
        assert (out[1::2] == -1).all()


def test_mask_row_checks(compiler):
    m = compiler.compile(StructuredSpec.regex("a")).matcher()
    with pytest.raises(ValueError, match=r"C-contiguous int32 \[256\]"):
        m.fill_bitmask(np.zeros(256, np.int64))
    with pytest.raises(ValueError, match="outside out's 1 rows"):
        fill_bitmasks([(m, 1)], allocate_bitmask(1, 8192))


def test_sentencepiece_bridge_bytes_agree_with_decode(sp_tokenizer, compiler):
    tokens = sentencepiece_token_bytes(sp_tokenizer)
    sp = sp_tokenizer.backend
    assert tokens[sp_tokenizer.eos_token_id].startswith(b"\xff")
    assert tokens[4] == b"\x00" and tokens[259] == b"\xff" and not tokens[259].startswith(b"\xff<")
    anchor = sp_tokenizer.token_to_id("a")
    for i in range(260, sp.vocab_size(), 7):
        # Decoding after an anchor token keeps a leading space that a first piece would lose.
        assert sp_tokenizer.decode([anchor, i]).encode()[1:] == tokens[i], i
    text = 'Résumé: {"naïve": [1, 2]}\n\tend  😀'
    ids = compiler.ll_tokenizer.tokenize_str(text)
    assert b"".join(tokens[i] for i in ids) == text.encode()


def test_accepting_is_not_finished_and_a_cut_output_is_not_accepting(compiler, sp_tokenizer):
    g = compiler.compile(StructuredSpec.regex("a+"))
    m = g.matcher()
    assert not m.is_accepting
    assert m.advance(sp_tokenizer.token_to_id("a"))
    assert m.is_accepting and not m.is_finished  # may stop here or go on
    allowed = allowed_tokens(m.allowed_bitmask(), g.vocab_size)
    assert set(g.eos_token_ids) <= set(allowed) and sp_tokenizer.token_to_id("a") in allowed
    cut = compiler.compile(StructuredSpec.json_schema(SCHEMA)).matcher()
    assert cut.advance_many(compiler.ll_tokenizer.tokenize_str('{"name":"x"'))
    assert not cut.is_accepting  # max_tokens here: finish_reason "length", not valid JSON
