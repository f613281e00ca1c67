"""GrammarCompiler: cache hits, off-thread compilation, and GrammarError for what llguidance rejects."""

import threading

import numpy as np
import pytest
from structured_walk import random_walk

from jaxserve.structured import GrammarCompiler, GrammarError, StructuredSpec, unpack_bitmask


def test_cache_hit_returns_the_same_compiled_grammar(sp_tokenizer):
    with GrammarCompiler(sp_tokenizer) as c:
        spec = StructuredSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
        g1 = c.compile(spec)
        g2 = c.compile(StructuredSpec.json_schema('{"type":"object","properties":{"a":{"type":"integer"}}}'))
        assert g1 is g2
        info = c.cache_info()
        assert (info.hits, info.misses, info.size) == (1, 1, 1)
        assert c.compile(StructuredSpec.json_schema({"type": "object"}, strict=False)) is not g1
        assert c.cache_info().misses == 2


def test_submit_is_asynchronous_and_shared_between_threads(sp_tokenizer):
    with GrammarCompiler(sp_tokenizer, max_workers=2) as c:
        spec = StructuredSpec.regex(r"[a-z]{3}")
        futures, lock = [], threading.Lock()

        def go():
            f = c.submit(spec)
            with lock:
                futures.append(f)

        threads = [threading.Thread(target=go) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({id(f) for f in futures}) == 1  # one compilation, shared
        assert futures[0].result(timeout=30).spec == spec
        assert c.cache_info().misses == 1 and c.cache_info().hits == 7


def test_lru_eviction(sp_tokenizer):
    with GrammarCompiler(sp_tokenizer, cache_size=2) as c:
        a, b, d = (StructuredSpec.choice([x]) for x in "abd")
        ga = c.compile(a)
        c.compile(b)
        c.compile(a)  # a is now the most recent
        c.compile(d)  # evicts b
        assert c.cache_info().size == 2
        assert c.compile(a) is ga
        misses = c.cache_info().misses
        c.compile(b)
        assert c.cache_info().misses == misses + 1


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            StructuredSpec.regex(r"(?=a)b"),
            "regex '(?=a)b': look-around, including look-ahead and look-behind, is not supported",
        ),
        (StructuredSpec.regex(r"(a)\1"), r"regex '(a)\\1': backreferences are not supported"),
        (StructuredSpec.regex(r"[a-"), "regex '[a-': "),
        (
            StructuredSpec.json_schema({"type": "integer", "minimum": 5, "maximum": 1}),
            "json_schema: Unsatisfiable schema: minimum (5) is greater than maximum (1)",
        ),
        (
            StructuredSpec.json_schema({"properties": {"a": {"$ref": "#/$defs/missing"}}}),
            "json_schema: Pointer '/$defs/missing' does not exist",
        ),
        (
            StructuredSpec.json_schema({"type": "string", "format": "no-such-format"}),
            "json_schema: Unknown format: no-such-format",
        ),
        (StructuredSpec.json_schema({"type": "objekt"}), "json_schema: "),
        (StructuredSpec.json_schema({"type": "string", "pattern": "(?<=x)y"}), "json_schema: "),
        (StructuredSpec.grammar("start: undefined_rule"), 'grammar: at 1(8): unknown name: "undefined_rule"'),
    ],
)
def test_rejected_specs_raise_grammar_error(compiler, spec, message):
    with pytest.raises(GrammarError) as e:
        compiler.compile(spec)
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)  # one line, fit for a 400's message
    # The rejection is cached: asking again costs no compilation.
    misses = compiler.cache_info().misses
    with pytest.raises(GrammarError):
        compiler.compile(spec)
    assert compiler.cache_info().misses == misses


def test_lark_and_gbnf_grammars_compile(compiler):
    assert compiler.compile(StructuredSpec.grammar('start: "yes" | "no"')).warnings == ()
    compiler.compile(StructuredSpec.grammar('root ::= "yes" | "no"'))  # llama.cpp GBNF


def test_vocab_size_pads_the_mask(sp_tokenizer):
    with GrammarCompiler(sp_tokenizer, vocab_size=8200) as c:
        g = c.compile(StructuredSpec.choice(["x"]))
        assert g.vocab_size == 8200 and g.matcher().bitmask_words == 257
    with pytest.raises(ValueError, match="smaller than the tokenizer's 8192"):
        GrammarCompiler(sp_tokenizer, vocab_size=100)


def test_strict_refuses_unimplemented_keywords_and_lenient_ignores_them(compiler):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(GrammarError, match=r'json_schema: Unimplemented keys: \["uniqueItems"\]'):
        compiler.compile(StructuredSpec.json_schema(schema))
    compiler.compile(StructuredSpec.json_schema(schema, strict=False))


def test_ids_past_the_tokenizer_are_never_allowed(hf_tokenizer):
    # The dummy SmolLM2 default: 49152 logits, an 8192-id tokenizer.
    with GrammarCompiler(hf_tokenizer, vocab_size=49152) as c:
        g = c.compile(StructuredSpec.json_object(compact_json=False))
        m = g.matcher()
        assert not unpack_bitmask(m.allowed_bitmask(), 49152)[8192:].any()
        g = c.compile(StructuredSpec.choice(["yes", "no"]))
        assert hf_tokenizer.decode(random_walk(g, np.random.default_rng(0))) in ("yes", "no")
