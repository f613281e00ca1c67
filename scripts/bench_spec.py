#!/usr/bin/env python
"""Speculative decoding benchmark: speedup over plain decoding, acceptance rate, mean accepted length,
and the draft/target cost ratio per step, for n-gram and draft-model speculation at several batch sizes.

Workloads (prompts from held-out standard-library files, so the default model never trained on them):
* copy     - a function's source, then "# The same function, copied unchanged:" and its first line;
             the greedy continuation re-types code that is in the prompt (n-gram's best case).
* natural  - the first lines of a file; the model continues it (the draft model's case).
* random   - uniformly random token ids: nothing to copy, nothing predictable (low acceptance: the
             adaptive policy must keep speculation from slowing decoding down).
* chat     - an instruct model's chat (its chat template) of held-out questions about code, docstrings and
             modules (scripts/eagle3_prompts.py's held-out split: files and templates an EAGLE-3 head
             was not trained on); answers end at the model's EOS (the EAGLE-3 comparison).
* edit     - an instruct model's chat (its chat template): "Rewrite this function with one change:
             rename it to NAME_v2", then the function; the answer re-types the code with one edit
             (the real case n-gram speculation is for: code assistants editing a file).

Every configuration gets an untimed pass first (it compiles the shapes the timed passes use); the
timed passes alternate between configurations, and each figure is the median. Greedy decoding (EOS
ignored, except in the chat workload), so every configuration produces the same tokens (checked and
reported).

    python scripts/bench_spec.py --model checkpoints/small --draft checkpoints/small-draft \\
        --batch-sizes 1,8 --workloads copy,natural,random --out out/bench_spec.json
    # the default model (SmolLM2-135M-Instruct) editing code, n-gram proposals only
    python scripts/bench_spec.py --model SmolLM2-135M-Instruct --draft '' --methods ngram \\
        --workloads edit --batch-sizes 1 --out out/bench_spec_edit.json
    # the default model's chats: none / n-gram / EAGLE-3 (the shipped head), batch 1, 4 and 16
    python scripts/bench_spec.py --model SmolLM2-135M-Instruct --draft '' --eagle3 checkpoints/eagle3-smollm2-135m \\
        --methods ngram,eagle3 --workloads chat --batch-sizes 1,4,16 --prompts 16 --new-tokens 256 \\
        --out out/bench_spec_eagle3.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COPY_HEADER = "\n\n# The same function, copied unchanged:\n"


def make_prompts(workload: str, tokenizer, vocab_size: int, count: int, seed: int) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    if workload == "random":
        return [rng.randint(3, vocab_size, size=64).tolist() for _ in range(count)]
    if tokenizer is None:
        raise SystemExit(f"the {workload!r} workload needs a tokenizer (the model directory has none)")
    if workload == "copy":
        from corpus import top_level_functions

        held_out = top_level_functions("heldout", 12, 40)
        chosen = [held_out[i] for i in rng.choice(len(held_out), size=count, replace=False)]
        return [tokenizer.encode(f + COPY_HEADER + f.splitlines()[0] + "\n") for f in chosen]
    if workload == "edit":
        from corpus import top_level_functions

        from jaxserve.server.chat import build_chat_renderer

        renderer = build_chat_renderer(tokenizer)
        held_out = top_level_functions("heldout", 12, 40)
        chosen = [held_out[i] for i in rng.choice(len(held_out), size=count, replace=False)]
        prompts = []
        for f in chosen:
            name = f.split("def ", 1)[1].split("(", 1)[0]
            ask = f"Rewrite this Python function with one change: rename it to {name}_v2.\n\n```python\n{f}\n```"
            text = renderer.render([{"role": "user", "content": ask}])
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        return prompts
    if workload == "chat":
        from eagle3_prompts import build_prompts

        from jaxserve.server.chat import build_chat_renderer

        renderer = build_chat_renderer(tokenizer)
        asks = build_prompts("heldout", count, seed)
        return [
            tokenizer.encode(renderer.render([{"role": "user", "content": a["content"]}]), add_special_tokens=False)
            for a in asks
        ]
    if workload == "natural":
        from corpus import iter_texts

        texts = [t for _, t in iter_texts("heldout") if len(t) > 2000]
        chosen = [texts[i] for i in rng.choice(len(texts), size=count, replace=False)]
        return [tokenizer.encode("\n".join(t.splitlines()[:12]) + "\n") for t in chosen]
    raise SystemExit(f"unknown workload {workload!r}")


# Per-method overrides of the flags, e.g. --methods ngram,ngram:k=8:min=1 compares two n-gram settings.
METHOD_KEYS = {"k": "num_speculative_tokens", "min": "prompt_lookup_min", "max": "prompt_lookup_max"}
# :policy=request - the adaptive policy as it was before the batch decision (issue 54): each row
# decides alone, and a new request starts from the fixed prior a = 0.75 (`per_request_policy`).
# :policy=off - the speculative engine never drafts (`never_draft`): what its steps cost when the
# policy turns speculation off, without the policy's own noise.
POLICIES = ("batch", "request", "off")


def spec_settings(method: str, args) -> dict:
    name, *overrides = method.split(":")
    if name == "off":
        settings = {}
    elif name == "ngram":
        settings = dict(
            speculative_method="ngram",
            num_speculative_tokens=args.k_ngram,
            prompt_lookup_min=args.lookup_min,
            prompt_lookup_max=args.lookup_max,
        )
    elif name == "draft":
        settings = dict(speculative_model=args.draft, num_speculative_tokens=args.k_draft)
    elif name == "eagle3":
        heads = args.eagle3.split(",")
        head = next((int(o[5:]) for o in overrides if o.startswith("head=") and o[5:].isdigit()), 0)
        if head >= len(heads):
            raise SystemExit(f"{method!r}: --eagle3 names {len(heads)} heads")
        settings = dict(
            speculative_method="eagle3", speculative_model=heads[head], num_speculative_tokens=args.k_eagle3
        )
    else:
        raise SystemExit(f"unknown method {method!r}")
    for override in overrides:
        key, _, value = override.partition("=")
        if (key == "policy" and value in POLICIES) or (key == "head" and name == "eagle3"):
            continue  # applied to the built engine (engine_for); the head was chosen above
        if key not in METHOD_KEYS or not value.isdigit() or (key != "k" and name != "ngram"):
            raise SystemExit(
                f"bad override {override!r} in {method!r} (k=N, policy=batch|request; eagle3 also head=N; ngram also min=N, max=N)"
            )
        settings[METHOD_KEYS[key]] = int(value)
    return settings


def engine_for(model: str, method: str, common: dict, args):
    """The engine a method runs on (`per_request_policy` applied for :policy=request)."""
    from jaxserve import LLM

    llm = LLM(model, **common, **spec_settings(method, args))
    if ":policy=request" in method:
        per_request_policy(llm.engine.spec)
    if ":policy=off" in method:
        never_draft(llm.engine)
    return llm


def never_draft(core) -> None:
    """No row drafts, ever (the engine's scheduler asks `lookahead`; an engine that overlaps asks
    `may_draft` before it schedules)."""
    core.scheduler.lookahead = lambda seq, batch_size: 0
    if hasattr(core.spec, "may_draft"):
        core.spec.may_draft = lambda running: False


def per_request_policy(decoder) -> None:
    """The policy before the batch decision, for a before/after comparison in one run: no batch gate,
    and every new request's estimate starts at the fixed prior (a = 0.75), not the engine's."""
    from jaxserve.spec_decode.policy import SpecState

    decoder._batch_drafts = lambda batch, costs: True
    decoder.acceptance.new_state = SpecState


def timed_generate(llm, prompts: list[list[int]], batch: int, new_tokens: int, eos: bool = False):
    """Generate for `prompts` in groups of `batch` (one generate call each); returns seconds, outputs.
    `eos`: a sequence ends at the model's EOS (chat answers), else after `new_tokens` tokens."""
    from jaxserve import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=not eos)
    outputs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outputs += llm.generate(prompt_token_ids=prompts[i : i + batch], sampling_params=params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def step_cost(llm, batch: int, pages: int) -> float:
    """Median seconds of one decode step (T = 1) of the target at `batch` rows over `pages` pages,
    called straight on the compiled step (no engine around it)."""
    import jax

    from jaxserve import steps
    from jaxserve.model.kv_cache import StepBatch

    return _time_decode(
        steps, StepBatch, jax, llm.runner.params, llm.runner.cache, llm.model_config, llm.runner.options, batch, pages
    )


def draft_step_cost(llm, batch: int, pages: int) -> float:
    import jax

    from jaxserve import steps
    from jaxserve.model.kv_cache import StepBatch

    spec = llm.engine.spec
    return _time_decode(
        steps, StepBatch, jax, spec.draft_params, spec.draft_cache, spec.draft_cfg, llm.runner.options, batch, pages
    )


def verify_step_cost(llm, batch: int, pages: int, k: int) -> float:
    """Median seconds of the target's forward over k + 1 tokens per row (what verification computes)."""
    import jax

    from jaxserve import steps
    from jaxserve.model.kv_cache import StepBatch

    return _time_decode(
        steps,
        StepBatch,
        jax,
        llm.runner.params,
        llm.runner.cache,
        llm.model_config,
        llm.runner.options,
        batch,
        pages,
        tokens=k + 1,
    )


def _time_decode(steps, StepBatch, jax, params, cache, cfg, options, batch, pages, iters=30, tokens=1) -> float:
    table = np.tile(np.arange(1, pages + 1, dtype=np.int32), (1, batch, 1))
    step = StepBatch(
        tokens=np.ones((1, batch, tokens), np.int32),
        start_pos=np.full((1, batch), pages * 8 - tokens, np.int32),
        num_new=np.full((1, batch), tokens, np.int32),
        page_table=table,
    )
    step = jax.device_put(step)
    fn = steps.decode_nodonate if tokens == 1 else steps.prefill_nodonate
    run = lambda: jax.block_until_ready(fn(params, cache, step, cfg=cfg, options=options))  # noqa: E731
    run()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def machine() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return dict(
        cpu=cpu,
        cores=os.cpu_count(),
        load_average=os.getloadavg(),
        tcmalloc=("tcmalloc" in open("/proc/self/maps").read()) if os.path.exists("/proc/self/maps") else None,
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="checkpoints/small")
    ap.add_argument("--draft", default="checkpoints/small-draft", help="draft model directory ('' to skip)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--methods",
        default="ngram,draft",
        help="compared with speculation off: ngram, draft, eagle3, each with optional overrides of the "
        "flags, :k=N (ngram also :min=N, :max=N), e.g. ngram,ngram:k=8:min=1",
    )
    ap.add_argument("--workloads", default="copy,natural,random")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per (workload, batch size)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--k-ngram", type=int, default=6)
    ap.add_argument("--k-draft", type=int, default=4)
    ap.add_argument(
        "--eagle3",
        default="",
        help="EAGLE-3 head directory (speculators format) for method eagle3; several, comma-separated: "
        "method eagle3:head=N runs the N-th (from 0)",
    )
    ap.add_argument("--k-eagle3", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument(
        "--token-buckets",
        default=None,
        help="the engines' token ladder (powers-of-two, fine, auto; default: the engine's)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import logging

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("jaxserve.spec_decode.decoder").setLevel(logging.INFO)  # the policy's decisions
    methods = ["off"] + [
        m
        for m in args.methods.split(",")
        if m and not (m.startswith("draft") and not args.draft) and not (m.startswith("eagle3") and not args.eagle3)
    ]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    workloads = args.workloads.split(",")
    # Warmed up like a server: adaptive speculation picks (tokens, pages) buckets as it goes, and
    # a timed pass must never compile.
    common = dict(
        load_format=args.load_format,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=max(batch_sizes),
        max_num_batched_tokens=args.max_num_batched_tokens,
        warm_up=True,
        # Off: a timed pass would hit the prefix cache of the untimed one, and run (and compile)
        # shorter prefill chunks than it did.
        enable_prefix_caching=False,
    )
    if args.token_buckets:
        common["token_buckets"] = args.token_buckets
    engines = {m: engine_for(args.model, m, common, args) for m in methods}
    base = engines["off"]
    prompt_sets = {
        w: make_prompts(w, base.tokenizer, base.model_config.vocab_size, args.prompts, args.seed) for w in workloads
    }

    results = []
    for workload in workloads:
        prompts = prompt_sets[workload]
        for batch in batch_sizes:
            outputs, times, spec_stats, steps = {}, {m: [] for m in methods}, {}, {m: [] for m in methods}
            eos = workload == "chat"  # answers end where the model ends them
            for m in methods:  # untimed: settles the measured step times (and would compile a missed shape)
                _, outputs[m] = timed_generate(engines[m], prompts, batch, args.new_tokens, eos)
            compiles = {m: engines[m].engine.stats()["compiles_after_warmup"] for m in methods}
            for _ in range(args.repeats):
                for m in methods:
                    before = dict(engines[m].engine.stats())
                    steps_before = engines[m].engine.counters["steps"]
                    seconds, out = timed_generate(engines[m], prompts, batch, args.new_tokens, eos)
                    times[m].append(seconds)
                    steps[m].append(engines[m].engine.counters["steps"] - steps_before)
                    after = engines[m].engine.stats()
                    if m != "off":
                        spec_stats[m] = {
                            k: after[k] - before[k]
                            for k in (
                                "spec_decode_num_draft_tokens",
                                "spec_decode_num_accepted_tokens",
                                "spec_decode_num_verify_steps",
                                "spec_decode_num_steps",
                                "spec_decode_num_off_steps",
                            )
                        }
                        for k in ("spec_decode_num_drafts_per_pos", "spec_decode_num_accepted_tokens_per_pos"):
                            was = before.get(k, [])
                            spec_stats[m][k] = [n - (was[j] if j < len(was) else 0) for j, n in enumerate(after[k])]
                        spec_stats[m]["engine_steps"] = engines[m].engine.counters["steps"]
            tokens = sum(len(o) for o in outputs["off"])
            for m in methods:
                row = dict(
                    workload=workload,
                    batch=batch,
                    method=m,
                    tokens=tokens,
                    seconds=statistics.median(times[m]),
                    all_seconds=times[m],
                    tok_per_s=tokens / statistics.median(times[m]),
                    speedup=statistics.median(times["off"]) / statistics.median(times[m]),
                    same_tokens=outputs[m] == outputs["off"],
                    # engine steps per timed pass, and the wall time of one (host and device together)
                    engine_steps=statistics.median(steps[m]),
                    ms_per_step=1e3 * statistics.median(times[m]) / max(statistics.median(steps[m]), 1),
                    timed_compiles=engines[m].engine.stats()["compiles_after_warmup"] - compiles[m],
                )
                if m != "off":
                    s = spec_stats[m]
                    proposed, accepted, verified = (
                        s["spec_decode_num_draft_tokens"],
                        s["spec_decode_num_accepted_tokens"],
                        s["spec_decode_num_verify_steps"],
                    )
                    by_pos = zip(s["spec_decode_num_accepted_tokens_per_pos"], s["spec_decode_num_drafts_per_pos"])
                    row.update(
                        acceptance_by_position=[round(a / n, 3) if n else 0.0 for a, n in by_pos],
                        acceptance_rate=accepted / proposed if proposed else 0.0,
                        mean_accepted_length=(accepted + verified) / verified if verified else 0.0,
                        draft_tokens=proposed,
                        verify_steps=verified,
                        spec_steps=s["spec_decode_num_steps"],
                        off_steps=s["spec_decode_num_off_steps"],  # batches the policy kept from drafting
                    )
                results.append(row)
                print(
                    json.dumps(
                        {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "all_seconds"}
                    ),
                    flush=True,
                )

    costs = {}
    for batch in batch_sizes:  # compiled steps alone (no engine): a decode step, a verify pass, a draft step
        target = step_cost(base, batch, 8)
        costs[batch] = dict(target_decode_ms=target * 1e3)
        for k in sorted({engines[m].engine.spec.k for m in methods if m != "off"}):
            verify = verify_step_cost(base, batch, 8, k)
            costs[batch][f"verify_k{k}_ms"] = verify * 1e3
            costs[batch][f"verify_k{k}_over_decode"] = verify / target
        if "draft" in engines:
            draft = draft_step_cost(engines["draft"], batch, 8)
            costs[batch].update(draft_ms=draft * 1e3, draft_over_target=draft / target)
        print(f"batch {batch}: " + ", ".join(f"{k} {v:.2f}" for k, v in costs[batch].items()), flush=True)
    report = dict(args=vars(args), machine=machine(), results=results, step_costs=costs)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    print(
        "\n| workload | batch | method | tok/s | speedup | acceptance | by position | tokens per target step "
        "| verifies | steps kept from drafting | engine steps | ms per step | same tokens |"
    )
    print("|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|")
    for r in results:
        acc = f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else "–"
        pos = " / ".join(f"{a:.2f}" for a in r.get("acceptance_by_position", [])) or "–"
        length = f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else "–"
        print(
            f"| {r['workload']} | {r['batch']} | {r['method']} | {r['tok_per_s']:.1f} | {r['speedup']:.2f}x | "
            f"{acc} | {pos} | {length} | {r.get('verify_steps', '–')} | {r.get('off_steps', '–')} | {r['engine_steps']:.0f} | {r['ms_per_step']:.1f} "
            f"| {r['same_tokens']} |"
        )


if __name__ == "__main__":
    main()
