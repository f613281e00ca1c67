"""Prometheus metrics of one server: engine state read at scrape time, request latencies observed by the API.

Every metric is named `jaxserve:...` and lives in the app's own registry, so several apps in one
process (tests) do not collide. One is also exported under vLLM's name, for the tools that read it
(the Gateway API Inference Extension's endpoint picker routes by it): `vllm:lora_requests_info`.

LoRA adapters (with --enable-lora, from `stats()["lora"]`): `jaxserve:lora_requests_info` and its
alias `vllm:lora_requests_info`, vLLM's shape: a gauge whose value is the scrape's wall-clock time and
whose labels say `running_lora_adapters` and `waiting_lora_adapters` (the adapters' names, comma
separated) and `max_lora`; the requests per adapter, `jaxserve:lora_requests_running{lora_name}` and
`jaxserve:lora_requests_waiting{lora_name}`; `jaxserve:lora_adapters_resident` (in device slots) and
`jaxserve:lora_adapters_cpu_cached` (held in host memory); the counters `jaxserve:lora_loads_total`
(adapters written into a device slot) and `jaxserve:lora_evictions_total` (swapped out for another).

Model bandwidth utilisation (MBU) = bytes the last engine step had to read (weights + KV) / the
step's time / the device's peak memory bandwidth. The peak comes from `--device-bandwidth`, else from the
device table (`jaxserve.planning.devices`, by `jax.devices()[0].device_kind`); without it only the achieved bytes/s
is exported.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from jaxserve.planning.devices import spec_for_device_kind

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


def detect_device_bandwidth() -> float | None:
    """Peak bandwidth of the first device, if jax is already in use and the device is in the device table."""
    if "jax" not in sys.modules:
        return None
    try:
        device = sys.modules["jax"].devices()[0]
    except Exception:  # noqa: BLE001 - no devices, no backend: simply unknown
        return None
    if device.platform == "cpu":  # the table's CPU bandwidth is measured per run, not a peak
        return None
    spec = spec_for_device_kind(device.device_kind)
    return spec.hbm_bandwidth if spec is not None and spec.hbm_bandwidth > 0 else None


def spec_positions(stats: dict):
    """jaxserve:spec_decode_num_drafts_per_pos{position} and ..._num_accepted_tokens_per_pos{position}:
    speculation's acceptance by draft position (vLLM's per-position counter)."""
    for key, doc in (
        ("spec_decode_num_drafts_per_pos", "Verifies that proposed a draft at this position (0: the first)."),
        ("spec_decode_num_accepted_tokens_per_pos", "Drafts accepted at this position (0: the first)."),
    ):
        counts = stats.get(key)
        if counts:
            family = CounterMetricFamily(f"jaxserve:{key}", doc, labels=["position"])
            for position, count in enumerate(counts):
                family.add_metric([str(position)], float(count))
            yield family


def step_composition(stats: dict):
    """jaxserve:steps_total{kind} and the jaxserve:iteration_tokens histogram (real tokens per step)."""
    by_kind = stats.get("steps_by_kind")
    if by_kind:
        family = CounterMetricFamily(
            "jaxserve:steps",
            "Engine steps by kind: decode, prefill, or mixed (prompt chunks and decode rows in one step).",
            labels=["kind"],
        )
        for kind, count in by_kind.items():
            family.add_metric([kind], float(count))
        yield family
    hist = stats.get("iteration_tokens")
    if hist:
        cumulative, buckets = 0, []
        for bound, count in zip([*hist["bounds"], "+Inf"], hist["counts"]):
            cumulative += count
            buckets.append((str(bound), float(cumulative)))
        yield HistogramMetricFamily(
            "jaxserve:iteration_tokens",
            "Real (unpadded) tokens computed per engine step.",
            buckets=buckets,
            sum_value=float(hist["sum"]),
        )


def kv_offload_metrics(stats: dict):
    """Prefix-cache hits per tier (vLLM's names: the device's `prefix_cache_*`, a connector's
    `external_prefix_cache_*`, in tokens) and, with a KV connector, pages and bytes moved each way."""
    for name, doc, key in (
        ("prefix_cache_queries", "Prompt tokens looked up in the device prefix cache.", "prefix_cache_queries"),
        ("prefix_cache_hits", "Prompt tokens found in the device prefix cache.", "prefix_cache_hits"),
        (
            "external_prefix_cache_queries",
            "Prompt tokens past the device hit looked up by the KV connector (the host tier).",
            "external_prefix_cache_queries",
        ),
        ("external_prefix_cache_hits", "Prompt tokens the KV connector loaded instead.", "external_prefix_cache_hits"),
    ):
        if stats.get(key) is not None:
            yield CounterMetricFamily("jaxserve:" + name, doc, value=float(stats[key]))
    for unit, doc in (("pages", "KV pages"), ("bytes", "Bytes of KV pages")):
        moved = {d: stats.get(f"kv_offload_{unit}_to_{d}_total") for d in ("host", "device")}
        if any(v is not None for v in moved.values()):
            family = CounterMetricFamily(
                f"jaxserve:kv_offload_{unit}", f"{doc} moved by the KV connector, by direction.", labels=["direction"]
            )
            for direction, v in moved.items():
                family.add_metric([f"to_{direction}"], float(v or 0))
            yield family
    if stats.get("kv_offload_host_pages") is not None:
        yield GaugeMetricFamily(
            "jaxserve:kv_offload_host_pages", "Pages held by the host tier.", value=stats["kv_offload_host_pages"]
        )
        yield GaugeMetricFamily(
            "jaxserve:kv_offload_host_capacity_pages",
            "Pages the host tier holds at most (--kv-offloading-size).",
            value=stats["kv_offload_host_capacity_pages"],
        )
    if stats.get("kv_transfer_pages_held") is not None:  # prefill and decode apart (JaxTransferConnector)
        yield GaugeMetricFamily(
            "jaxserve:kv_transfer_pages_held",
            "Pages a prefill engine keeps until a decode engine pulls them (or the timeout frees them).",
            value=stats["kv_transfer_pages_held"],
        )
        family = CounterMetricFamily(
            "jaxserve:kv_transfer_pages", "KV pages moved between engines, by direction.", labels=["direction"]
        )
        for direction in ("sent", "received"):
            family.add_metric([direction], float(stats.get(f"kv_transfer_pages_{direction}", 0)))
        yield family
        for name, doc in (
            ("kv_transfer_offers_expired", "Prefill pages freed because nobody pulled them in time."),
            ("kv_transfer_loads_failed", "Pulls that failed (the decode engine recomputed the prompt)."),
        ):
            yield CounterMetricFamily(f"jaxserve:{name}", doc, value=float(stats.get(name, 0)))
    if stats.get("num_waiting_for_kv") is not None:
        yield GaugeMetricFamily(
            "jaxserve:num_requests_waiting_for_kv",
            "Sequences holding pages while a KV connector loads them.",
            value=stats["num_waiting_for_kv"],
        )


def lora_metrics(stats: dict, now: float | None = None):
    """The LoRA adapters' metrics (module docstring), when the engine reports `stats()["lora"]`."""
    lora = stats.get("lora")
    if not isinstance(lora, dict):
        return
    running, waiting = dict(lora.get("running") or {}), dict(lora.get("waiting") or {})
    labels = ["max_lora", "running_lora_adapters", "waiting_lora_adapters"]
    values = [
        str(lora.get("max_loras", "")),
        ",".join(n for n, k in running.items() if k),
        ",".join(n for n, k in waiting.items() if k),
    ]
    for name in ("vllm:lora_requests_info", "jaxserve:lora_requests_info"):
        family = GaugeMetricFamily(
            name,
            "Running and waiting LoRA adapters (labels) and max_lora; the value is the "
            "time of this reading (vLLM's shape).",
            labels=labels,
        )
        family.add_metric(values, time.time() if now is None else now)
        yield family
    for key, doc in (
        ("running", "Requests running, per LoRA adapter."),
        ("waiting", "Requests waiting, per LoRA adapter."),
    ):
        family = GaugeMetricFamily(f"jaxserve:lora_requests_{key}", doc, labels=["lora_name"])
        for name, count in (running if key == "running" else waiting).items():
            family.add_metric([name], float(count))
        yield family
    yield GaugeMetricFamily(
        "jaxserve:lora_adapters_resident",
        "LoRA adapters in device slots (at most max_loras).",
        value=float(len(lora.get("resident") or ())),
    )
    yield GaugeMetricFamily(
        "jaxserve:lora_adapters_cpu_cached",
        "LoRA adapters held in host memory.",
        value=float(len(lora.get("cpu_cached") or ())),
    )
    yield CounterMetricFamily(
        "jaxserve:lora_loads", "LoRA adapters written into a device slot.", value=float(lora.get("loads_total", 0))
    )
    yield CounterMetricFamily(
        "jaxserve:lora_evictions",
        "LoRA adapters swapped out of a device slot for another.",
        value=float(lora.get("evictions_total", 0)),
    )


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict | None], bandwidth: Callable[[], float | None]):
        self._stats = stats
        self._bandwidth = bandwidth

    def collect(self):
        stats = self._stats()
        if not stats:
            return

        def total(key, mean=False):
            v = stats.get(key)
            if isinstance(v, (list, tuple)):
                if not v:
                    return None
                return sum(float(x) for x in v) / (len(v) if mean else 1)
            return None if v is None else float(v)

        def gauge(name, doc, key, mean=False):
            v = total(key, mean)
            if v is not None:
                yield GaugeMetricFamily(name, doc, value=v)

        def counter(name, doc, key):
            v = total(key)
            if v is not None:
                yield CounterMetricFamily(name, doc, value=v)

        def per_replica(name, doc, key):
            v = stats.get(key + "_per_replica", stats.get(key))
            if isinstance(v, (list, tuple)) and v:
                family = GaugeMetricFamily(name, doc, labels=["replica"])
                for i, x in enumerate(v):
                    family.add_metric([str(i)], float(x))
                yield family

        yield from gauge("jaxserve:num_requests_running", "Requests in the running batch.", "num_running")
        yield from gauge("jaxserve:num_requests_waiting", "Requests waiting to be admitted.", "num_waiting")
        yield from gauge(
            "jaxserve:kv_cache_usage_perc",
            "KV-cache utilisation: tokens stored / token slots allocated (mean over replicas).",
            "kv_cache_utilization",
            mean=True,
        )
        yield from gauge(
            "jaxserve:prefix_cache_hit_rate",
            "Share of prompt tokens served from the prefix cache.",
            "prefix_cache_hit_rate",
        )
        yield from gauge("jaxserve:kv_pages_used", "KV-cache pages in use (all replicas).", "pages_used")
        yield from gauge("jaxserve:kv_pages_free", "KV-cache pages free (all replicas).", "pages_free")
        yield from per_replica("jaxserve:kv_pages_used_replica", "KV-cache pages in use per replica.", "pages_used")
        yield from per_replica("jaxserve:kv_pages_free_replica", "KV-cache pages free per replica.", "pages_free")
        yield from per_replica(
            "jaxserve:kv_cache_usage_perc_replica", "KV-cache utilisation per replica.", "kv_cache_utilization"
        )
        yield from per_replica("jaxserve:num_requests_running_replica", "Sequences running per replica.", "num_running")
        # Multi-host (process 0 only): the per-step message to the other processes.
        yield from counter(
            "jaxserve:multihost_messages", "Step messages sent to the other processes.", "multihost_messages_total"
        )
        yield from counter(
            "jaxserve:multihost_message_bytes",
            "Bytes of step messages sent to the other processes.",
            "multihost_message_bytes_total",
        )
        yield from counter(
            "jaxserve:multihost_send_seconds",
            "Seconds process 0 spent sending step messages.",
            "multihost_send_seconds_total",
        )
        yield from counter(
            "jaxserve:arrivals_joined",
            "Requests that arrived while a step ran and joined the next step, held back for them (async scheduling).",
            "arrivals_joined_total",
        )
        yield from counter(
            "jaxserve:num_preemptions", "Sequences preempted (pages reclaimed, recomputed later).", "num_preemptions"
        )
        yield from counter("jaxserve:prompt_tokens", "Prompt tokens processed.", "prompt_tokens_total")
        yield from counter("jaxserve:generation_tokens", "Tokens generated.", "generation_tokens_total")
        yield from counter(
            "jaxserve:compiles_after_warmup", "XLA compilations after warm-up (should stay 0).", "compiles_after_warmup"
        )
        yield from counter(
            "jaxserve:grammar_mask_seconds",
            "Host seconds computing structured-output token masks.",
            "grammar_mask_seconds_total",
        )
        yield from counter(
            "jaxserve:grammar_masked_rows", "Sampled rows that a grammar mask constrained.", "grammar_masked_rows_total"
        )
        yield from gauge(
            "jaxserve:executables", "Compiled step executables the engine holds (buckets and variants).", "executables"
        )
        # Serving while the rest compile (--compile-in-background): token buckets usable now, of all.
        yield from gauge("jaxserve:step_buckets_ready", "Token buckets compiled and usable by steps.", "buckets_ready")
        yield from gauge("jaxserve:step_buckets_total", "Token buckets the engine compiles.", "buckets_total")
        yield from gauge(
            "jaxserve:step_bucket_compile_seconds",
            "Seconds spent building the ready token buckets' executables (start-up and background).",
            "bucket_compile_seconds",
        )
        # Speculative decoding (only when it is on).
        yield from counter(
            "jaxserve:spec_decode_num_draft_tokens", "Draft tokens proposed.", "spec_decode_num_draft_tokens"
        )
        yield from counter(
            "jaxserve:spec_decode_num_accepted_tokens",
            "Draft tokens the target accepted.",
            "spec_decode_num_accepted_tokens",
        )
        yield from counter(
            "jaxserve:spec_decode_num_verify_steps",
            "Verify steps of a sequence with at least one draft token.",
            "spec_decode_num_verify_steps",
        )
        yield from gauge(
            "jaxserve:spec_decode_acceptance_rate",
            "Accepted / proposed draft tokens (since start).",
            "spec_decode_acceptance_rate",
        )
        yield from gauge(
            "jaxserve:spec_decode_mean_accepted_length",
            "Tokens per verify step: accepted drafts + the target's own token (since start).",
            "spec_decode_mean_accepted_length",
        )
        yield from spec_positions(stats)
        yield from step_composition(stats)
        yield from lora_metrics(stats)
        yield from kv_offload_metrics(stats)
        seconds = stats.get("last_step_seconds")
        nbytes = stats.get("last_step_bytes_read")
        if seconds is not None:
            yield GaugeMetricFamily(
                "jaxserve:last_step_seconds", "Wall time of the last engine step.", value=float(seconds)
            )
        if nbytes is not None:
            yield GaugeMetricFamily(
                "jaxserve:last_step_bytes_read", "Bytes the last step read (weights + KV).", value=float(nbytes)
            )
        if seconds and nbytes is not None:
            rate = float(nbytes) / float(seconds)
            yield GaugeMetricFamily(
                "jaxserve:model_bytes_read_per_second", "Bytes read per second in the last step.", value=rate
            )
            peak = self._bandwidth()
            if peak:
                yield GaugeMetricFamily(
                    "jaxserve:model_bandwidth_utilization",
                    "Model bandwidth utilisation of the last step: bytes read / time / peak.",
                    value=rate / peak,
                )


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict | None], device_bandwidth: float | None = None):
        self.registry = CollectorRegistry()
        self._bandwidth_value = device_bandwidth
        self._bandwidth_detected = device_bandwidth is not None
        r = self.registry
        # process_cpu_seconds_total and memory: CPU per output token (host and XLA share the cores)
        ProcessCollector(registry=r)
        self.ttft = Histogram(
            "jaxserve:time_to_first_token_seconds", "Time to first token.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "jaxserve:time_per_output_token_seconds",
            "Time per output token after the first.",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "jaxserve:e2e_request_latency_seconds", "End-to-end request latency.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue = Histogram(
            "jaxserve:request_queue_time_seconds",
            "Time from arrival to first scheduling.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "jaxserve:http_requests", "HTTP requests answered, by route and status.", ["route", "status"], registry=r
        )
        self.finished = Counter(
            "jaxserve:request_finished",
            "Generation requests finished, by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "jaxserve:requests_rejected", "Requests rejected before reaching the engine.", ["reason"], registry=r
        )
        r.register(_EngineCollector(stats, self.bandwidth))

    def bandwidth(self) -> float | None:
        if not self._bandwidth_detected:
            self._bandwidth_value = detect_device_bandwidth()
            self._bandwidth_detected = "jax" in sys.modules
        return self._bandwidth_value

    def render(self) -> bytes:
        return generate_latest(self.registry)
