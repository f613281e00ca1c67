#!/usr/bin/env python
"""The prefix cache's host tier on a multi-turn chat workload: prompt tokens computed and TTFT with
and without `--kv-offloading-size`, the default model (SmolLM2-135M-Instruct) on this CPU, one run.

The workload: `--conversations` chats under one system prompt, `--active` of them at a time; each round
sends the next turn of every active chat at once (the chat so far, the model's own earlier answers
included, plus a new user message with a pasted log), greedy, `--answer-tokens` each (few: TTFT is the
prompt's work, not a wait behind other requests' decoding). A chat that has had its `--turns`
turns is replaced by the next. The device pool is small (`--num-pages`), so the active chats' histories
do not fit it: each round's prompts evict the others' pages. Without the tier they are recomputed;
with a host tier of `--tier-pools` device pools, evicted pages wait in host memory (LRU) and come back.
The script prints how many distinct prefix tokens the workload holds against the pool (its pages
all chats' final histories would take, over the pool's), then for each engine: prompt tokens
computed, prefix hits per tier, pages and bytes moved, TTFT p50 and p90, and wall time. Both engines'
greedy answers are compared (they must be equal).

    nice -n 5 python scripts/bench_host_tier.py --out out/host_tier.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SYSTEM = (
    "You are a careful assistant for a team that maintains a small inference engine. Answer briefly, "
    "name the file you would change, and say how you would test the change before merging it."
)
TOPICS = ["the scheduler", "the block manager", "the page mover", "the metrics", "the planner", "the server"]
ASKS = [
    "What should I read first in {t}, and why does it matter for latency under load?",
    "Suppose a request is preempted while {t} is busy. What happens to its pages and its output?",
    "Write three short test ideas for {t}, each with the invariant it checks.",
    "How would you measure whether a change to {t} made serving faster on a shared CPU?",
    "Explain the failure mode you worry about most in {t}, and how a user would notice it.",
    "Summarise our conversation so far about {t} in four bullet points.",
    "Which configuration flag changes the behaviour of {t} the most, and what is a safe default?",
    "If you had one hour to improve {t}, what would you do and how would you prove it worked?",
    "What would break in {t} if the page size doubled, and what would get faster?",
    "Give a one-paragraph design note for {t} that a new engineer could follow.",
]


def chat_ids(tokenizer, history: list[tuple[str, object]]) -> list[int]:
    """The chat's token ids in SmolLM2's template (ChatML): the system prompt, then every turn; an
    assistant turn is the model's own token ids, as the engine produced them."""
    ids = tokenizer.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n", add_special_tokens=False)
    for role, content in history:
        if role == "user":
            text = f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
            ids += tokenizer.encode(text, add_special_tokens=False)
        else:
            ids += list(content) + tokenizer.encode("<|im_end|>\n", add_special_tokens=False)
    return ids


def run(args, tier_gib: float | None) -> dict:
    from jaxserve import LLM, SamplingParams

    settings = dict(
        max_model_len=2048,
        max_num_seqs=args.active,
        max_num_batched_tokens=args.batched_tokens,
        num_pages=args.num_pages,
        page_size=args.page_size,
        token_buckets="powers-of-two",
    )
    if tier_gib is not None:
        settings["kv_offloading_size"] = tier_gib
    started = time.perf_counter()
    with LLM(**settings) as llm:
        build_s = time.perf_counter() - started
        tok = llm.tokenizer
        params = SamplingParams(max_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True)
        chats = {c: [] for c in range(args.conversations)}
        turns = {c: 0 for c in chats}
        queue, active = list(chats), []
        ttft, answers, prompt_tokens, longest = [], {}, 0, {}
        t0 = time.perf_counter()
        while queue or active:
            while len(active) < args.active and queue:
                active.append(queue.pop(0))
            batch = []
            for c in active:
                ask = ASKS[(turns[c] + c) % len(ASKS)].format(t=TOPICS[c % len(TOPICS)])
                log = " ".join(
                    f"step {i} took {(c * 31 + turns[c] * 17 + i * 7) % 97} ms;" for i in range(args.log_lines)
                )
                chats[c].append(("user", f"(chat {c}, turn {turns[c] + 1}) {ask} Here is the log: {log}"))
                batch.append(chat_ids(tok, chats[c]))
            outs = llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False)
            for c, ids, out in zip(active, batch, outs):
                m = out.metrics
                ttft.append(m.first_token_time - m.arrival_time)
                answer = list(out.outputs[0].token_ids)
                chats[c].append(("assistant", answer))
                answers[f"{c}.{turns[c]}"] = answer
                prompt_tokens += len(ids)
                longest[c] = len(ids) + len(answer)
                turns[c] += 1
            active = [c for c in active if turns[c] < args.turns]
        wall = time.perf_counter() - t0
        stats = llm.engine.stats()
        llm.engine.blocks.check_invariants()
        assert llm.engine.blocks.num_free_pages(0) == args.num_pages - 1, "pages leaked"
    ttft.sort()
    keys = (
        "prefill_tokens_computed",
        "prefix_cache_hits",
        "external_prefix_cache_hits",
        "kv_offload_pages_to_host_total",
        "kv_offload_pages_to_device_total",
        "kv_offload_bytes_to_host_total",
        "kv_offload_bytes_to_device_total",
        "kv_offload_host_capacity_pages",
        "num_preemptions",
        "compiles_after_warmup",
    )
    return dict(
        kv_offloading_size_gib=tier_gib,
        prompt_tokens=prompt_tokens,
        **{k: stats.get(k) for k in keys},
        ttft_p50_s=round(statistics.median(ttft), 4),
        ttft_p90_s=round(ttft[int(0.9 * (len(ttft) - 1))], 4),
        requests=len(ttft),
        workload_s=round(wall, 2),
        build_s=round(build_s, 1),
        distinct_prefix_pages=sum(-(-n // args.page_size) for n in longest.values()),
        answers=answers,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--active", type=int, default=3, help="chats taking turns at once")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--log-lines", type=int, default=12, help="a pasted log in each user message (~6 tokens a line)")
    ap.add_argument("--num-pages", type=int, default=64, help="the device pool per replica (page 0 is padding)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--batched-tokens", type=int, default=256)
    ap.add_argument("--tier-pools", type=float, default=2.0, help="the host tier's size in device pools")
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    from jaxserve.config.model_config import ModelConfig

    cfg = ModelConfig.from_dir(str(Path(__file__).resolve().parents[1] / "configs" / "models" / "smollm2-135m"))
    page_bytes = args.page_size * cfg.kv_bytes_per_token(4)  # float32 on a CPU
    tier_gib = args.tier_pools * args.num_pages * page_bytes / 2**30
    results = {"off": run(args, None), "host tier": run(args, tier_gib)}
    off, on = results["off"], results["host tier"]
    same = off.pop("answers") == on.pop("answers")
    pool = args.num_pages - 1
    summary = dict(
        device_pool_pages=pool,
        host_tier_pages=on["kv_offload_host_capacity_pages"],
        workload_prefix_pages=off["distinct_prefix_pages"],
        prefixes_over_pool=round(off["distinct_prefix_pages"] / pool, 2),
        computed_ratio=round(on["prefill_tokens_computed"] / off["prefill_tokens_computed"], 3),
        ttft_p50_ratio=round(on["ttft_p50_s"] / off["ttft_p50_s"], 3),
        greedy_answers_equal=same,
    )
    report = {"settings": vars(args), "summary": summary, **results}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
