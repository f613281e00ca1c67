"""How long `update_weights` takes on the default model, and whether 100 of them leave memory flat
(issue 53; docs/training_loop.md, docs/BENCHMARKS.md "update_weights").

    python scripts/bench_weight_update.py [--updates 100] [--repeats 20]

Measured on an engine built without warm-up (the update compiles nothing and never runs a step):
- same sharding: the trainer's arrays already on the engine's devices and sharding, adopted as they are;
- from host memory: a mapping of Hugging Face names to NumPy arrays (what update_weights_from_disk
  reads), every tensor copied to the device;
- resharding: arrays on another sharding (on a 4-virtual-device CPU mesh, the engine on a (1, 3) mesh (9 heads)
  and the trainer's arrays on one device), with the peak of live device bytes beyond the served
  weights sampled after every tensor is placed;
- 100 updates alternating two weight sets (copied from the host), with live device bytes and the
  process's RSS after each;
- sleep(1) and sleep(2): live device bytes and RSS asleep and woken;
- against a restart: the time to build the same engine again (without its compile).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax
import numpy as np

from jaxserve import LLM
from jaxserve.loading.checkpoint import hf_tensors
from jaxserve.model.weights import param_bytes
from jaxserve.runner import weight_update


def live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed(fn, repeats: int) -> tuple[float, float, list]:
    """(median wall ms, median ms of placing the tensors alone, reports)."""
    walls, reports = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        reports.append(fn())
        walls.append(time.perf_counter() - start)
    return statistics.median(walls) * 1e3, statistics.median(r.seconds for r in reports) * 1e3, reports


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--updates", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()

    start = time.perf_counter()
    llm = LLM(warm_up=False, compilation_cache_dir="none")
    built = time.perf_counter() - start
    engine, cfg = llm.engine, llm.model_config
    served = param_bytes(llm.runner.params)
    print(f"default model: {cfg.num_layers} layers, {served / 2**20:.0f} MiB of {llm.engine.dtype} weights")
    print(f"engine built (load, plan, cache; no compile) in {built:.2f} s")

    # Same sharding: the trainer's own arrays (a copy made on the devices), adopted.
    trainer = jax.tree.map(lambda x: x + 0, llm.runner.params)
    jax.block_until_ready(trainer)
    wall, placing, reports = timed(lambda: llm.update_weights(trainer), args.repeats)
    r = reports[-1]
    print(
        f"same sharding: {wall:.2f} ms per update ({placing:.2f} ms placing {r.tensors} tensors, "
        f"{r.adopted} adopted, {r.copied} copied; the rest empties the prefix cache and logs)"
    )
    start = time.perf_counter()
    engine.blocks.reset_prefix_cache()
    print(f"  emptying the prefix cache alone: {(time.perf_counter() - start) * 1e3:.3f} ms")

    # From host memory: HF names -> NumPy, every tensor copied in.
    # copies: NumPy views of the trainer's (CPU) arrays would keep them alive after they are dropped
    host = {name: np.array(x) for name, x in hf_tensors(llm.runner.params, cfg).items()}
    wall, placing, reports = timed(lambda: llm.update_weights(host, copy=True), max(3, args.repeats // 4))
    jax.block_until_ready(llm.runner.params)
    print(f"from host NumPy (HF names): {wall:.1f} ms per update ({reports[-1].copied} tensors copied)")

    # 100 updates alternating two weight sets: memory must stay flat.
    rng = np.random.default_rng(0)
    other = {name: (x + rng.normal(0, 1e-3, x.shape)).astype(x.dtype) for name, x in host.items()}
    live, rss = [], []
    for i in range(args.updates):
        llm.update_weights(other if i % 2 else host)
        jax.block_until_ready(llm.runner.params)
        live.append(live_bytes())
        rss.append(rss_bytes())
    mib = 2**20
    print(
        f"{args.updates} updates: live device bytes first {live[0] / mib:.1f} MiB, last {live[-1] / mib:.1f}, "
        f"max {max(live) / mib:.1f}; RSS first {rss[0] / mib:.0f} MiB, last {rss[-1] / mib:.0f}, "
        f"max {max(rss) / mib:.0f}"
    )
    marks = sorted({0, 1, 4, 9, 24, 49, len(rss) - 1} & set(range(len(rss))))
    print("  RSS after update " + ", ".join(f"{i + 1}: {rss[i] / mib:.0f}" for i in marks) + " MiB")

    # Sleep: what each level frees (JAX's live device bytes, and the process's RSS: on a CPU the
    # "device" is host memory, so level 1's host copy keeps the weights' bytes in the process).
    del trainer
    gc.collect()
    rows = [("awake", live_bytes(), rss_bytes())]
    for level in (1, 2):
        start = time.perf_counter()
        llm.sleep(level)
        slept = time.perf_counter() - start
        gc.collect()
        rows.append((f"sleep({level}) in {slept * 1e3:.0f} ms", live_bytes(), rss_bytes()))
        start = time.perf_counter()
        if level == 1:
            llm.wake_up()
        else:
            llm.wake_up(["kv_cache"])
            llm.update_weights(host)
        woke = time.perf_counter() - start
        rows.append(
            (
                f"woken ({'wake_up()' if level == 1 else 'kv_cache + update_weights'}) in {woke * 1e3:.0f} ms",
                live_bytes(),
                rss_bytes(),
            )
        )
    for what, dev, rss in rows:
        print(f"  {what}: live device bytes {dev / mib:.0f} MiB, RSS {rss / mib:.0f} MiB")
    llm.close()

    # Resharding: the engine tensor-parallel over 3 devices, the trainer's arrays on one device.
    llm = LLM(warm_up=False, compilation_cache_dir="none", tensor_parallel_size=3)
    one = jax.devices()[3]
    trainer = jax.tree.map(lambda x: jax.device_put(x, one), llm.runner.params)
    jax.block_until_ready(trainer)
    mesh = llm.runner.params.embed.sharding.device_set

    def engine_bytes() -> int:
        # Arrays over the engine's whole mesh: not the trainer's (on another device), nor the one-device
        # views of a sharded array's shards that reading it leaves behind (they are not memory of their own)
        return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted() and x.sharding.device_set == mesh)

    gc.collect()
    baseline = engine_bytes()
    peaks: list[tuple[str, int]] = []  # (field, live bytes beyond the baseline) after each tensor is placed
    place = weight_update.WeightUpdater._place

    def placed(self, value, spec, field, *a, **k):
        out = place(self, value, spec, field, *a, **k)
        jax.block_until_ready(out)
        peaks.append((field, engine_bytes() - baseline))  # the new tensor placed, the old not yet deleted
        return out

    weight_update.WeightUpdater._place = placed
    start = time.perf_counter()
    report = llm.update_weights(trainer)
    jax.block_until_ready(llm.runner.params)
    took = time.perf_counter() - start
    weight_update.WeightUpdater._place = place
    layer = param_bytes(llm.runner.params.layers[0])
    largest = max(x.nbytes for x in jax.tree.leaves(llm.runner.params))
    layer_peak = max(b for f, b in peaks if f not in ("embed", "lm_head"))
    peak = max(b for _, b in peaks)
    print(f"  peak while placing the layers' tensors: {layer_peak / mib:.1f} MiB")
    print(
        f"resharding (1 device -> (1, 3) mesh): {took * 1e3:.0f} ms, {report.copied} tensors; peak live bytes "
        f"beyond the served weights {peak / mib:.1f} MiB (one layer: {layer / mib:.1f} MiB; the largest "
        f"tensor, the embedding: {largest / mib:.1f} MiB)"
    )
    llm.close()

    start = time.perf_counter()
    LLM(warm_up=False, compilation_cache_dir="none").close()
    print(f"a restart instead (engine built again, no compile): {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
