#!/usr/bin/env python
"""LoRA updates of a ragged batch, three ways (issue 41): each of N tokens uses one of M resident
adapters (slot s in [0, M)) or none (s = -1), rank padded to R, for the seven linear modules of a layer
(SmolLM2-135M's shapes by default: q/o 576x576, k/v 576x192, gate/up 576x1536, down 1536x576), float32.

  dense       all adapters side by side, a f[D_in, M*R], b f[M*R, D_out] (docs/lora.md):
              delta = ((x @ a) * onehot_cols) @ b, onehot_cols[n, c] = (c // R == s[n])
  gather      per token A[s], B[s] (index clamped, zeroed for s = -1), einsum nd,ndr->nr then nr,nro->no
  ragged_dot  tokens sorted by slot (argsort, base tokens last and dropped: group sizes sum to the adapted
              tokens, their rows masked to zero), two jax.lax.ragged_dot, then scattered back to token order

Each is one jitted function computing the whole layer's seven deltas (the step-level parts: one-hot,
clamped index, sort, shared by the seven modules as XLA would share them within a layer), timed
round-robin with the base layer (x @ W for the seven modules, also one jitted function) and an empty
call (a jitted function of the same arguments returning slots + 1: the dispatch floor every figure
includes), median of --rounds calls after a warm-up (block_until_ready), so the LoRA figures read as a
fraction of the base matmuls (the ratio: median over rounds of the call's time over the base call's in
the same round, so that a slow stretch of the machine cancels). The three are checked to agree
(allclose) first, on the timed slots and on slots with base tokens mixed in. Slots are spread evenly
over the M adapters (token n uses slot n % M).

    python scripts/bench_lora_matmul.py                              # N 1,16,256 x M 1,4,8 x R 8,16,64
    python scripts/bench_lora_matmul.py --per-module --tokens 16 --adapters 8 --ranks 16 --out lora.json
    python scripts/bench_lora_matmul.py --tokens 16,64,256,1024 --adapters 1,4,8,16,32 --rounds 31

docs/BENCHMARKS.md ("LoRA: how the rows' low-rank updates are computed (issue 41)") quotes it.
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
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MODULES = ("q", "k", "v", "o", "gate", "up", "down")


def module_shapes(hidden: int, kv: int, intermediate: int) -> dict[str, tuple[int, int]]:
    return {
        "q": (hidden, hidden),
        "k": (hidden, kv),
        "v": (hidden, kv),
        "o": (hidden, hidden),
        "gate": (hidden, intermediate),
        "up": (hidden, intermediate),
        "down": (intermediate, hidden),
    }


def machine() -> dict:
    import jax

    def run(*cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    lscpu = run("lscpu").splitlines()
    field = lambda name: next((l.split(":", 1)[1].strip() for l in lscpu if l.startswith(name)), "")  # noqa: E731
    flags = [f for f in field("Flags").split() if f.startswith(("avx512", "amx")) or f == "avx2"]
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=run("git", "rev-parse", "--short", "HEAD"),
        cpu=field("Model name") or platform.processor(),
        cpu_flags=" ".join(flags),
        cores=os.cpu_count(),
        jax=jax.__version__,
        backend=jax.default_backend(),
    )


def make_fns(modules: tuple[str, ...], rank: int, adapters: int):
    """The jitted layer functions: base(x, W) and the three deltas(x, slots, adapters' weights)."""
    import jax
    import jax.numpy as jnp

    def base(xs, w):
        return {m: xs[m] @ w[m] for m in modules}

    def dense(xs, slots, ab):
        cols = (jnp.arange(adapters * rank, dtype=jnp.int32) // rank == slots[:, None]).astype(xs[modules[0]].dtype)
        return {m: ((xs[m] @ ab[m][0]) * cols) @ ab[m][1] for m in modules}

    def gather(xs, slots, ab):
        idx, keep = jnp.maximum(slots, 0), (slots >= 0)[:, None, None]
        out = {}
        for m in modules:
            a = jnp.where(keep, ab[m][0][idx], 0)  # [N, D_in, R]
            b = jnp.where(keep, ab[m][1][idx], 0)  # [N, R, D_out]
            out[m] = jnp.einsum("nr,nro->no", jnp.einsum("nd,ndr->nr", xs[m], a), b)
        return out

    def ragged(xs, slots, ab):
        key = jnp.where(slots < 0, adapters, slots)  # base tokens sort last, past the groups
        order = jnp.argsort(key, stable=True)
        sizes = jnp.bincount(key, length=adapters + 1)[:adapters].astype(jnp.int32)
        adapted = (key[order] < adapters)[:, None]
        out = {}
        for m in modules:
            h = jax.lax.ragged_dot(xs[m][order], ab[m][0], sizes)
            d = jnp.where(adapted, jax.lax.ragged_dot(h, ab[m][1], sizes), 0)  # rows past the groups: zero
            out[m] = jnp.zeros_like(d).at[order].set(d, unique_indices=True)
        return out

    return jax.jit(base), {"dense": jax.jit(dense), "gather": jax.jit(gather), "ragged_dot": jax.jit(ragged)}


def timed_round_robin(calls: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds of each call per round, the calls interleaved round by round after one warm-up call each."""
    import jax

    for fn in calls.values():
        jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    return times


def bench(
    tokens: int, adapters: int, rank: int, modules: tuple[str, ...], shapes: dict, rounds: int, rng: np.random.Generator
) -> dict:
    import jax
    import jax.numpy as jnp

    xs = {m: jnp.asarray(rng.standard_normal((tokens, shapes[m][0])), jnp.float32) for m in modules}
    w = {m: jnp.asarray(rng.standard_normal(shapes[m]) * 0.05, jnp.float32) for m in modules}
    stacked, side_by_side = {}, {}
    for m in modules:
        d_in, d_out = shapes[m]
        a = rng.standard_normal((adapters, d_in, rank)).astype(np.float32) * 0.05
        b = rng.standard_normal((adapters, rank, d_out)).astype(np.float32) * 0.05
        stacked[m] = (jnp.asarray(a), jnp.asarray(b))
        side_by_side[m] = (
            jnp.asarray(a.transpose(1, 0, 2).reshape(d_in, adapters * rank)),
            jnp.asarray(b.reshape(adapters * rank, d_out)),
        )
    weights = {"dense": side_by_side, "gather": stacked, "ragged_dot": stacked}
    slots = jnp.asarray(np.arange(tokens) % adapters, jnp.int32)  # spread evenly over the M adapters
    mixed = jnp.asarray(np.where(np.arange(tokens) % 3 == 0, -1, np.arange(tokens) % adapters), jnp.int32)
    base_fn, fns = make_fns(modules, rank, adapters)

    for check in (slots, mixed):  # the three agree, with and without base tokens
        ref = fns["dense"](xs, check, side_by_side)
        for name in ("gather", "ragged_dot"):
            got = fns[name](xs, check, weights[name])
            for m in modules:
                np.testing.assert_allclose(
                    np.asarray(got[m]),
                    np.asarray(ref[m]),
                    rtol=2e-4,
                    atol=2e-4,
                    err_msg=f"{name} != dense: N={tokens} M={adapters} R={rank} module {m}",
                )
        zero = np.asarray(check) < 0
        assert all(not np.asarray(ref[m])[zero].any() for m in modules), "base tokens got an update"

    empty = jax.jit(lambda xs, slots, ab: slots + 1)  # the call floor: dispatch of the same arguments
    calls = {"base": lambda: base_fn(xs, w), "empty": lambda: empty(xs, slots, side_by_side)}
    calls.update({name: (lambda fn=fn, name=name: fn(xs, slots, weights[name])) for name, fn in fns.items()})
    sec = timed_round_robin(calls, rounds)
    row = {"tokens": tokens, "adapters": adapters, "rank": rank, "modules": ",".join(modules)}
    for name, t in sec.items():
        row[f"{name}_us"] = round(statistics.median(t) * 1e6, 1)
        row[f"{name}_min_us"] = round(min(t) * 1e6, 1)
        if name in fns:  # median over rounds of (this call / the base call of the same round): drift cancels
            row[f"{name}_x_base"] = round(statistics.median(v / b for v, b in zip(t, sec["base"])), 3)
    return row


def table(rows: list[dict], first: str) -> str:
    head = f"| {first} | N | M | R | empty call us | base us | dense us (x base) | gather us (x base) | ragged_dot us (x base) |"
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        cells = [
            r["modules"] if first == "module" else "layer",
            r["tokens"],
            r["adapters"],
            r["rank"],
            f"{r['empty_us']:,.1f}",
            f"{r['base_us']:,.1f}",
        ]
        cells += [f"{r[k + '_us']:,.1f} ({r[k + '_x_base']:.2f})" for k in ("dense", "gather", "ragged_dot")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=ints, default=[1, 16, 256], help="N, tokens in the step")
    p.add_argument("--adapters", type=ints, default=[1, 4, 8], help="M, resident adapters")
    p.add_argument("--ranks", type=ints, default=[8, 16, 64], help="R, padded rank")
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--kv", type=int, default=192, help="k/v output width (KV heads x head dim)")
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--rounds", type=int, default=25, help="timed calls of each function (median)")
    p.add_argument("--per-module", action="store_true", help="also time each module alone (one jit each)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)

    info = machine()
    print(
        f"CPU: {info['cpu']} ({info['cores']} cores; {info['cpu_flags']}), {info['date']}, commit {info['commit']}, "
        f"jax {info['jax']} ({info['backend']}), float32",
        flush=True,
    )
    shapes = module_shapes(args.hidden, args.kv, args.intermediate)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    layer, per_module = [], []
    for n in args.tokens:
        for m in args.adapters:
            for r in args.ranks:
                layer.append(bench(n, m, r, MODULES, shapes, args.rounds, rng))
                print(json.dumps(layer[-1]), flush=True)
                if args.per_module:
                    for mod in MODULES:
                        per_module.append(bench(n, m, r, (mod,), shapes, args.rounds, rng))
                        print(json.dumps(per_module[-1]), flush=True)
    print(
        f"\n{time.perf_counter() - start:.0f} s. Layer = the seven modules "
        f"({', '.join(f'{k} {a}x{b}' for k, (a, b) in shapes.items())}) in one jitted function each; "
        f"median of {args.rounds}, in microseconds, on {info['cpu']}:\n"
    )
    print(table(layer, "scope"))
    if per_module:
        print()
        print(table(per_module, "module"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "machine": info,
                    "args": {k: v for k, v in vars(args).items() if k != "out"},
                    "layer": layer,
                    "per_module": per_module,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
