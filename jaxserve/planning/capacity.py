"""Capacity from benchmark results: the replicas (and devices, and cost) that serve a request rate within
a latency SLO, from one replica's goodput measured by scripts/bench_serving.py at several request rates.
`python -m jaxserve.plan capacity` (jaxserve/plan.py) is the command line.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from jaxserve.errors import ConfigError
from jaxserve.planning.roofline import cost_per_million_tokens


# ---- capacity: replicas for a request rate under a latency SLO, from a measured replica --------------
def request_goodput(
    requests: Sequence[dict], duration_s: float, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None
) -> tuple[float, float]:
    """(goodput in requests/s, SLO attainment) of bench_serving's per-request records (--save-requests:
    ok, ttft and e2el in seconds, output_tokens): the requests that succeeded with TTFT <= slo_ttft_ms
    and TPOT = (e2el - ttft) / (output_tokens - 1) <= slo_tpot_ms (an SLO left None is not checked),
    per second of the run, and as a share of all requests (failed ones count against it)."""
    good = 0
    for r in requests:
        if not r.get("ok"):
            continue
        if slo_ttft_ms is not None and r["ttft"] * 1e3 > slo_ttft_ms:
            continue
        n = r.get("output_tokens", 0)
        if slo_tpot_ms is not None and n > 1 and (r["e2el"] - r["ttft"]) / (n - 1) * 1e3 > slo_tpot_ms:
            continue
        good += 1
    return (good / duration_s if duration_s else 0.0), (good / len(requests) if requests else 0.0)


@dataclasses.dataclass(frozen=True)
class ReplicaCapacity:
    """The most requests/s one replica served within the SLO, and the run that showed it."""

    requests_per_s: float  # goodput of the chosen run
    attainment: float  # its share of requests within the SLO
    offered_rate: float | str  # that run's request rate (or "inf")
    mean_input_tokens: float
    mean_output_tokens: float
    p99_tpot_ms: float
    p99_ttft_ms: float
    meets_attainment: bool  # False: no run reached min_attainment; the best goodput is used anyway
    saturated: bool = False  # the run served under 90% of its offered rate: a queue was building up


def replica_capacity(
    runs: Sequence[dict],
    min_attainment: float = 0.9,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> ReplicaCapacity:
    """One replica's capacity from bench_serving run summaries (one per request rate): the highest
    goodput among the runs where at least `min_attainment` of requests met the SLO (past that rate,
    queueing breaks the SLO). With an SLO given here the goodput is recomputed from each run's
    per-request records (bench_serving --save-requests); without, each run's own `goodput` (measured
    with bench_serving's --slo-ttft/--slo-tpot) is used. No run reaching `min_attainment`: the
    best goodput, marked meets_attainment=False."""
    measured = []
    for run in runs:
        if run.get("completed", 0) == 0:
            continue
        if slo_ttft_ms is not None or slo_tpot_ms is not None:
            if "requests" not in run:
                raise ConfigError(
                    "an SLO given to the capacity planner needs per-request records: run "
                    "bench_serving.py with --save-requests (or give the SLO to bench_serving.py instead)"
                )
            goodput, attainment = request_goodput(run["requests"], run["duration_s"], slo_ttft_ms, slo_tpot_ms)
        elif "goodput" in run:
            goodput, attainment = run["goodput"], run["slo_attainment"]
        else:
            raise ConfigError(
                "the benchmark has no goodput: run bench_serving.py with --slo-ttft/--slo-tpot "
                "(or --save-requests and give the SLO here)"
            )
        measured.append((goodput, attainment, run))
    if not measured:
        raise ConfigError("the benchmark has no run with a completed request")
    meeting = [m for m in measured if m[1] >= min_attainment]
    goodput, attainment, run = max(meeting or measured, key=lambda m: m[0])
    return ReplicaCapacity(
        requests_per_s=goodput,
        attainment=attainment,
        offered_rate=run.get("request_rate", "inf"),
        mean_input_tokens=run["total_input_tokens"] / run["completed"],
        mean_output_tokens=run["total_output_tokens"] / run["completed"],
        p99_tpot_ms=run.get("p99_tpot_ms", float("nan")),
        p99_ttft_ms=run.get("p99_ttft_ms", float("nan")),
        meets_attainment=bool(meeting),
        saturated=_saturated(run),
    )


def _saturated(run: dict) -> bool:
    """Served under 90% of a finite offered rate: in a longer run its queue, and TTFT, would keep growing."""
    rate = run.get("request_rate")
    if not isinstance(rate, (int, float)) or not math.isfinite(rate):
        return rate == "inf" or rate == float("inf")
    return run.get("request_throughput", rate) < 0.9 * rate


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    target_rate: float  # requests/s to serve
    per_replica_rate: float  # requests/s one replica serves within the SLO
    headroom: float  # extra share of capacity kept spare (0.2 = 20 %)
    replicas: int
    devices_per_replica: int
    devices: int
    utilisation: float  # target_rate / (replicas * per_replica_rate)
    cost_per_hour: float | None  # all devices, USD
    usd_per_million_input_tokens: float | None  # at the target rate, the whole cost charged to input tokens
    usd_per_million_output_tokens: float | None  # ... or to output tokens


def capacity_plan(
    target_rate: float,
    per_replica_rate: float,
    devices_per_replica: int = 1,
    cost_per_device_hour: float | None = None,
    headroom: float = 0.0,
    mean_input_tokens: float | None = None,
    mean_output_tokens: float | None = None,
) -> CapacityPlan:
    """Replicas = ceil(target_rate · (1 + headroom) / per_replica_rate); devices = replicas ·
    devices_per_replica; cost = devices · cost_per_device_hour. Token costs at the target rate:
    cost_per_million_tokens(cost, devices, target_rate · mean tokens per request)."""
    if target_rate <= 0 or per_replica_rate <= 0:
        raise ConfigError(f"need a positive target rate and per-replica rate, got {target_rate}, {per_replica_rate}")
    if devices_per_replica < 1 or headroom < 0:
        raise ConfigError("devices_per_replica must be >= 1 and headroom >= 0")
    replicas = max(1, math.ceil(target_rate * (1 + headroom) / per_replica_rate - 1e-9))
    devices = replicas * devices_per_replica
    cost = None if cost_per_device_hour is None else cost_per_device_hour * devices

    def per_million(tokens_per_request: float | None) -> float | None:
        if cost_per_device_hour is None or not tokens_per_request:
            return None
        return cost_per_million_tokens(cost_per_device_hour, devices, target_rate * tokens_per_request)

    return CapacityPlan(
        target_rate,
        per_replica_rate,
        headroom,
        replicas,
        devices_per_replica,
        devices,
        target_rate / (replicas * per_replica_rate),
        cost,
        per_million(mean_input_tokens),
        per_million(mean_output_tokens),
    )
