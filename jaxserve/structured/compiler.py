"""GrammarCompiler: StructuredSpec -> CompiledGrammar through llguidance, cached by spec, on a worker thread.

Why llguidance (`python scripts/bench_grammar_masks.py`, table in docs/ARCHITECTURE.md, "Structured
output"): it is one wheel with no Python dependencies, where xgrammar 0.2.9 requires torch,
transformers and triton at run time, and torch is kept out of jaxserve's runtime dependencies.
xgrammar's masks are faster (mean 3 vs 12 us per token on the shipped 8192-id sentencepiece
tokenizer, 18 vs 89 us on a 49152-id byte-level BPE, for a bounded JSON schema), but llguidance's fit
a decode step's budget, compiling that schema takes under 2 ms, it accepts the integer -0 that JSON
allows (xgrammar refused 3 of the 40 documents for it), and it rejects bad input with messages that
name the problem (regex look-around and backreferences, an unknown $ref, unsatisfiable bounds,
unimplemented keywords), which GrammarError passes on.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import threading

import llguidance

from jaxserve.structured.errors import GrammarError
from jaxserve.structured.matcher import GrammarMatcher
from jaxserve.structured.reasoning import ReasoningGate, ReasoningGatedMatcher, build_gate
from jaxserve.structured.spec import StructuredSpec
from jaxserve.structured.tokenizer_bridge import ll_tokenizer
from jaxserve.loading.tokenizer import Tokenizer

__all__ = ["CacheInfo", "CompiledGrammar", "GrammarCompiler", "ll_grammar"]


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A spec compiled against one tokenizer: shared, read-only; `matcher()` starts a sequence."""

    spec: StructuredSpec
    grammar: str  # llguidance's grammar (its JSON form)
    vocab_size: int  # bitmask rows have ceil(vocab_size / 32) words
    eos_token_ids: tuple[int, ...]
    warnings: tuple[str, ...]
    _tokenizer: llguidance.LLTokenizer = dataclasses.field(repr=False)
    _template: llguidance.LLMatcher = dataclasses.field(repr=False)
    gate: ReasoningGate | None = dataclasses.field(default=None, repr=False)  # spec.reasoning_end's tables

    def matcher(self) -> GrammarMatcher | ReasoningGatedMatcher:
        """A fresh matcher at the start of the output (a copy of the compiled one: microseconds);
        reasoning-gated when the spec has a `reasoning_end`."""
        inner = GrammarMatcher(self, self._template.deep_copy())
        return inner if self.gate is None else ReasoningGatedMatcher(self, self.gate, inner)

    def new_ll_matcher(self) -> llguidance.LLMatcher:
        return self._template.deep_copy()


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    hits: int
    misses: int
    size: int  # specs cached now (finished or compiling)


def ll_grammar(spec: StructuredSpec) -> str:
    """llguidance's grammar text for `spec` (not yet checked against a tokenizer)."""
    try:
        if spec.is_json:
            options = {
                # No whitespace at all between JSON tokens: separators are exactly "," and ":".
                "whitespace_flexible": not spec.compact_json,
                "item_separator": ",",
                "key_separator": ":",
                # strict: keywords the library does not implement are an error, not ignored.
                "lenient": not spec.strict,
            }
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, overrides=options)
        if spec.kind == "regex":
            # \d means [0-9]: the Rust regex crate's Unicode \d would let a model asked for
            # digits write digits of any script (which Python's re, with its older Unicode
            # tables, may not even match).
            return llguidance.LLMatcher.grammar_from_lark("start: /" + llguidance.regex_to_lark(spec.text, "d") + "/")
        if spec.kind == "choice":
            # JSON string syntax is Lark's string-literal syntax, escapes included.
            lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choices())
            return llguidance.LLMatcher.grammar_from_lark(lark)
        return llguidance.grammar_from("grammar", spec.text)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise GrammarError(f"{_label(spec)}: {_first_error_line(str(e))}") from None


class GrammarCompiler:
    """Compiles specs for one tokenizer, caching by spec (LRU), off the caller's thread.

    `submit(spec)` returns a Future at once (the server awaits it before the request enters the
    engine); the same spec submitted twice shares one compilation. A spec the library rejects
    resolves to GrammarError, which is cached like a success (a client retrying a bad schema costs
    nothing). Thread-safe.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int | None = None,
        *,
        max_workers: int = 1,
        cache_size: int = 256,
        limits: llguidance.LLParserLimits | None = None,
    ):
        if cache_size < 1:
            raise ValueError(f"cache_size must be at least 1, got {cache_size}")
        self.vocab_size = tokenizer.vocab_size if vocab_size is None else int(vocab_size)
        self.eos_token_ids = tuple(tokenizer.eos_token_ids)
        self.ll_tokenizer = ll_tokenizer(tokenizer, self.vocab_size)
        self._limits = limits
        self._cache_size = cache_size
        self._cache: collections.OrderedDict[StructuredSpec, concurrent.futures.Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="jaxserve-grammar")
        self._gates: dict[str, ReasoningGate] = {}  # per reasoning_end marker

    def submit(self, spec: StructuredSpec) -> "concurrent.futures.Future[CompiledGrammar]":
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                self._hits += 1
                return fut
            self._misses += 1
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        fut.add_done_callback(lambda f, spec=spec: self._forget_if_broken(spec, f))
        return fut

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """`submit(spec).result()`: blocks; raises GrammarError for a rejected spec."""
        return self.submit(spec).result()

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._hits, self._misses, len(self._cache))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "GrammarCompiler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- worker ----------------------------------------------------------------------------------

    def _compile(self, spec: StructuredSpec) -> CompiledGrammar:
        grammar = ll_grammar(spec)
        kwargs = {"log_level": 0}
        if self._limits is not None:
            kwargs["limits"] = self._limits
        # Building the matcher builds the grammar and its lexer (the GIL is released meanwhile);
        # an invalid grammar leaves the matcher in error, with the library's message.
        template = llguidance.LLMatcher(self.ll_tokenizer, grammar, **kwargs)
        if template.is_error():
            raise GrammarError(f"{_label(spec)}: {_first_error_line(template.get_error())}")
        return CompiledGrammar(
            spec=spec,
            grammar=grammar,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            warnings=tuple(template.get_grammar_warnings()),
            _tokenizer=self.ll_tokenizer,
            _template=template,
            gate=None if spec.reasoning_end is None else self._gate(spec.reasoning_end),
        )

    def _gate(self, marker: str) -> ReasoningGate:
        with self._lock:
            gate = self._gates.get(marker)
        if gate is None:
            gate = build_gate(self.ll_tokenizer, self.vocab_size, self.eos_token_ids, marker)
            with self._lock:
                gate = self._gates.setdefault(marker, gate)
        return gate

    def _forget_if_broken(self, spec: StructuredSpec, fut: concurrent.futures.Future) -> None:
        # Only the spec's own fault is worth remembering; anything else (cancelled at close, a bug)
        # must not poison the cache.
        if fut.cancelled() or (fut.exception() is not None and not isinstance(fut.exception(), GrammarError)):
            with self._lock:
                if self._cache.get(spec) is fut:
                    del self._cache[spec]


def _label(spec: StructuredSpec) -> str:
    if spec.kind in ("regex", "choice"):
        text = spec.text if len(spec.text) <= 60 else spec.text[:57] + "..."
        return f"{spec.kind} {text!r}"
    return spec.kind


def _first_error_line(message: str) -> str:
    # The library's regex errors carry the parser's caret diagram and the internal Lark wrapper
    # ("start: /.../"); the "error: ..." line is the part that names the problem.
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("error:"):
            return ln[len("error:") :].strip()
    return lines[0] if lines else "rejected by the grammar library"
