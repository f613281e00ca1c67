"""Mask time per token for a bounded JSON schema: llguidance (and xgrammar, when importable) on jaxserve tokenizers.

    python scripts/bench_grammar_masks.py [--hf-tokenizer DIR] [--xgrammar] [--apply] [--step-inputs]

Each document is a valid instance of SCHEMA (drawn by a seeded random walk under the grammar),
tokenized as the bridge tokenizes text (no sentencepiece dummy prefix); the time is that of computing the mask before each of
its tokens, as a decode step would. Results are printed as one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from jaxserve.loading.resources import small_checkpoint
from jaxserve.structured.bitmask import allocate_bitmask, allowed_tokens
from jaxserve.structured.compiler import GrammarCompiler
from jaxserve.structured.matcher import fill_bitmasks
from jaxserve.structured.spec import StructuredSpec
from jaxserve.loading.tokenizer import Tokenizer, load_tokenizer

# The acceptance schema: nested object, bounded array, enums, bounded integers, bounded
# strings, optional fields.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "maxLength": 10},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "score": {"type": "integer", "minimum": -10, "maximum": 10},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


def sample_documents(compiler: GrammarCompiler, tokenizer: Tokenizer, n: int, seed: int) -> list[str]:
    """n schema-valid JSON texts from random walks restricted to ASCII-letter tokens inside strings."""
    g = compiler.compile(StructuredSpec.json_schema(SCHEMA))
    rng = np.random.default_rng(seed)
    nice = np.zeros(g.vocab_size, bool)
    for i in range(tokenizer.vocab_size):
        s = tokenizer.decode([i])
        nice[i] = bool(s) and all(c.isalnum() or c in ' {}[]",:-' for c in s)
    docs = []
    while len(docs) < n:
        m, out = g.matcher(), []
        while not m.is_finished:
            a = allowed_tokens(m.allowed_bitmask(), g.vocab_size)
            pref = a[nice[a]]
            t = int(rng.choice(pref if len(pref) else a))
            if t in g.eos_token_ids:
                break
            m.advance(t)
            out.append(t)
        docs.append(tokenizer.decode(out))
    return docs


def time_llguidance(compiler: GrammarCompiler, tokenizer: Tokenizer, docs: list[str]) -> dict:
    spec = StructuredSpec.json_schema(SCHEMA)
    cold = GrammarCompiler(tokenizer, compiler.vocab_size)
    t0 = time.perf_counter()
    cold.compile(spec)
    compile_ms = (time.perf_counter() - t0) * 1e3
    g = compiler.compile(spec)
    mask_us, mask_cpu_us, adv_us, copy_us = [], [], [], []
    row = allocate_bitmask(1, g.vocab_size)[0]
    # Two passes over the documents: the first builds the lexer states lazily (as the first
    # requests on a schema do), the second is what a server sees once a schema is in use.
    for doc in docs + docs:
        ids = compiler.ll_tokenizer.tokenize_str(doc)
        t0 = time.perf_counter()
        m = g.matcher()
        copy_us.append((time.perf_counter() - t0) * 1e6)
        for t in ids:
            c0, t0 = time.thread_time(), time.perf_counter()
            m.fill_bitmask(row)
            c1, t1 = time.thread_time(), time.perf_counter()
            ok = m.advance(t)
            t2 = time.perf_counter()
            assert ok, (doc, m.error)
            mask_us.append((t1 - t0) * 1e6)
            mask_cpu_us.append((c1 - c0) * 1e6)
            adv_us.append((t2 - t1) * 1e6)
    # One batch step of 16 sequences, as the engine would fill its [rows, W] array.
    import llguidance

    ex = llguidance.LLExecutor()
    batch = allocate_bitmask(16, g.vocab_size)
    ms = [g.matcher() for _ in range(16)]
    step_us = []
    ids0 = [compiler.ll_tokenizer.tokenize_str(docs[i % len(docs)]) for i in range(16)]
    for k in range(min(map(len, ids0))):
        t0 = time.perf_counter()
        fill_bitmasks([(m, i) for i, m in enumerate(ms)], batch, ex)
        step_us.append((time.perf_counter() - t0) * 1e6)
        for m, ids in zip(ms, ids0):
            m.advance(ids[k])
    return {
        "library": "llguidance",
        "compile_ms": round(compile_ms, 2),
        "matcher_copy_us": round(statistics.median(copy_us), 1),
        **_summary("mask_us_first_pass", mask_us[: len(mask_us) // 2]),
        **_summary("mask_us_second_pass", mask_us[len(mask_us) // 2 :]),
        # CPU time of the computing thread: the same work without the waits for a core that a
        # loaded machine adds to the wall times (their p99 is mostly that).
        **_summary("mask_cpu_us_second_pass", mask_cpu_us[len(mask_cpu_us) // 2 :]),
        **_summary("advance_us", adv_us),
        **_summary("batch16_step_us", step_us),
    }


def time_xgrammar(compiler: GrammarCompiler, tokenizer: Tokenizer, docs: list[str]) -> dict:
    import torch
    import xgrammar as xgr

    from jaxserve.structured.tokenizer_bridge import sentencepiece_token_bytes

    vocab_size = compiler.vocab_size
    if tokenizer.kind == "sentencepiece":
        vocab = [b"" if t.startswith(b"\xff") else t for t in sentencepiece_token_bytes(tokenizer)]
        info = xgr.TokenizerInfo(
            vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(tokenizer.eos_token_ids)
        )
    else:
        from transformers import PreTrainedTokenizerFast

        info = xgr.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend),
            vocab_size=vocab_size,
            stop_token_ids=list(tokenizer.eos_token_ids),
        )
    t0 = time.perf_counter()
    cg = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    compile_ms = (time.perf_counter() - t0) * 1e3
    bm = xgr.allocate_token_bitmask(1, vocab_size)
    mask_us, mask_cpu_us, rejected = [], [], []
    for doc in docs + docs:
        m = xgr.GrammarMatcher(cg)
        for t in compiler.ll_tokenizer.tokenize_str(doc):
            c0, t0 = time.thread_time(), time.perf_counter()
            m.fill_next_token_bitmask(bm)
            mask_us.append((time.perf_counter() - t0) * 1e6)
            mask_cpu_us.append((time.thread_time() - c0) * 1e6)
            if not m.accept_token(t):  # e.g. "-0", which JSON allows and xgrammar's integers do not
                rejected.append(doc)
                break
    del torch
    return {
        "library": "xgrammar",
        "compile_ms": round(compile_ms, 2),
        "docs_rejected": len(rejected) // 2,
        **_summary("mask_us_second_pass", mask_us[len(mask_us) // 2 :]),
        **_summary("mask_cpu_us_second_pass", mask_cpu_us[len(mask_cpu_us) // 2 :]),
    }


def time_apply(vocab_size: int, rows: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxserve.structured.apply import apply_token_bitmask

    logits = jax.random.normal(jax.random.key(0), (rows, vocab_size), jnp.float32)
    mask = jnp.asarray(allocate_bitmask(rows, vocab_size))
    flag = jnp.ones((rows,), bool)
    masked = jax.jit(lambda x, b, c: jnp.argmax(apply_token_bitmask(x, b, c), -1))
    plain = jax.jit(lambda x: jnp.argmax(x, -1))
    out = {"vocab": vocab_size, "rows": rows, "device": jax.devices()[0].platform}
    for name, f, args in (("argmax_us", plain, (logits,)), ("masked_argmax_us", masked, (logits, mask, flag))):
        f(*args).block_until_ready()
        ts = []
        for _ in range(50):
            t0 = time.perf_counter()
            f(*args).block_until_ready()
            ts.append((time.perf_counter() - t0) * 1e6)
        out[name] = round(statistics.median(ts), 1)
    return out


def time_step_inputs(vocab_size: int, rows: int, iters: int = 2000) -> dict:
    """What the TokenMask costs a step with no constrained row, host side: the runner's mask for `rows`
    logits (one reused buffer, a flag array), packed with a decode step's other inputs into the one
    int32 buffer and copied to the device, against the same inputs without it. Medians in us."""
    import jax

    from jaxserve.model.kv_cache import RaggedBatch
    from jaxserve.model.sampler import RowSampling, SamplingTensors
    from jaxserve.structured.apply import TokenMask
    from jaxserve.model.transfer import Layout

    R, S, P, history = 1, rows, 64, 64 * 16
    i32 = lambda *shape: np.zeros((R,) + shape, np.int32)  # noqa: E731
    batch = RaggedBatch(
        tokens=i32(rows),
        positions=i32(rows),
        slots=i32(rows),
        token_row=i32(rows),
        query_start=i32(S + 1),
        context_lens=i32(S),
        page_table=i32(S, P),
        logit_index=i32(rows),
    )
    st = SamplingTensors.pack([RowSampling(temperature=0.7, seed=i) for i in range(rows)], (R, rows), history)
    no_grammar = TokenMask(np.full((R, rows, -(-vocab_size // 32)), -1, np.int32), np.zeros((R, rows), bool))
    plain, masked = Layout.of((batch, st)), Layout.of((batch, st, TokenMask.spec((R, rows), vocab_size)))

    def once(layout, with_mask):
        t0 = time.perf_counter()
        inputs = (batch, st, no_grammar) if with_mask else (batch, st)
        jax.block_until_ready(layout.put(inputs))
        return (time.perf_counter() - t0) * 1e6

    out = {
        "vocab": vocab_size,
        "rows": rows,
        "device": jax.devices()[0].platform,
        "mask_bytes": rows * ((vocab_size + 31) // 32) * 4 + rows,
        "inputs_bytes_without": plain.width * 4,
    }
    ts = {False: [], True: []}
    for _ in range(iters):  # interleaved, so drift in the machine's load hits both alike
        for flag, layout in ((False, plain), (True, masked)):
            ts[flag].append(once(layout, flag))
    out["pack_put_us_without_mask"] = round(statistics.median(ts[False][iters // 10 :]), 1)
    out["pack_put_us_with_mask"] = round(statistics.median(ts[True][iters // 10 :]), 1)
    out["mask_us_per_step"] = round(out["pack_put_us_with_mask"] - out["pack_put_us_without_mask"], 1)
    return out


def _summary(name: str, xs: list[float]) -> dict:
    a = np.asarray(xs)
    return {
        f"{name}_mean": round(float(a.mean()), 1),
        f"{name}_p50": round(float(np.median(a)), 1),
        f"{name}_p99": round(float(np.percentile(a, 99)), 1),
        f"{name}_n": int(a.size),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-tokenizer", action="append", default=[], help="also measure this tokenizer (dir or file)")
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--xgrammar", action="store_true", help="also time xgrammar (needs torch; not a dependency)")
    ap.add_argument("--apply", action="store_true", help="also time apply_token_bitmask at V=49152, 16 rows")
    ap.add_argument(
        "--step-inputs",
        action="store_true",
        help="only time what the mask adds to a step's host inputs when no row is constrained",
    )
    args = ap.parse_args(argv)
    if args.step_inputs:
        for vocab, rows in ((8192, 16), (49152, 16), (128256, 16), (128256, 256)):
            print(json.dumps(time_step_inputs(vocab, rows)), flush=True)
        return 0
    for path in [str(small_checkpoint()), *args.hf_tokenizer]:
        tok = load_tokenizer(path)
        t0 = time.perf_counter()
        compiler = GrammarCompiler(tok)
        bridge_ms = (time.perf_counter() - t0) * 1e3
        docs = sample_documents(compiler, tok, args.docs, args.seed)
        head = {"tokenizer": tok.kind, "vocab": tok.vocab_size, "bridge_ms": round(bridge_ms, 1), "example": docs[0]}
        print(json.dumps({**head, **time_llguidance(compiler, tok, docs)}), flush=True)
        if args.xgrammar:
            print(json.dumps({**head, **time_xgrammar(compiler, tok, docs)}), flush=True)
    if args.apply:
        print(json.dumps(time_apply(49152, 16)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
