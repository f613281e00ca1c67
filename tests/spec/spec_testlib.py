"""Shared helpers of the speculative-decoding tests: a pooled chi-square test and exact distributions."""

from __future__ import annotations

import numpy as np
from scipy import stats

SIGNIFICANCE = 1e-3  # a correct sampler fails a test with this probability; seeds are fixed, so never flaky


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Pearson's chi-square p-value of observed `counts` against `probs` (flattened), pooling every cell
    expected below `min_expected` into one (so the chi-square approximation holds)."""
    counts, probs = np.ravel(counts).astype(np.float64), np.ravel(probs).astype(np.float64)
    n = counts.sum()
    expected = n * probs / probs.sum()
    if np.any((expected == 0) & (counts > 0)):
        return 0.0  # a token the target can never produce
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < min_expected:  # the pooled cell itself is too small: fold it into the largest
        obs[np.argmax(exp[:-1])] += obs[-1]
        exp[np.argmax(exp[:-1])] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    statistic = ((obs - exp) ** 2 / exp).sum()
    return float(stats.chi2.sf(statistic, df=len(obs) - 1))


def processed_probs(
    logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """The distribution a sampled row draws from, written independently of jaxserve (numpy, f64):
    softmax(logits / T) restricted to the top-k, then to the smallest most-likely set holding top_p
    of the top-k mass, then to tokens with p >= min_p * p_max; renormalised."""
    scaled = np.asarray(logits, np.float64) / temperature
    keep = np.ones(scaled.shape, bool)
    if top_k:
        keep &= scaled >= np.sort(scaled, axis=-1)[..., -top_k][..., None]
    probs = _softmax(np.where(keep, scaled, -np.inf))
    if top_p < 1:
        order = np.argsort(-probs, axis=-1)
        before = np.cumsum(np.take_along_axis(probs, order, -1), axis=-1) - np.take_along_axis(probs, order, -1)
        kept_sorted = before < top_p  # the mass of strictly more likely tokens is still short of top_p
        np.put_along_axis(keep, order, kept_sorted & np.take_along_axis(keep, order, -1), axis=-1)
    if min_p > 0:
        p_all = _softmax(scaled)
        keep &= p_all >= min_p * p_all.max(axis=-1, keepdims=True)
    return _softmax(np.where(keep, scaled, -np.inf))


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def perturbed_copy(model, out_dir: str, scale: float, seed: int = 0) -> str:
    """Save a copy of a torch HF model with N(0, scale) noise on every weight: a draft that agrees with
    the target often but not always (so both accepted runs and rejections happen)."""
    import copy

    import torch

    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    draft.save_pretrained(out_dir)
    return out_dir


def toggle_drafting(monkeypatch, engine, period: int = 3) -> None:
    """Make the engine's policy adaptive and let it draft for `period` decode steps, then not for
    `period` (the batch decision and each request's choice alike): steps that verify drafts and steps
    that overlap the next one (async scheduling) alternate mid-run, whatever the batch."""
    from jaxserve.spec_decode.policy import SpecPolicy

    spec = engine.spec
    on, off = [1.0] * (spec.k + 1), [1.0] + [1e3] * spec.k  # drafting free, then never paying
    monkeypatch.setattr(spec, "policy", SpecPolicy(spec.k, adaptive=True))
    monkeypatch.setattr(spec, "costs", lambda batch: on if (spec.decode_steps // period) % 2 == 0 else off)


def record_dispatches(monkeypatch, llm) -> list[tuple[int, bool]]:
    """Each dispatched step's (steps in flight beside it, whether it verifies drafts), as the
    engine's overlap wrapper dispatches them."""
    core, seen = llm.engine, []
    execute = core.execute

    def recorded(batch):
        step = execute(batch)
        if step is not None:
            seen.append((len(llm.overlap.in_flight), step.serial))
        return step

    monkeypatch.setattr(core, "execute", recorded)
    return seen


def assert_overlapped(seen: list[tuple[int, bool]]) -> None:
    """Steps that verify nothing ran beside the one before them, and steps verifying drafts ran too."""
    assert any(depth == 1 and not serial for depth, serial in seen), seen
    assert any(serial for _, serial in seen), seen
