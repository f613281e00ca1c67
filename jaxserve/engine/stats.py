"""The engine core's gauges and counters in one dict (what the server's /metrics and `stats()` show).

Host only; reads the core's scheduler, block manager, counters and the runner's own stats.
"""

from __future__ import annotations

from typing import Any


def engine_stats(core: Any) -> dict:
    """`EngineCore.stats()`: requests running and waiting, pages, prefix-cache hits, token counters,
    the last step's time and bytes, the runner's compile counts, speculation, multi-host and LoRA."""
    s, b = core.scheduler, core.blocks
    replicas = range(core.num_replicas)
    queried = b.num_prefix_queried_tokens
    return dict(
        num_running=len(s.running),
        num_running_per_replica=[sum(q.replica == r for q in s.running) for r in replicas],
        num_waiting=len(s.waiting),
        num_preemptions=s.num_preemptions,
        pages_used=[b.num_used_pages(r) for r in replicas],
        pages_free=[b.num_free_pages(r) for r in replicas],
        kv_cache_utilization=[b.kv_utilization(r) for r in replicas],
        prefix_cache_hit_rate=(b.num_prefix_hit_tokens / queried) if queried else 0.0,
        prefix_cache_queries=queried,  # tokens, as vLLM counts them (device tier)
        prefix_cache_hits=b.num_prefix_hit_tokens,
        prompt_tokens_total=core.counters["prompt_tokens"],
        generation_tokens_total=core.counters["generation_tokens"],
        prefill_tokens_computed=core.counters["prefill_tokens_computed"],
        arrivals_joined_total=core.counters["arrivals_joined"],
        last_step_seconds=core.last_step_seconds,
        last_step_bytes_read=core.composition.last_bytes_read,
        **core.runner.stats(),
        **core.composition.as_stats(),
        **(core.spec.stats() if core.spec is not None else {}),
        **(core.multihost.stats() if core.multihost is not None else {}),
        **(s.kv.stats() if s.kv is not None else {}),  # KV connector: host-tier hits, bytes moved
        **(
            {}
            if core.lora is None
            else {"lora": core.lora.stats((q.lora for q in s.running), (q.lora for q in s.waiting))}
        ),
    )


def spec_metrics(spec: Any, seqs: list) -> dict:
    """A request's speculation counters (drafted, accepted tokens, verify steps) for its output;
    nothing without speculative decoding (`spec` None)."""
    if spec is None:
        return {}
    states = [s.spec for s in seqs if s.spec is not None]
    return dict(
        spec_draft_tokens=sum(st.proposed for st in states),
        spec_accepted_tokens=sum(st.accepted for st in states),
        spec_verify_steps=sum(st.verify_steps for st in states),
    )
