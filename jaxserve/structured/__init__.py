"""Structured output: constrain decoding to a JSON schema, regex, choice or grammar (llguidance on the host, a bitmask on the device).

Host side (no jax): request fields -> spec_from_request -> StructuredSpec -> GrammarCompiler.submit -> CompiledGrammar.matcher() ->
GrammarMatcher.fill_bitmask / advance per step; fill_bitmasks for a whole batch. Device side:
jaxserve.structured.apply.apply_token_bitmask (imported separately so the host modules stay jax-free).
"""

from jaxserve.structured.bitmask import allocate_bitmask, allowed_tokens, bitmask_words, unpack_bitmask
from jaxserve.structured.compiler import CacheInfo, CompiledGrammar, GrammarCompiler, ll_grammar
from jaxserve.structured.errors import GrammarError
from jaxserve.structured.matcher import GrammarMatcher, fill_bitmasks
from jaxserve.structured.reasoning import ReasoningGatedMatcher
from jaxserve.structured.request_fields import spec_from_request
from jaxserve.structured.spec import KINDS, StructuredSpec
from jaxserve.structured.tokenizer_bridge import ll_tokenizer

__all__ = [
    "KINDS",
    "CacheInfo",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "ReasoningGatedMatcher",
    "StructuredSpec",
    "allocate_bitmask",
    "allowed_tokens",
    "bitmask_words",
    "fill_bitmasks",
    "ll_grammar",
    "ll_tokenizer",
    "spec_from_request",
    "unpack_bitmask",
]
