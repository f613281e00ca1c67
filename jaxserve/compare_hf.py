"""Parity check against Hugging Face transformers, through the engine that serves.

jaxserve's side is the server's own engine (`LLM` over `LLMEngine`, built from the same settings as
`jaxserve serve`: the same loader, the same per-layer or stacked layout, the same bucket executables,
host packing, placeholders and sampler), and what it compares is what the server returns:
- "score": one request with prompt_logprobs over the prompt and HF's greedy continuation (teacher
  forcing): the scoring variant's per-position scores (the next token's logprob and the top-N), the
  last position from the sampler's logprobs of the token it samples;
- "generate": the engine's greedy tokens (temperature 0) from the prompt with their logprobs, the first
  from the prompt's step, the rest from decode steps over the paged cache, each against HF's argmax and
  log_softmax given the same tokens before it.
Per position: the largest |logprob difference| over the ids the engine returns (the target and its
top-N), the KL of the two distributions coarsened to those ids and the rest (a lower bound of the
full KL), whether HF's top-N are among ours, and greedy agreement (near-ties apart).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Sequence

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.errors import ConfigError, JaxServeError, ModelLoadError


@dataclasses.dataclass(frozen=True)
class Tolerances:
    atol: float  # largest allowed |our logprob - HF logprob| over the ids the engine returns at a position
    kl: float  # largest allowed KL(HF || ours), both coarsened to the returned ids and the rest
    tie_gap: float  # a greedy disagreement where HF's top-2 logits are closer than this is a near-tie, not a failure
    relative: bool = False  # atol and tie_gap are fractions of the position's largest |HF logit|


# float32: the two sides differ only in summation order. Through the engine (CPU, reference attention,
# per-layer weights; random prompts, page 8, 8 new tokens), correct random 2-layer models of every
# architecture in tests/hf_models measured |dlogprob| <= 3.1e-5 and coarse KL <= 7e-11 (2026-12-07).
# bfloat16: each side rounds activations to 8 significant bits in its own places, so the error grows
# with the size of the logits, hence relative bounds (set when the checker compared whole logits: the
# worst |dlogit| 0.026-0.075 of the position's largest |logit|, KL up to 7e-2 on an 8-layer model, greedy
# flips only where HF's top-2 gap was under 0.033 of it; the defaults are about twice those). Through the
# engine the same models measured coarse KL <= 2.5e-2 and only near-tie flips, all within these bounds.
# Comparing bf16 with bf16 cannot see a subtle error (one weight scaled by 1.05 stays inside that
# noise): float32 is the exactness check.
DEFAULT_TOLERANCES = {
    "float32": Tolerances(atol=1e-3, kl=1e-5, tie_gap=1e-3),
    "bfloat16": Tolerances(atol=0.15, kl=0.15, tie_gap=0.06, relative=True),
}


@dataclasses.dataclass
class Position:
    """One next-token prediction: the engine's scores after input token `pos`, against HF's logits there."""

    phase: str  # "score" (prompt_logprobs, teacher-forced) or "generate" (the engine's greedy tokens)
    pos: int
    token: int  # the token scored: the next input token, or the one the engine sampled
    logprob: float  # our logprob of `token`
    hf_logprob: float  # HF's
    max_abs: float  # max |ours - HF| over the returned ids (token and top-N)
    kl: float  # KL(HF || ours) coarsened to the returned ids and the rest
    ours: int  # our argmax (generate: the token the engine chose)
    hf: int  # HF's argmax
    gap: float  # HF's top-1 minus top-2 logit
    status: str  # "ok", "near-tie", or "FAIL (what)"


@dataclasses.dataclass
class PromptReport:
    prompt: list[int]
    continuation: list[int]  # HF's greedy continuation, scored by both models (teacher forcing)
    generated: list[int]  # the engine's greedy tokens from the prompt
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
    engine: dict  # how the engine ran: attention, layer layout, page size, top-N, executables
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


def _coarse_kl(p: np.ndarray, q: np.ndarray) -> float:
    """KL(p || q) of two distributions given on the same few ids, each with the rest of its mass as one more
    outcome: a lower bound of the KL of the whole distributions (merging outcomes cannot raise it)."""
    p, q = np.append(p, max(1.0 - p.sum(), 0.0)), np.append(q, max(1.0 - q.sum(), 0.0))
    keep = p > 0
    return max(float((p[keep] * (np.log(p[keep]) - np.log(np.maximum(q[keep], 1e-300)))).sum()), 0.0)


def compare_scores(
    phase: str,
    first_pos: int,
    ours: Sequence[dict[int, float]],
    tokens: Sequence[int],
    ref: np.ndarray,
    tol: Tolerances,
    top_n: int,
) -> list[Position]:
    """Per-position comparison of the engine's score entries ({token id: logprob}: `tokens[t]`'s and the
    top `top_n`) with HF's logits f[T, V], in float64 so the metric adds no error of its own. Our argmax
    is the entry's best in "score", the token the engine chose in "generate"."""
    ref = ref.astype(np.float64)
    lp_ref = _log_softmax(ref)
    top2 = np.partition(ref, -2, axis=-1)[:, -2:]
    gap = top2[:, 1] - top2[:, 0]
    scale = np.abs(ref).max(-1) if tol.relative else np.ones(len(ref))
    out = []
    for t, entry in enumerate(ours):
        ids = np.fromiter(entry.keys(), np.int64, len(entry))
        lp = np.fromiter(entry.values(), np.float64, len(entry))
        hf = lp_ref[t]
        max_abs = float(np.abs(lp - hf[ids]).max())
        kl = _coarse_kl(np.exp(hf[ids]), np.exp(lp))
        # HF's top-N missing from ours: wrong unless its HF logprob is within atol of our N-th best.
        nth = np.sort(lp)[::-1][min(top_n, len(lp)) - 1]
        missing = [j for j in np.argsort(-hf)[:top_n] if j not in entry and hf[j] > nth + tol.atol * scale[t]]
        a = int(tokens[t]) if phase == "generate" else int(ids[lp.argmax()])
        b = int(ref[t].argmax())
        bad = [
            name
            for name, failed in (
                ("logprobs", max_abs > tol.atol * scale[t]),
                ("kl", kl > tol.kl),
                ("top", bool(missing)),
                ("greedy", a != b and gap[t] > tol.tie_gap * scale[t]),
            )
            if failed
        ]
        status = f"FAIL ({', '.join(bad)})" if bad else ("near-tie" if a != b else "ok")
        token = int(tokens[t])
        out.append(
            Position(
                phase,
                first_pos + t,
                token,
                float(entry[token]),
                float(hf[token]),
                max_abs,
                kl,
                a,
                b,
                float(gap[t]),
                status,
            )
        )
    return out


def build_llm(model_dir: str, **settings: Any):
    """The engine `jaxserve serve MODEL_DIR` would build with these settings, with the scoring variant
    on (enable_prompt_logprobs). Not warmed up: each bucket compiles when first used, the same
    executable the server's warm-up compiles (the same bucket table, function and options)."""
    from jaxserve.llm import LLM

    return LLM(model_dir, warm_up=False, **{"enable_prompt_logprobs": True, **settings})


def engine_scores(llm, ids: Sequence[int], top_n: int) -> list[dict[int, float]]:
    """What the server returns for `ids` with prompt_logprobs=top_n, logprobs=top_n and one greedy
    token: per position r the scores of the token after ids[:r + 1] ({id: logprob}, the next token's
    and the top-N); rows 0..len-2 from the scoring variant, the last from the sampler's logprobs."""
    from jaxserve.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=top_n, logprobs=top_n)
    out = llm.generate(prompt_token_ids=[list(ids)], sampling_params=params, use_tqdm=False)[0]
    return [dict(e) for e in out.prompt_logprobs[1:]] + [dict(out.outputs[0].logprobs[0])]


def engine_greedy(llm, prompt: Sequence[int], max_tokens: int, top_n: int) -> tuple[list[int], list[dict]]:
    """The engine's greedy tokens from `prompt` (EOS ignored, as HF's loop does) and their logprob entries."""
    from jaxserve.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=top_n)
    out = llm.generate(prompt_token_ids=[list(prompt)], sampling_params=params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [dict(e) for e in out.logprobs]


def describe_engine(llm) -> dict:
    """How the engine ran: the resolved attention, the layer layout, its page size, executables compiled."""
    options = llm.runner.options
    return {
        "attention": options.attention_backend,
        "layers": "scanned" if options.scan_layers else "per-layer",
        "page_size": llm.config.page_size,
        "max_model_len": llm.memory.max_model_len,
        "top_n": llm.config.max_logprobs,
        "executables": llm.engine.num_executables(),
    }


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
    attention: str = "auto",
    reference_dir: str | None = None,
    llm: Any = None,
    **settings: Any,
) -> Report:
    """Run every prompt through the serving engine and HF (CPU) and compare their scores position by position.

    The engine is `llm` when given (an `LLM` built with enable_prompt_logprobs, e.g. one a server runs
    over; its dtype and page size win), else `build_llm(model_dir, dtype=, page_size=,
    attention_backend=attention, **settings)` (any EngineConfig setting, as `jaxserve serve` takes them).
    Its top-N is its max_logprobs. HF loads `reference_dir` (default: `model_dir`), so a converted or
    edited checkpoint can be checked against the original.
    """
    torch, AutoModelForCausalLM = _hf_reference()

    if llm is not None:
        dtype, page_size = str(np.dtype(llm.engine.dtype)), llm.config.page_size
    if dtype not in DEFAULT_TOLERANCES:
        raise ConfigError(f"dtype must be one of {', '.join(DEFAULT_TOLERANCES)}, got {dtype!r}")
    if page_size < 1 or max_new_tokens < 0:
        raise ConfigError("page_size must be >= 1 and max_new_tokens >= 0")
    base = DEFAULT_TOLERANCES[dtype]
    tol = Tolerances(
        atol=base.atol if atol is None else atol,
        kl=base.kl if kl_tol is None else kl_tol,
        tie_gap=base.tie_gap if tie_gap is None else tie_gap,
        relative=base.relative,
    )

    cfg = ModelConfig.from_dir(model_dir)  # ours first: its errors name the problem (JaxServeError)
    if prompts_token_ids is None:
        prompts_token_ids = random_prompts(cfg.vocab_size, page_size)
    prompts = [list(map(int, p)) for p in prompts_token_ids]
    if not prompts:
        raise ConfigError("no prompts given")
    for i, p in enumerate(prompts):
        if not p or min(p) < 0 or max(p) >= cfg.vocab_size:
            raise ConfigError(f"prompt {i} is empty or has token ids outside [0, {cfg.vocab_size})")
    reference_dir = reference_dir or model_dir
    if not os.path.isdir(reference_dir):
        raise ModelLoadError(f"reference directory {reference_dir!r} does not exist")
    try:
        model = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=getattr(torch, dtype)).eval()
    except (OSError, ValueError) as err:  # transformers' own words, without its traceback
        raise ModelLoadError(f"transformers cannot load {reference_dir!r}: {err}") from None

    def hf_logits(ids: list[int]) -> np.ndarray:
        """HF's logits f32[len, V] over `ids` in one full forward (no HF KV cache: the same call in every
        transformers version)."""
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().numpy()

    def hf_greedy(prompt: list[int]) -> list[int]:
        ids = list(prompt)
        for _ in range(max_new_tokens):
            ids.append(int(hf_logits(ids)[-1].argmax()))
        return ids[len(prompt) :]

    def check(llm) -> Report:
        if not llm.config.enable_prompt_logprobs:
            raise ConfigError("the engine needs enable_prompt_logprobs=True: its scoring variant gives the scores")
        for i, p in enumerate(prompts):  # the scoring request: prompt + continuation, and one token sampled
            if len(p) + max_new_tokens + 1 > llm.memory.max_model_len:
                raise ConfigError(
                    f"prompt {i}: {len(p)} + {max_new_tokens} + 1 tokens exceed the engine's "
                    f"max_model_len {llm.memory.max_model_len}"
                )
        top_n = llm.config.max_logprobs
        reports = []
        for prompt in prompts:
            continuation = hf_greedy(prompt)
            full = prompt + continuation
            ref = hf_logits(full)
            scores = engine_scores(llm, full, top_n)
            sampled = max(scores[-1], key=scores[-1].get)  # temperature 0 sampled the argmax
            positions = compare_scores("score", 0, scores, full[1:] + [sampled], ref, tol, top_n)
            generated = []
            if max_new_tokens:
                generated, entries = engine_greedy(llm, prompt, max_new_tokens, top_n)
                # HF given the engine's tokens: each step compared in the same context, after a flip too.
                gen_ref = ref if generated == continuation else hf_logits(prompt + generated)
                positions += compare_scores(
                    "generate",
                    len(prompt) - 1,
                    entries,
                    generated,
                    gen_ref[len(prompt) - 1 : len(prompt) - 1 + len(generated)],
                    tol,
                    top_n,
                )
            reports.append(PromptReport(prompt, continuation, generated, positions))
        return Report(model_dir, reference_dir, dtype, tol, describe_engine(llm), reports)

    if llm is not None:
        return check(llm)
    with build_llm(model_dir, dtype=dtype, page_size=page_size, attention_backend=attention, **settings) as llm:
        return check(llm)  # an engine built here is released here: its executables, weights and cache


def _summary(positions: list[Position]) -> str:
    mismatches = sum(p.status.startswith("FAIL") and "greedy" in p.status for p in positions)
    ties = sum(p.status == "near-tie" for p in positions)
    return (
        f"{len(positions)} positions, max|dlogprob| {max(p.max_abs for p in positions):.2e}, "
        f"max KL {max(p.kl for p in positions):.2e}, greedy mismatches {mismatches}, near-ties {ties}"
    )


def format_report(report: Report) -> str:
    t, e = report.tolerances, report.engine
    ref = "" if report.reference_dir == report.model_dir else f" vs HF {report.reference_dir}"
    unit = " x max|HF logit|" if t.relative else ""
    lines = [
        f"{report.model_dir}{ref} ({report.dtype}) through the serving engine: attention {e['attention']}, "
        f"layers {e['layers']}, page size {e['page_size']}, top-{e['top_n']} logprobs, "
        f"{e['executables']} executables",
        f"atol {t.atol:g}{unit} on logprobs, coarse-KL tol {t.kl:g}, near-tie gap {t.tie_gap:g}{unit}",
    ]
    for i, pr in enumerate(report.prompts):
        same = "the same" if pr.generated == pr.continuation else f"ours {pr.generated}"
        lines.append(
            f"\nprompt {i}: {len(pr.prompt)} tokens + {len(pr.continuation)} from HF's greedy continuation ({same})"
        )
        lines.append(
            f"  {'phase':8} {'pos':>5} {'token':>7} {'logprob':>10} {'max|dlp|':>9} {'KL':>9} {'ours':>7} "
            f"{'hf':>7} {'hf gap':>8}  status"
        )
        for p in pr.positions:
            lines.append(
                f"  {p.phase:8} {p.pos:5d} {p.token:7d} {p.logprob:10.4f} {p.max_abs:9.2e} {p.kl:9.2e} "
                f"{p.ours:7d} {p.hf:7d} {p.gap:8.2e}  {p.status}"
            )
        lines.append(f"prompt {i}: {'PASS' if pr.passed else 'FAIL'}: {_summary(pr.positions)}")
    everything = [p for pr in report.prompts for p in pr.positions]
    lines.append(
        f"\noverall: {'PASS' if report.passed else 'FAIL'}: {len(report.prompts)} prompts, {_summary(everything)}"
    )
    return "\n".join(lines)


def _hf_reference():
    """torch and transformers' AutoModelForCausalLM: the referee, not a serving dependency (the [hf] extra)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as err:
        raise ConfigError(
            f"comparing against Hugging Face needs torch and transformers ({err}); "
            "install them with the [hf] extra: pip install -e '.[hf]' in the jaxserve checkout"
        ) from None
    return torch, AutoModelForCausalLM


def _settings(pairs: Sequence[str]) -> dict[str, str]:
    """--setting NAME=VALUE pairs (the engine parses the values, as from YAML); the settings with flags
    of their own are refused, so one value cannot be given twice."""
    own = {
        "model": "MODEL_DIR",
        "dtype": "--dtype",
        "page_size": "--page-size",
        "attention_backend": "--attention",
        "enable_prompt_logprobs": "(always on: the scores come from it)",
    }
    settings = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ConfigError(f"--setting takes NAME=VALUE, got {pair!r}")
        if name in own:
            raise ConfigError(f"--setting {name}: use {own[name]}")
        settings[name] = value
    return settings


def main(argv: Sequence[str] | None = None, prog: str = "python -m jaxserve.compare_hf") -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_dir", help="Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--reference", metavar="DIR", help="HF directory to compare against (default MODEL_DIR)")
    parser.add_argument("--dtype", choices=tuple(DEFAULT_TOLERANCES), default="float32")
    parser.add_argument(
        "--attention",
        default="auto",
        help="the engine's attention_backend: auto | reference | pallas (default auto, as served)",
    )
    parser.add_argument("--prompts", help="file, one prompt a line: text, or 'ids: 1,2,3'; default: random ids")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=8,
        help="HF greedy tokens, scored teacher-forced, and the engine's greedy tokens (default 8)",
    )
    parser.add_argument("--page-size", type=int, default=16, help="KV-cache page size (default 16)")
    relative = "bfloat16: a fraction of the position's largest |HF logit|"
    parser.add_argument("--atol", type=float, help=f"max |logprob difference| (default 1e-3; {relative}, 0.15)")
    parser.add_argument(
        "--kl-tol",
        type=float,
        help="max KL(HF || ours) over the returned ids and the rest (default 1e-5; bfloat16: 0.15)",
    )
    parser.add_argument(
        "--tie-gap",
        type=float,
        help=f"HF top-2 gap under which a greedy mismatch is a near-tie (default 1e-3; {relative}, 0.06)",
    )
    parser.add_argument("--json", metavar="OUT", help="also write the full report as JSON")
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="any other engine setting, by its YAML name, as the server would be started with "
        "(e.g. max_model_len=4096, scan_layers=true, quantization=int8); repeatable",
    )
    args = parser.parse_args(argv)
    try:
        settings = _settings(args.setting)
        ModelConfig.from_dir(args.model_dir)  # a missing directory or config is reported before anything else
        prompts = read_prompts(args.prompts, args.model_dir) if args.prompts else None
        report = compare(
            args.model_dir,
            prompts,
            dtype=args.dtype,
            max_new_tokens=args.max_new_tokens,
            page_size=args.page_size,
            atol=args.atol,
            kl_tol=args.kl_tol,
            tie_gap=args.tie_gap,
            attention=args.attention,
            reference_dir=args.reference,
            **settings,
        )
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
