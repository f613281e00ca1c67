"""Builders of paged KV caches full of traps (NaN pages, garbage tails) shared by the kernel tests."""

from __future__ import annotations

import itertools
import os

import numpy as np
import jax.numpy as jnp
import pytest

GARBAGE = 1e4

# PALLAS_TESTS_NATIVE=1 (scripts/gpu_check.py sets it on a GPU; set it by hand on a TPU): the kernels of the
# machine's own platform run compiled (interpret=False) and the other platform's kernels are skipped.
# Unset (the default, CPU): every kernel runs in its interpreter.
NATIVE = os.environ.get("PALLAS_TESTS_NATIVE", "") not in ("", "0")


def native_platform() -> str:
    import jax

    platform = jax.default_backend()
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def interpret_for(backend: str) -> bool:
    """`interpret=` for a test of `backend`'s kernel: True unless NATIVE; natively, other backends skip."""
    if not NATIVE:
        return True
    if native_platform() != backend:
        pytest.skip(f"PALLAS_TESTS_NATIVE: the {backend} kernel does not run natively on {native_platform()}")
    return False


def engine_attention_impl() -> str:
    """The attention implementation attention_backend='pallas' resolves to in this test run."""
    return "pallas_" + native_platform() if NATIVE else "pallas_interpret"


def cdiv(a, b):
    return -(-a // b)


def tolerance(dtype):
    """(atol, rtol) per dtype; bf16 kernels feed bf16 probabilities to the PV matmul."""
    if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16):
        return 3e-2, 3e-2
    if jnp.dtype(dtype) == jnp.dtype(jnp.float16):
        return 1e-2, 1e-2
    return 2e-5, 2e-5


def build_paged_cache(
    rng,
    *,
    num_kv_heads,
    head_dim,
    page_size,
    lens,
    dtype,
    max_pages=None,
    quantized=False,
    extra_trap_pages=2,
    fp8=None,
):
    """Random paged cache whose unused memory is hostile.

    Every page used by some sequence is shuffled over the pool; the slots past a
    sequence's length in its last page hold GARBAGE (even sequences) or NaN (odd
    ones); pages not owned by any sequence hold NaN (int8 caches: 127 with NaN
    scales), page 0 is always one of them (kernels may redirect unused table
    entries there), and every page-table entry past a sequence's length points at
    one of them. fp8 (a float8 dtype): the float pages stored in it, traps included (E4M3 has no
    infinity: GARBAGE becomes NaN there).
    Returns (k_pages, v_pages, page_table, k_scale, v_scale) as jnp arrays.
    """
    lens = [int(x) for x in lens]
    need = [cdiv(n, page_size) for n in lens]
    if max_pages is None:
        max_pages = max(max(need), 1) + 1
    assert max(need) <= max_pages
    n_used = sum(need)
    num_pages = n_used + extra_trap_pages
    perm = rng.permutation(np.arange(1, num_pages))
    used_ids, trap_ids = perm[:n_used], np.concatenate([[0], perm[n_used:]])
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    if quantized:
        k = rng.integers(-127, 128, size=shape).astype(np.int8)
        v = rng.integers(-127, 128, size=shape).astype(np.int8)
        ks = rng.uniform(0.002, 0.02, size=shape[:3]).astype(np.float32)
        vs = rng.uniform(0.002, 0.02, size=shape[:3]).astype(np.float32)
    else:
        k = rng.standard_normal(shape).astype(np.float32)
        v = rng.standard_normal(shape).astype(np.float32)
        ks = vs = None
    table = np.zeros((len(lens), max_pages), np.int32)
    cursor = 0
    for b, n in enumerate(lens):
        ids = used_ids[cursor : cursor + need[b]]
        cursor += need[b]
        table[b, : need[b]] = ids
        table[b, need[b] :] = rng.choice(trap_ids, size=max_pages - need[b])
        tail = n % page_size
        junk = GARBAGE if b % 2 == 0 else np.nan
        if need[b] and tail:
            last = ids[-1]
            if quantized:
                k[:, last, tail:] = 127
                v[:, last, tail:] = 127
                ks[:, last, tail:] = junk
                vs[:, last, tail:] = junk
            else:
                k[:, last, tail:] = junk
                v[:, last, tail:] = junk
    if quantized:
        k[:, trap_ids] = 127
        v[:, trap_ids] = 127
        ks[:, trap_ids] = np.nan
        vs[:, trap_ids] = np.nan
    else:
        k[:, trap_ids] = np.nan
        v[:, trap_ids] = np.nan
    if quantized:
        return (jnp.asarray(k), jnp.asarray(v), jnp.asarray(table), jnp.asarray(ks), jnp.asarray(vs))
    page_dtype = dtype if fp8 is None else fp8
    return (jnp.asarray(k).astype(page_dtype), jnp.asarray(v).astype(page_dtype), jnp.asarray(table), None, None)


def assert_close(out, ref, dtype):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    ref = np.asarray(jnp.asarray(ref, jnp.float32))
    assert np.all(np.isfinite(out)), "kernel output has non-finite values"
    assert np.all(np.isfinite(ref)), "reference output has non-finite values"
    atol, rtol = tolerance(dtype)
    np.testing.assert_allclose(out, ref, atol=atol, rtol=rtol)


# Interpret-mode programs are large; XLA:CPU compiles them ~4x faster without
# backend optimizations and fusion emitters, and they run for milliseconds anyway.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


def fast_jit(fn):
    import jax

    return jax.jit(fn) if NATIVE else jax.jit(fn, compiler_options=FAST_COMPILE)


def decode_lens(page_size):
    """A ragged mix: 1 token, a partial last page (NaN tail: odd index), an exact page, empty, two pages."""
    return [1, 3 * page_size + 5, page_size, 0, 2 * page_size]


def make_decode_case(
    seed, *, page_size, head_dim, group, dtype, num_kv_heads=2, lens=None, quantized=False, max_pages=None
):
    rng = np.random.default_rng(seed)
    lens = decode_lens(page_size) if lens is None else lens
    k, v, table, ks, vs = build_paged_cache(
        rng,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        lens=lens,
        dtype=dtype,
        quantized=quantized,
        max_pages=max_pages,
    )
    q = jnp.asarray(rng.standard_normal((len(lens), num_kv_heads * group, head_dim)), dtype)
    return dict(
        q=q, k_pages=k, v_pages=v, seq_lens=jnp.asarray(lens, jnp.int32), page_table=table, k_scale=ks, v_scale=vs
    )


def ragged_seqs(page_size):
    """(context_len, q_len) pairs: 1-token prompt, whole prompt, decode at a page edge,
    chunked prefill over a partial page, plain decode, a sequence with no new tokens."""
    return [(1, 1), (37, 37), (page_size, 1), (3 * page_size + 5, 2 * page_size + 3), (20, 1), (5, 0)]


def make_ragged_case(
    seed,
    *,
    page_size,
    head_dim,
    group,
    dtype,
    num_kv_heads=2,
    seqs=None,
    pad_tokens=3,
    spare_seq_slots=1,
    quantized=False,
    fp8=None,
):
    """Flat query batch + cache; pads the token axis and the sequence slots with junk that must be ignored.
    quantized=True: an int8 cache, its scales under "k_scale"/"v_scale" (None otherwise); fp8: float8
    pages of that dtype (no scales)."""
    rng = np.random.default_rng(seed)
    seqs = ragged_seqs(page_size) if seqs is None else seqs
    ctx = [c for c, _ in seqs] + [0] * spare_seq_slots
    q_lens = [n for _, n in seqs]
    k, v, table, ks, vs = build_paged_cache(
        rng,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        lens=ctx,
        dtype=dtype,
        quantized=quantized,
        fp8=fp8,
    )
    qsl = np.zeros(len(ctx) + 1, np.int32)
    qsl[1 : len(seqs) + 1] = np.cumsum(q_lens)
    qsl[len(seqs) + 1 :] = 10_000  # junk past num_seqs: must never be read
    num_tokens = sum(q_lens) + pad_tokens
    q = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)), dtype)
    return dict(
        q=q,
        k_pages=k,
        v_pages=v,
        page_table=table,
        context_lens=jnp.asarray(ctx, jnp.int32),
        query_start_loc=jnp.asarray(qsl),
        num_seqs=jnp.asarray(len(seqs), jnp.int32),
        k_scale=ks,
        v_scale=vs,
    )


def covering_grid(per_pair=2):
    """(page_size, head_dim, group, dtype) cases: every (page_size, group) pair meets `per_pair` of the four
    (head_dim, dtype) combos, rotating so each page size and each group still meets (nearly) all of them.
    Compile time, not run time, is what each interpret case costs, hence no full product."""
    combos = [(64, jnp.float32), (128, jnp.bfloat16), (128, jnp.float32), (64, jnp.bfloat16)]
    grid = []
    for (si, page_size), (gi, group) in itertools.product(enumerate((8, 16, 32)), enumerate((1, 4, 8))):
        for j in range(per_pair):
            head_dim, dtype = combos[(si + gi + 2 * j) % 4]  # Latin-square rotation
            grid.append((page_size, head_dim, group, dtype))
    return grid
