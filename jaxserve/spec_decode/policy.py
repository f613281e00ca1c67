"""Per-request speculation state and how many tokens to propose (host side, no jax).

Proposals pay off only when enough of them are accepted. Each request keeps a decayed count of
accepted drafts and of rejections; their ratio estimates the per-token acceptance probability a
(a run of k drafts stops at its first rejection, so accepted / (accepted + rejections) is the
maximum-likelihood estimate of a). The policy proposes the k in 0..K that maximises expected tokens
per unit of step time:

    tokens(k) = (1 - a^(k+1)) / (1 - a)      (accepted drafts + the target's own token)
    cost(k)   = time of a speculative step verifying k drafts / time of a plain decode step

k = 0 means the request decodes without speculation. The costs are measured (SpeculativeDecoder:
on the compiled steps at start, then from the engine's actual step times), because they vary
widely: on this CPU a verify pass over k + 1 positions costs up to ~k + 1 decode steps (XLA:CPU's
small-M matmuls run far below its matrix-vector product), on accelerators about one.

A request at k = 0 is re-measured with one draft token every `probe_interval` decode steps; the
interval grows with the cost of a speculative step (probes cost at most ~2%), and probes are aligned
on the engine's step count, so a batch of low-acceptance requests probes together.

A step is priced for the whole batch (a row's drafts widen every row's step: at batch 16 one draft
moves the step from the 16- to the 32-token bucket), so at batch > 1 the batch decides first
(`SpecPolicy.batch_drafts`, from the engine-wide acceptance `AcceptanceEstimate`): when drafting
does not pay at the batch's mean acceptance, no row drafts, but at the shared probes. A new request's
estimate starts from the engine-wide one (`AcceptanceEstimate.prior`), not from a fixed optimistic
guess: with a head accepting 0.3 a draft, a fixed 0.75 made every new request verify until two
rejections outweighed it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

PRIOR_ACCEPTED = 1.5  # prior pseudo-counts: a = 0.75 before the engine has measured anything
PRIOR_REJECTED = 0.5  # (optimistic, so an engine starts speculating; two verify steps outweigh it)
PRIOR_WEIGHT = PRIOR_ACCEPTED + PRIOR_REJECTED  # the pseudo-counts of a request's prior, whatever its a
DECAY = 0.9  # per verify step: the estimate follows roughly the last ten steps
ENGINE_DECAY = 0.98  # per verify of any request: the engine-wide estimate follows the last ~50 verifies
PROBE_INTERVAL = 16


@dataclasses.dataclass
class SpecState:
    """What speculation keeps per sequence (Sequence.spec)."""

    # Draft method: how many of the target's computed tokens the draft's cache still lacks (0 after a
    # prefill; 1 after a fully accepted run, whose last draft the draft never consumed; more after
    # decode steps that ran without the draft).
    lag: int = 0
    proposal: list[int] = dataclasses.field(default_factory=list)  # ngram: the tokens for the next step
    tokens: Any = None  # ngram: the sequence's tokens as a numpy buffer (ngram.TokenBuffer)
    # Totals for the request's metrics.
    proposed: int = 0
    accepted: int = 0
    verify_steps: int = 0  # steps in which this sequence had at least one draft token verified
    # Decayed counts behind the acceptance estimate, and the pseudo-counts it starts from.
    recent_accepted: float = 0.0
    recent_rejected: float = 0.0
    prior_accepted: float = PRIOR_ACCEPTED
    prior_rejected: float = PRIOR_REJECTED

    @property
    def acceptance(self) -> float:
        """Estimated probability that the next draft token is accepted."""
        a = self.recent_accepted + self.prior_accepted
        return a / (a + self.recent_rejected + self.prior_rejected)

    def record(self, proposed: int, accepted: int) -> None:
        """One verify step of `proposed` drafts of which the first `accepted` were accepted."""
        if proposed <= 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        self.verify_steps += 1
        self.recent_accepted = DECAY * self.recent_accepted + accepted
        self.recent_rejected = DECAY * self.recent_rejected + (1.0 if accepted < proposed else 0.0)


@dataclasses.dataclass
class AcceptanceEstimate:
    """The engine-wide acceptance: decayed counts over every request's verifies (the batch's mean
    acceptance for the batch decision, and a new request's prior)."""

    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def value(self) -> float:
        a = self.accepted + PRIOR_ACCEPTED
        return a / (a + self.rejected + PRIOR_REJECTED)

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.accepted = ENGINE_DECAY * self.accepted + accepted
        self.rejected = ENGINE_DECAY * self.rejected + (1.0 if accepted < proposed else 0.0)

    def new_state(self) -> SpecState:
        """A new request's state: PRIOR_WEIGHT pseudo-counts at the engine's estimate."""
        a = self.value
        return SpecState(prior_accepted=PRIOR_WEIGHT * a, prior_rejected=PRIOR_WEIGHT * (1.0 - a))


def expected_tokens(a: float, k: int) -> float:
    """Tokens one verify step yields with k drafts each accepted with probability a (independently)."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def probe_interval(costs: Sequence[float]) -> int:
    """Decode steps between probes of a request at k = 0 (costs[1]: a one-draft step, in plain steps)."""
    return max(PROBE_INTERVAL, int(50 * (costs[1] - 1)))


@dataclasses.dataclass(frozen=True)
class SpecPolicy:
    max_tokens: int  # K = num_speculative_tokens
    adaptive: bool = True

    def choose(self, state: SpecState, step_count: int, costs: Sequence[float] | None) -> int:
        """Draft tokens to propose for this sequence now (before the caps of its length and pages).

        costs[k]: a step verifying k drafts, in plain decode steps (costs[0] = 1)."""
        if not self.adaptive:
            return self.max_tokens
        best_k = self.best(state.acceptance, costs)
        if best_k == 0 and is_probe_step(step_count, costs):
            return 1  # re-measure: acceptance changes as the text does (e.g. a copied passage starts)
        return best_k

    def best(self, a: float, costs: Sequence[float]) -> int:
        """The k in 0..K with the most expected tokens per unit of step time at acceptance a."""
        best_k, best = 0, 1.0  # k = 0: one token per plain decode step of cost 1
        for k in range(1, self.max_tokens + 1):
            rate = expected_tokens(a, k) / costs[k]
            if rate > best:
                best_k, best = k, rate
        return best_k

    def batch_drafts(self, engine: AcceptanceEstimate, step_count: int, costs: Sequence[float]) -> bool:
        """Whether the rows of a batch priced by `costs` may draft this step: drafting pays at the
        engine-wide acceptance (the batch's mean), or this is a probe step (shared by every row)."""
        if not self.adaptive:
            return True
        return self.best(engine.value, costs) > 0 or is_probe_step(step_count, costs)


def is_probe_step(step_count: int, costs: Sequence[float]) -> bool:
    return step_count % probe_interval(costs) == 0
