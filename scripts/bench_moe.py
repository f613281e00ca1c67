#!/usr/bin/env python
"""Mixture-of-experts decode: a small Qwen3-MoE against the dense Qwen3 with the same active parameters,
and whether `jax.lax.ragged_dot` computes only the routed experts on this backend.

1. Engine decode tokens/s (`LLM(load_format="dummy")`, greedy, EOS ignored) of the MoE (E experts of
   F_e, top-k) and of the dense model whose MLP is k * F_e wide (the same attention, embeddings and
   active MLP parameters per token), at each batch: B prompts of the same length generate N tokens;
   decode tokens/s = B * (N - 1) / (t(N tokens) - t(1 token)), each time the median of --repeats
   runs after a warm-up that compiles every bucket used. At batch B a decode step has B * k
   assignments: at most E takes moe.py's gathered path (reads only the chosen experts), more takes
   the grouped path (three ragged_dots over all E experts' weights).
2. ragged_dot against the number of experts: R rows (split evenly over the groups) times [E, D, F]
   weights, E swept, beside one dense [R, D] x [D, F] matmul (the routed FLOPs). A time flat in E
   means ragged_dot computes only each row's expert; a time growing with E means it computes every
   expert for every row (XLA:CPU does).
3. One MoE layer's MLP (`moe.moe_mlp`, jitted) at each batch's token count, each path forced
   (gathered: T * k expert weights gathered; grouped: sort + three ragged_dots + scatter-add),
   beside the dense twin's SwiGLU: where the MoE step's time goes.

    python scripts/bench_moe.py --out bench_moe.json
    python scripts/bench_moe.py --new-tokens 9 --repeats 1 --batches 1   # quick development run
    python scripts/bench_moe.py --mesh-shape 1,4 --moe-parallelism expert   # on 4 devices
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def model_configs(hidden: int, layers: int, experts: int, expert_mlp: int, top_k: int, vocab: int) -> dict:
    """HF config.json dicts of the MoE and of its dense twin (MLP k * F_e wide)."""
    common = {
        "attention_bias": False,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "max_position_embeddings": 4096,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": max(1, hidden // 128),
        "num_hidden_layers": layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
    }
    moe = {
        **common,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": expert_mlp,
        "intermediate_size": top_k * expert_mlp,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    dense = {
        **common,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "intermediate_size": top_k * expert_mlp,
    }
    return {"moe": moe, "dense": dense}


def time_generate(llm, prompts, max_tokens: int, repeats: int) -> float:
    from jaxserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=params)  # warm-up: compiles the buckets used
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        times.append(time.perf_counter() - t0)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in out)
    return statistics.median(times)


def bench_engine(name: str, model_dir: str, args) -> list[dict]:
    from jaxserve import LLM

    rows = []
    with LLM(
        model=model_dir,
        load_format="dummy",
        dtype="float32",
        page_size=16,
        max_num_seqs=max(args.batches),
        max_model_len=args.prompt_len + args.new_tokens + 16,
        max_num_batched_tokens=256,
        mesh_shape=args.mesh_shape,
        moe_parallelism=args.moe_parallelism,
        warm_up=False,
    ) as llm:
        cfg = llm.model_config
        for batch in args.batches:
            rng = np.random.RandomState(batch)
            prompts = [rng.randint(2, cfg.vocab_size, args.prompt_len).tolist() for _ in range(batch)]
            t1 = time_generate(llm, prompts, 1, args.repeats)
            tn = time_generate(llm, prompts, args.new_tokens, args.repeats)
            step = (tn - t1) / (args.new_tokens - 1)
            row = dict(
                model=name,
                batch=batch,
                params=cfg.num_params(),
                active_params=cfg.active_params(),
                step_ms=round(step * 1e3, 3),
                decode_tokens_per_s=round(batch / step, 1),
            )
            if cfg.is_moe:
                row["assignments"] = batch * cfg.num_experts_per_tok
                row["path"] = "gathered" if batch * cfg.num_experts_per_tok <= cfg.num_experts else "grouped"
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def bench_ragged_dot(rows: int, hidden: int, expert_mlp: int, experts: list[int], repeats: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((rows, hidden)), jnp.float32)
    out = []

    def timed(fn, *a):
        fn(*a).block_until_ready()
        times = []
        for _ in range(max(repeats, 5)):
            t0 = time.perf_counter()
            fn(*a).block_until_ready()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    w1 = jnp.asarray(rng.standard_normal((hidden, expert_mlp)), jnp.float32)
    dense_ms = timed(jax.jit(jnp.dot), x, w1) * 1e3
    for e in experts:
        w = jnp.asarray(rng.standard_normal((e, hidden, expert_mlp)), jnp.float32)
        sizes = np.full(e, rows // e, np.int32)
        sizes[: rows - sizes.sum()] += 1
        ms = timed(jax.jit(jax.lax.ragged_dot), x, w, jnp.asarray(sizes)) * 1e3
        row = dict(
            rows=rows,
            hidden=hidden,
            expert_mlp=expert_mlp,
            experts=e,
            ragged_dot_ms=round(ms, 3),
            dense_one_expert_ms=round(dense_ms, 3),
            ratio=round(ms / dense_ms, 2),
        )
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def bench_mlp(hidden: int, experts: int, expert_mlp: int, top_k: int, batches: list[int], repeats: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxserve.model import moe
    from jaxserve.model.layers import swiglu

    rng = np.random.default_rng(1)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape) * 0.05, jnp.float32)  # noqa: E731
    p = moe.MoEParams(
        router=f(hidden, experts),
        w_gate=f(experts, hidden, expert_mlp),
        w_up=f(experts, hidden, expert_mlp),
        w_down=f(experts, expert_mlp, hidden),
    )
    dense_w = (f(hidden, top_k * expert_mlp), f(hidden, top_k * expert_mlp), f(top_k * expert_mlp, hidden))

    def gathered(x, p):
        w, e = moe.route(x, p.router, top_k, True)
        return moe._gathered_experts(x, p, w, e, jax.nn.silu)

    def grouped(x, p):
        w, e = moe.route(x, p.router, top_k, True)
        return moe._grouped_experts(x, p, w, e, experts, jax.nn.silu)

    def timed(fn, *a):
        fn(*a).block_until_ready()
        times = []
        for _ in range(max(repeats, 10)):
            t0 = time.perf_counter()
            fn(*a).block_until_ready()
            times.append(time.perf_counter() - t0)
        return round(statistics.median(times) * 1e3, 3)

    out = []
    for b in batches:
        x = f(b, hidden)
        row = dict(
            tokens=b,
            assignments=b * top_k,
            experts=experts,
            chosen="gathered" if b * top_k <= experts else "grouped",
            gathered_ms=timed(jax.jit(gathered), x, p),
            grouped_ms=timed(jax.jit(grouped), x, p),
            dense_twin_ms=timed(jax.jit(lambda x, w: swiglu(x[None], *w)[0]), x, dense_w),
        )
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def machine() -> dict:
    import jax

    def run(*cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    cpu = next(
        (line.split(":", 1)[1].strip() for line in (run("lscpu") or "").splitlines() if line.startswith("Model name")),
        platform.processor(),
    )
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=run("git", "rev-parse", "--short", "HEAD"),
        cpu=cpu,
        cores=os.cpu_count(),
        jax=jax.__version__,
        backend=jax.default_backend(),
        devices=len(jax.devices()),
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--expert-mlp", type=int, default=256, help="each expert's hidden size F_e")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=33)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sweep-experts", type=lambda s: [int(e) for e in s.split(",")], default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--sweep-rows", type=int, default=32, help="ragged_dot rows (batch 16 x top-2 by default)")
    p.add_argument("--mesh-shape", type=lambda s: tuple(int(d) for d in s.split(",")), default=(1, 1))
    p.add_argument("--moe-parallelism", default="tensor", choices=["tensor", "expert"])
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)

    result = dict(machine=machine(), args={k: v for k, v in vars(args).items() if k != "out"})
    print(json.dumps(result["machine"]), flush=True)
    if not args.skip_engine:
        with tempfile.TemporaryDirectory() as tmp:
            result["engine"] = []
            for name, config in model_configs(
                args.hidden, args.layers, args.experts, args.expert_mlp, args.top_k, args.vocab
            ).items():
                d = os.path.join(tmp, name)
                os.makedirs(d)
                with open(os.path.join(d, "config.json"), "w") as f:
                    json.dump(config, f)
                result["engine"] += bench_engine(name, d, args)
    result["ragged_dot"] = bench_ragged_dot(
        args.sweep_rows, args.hidden, args.expert_mlp, args.sweep_experts, args.repeats
    )
    result["moe_mlp"] = bench_mlp(args.hidden, args.experts, args.expert_mlp, args.top_k, args.batches, args.repeats)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
