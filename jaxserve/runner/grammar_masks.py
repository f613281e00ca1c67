"""Structured output's grammar masks for a step: each constrained row's allowed next tokens, filled
on the host by llguidance (its threads, GIL released) into a buffer the step's inputs copy."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from jaxserve.runner.update_codec import SentMask
from jaxserve.structured.apply import TokenMask


class GrammarMasks:
    """One [R * L, ceil(V / 32)] bitmask buffer per number of logits L, kept and reused: the rows of
    unconstrained slots are never read on the device (their flag is off), so a step without a
    constrained row costs no mask work here, only the copy of the buffer into the step's inputs."""

    def __init__(self, num_replicas: int, vocab_size: int):
        self.num_replicas, self.vocab_size = num_replicas, vocab_size
        self._buffers: dict[int, np.ndarray] = {}
        self._executor: Any = None  # llguidance's, made on the first constrained step
        self.seconds = 0.0  # host time spent computing grammar masks, all steps together
        self.rows = 0  # constrained rows masked, all steps together

    def fill(self, L: int, grammars: list[tuple[Any, int]]) -> TokenMask:
        """The step's TokenMask [R, L]; `grammars`: (GrammarMatcher, flat logit slot) per constrained
        row. On a multi-host follower a row's grammar is the words the leader filled
        (`update_codec.SentMask`): copied as they are."""
        R = self.num_replicas
        bitmask = self._buffers.get(L)
        if bitmask is None:
            bitmask = self._buffers[L] = np.full((R * L, -(-self.vocab_size // 32)), -1, np.int32)
        constrained = np.zeros(R * L, bool)
        sent = [(g, at) for g, at in grammars if isinstance(g, SentMask)]
        if sent:
            for mask, at in sent:
                bitmask[at] = mask.words
            constrained[[at for _, at in sent]] = True
            grammars = [(g, at) for g, at in grammars if not isinstance(g, SentMask)]
        if grammars:
            from jaxserve.structured import fill_bitmasks

            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor()
            start = time.perf_counter()
            fill_bitmasks(grammars, bitmask, self._executor)
            self.seconds += time.perf_counter() - start
            self.rows += len(grammars)
            constrained[[at for _, at in grammars]] = True
        return TokenMask(bitmask.reshape(R, L, -1), constrained.reshape(R, L))
