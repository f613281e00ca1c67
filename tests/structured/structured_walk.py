"""Test helper: drive a matcher with seeded random allowed tokens until its grammar finishes."""

from __future__ import annotations

import numpy as np

from jaxserve.structured import CompiledGrammar, allowed_tokens


def random_walk(g: CompiledGrammar, rng: np.random.Generator, max_tokens: int = 600) -> list[int]:
    """Ids sampled uniformly from each step's allowed set; stops at EOS or when the grammar is
    finished (the mask then allows only EOS, which is checked). The ids exclude EOS."""
    m = g.matcher()
    out: list[int] = []
    for _ in range(max_tokens):
        allowed = allowed_tokens(m.allowed_bitmask(), g.vocab_size)
        assert len(allowed), "a mask allowed nothing"
        if m.is_finished:
            assert sorted(allowed) == sorted(g.eos_token_ids)
            return out
        t = int(rng.choice(allowed))
        assert m.advance(t), m.error
        if t in g.eos_token_ids:
            assert m.is_finished
            return out
        out.append(t)
    raise AssertionError(f"grammar {g.spec.kind} not finished after {max_tokens} random tokens")
