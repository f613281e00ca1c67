"""A pooling engine without a model, for server and scheduling tests that need no device: each
token's "final state" is a fixed function of its id and position, so results are deterministic and
a prompt's LAST / MEAN / CLS pooling can be computed by hand (`token_states`). The host state machine
(`engine/pooling.py`) and the HTTP layer run as in a real engine. No jax."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from jaxserve.engine.pooling import AsyncPoolingEngine, PoolingCore
from jaxserve.engine.pooling_config import PoolerConfig


def token_states(token_ids: Sequence[int], hidden_size: int, start: int = 0) -> np.ndarray:
    """f32[len, D]: the fake final state of each token at positions start.."""
    ids = np.asarray(token_ids, np.float64)[:, None]
    pos = np.arange(start, start + len(token_ids), dtype=np.float64)[:, None]
    d = np.arange(hidden_size, dtype=np.float64)[None, :]
    return np.cos(0.37 * (ids + 1) * (d + 1) + 0.011 * pos).astype(np.float32)


@dataclasses.dataclass
class _Pooled:
    states: np.ndarray | None
    sums: np.ndarray | None


class FakePoolingRunner:
    """`runner.pool_step.PoolingRunner`'s interface on the host; records each step's rows."""

    def __init__(self, hidden_size: int, pooling_type: str, max_rows=8, max_tokens=32, max_pages=16, page_size=4):
        self.hidden_size, self.pooling_type = hidden_size, pooling_type
        self.max_rows, self.max_tokens, self.max_pages, self.page_size = max_rows, max_tokens, max_pages, page_size
        self.num_replicas = 1
        self.steps: list[list[tuple[int, int]]] = []  # per step: each row's (start, tokens)

    def run(self, rows: Sequence[Any]) -> _Pooled:
        for rep in range(self.num_replicas):  # each replica's rows under its own budget
            mine = [r for r in rows if r.replica == rep]
            if len(mine) > self.max_rows or sum(len(r.tokens) for r in mine) > self.max_tokens:
                raise AssertionError(f"the core scheduled past replica {rep}'s step budget")
        self.steps.append([(r.start_pos, len(r.tokens)) for r in rows])
        chunks = [token_states(r.tokens, self.hidden_size, r.start_pos) for r in rows]
        last = self.pooling_type == "LAST"
        states = np.stack([c[-1] if last else c[0] for c in chunks])
        return _Pooled(states=states, sums=np.stack([c.sum(0) for c in chunks]))

    def stats(self) -> dict:
        return {"executables": 0}

    def close(self) -> None:
        pass


def fake_pooling_engine(
    pooler: PoolerConfig | None = None,
    hidden_size: int = 16,
    vocab_size: int = 512,
    num_pages: int = 64,
    max_model_len: int = 64,
    tokenizer: Any = None,
    **runner: Any,
) -> AsyncPoolingEngine:
    """An `AsyncPoolingEngine` over the fake runner (not started)."""
    pooler = pooler or PoolerConfig()
    fake = FakePoolingRunner(hidden_size, pooler.pooling_type, **runner)
    core = PoolingCore(fake, pooler, hidden_size, vocab_size, num_pages, max_model_len, tokenizer=tokenizer)
    return AsyncPoolingEngine(core)
