"""What a serving benchmark reports, from each request's timings: throughput, latency statistics, goodput.

The definitions and key names are vLLM's (`vllm bench serve`), so result files compare side by side:
TTFT is the time to the first streamed token; TPOT the time per output token after the first,
(e2el - ttft) / (output tokens - 1); ITL the gaps between streamed chunks; E2EL the whole request.
Each selected metric gets mean_/median_/std_ and p{q}_ keys in milliseconds (percentiles linearly
interpolated, as numpy's default). Goodput counts the requests per second that met every SLO given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """One request's outcome (times in seconds, from the client's clock)."""

    index: int
    ok: bool = False
    error: str = ""
    input_len: int = 0  # prompt tokens: the server's usage when it reports one, else the dataset's count
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0  # when it was sent (perf_counter)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between order statistics; NaN when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def percentile_key(metric: str, q: float) -> str:
    """vLLM's key: p99_ttft_ms, p99.9_ttft_ms."""
    return f"p{q:g}_{metric}_ms"


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """vLLM's `--goodput ttft:500 tpot:50` (milliseconds) as {"ttft": 500.0, "tpot": 50.0}."""
    slo: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        try:
            slo[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slo[name] < 0:
            raise ValueError(f"--goodput {item!r}: an SLO cannot be negative")
    return slo


def meets_slo(result: RequestResult, slo: dict[str, float]) -> bool:
    """A completed request within every SLO (TPOT is not checked for a single-token reply)."""
    if not result.ok:
        return False
    if "ttft" in slo and result.ttft * 1e3 > slo["ttft"]:
        return False
    if "tpot" in slo and result.tpot is not None and result.tpot * 1e3 > slo["tpot"]:
        return False
    return not ("e2el" in slo and result.e2el * 1e3 > slo["e2el"])


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    percentiles: Sequence[float] = (99,),
    metrics: Sequence[str] = ("ttft", "tpot", "itl"),
    goodput: dict[str, float] | None = None,
) -> dict:
    """The run's figures under vLLM's keys: counts, token totals, throughputs, and per metric the mean,
    median, standard deviation and each percentile (ms). With `goodput` SLOs also request_goodput
    (requests/s within them) and slo_attainment (their share of all requests, failed ones included)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_len for r in ok)

    def per_s(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    summary: dict = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": per_s(len(ok)),
        "request_goodput": None,
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
    }
    if goodput:
        good = sum(meets_slo(r, goodput) for r in results)
        summary["request_goodput"] = per_s(good)
        summary["slo_attainment"] = good / len(results) if results else 0.0
    series = {
        "ttft": [r.ttft * 1e3 for r in ok],
        "tpot": [r.tpot * 1e3 for r in ok if r.tpot is not None],
        "itl": [x * 1e3 for r in ok for x in r.itl],
        "e2el": [r.e2el * 1e3 for r in ok],
    }
    for name in metrics:
        values = series[name]
        mean = sum(values) / len(values) if values else float("nan")
        summary[f"mean_{name}_ms"] = mean
        summary[f"median_{name}_ms"] = percentile(values, 50)
        summary[f"std_{name}_ms"] = (
            math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) if values else float("nan")
        )
        for q in percentiles:
            summary[percentile_key(name, q)] = percentile(values, q)
    return summary
