"""Parity check against Hugging Face transformers: per-position logit error, KL and greedy agreement."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Sequence

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.errors import ConfigError, JaxServeError, ModelLoadError


@dataclasses.dataclass(frozen=True)
class Tolerances:
    atol: float  # largest allowed |our logit - HF logit| at a position
    kl: float  # largest allowed KL(HF || ours) of the next-token distributions
    tie_gap: float  # a greedy disagreement where HF's top-2 logits are closer than this is a near-tie, not a failure
    relative: bool = False  # atol and tie_gap are fractions of the position's largest |HF logit|


# float32: the two sides differ only in summation order; correct tiny models measure |dlogit| <= 3e-5
# and KL <= 3e-11, an 8-layer 256-wide random Llama 6e-4 and 1.5e-8.
# bfloat16: each side rounds activations to 8 significant bits in its own places, so the error grows
# with the size of the logits, hence relative bounds. On correct random models (2-layer models of
# every architecture; the 8-layer one) the worst |dlogit| was 0.026-0.075 of the position's largest
# |logit|, the worst KL 8e-3 (2-layer) and 7e-2 (8-layer), and greedy flips only where HF's top-2 gap
# was under 0.033 of it; the defaults are about twice those. Comparing bf16 with bf16 cannot see a
# subtle error (one weight scaled by 1.05 stays inside that noise): float32 is the exactness check.
DEFAULT_TOLERANCES = {
    "float32": Tolerances(atol=1e-3, kl=1e-5, tie_gap=1e-3),
    "bfloat16": Tolerances(atol=0.15, kl=0.15, tie_gap=0.06, relative=True),
}


@dataclasses.dataclass
class Position:
    """One next-token prediction: the logits after input token `pos`."""

    phase: str  # "prefill" (all positions in one step) or "decode" (one token per step over the paged cache)
    pos: int
    max_abs: float  # max over the vocabulary of |ours - HF|
    kl: float  # KL(HF || ours)
    ours: int  # our argmax
    hf: int  # HF's argmax
    gap: float  # HF's top-1 minus top-2 logit
    status: str  # "ok", "near-tie", or "FAIL (what)"


@dataclasses.dataclass
class PromptReport:
    prompt: list[int]
    continuation: list[int]  # HF's greedy continuation, fed to both models (teacher forcing)
    positions: list[Position]

    @property
    def passed(self) -> bool:
        return not any(p.status.startswith("FAIL") for p in self.positions)


@dataclasses.dataclass
class Report:
    model_dir: str
    reference_dir: str
    dtype: str
    tolerances: Tolerances
    prompts: list[PromptReport]

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.prompts)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["passed"] = self.passed
        for d, p in zip(out["prompts"], self.prompts):
            d["passed"] = p.passed
        return out


def random_prompts(vocab_size: int, page_size: int, seed: int = 0) -> list[list[int]]:
    """Seeded random prompts: one token, just under and over a page, and several pages plus a bit."""
    rng = np.random.RandomState(seed)
    lengths = (1, page_size - 1, page_size + 1, 3 * page_size + 5)
    return [rng.randint(0, vocab_size, size=max(n, 1)).tolist() for n in lengths]


def read_prompts(path: str, model_dir: str) -> list[list[int]]:
    """One prompt a line: text (tokenized with the model's tokenizer) or `ids: 1, 2, 3`."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(i, line.rstrip("\n")) for i, line in enumerate(f, 1) if line.strip()]
    except OSError as err:
        raise ConfigError(f"cannot read prompts file: {err}") from None
    tokenizer = None
    prompts = []
    for lineno, line in lines:
        if line.startswith("ids:"):
            try:
                prompts.append([int(t) for t in line[4:].split(",") if t.strip()])
            except ValueError:
                raise ConfigError(f"{path}:{lineno}: 'ids:' needs comma-separated integers") from None
            continue
        if tokenizer is None:
            from jaxserve.loading.tokenizer import load_tokenizer

            try:
                tokenizer = load_tokenizer(model_dir)
            except FileNotFoundError as err:
                raise ConfigError(f"{path}:{lineno} is text, but {err}; give token ids as 'ids: 1,2,3'") from None
        prompts.append(tokenizer.encode(line))
    if not prompts:
        raise ConfigError(f"{path} holds no prompts")
    return prompts


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare_logits(phase: str, first_pos: int, ours: np.ndarray, ref: np.ndarray, tol: Tolerances) -> list[Position]:
    """Per-position comparison of f[T, V] logits, in float64 so the metric adds no error of its own."""
    ours, ref = ours.astype(np.float64), ref.astype(np.float64)
    max_abs = np.abs(ours - ref).max(-1)
    lp_ref, lp_ours = _log_softmax(ref), _log_softmax(ours)
    kl = np.maximum((np.exp(lp_ref) * (lp_ref - lp_ours)).sum(-1), 0.0)  # clamp rounding below 0
    top2 = np.partition(ref, -2, axis=-1)[:, -2:]
    gap = top2[:, 1] - top2[:, 0]
    scale = np.abs(ref).max(-1) if tol.relative else np.ones(len(ref))
    out = []
    for t in range(ref.shape[0]):
        a, b = int(ours[t].argmax()), int(ref[t].argmax())
        bad = [name for name, failed in (("logits", max_abs[t] > tol.atol * scale[t]), ("kl", kl[t] > tol.kl),
                                         ("greedy", a != b and gap[t] > tol.tie_gap * scale[t])) if failed]
        status = f"FAIL ({', '.join(bad)})" if bad else ("near-tie" if a != b else "ok")
        out.append(Position(phase, first_pos + t, float(max_abs[t]), float(kl[t]), a, b, float(gap[t]), status))
    return out


def compare(
    model_dir: str,
    prompts_token_ids: Sequence[Sequence[int]] | None = None,
    *,
    dtype: str = "float32",
    max_new_tokens: int = 8,
    page_size: int = 16,
    atol: float | None = None,
    kl_tol: float | None = None,
    tie_gap: float | None = None,
    scan_layers: bool = False,
    attention: str = "reference",
    reference_dir: str | None = None,
) -> Report:
    """Run every prompt through jaxserve and HF (CPU) and compare their logits position by position.

    jaxserve's side is `steps.prefill` / `steps.decode`: the engine's ragged step, forward and
    attention (`attention`: one of `steps.ATTENTION_IMPLS`), on rows laid out by the step itself.

    HF loads `reference_dir` (default: `model_dir`), so a converted or edited checkpoint can be checked
    against the original.
    """
    import jax
    import jax.numpy as jnp

    torch, AutoModelForCausalLM = _hf_reference()

    from jaxserve import steps
    from jaxserve.loading.checkpoint import load_hf_params
    from jaxserve.model.kv_cache import StepBatch, init_cache

    if dtype not in DEFAULT_TOLERANCES:
        raise ConfigError(f"dtype must be one of {', '.join(DEFAULT_TOLERANCES)}, got {dtype!r}")
    if page_size < 1 or max_new_tokens < 0:
        raise ConfigError("page_size must be >= 1 and max_new_tokens >= 0")
    try:
        steps.ragged_attention_impl(attention)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    base = DEFAULT_TOLERANCES[dtype]
    tol = Tolerances(atol=base.atol if atol is None else atol, kl=base.kl if kl_tol is None else kl_tol,
                     tie_gap=base.tie_gap if tie_gap is None else tie_gap, relative=base.relative)

    cfg = ModelConfig.from_dir(model_dir)  # ours first: its errors name the problem (JaxServeError)
    params = load_hf_params(model_dir, cfg, jnp.dtype(dtype))
    if prompts_token_ids is None:
        prompts_token_ids = random_prompts(cfg.vocab_size, page_size)
    prompts = [list(map(int, p)) for p in prompts_token_ids]
    if not prompts:
        raise ConfigError("no prompts given")
    for i, p in enumerate(prompts):
        if not p or min(p) < 0 or max(p) >= cfg.vocab_size:
            raise ConfigError(f"prompt {i} is empty or has token ids outside [0, {cfg.vocab_size})")
        if len(p) + max_new_tokens > cfg.max_position_embeddings:
            raise ConfigError(f"prompt {i}: {len(p)} + {max_new_tokens} tokens exceed max_position_embeddings")
    reference_dir = reference_dir or model_dir
    if not os.path.isdir(reference_dir):
        raise ModelLoadError(f"reference directory {reference_dir!r} does not exist")
    try:
        model = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=getattr(torch, dtype)).eval()
    except (OSError, ValueError) as err:  # transformers' own words, without its traceback
        raise ModelLoadError(f"transformers cannot load {reference_dir!r}: {err}") from None

    def hf_run(prompt: list[int]) -> tuple[list[int], np.ndarray]:
        """HF's greedy continuation, then its teacher-forced logits f32[len, V] over prompt + continuation.

        Full forwards without HF's KV cache: slower, but the same call in every transformers version.
        """
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(max_new_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            return ids[len(prompt):], model(torch.tensor([ids])).logits[0].float().numpy()

    refs = [hf_run(p) for p in prompts]
    longest = max(len(p) + max_new_tokens for p in prompts)
    num_pages = math.ceil(longest / page_size)
    # Pages in reverse order and page 0 left out, so a page-table mistake reads the wrong K/V and shows.
    page_table = jnp.asarray(np.arange(num_pages, 0, -1, dtype=np.int32)[None, None])

    def batch(tokens: list[int], start: int, width: int) -> StepBatch:
        # Pad the chunk to `width` (num_new marks the real tokens): every prefill shares one compilation.
        padded = np.zeros(width, np.int32)
        padded[: len(tokens)] = tokens
        def scalar(x: int) -> jax.Array:
            return jnp.asarray(np.full((1, 1), x, np.int32))  # from numpy: no op to compile

        return StepBatch(tokens=jnp.asarray(padded[None, None]), start_pos=scalar(start), num_new=scalar(len(tokens)),
                         page_table=page_table)

    prefill_opts = steps.StepOptions(scan_layers=scan_layers, all_logits=True, attention_backend=attention)
    decode_opts = steps.StepOptions(scan_layers=scan_layers, attention_backend=attention)
    # One cache for every run, as the engine reuses pages: K/V left over from the previous run sits past
    # the current sequence's length and must be masked out.
    cache = init_cache(cfg, num_pages=num_pages + 1, page_size=page_size, dtype=jnp.dtype(dtype))
    reports = []
    # float32 is the exactness check: matmuls at full precision (TPU and GPU default to bf16 / TF32 passes).
    with jax.default_matmul_precision("highest" if dtype == "float32" else None):
        for prompt, (continuation, ref) in zip(prompts, refs):
            full = prompt + continuation
            width = num_pages * page_size
            logits, cache = steps.prefill(params, cache, batch(full, 0, width), cfg=cfg, options=prefill_opts)
            positions = compare_logits("prefill", 0, np.asarray(logits)[0, 0, : len(full)], ref, tol)

            # The decode path: prefill the prompt (same width and options: no new compilation), then feed
            # the continuation one token at a time.
            _, cache = steps.prefill(params, cache, batch(prompt, 0, width), cfg=cfg, options=prefill_opts)
            decoded = []
            for pos in range(len(prompt), len(full)):
                logits, cache = steps.decode(params, cache, batch([full[pos]], pos, 1), cfg=cfg, options=decode_opts)
                decoded.append(np.asarray(logits)[0, 0])
            if decoded:
                positions += compare_logits("decode", len(prompt), np.stack(decoded), ref[len(prompt):], tol)
            reports.append(PromptReport(prompt, continuation, positions))
    return Report(model_dir, reference_dir, dtype, tol, reports)


def _summary(positions: list[Position]) -> str:
    mismatches = sum(p.status.startswith("FAIL") and "greedy" in p.status for p in positions)
    ties = sum(p.status == "near-tie" for p in positions)
    return (f"{len(positions)} positions, max|dlogit| {max(p.max_abs for p in positions):.2e}, "
            f"max KL {max(p.kl for p in positions):.2e}, greedy mismatches {mismatches}, near-ties {ties}")


def format_report(report: Report) -> str:
    t = report.tolerances
    ref = "" if report.reference_dir == report.model_dir else f" vs HF {report.reference_dir}"
    unit = " x max|HF logit|" if t.relative else ""
    lines = [f"{report.model_dir}{ref} ({report.dtype}): atol {t.atol:g}{unit}, KL tol {t.kl:g}, "
             f"near-tie gap {t.tie_gap:g}{unit}"]
    for i, pr in enumerate(report.prompts):
        lines.append(f"\nprompt {i}: {len(pr.prompt)} tokens + {len(pr.continuation)} from HF's greedy continuation")
        lines.append(f"  {'phase':8} {'pos':>5} {'max|dlogit|':>11} {'KL':>9} {'ours':>7} {'hf':>7} {'hf gap':>8}"
                     "  status")
        for p in pr.positions:
            lines.append(f"  {p.phase:8} {p.pos:5d} {p.max_abs:11.2e} {p.kl:9.2e} {p.ours:7d} {p.hf:7d} "
                         f"{p.gap:8.2e}  {p.status}")
        lines.append(f"prompt {i}: {'PASS' if pr.passed else 'FAIL'}: {_summary(pr.positions)}")
    everything = [p for pr in report.prompts for p in pr.positions]
    lines.append(f"\noverall: {'PASS' if report.passed else 'FAIL'}: {len(report.prompts)} prompts, "
                 f"{_summary(everything)}")
    return "\n".join(lines)


def _hf_reference():
    """torch and transformers' AutoModelForCausalLM: the referee, not a serving dependency (the [hf] extra)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as err:
        raise ConfigError(f"comparing against Hugging Face needs torch and transformers ({err}); "
                          "install them with: pip install 'jaxserve[hf]'") from None
    return torch, AutoModelForCausalLM


def main(argv: Sequence[str] | None = None, prog: str = "python -m jaxserve.compare_hf") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("model_dir", help="Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--reference", metavar="DIR", help="HF directory to compare against (default MODEL_DIR)")
    parser.add_argument("--dtype", choices=tuple(DEFAULT_TOLERANCES), default="float32")
    parser.add_argument("--attention", default="reference", help="our attention implementation (default reference)")
    parser.add_argument("--prompts", help="file, one prompt a line: text, or 'ids: 1,2,3'; default: random ids")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="HF greedy tokens, teacher-forced (default 8)")
    parser.add_argument("--page-size", type=int, default=16, help="KV-cache page size (default 16)")
    relative = "bfloat16: a fraction of the position's largest |HF logit|"
    parser.add_argument("--atol", type=float, help=f"max |logit difference| (default 1e-3; {relative}, 0.15)")
    parser.add_argument("--kl-tol", type=float, help="max KL(HF || ours) (default 1e-5; bfloat16: 0.15)")
    parser.add_argument("--tie-gap", type=float,
                        help=f"HF top-2 gap under which a greedy mismatch is a near-tie "
                        f"(default 1e-3; {relative}, 0.06)")
    parser.add_argument("--json", metavar="OUT", help="also write the full report as JSON")
    args = parser.parse_args(argv)
    try:
        ModelConfig.from_dir(args.model_dir)  # a missing directory or config is reported before anything else
        prompts = read_prompts(args.prompts, args.model_dir) if args.prompts else None
        report = compare(args.model_dir, prompts, dtype=args.dtype, max_new_tokens=args.max_new_tokens,
                         page_size=args.page_size, atol=args.atol, kl_tol=args.kl_tol,
                         tie_gap=args.tie_gap, attention=args.attention,
                         reference_dir=args.reference)
    except JaxServeError as err:
        print(f"compare_hf: error: {err}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report.to_dict(), f, indent=1)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
