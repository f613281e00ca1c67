#!/usr/bin/env python
"""One prepared check of jaxserve on a machine with a GPU: kernel tests compiled natively, kernel timings
against their references and the bandwidth bound, and a server smoke test; one JSON report.

Sections (`--sections`, in this order by default):

* bench   times each Pallas kernel the engine runs (ragged paged attention on decode rows and on prefill
          rows, as the engine calls it: the stacked cache and a layer index; int8 and int4 matmul) on
          Llama-3-8B-shaped inputs against its plain-JAX reference (and the engine's plain-JAX attention),
          and against the bandwidth bound: bytes of K/V (or weights) read / the device copy bandwidth,
          measured here with a large on-device copy. Each kernel's output is also checked against a
          reference (max abs error).
* tests   `pytest tests/kernels` in a child process with PALLAS_TESTS_NATIVE=1: the GPU kernels run
          compiled (interpret=False), the TPU-only interpreter cases are skipped.
* copies  the engine's ragged decode step for the Llama-3-8B shape, lowered and compiled here (from
          shapes alone: no weights), scanned and unrolled, with and without XLA:GPU's
          `xla_gpu_enable_dynamic_slice_fusion`: the copies, dynamic slices and gathers left in the
          optimized program outside fusions, and the bytes they move per step (a per-layer copy of
          the KV cache or of a stacked weight shows up here).
* server  `python -m jaxserve.serve` on a dummy (random weights) Llama-3-8B-shaped model (64 sequence
          slots), then streamed completions (token-id prompts: the model has no tokenizer) at 1, 4,
          16 and 64 concurrent streams: start-up time, time to first token, decode speed, output
          tokens/s at each concurrency, and batch-1 decode against the weight-read bound.

Every section runs even if an earlier one fails; the report is rewritten after each, so a run cut
short still leaves what it measured. GPU memory: XLA_PYTHON_CLIENT_PREALLOCATE=false here and in the
child processes, so the sections do not starve each other.

    python scripts/gpu_check.py                       # on the GPU machine; report at $OUT/gpu_check.json
    python scripts/gpu_check.py --sections bench      # one section
    python scripts/gpu_check.py --dry-run --out /tmp/gpu_check.json   # the whole script on CPU, tiny shapes,
                                                      # kernels in interpret mode (tests/test_gpu_check.py)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("bench", "tests", "copies", "server")
DEFAULT_MODEL = os.path.join(REPO, "configs", "models", "llama3-8b")

# Llama-3-8B attention and MLP shapes (bench); the dry run shrinks every dimension.
FULL = dict(
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    page_size=16,
    decode_batch=32,
    decode_context=2048,
    prefill_seqs=4,
    prefill_tokens=512,
    matmul=[(16, 4096, 14336), (2048, 4096, 14336)],  # (m, k, n): decode rows and a prefill chunk, MLP up
    copy_elements=1 << 30,  # bf16: 2 GiB read + 2 GiB written
    back_to_back=20,
    repeats=5,
)
TINY = dict(
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    page_size=16,
    decode_batch=2,
    decode_context=40,
    prefill_seqs=2,
    prefill_tokens=8,
    matmul=[(4, 64, 64)],
    copy_elements=1 << 20,
    back_to_back=2,
    repeats=2,
)
TINY_MODEL = dict(  # the dry run's server model
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=512,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="bfloat16",
)


# ---- report --------------------------------------------------------------------------------------
class SectionFailed(Exception):
    """A section's error with what it had measured (and its logs) before failing."""

    def __init__(self, error: BaseException, partial: dict):
        super().__init__(f"{type(error).__name__}: {error}")
        self.partial = partial


class Report:
    def __init__(self, path: str, dry_run: bool):
        self.path = path
        self.start = time.perf_counter()
        self.data: dict = {
            "schema": 1,
            "dry_run": dry_run,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": {"python": sys.version.split()[0], "platform": platform.platform(), "nvidia_smi": nvidia_smi()},
            "errors": [],
        }

    def section(self, name: str, fn, *args) -> None:
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            self.data[name] = fn(*args)
        except BaseException as err:  # noqa: BLE001 - recorded; the next section still runs
            if isinstance(err, KeyboardInterrupt):
                raise
            if isinstance(err, SectionFailed):
                self.data[name] = err.partial
            self.data["errors"].append(
                {"section": name, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
            )
            print(f"   {name} failed: {type(err).__name__}: {err}", flush=True)
        self.data.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 2)
        self.write()

    def write(self) -> None:
        self.data["seconds"] = round(time.perf_counter() - self.start, 2)
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.data, f, indent=2, default=str)
        os.replace(tmp, self.path)


def nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.memory", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip() or out.stderr.strip()
    except (OSError, subprocess.SubprocessError) as err:
        return f"nvidia-smi failed: {err}"


def child_env(dry_run: bool, **extra: str) -> dict:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    # Empty, not unset, on the accelerator: tests/conftest.py defaults an unset JAX_PLATFORMS to cpu.
    env["JAX_PLATFORMS"] = "cpu" if dry_run else ""
    return env


# ---- bench ---------------------------------------------------------------------------------------
def timed(fn, args, back_to_back: int, repeats: int) -> tuple[float, object]:
    """Median seconds per call over `repeats` runs of `back_to_back` asynchronous dispatches (hides the
    dispatch overhead of one call behind the previous one's device time). The first call compiles."""
    import jax

    out = jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(back_to_back)]
        jax.block_until_ready(outs)
        samples.append((time.perf_counter() - t0) / back_to_back)
        del outs
    return statistics.median(samples), out


class Measurements:
    """Timings of one kernel and its baselines; a baseline that fails (e.g. out of memory) is recorded,
    not fatal, so the others still get measured."""

    def __init__(self, args: tuple, rep: dict, errors: list):
        self.args, self.rep, self.errors = args, rep, errors
        self.times: dict = {}
        self.outs: dict = {}

    def run(self, name: str, label: str, fn, args: tuple | None = None) -> None:
        try:
            self.times[label], self.outs[label] = timed(fn, self.args if args is None else args, **self.rep)
        except Exception as err:  # noqa: BLE001 - recorded in the report
            self.errors.append(f"{name} / {label}: {type(err).__name__}: {str(err)[:2000]}")
            print(f"   {name} / {label} failed: {type(err).__name__}: {str(err)[:300]}", flush=True)

    def errors_vs_kernel(self) -> dict:
        if "kernel" not in self.outs:
            return {}
        return {k: max_abs_error(self.outs["kernel"], o) for k, o in self.outs.items() if k != "kernel"}


def max_abs_error(a, b) -> float:
    import numpy as np

    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def copy_bandwidth(scale: dict, dtype) -> dict:
    import jax
    import jax.numpy as jnp

    x = jnp.ones((scale["copy_elements"],), dtype)
    fn = jax.jit(lambda a: a + jnp.asarray(1, dtype))  # reads and writes every byte once
    seconds, _ = timed(fn, (x,), max(2, scale["back_to_back"] // 4), scale["repeats"])
    moved = 2 * x.size * x.dtype.itemsize
    return {
        "bytes_moved": moved,
        "seconds": seconds,
        "bytes_per_second": moved / seconds,
        "gb_per_s": round(moved / seconds / 1e9, 2),
        "how": "jit(x + 1) over a bf16 array: bytes read + written",
    }


def kernel_row(name: str, shape: dict, bytes_read: int, bandwidth: float, m: Measurements, flops: int) -> dict:
    bound = bytes_read / bandwidth
    row = {
        "kernel": name,
        "shape": shape,
        "bytes_read": bytes_read,
        "flops": flops,
        "bound_seconds": bound,
        "seconds": m.times,
        "max_abs_error_vs": m.errors_vs_kernel(),
    }
    kernel = m.times.get("kernel")
    if kernel:
        row.update(
            {
                "fraction_of_bandwidth_bound": round(bound / kernel, 3),
                "achieved_gb_per_s": round(bytes_read / kernel / 1e9, 2),
                "achieved_tflop_per_s": round(flops / kernel / 1e12, 3),
                "speedup_vs": {k: round(v / kernel, 3) for k, v in m.times.items() if k != "kernel"},
            }
        )
    return row


def random_paged_cache(rng, *, num_kv_heads, head_dim, page_size, lens, dtype):
    """Pages for sequences of `lens` tokens, shuffled over the pool (page 0 spare), and their table."""
    import jax.numpy as jnp
    import numpy as np

    per_seq = [-(-n // page_size) for n in lens]
    max_pages = max(per_seq)
    num_pages = sum(per_seq) + 1
    ids = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((len(lens), max_pages), np.int32)
    cursor = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = ids[cursor : cursor + n]
        cursor += n
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    v = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    return k, v, jnp.asarray(table)


def bench(dry_run: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.model.layers import ragged_attention_blocked
    from pallas_kernels import (
        int4_matmul,
        int8_matmul,
        ragged_paged_attention,
        reference_int4_matmul,
        reference_int8_matmul,
        reference_ragged_paged_attention,
    )
    from pallas_kernels.int4_matmul import dequantize_int4

    scale = TINY if dry_run else FULL
    platform_name = jax.default_backend()
    backend = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(platform_name)
    if backend is None and not dry_run:
        raise RuntimeError(f"no accelerator: jax.default_backend() is {platform_name!r} (use --dry-run on CPU)")
    backend = backend or "gpu"
    interpret = dry_run
    dtype = jnp.bfloat16
    rep = dict(back_to_back=scale["back_to_back"], repeats=scale["repeats"])
    dev = jax.devices()[0]
    result = {
        "jax": jax.__version__,
        "platform": platform_name,
        "device": str(dev),
        "device_kind": getattr(dev, "device_kind", None),
        "num_devices": jax.device_count(),
        "backend": backend,
        "interpret": interpret,
        "dtype": "bfloat16",
        "timing": f"median of {rep['repeats']} runs of {rep['back_to_back']} back-to-back calls, per call",
    }
    bw = copy_bandwidth(scale, dtype)
    result["copy_bandwidth"] = bw
    bandwidth = bw["bytes_per_second"]
    rows = result["kernels"] = []
    errors = result["errors"] = []
    rng = np.random.default_rng(0)
    N, K, H, S = scale["num_heads"], scale["num_kv_heads"], scale["head_dim"], scale["page_size"]
    itemsize = jnp.dtype(dtype).itemsize

    # The engine's attention call: the whole stacked cache (one layer here) and the layer index.
    def kernel_call(q, k, v, t, c, s, n):
        return ragged_paged_attention(
            q, k, v, t, c, s, jnp.int32(n), layer=jnp.int32(0), backend=backend, interpret=interpret
        )

    def engine_reference(q, k, v, t, c, s, positions):  # the plain-JAX attention the engine runs without kernels
        return ragged_attention_blocked(q, k, v, jnp.int32(0), positions, s, c, t)

    # -- ragged paged attention, decode rows: one query token per sequence over its whole context
    B, C = scale["decode_batch"], scale["decode_context"]
    k, v, table = random_paged_cache(rng, num_kv_heads=K, head_dim=H, page_size=S, lens=[C] * B, dtype=dtype)
    k, v = k[None], v[None]  # a one-layer stack
    q = jnp.asarray(rng.standard_normal((B, N, H), np.float32), dtype)
    ctx = jnp.full((B,), C, jnp.int32)
    qsl = jnp.arange(B + 1, dtype=jnp.int32)
    kernel = jax.jit(lambda q, k, v, t, c, s: kernel_call(q, k, v, t, c, s, B))
    ref = jax.jit(
        lambda q, k, v, t, c, s: reference_ragged_paged_attention(q, k, v, t, c, s, jnp.int32(B), layer=jnp.int32(0))
    )
    engine_ref = jax.jit(lambda q, k, v, t, c, s: engine_reference(q, k, v, t, c, s, c - 1))
    name = "ragged_paged_attention (decode)"
    m = Measurements((q, k, v, table, ctx, qsl), rep, errors)
    for label, fn in (("kernel", kernel), ("kernel_reference", ref), ("engine_reference", engine_ref)):
        m.run(name, label, fn)
    rows.append(
        kernel_row(
            name,
            dict(batch=B, context=C, num_heads=N, num_kv_heads=K, head_dim=H, page_size=S),
            2 * B * C * K * H * itemsize + 2 * q.size * itemsize,
            bandwidth,
            m,
            4 * B * C * N * H,
        )
    )
    print(f"   {name}: {m.times}, bound {rows[-1]['bound_seconds']:.3g} s", flush=True)
    del k, v, m

    # -- ragged paged attention, prefill rows: fresh prompts, every token attends causally to its prompt
    P, T = scale["prefill_seqs"], scale["prefill_tokens"]
    k, v, table = random_paged_cache(rng, num_kv_heads=K, head_dim=H, page_size=S, lens=[T] * P, dtype=dtype)
    k, v = k[None], v[None]
    q = jnp.asarray(rng.standard_normal((P * T, N, H), np.float32), dtype)
    ctx = jnp.full((P,), T, jnp.int32)
    qsl = jnp.arange(P + 1, dtype=jnp.int32) * T
    positions = jnp.tile(jnp.arange(T, dtype=jnp.int32), P)
    kernel = jax.jit(lambda q, k, v, t, c, s: kernel_call(q, k, v, t, c, s, P))
    engine_ref = jax.jit(lambda q, k, v, t, c, s: engine_reference(q, k, v, t, c, s, positions))
    name = "ragged_paged_attention (prefill)"
    m = Measurements((q, k, v, table, ctx, qsl), rep, errors)
    for label, fn in (("kernel", kernel), ("engine_reference", engine_ref)):
        m.run(name, label, fn)
    causal_pairs = P * T * (T + 1) // 2
    rows.append(
        kernel_row(
            name,
            dict(seqs=P, tokens_per_seq=T, num_heads=N, num_kv_heads=K, head_dim=H, page_size=S),
            2 * P * T * K * H * itemsize + 2 * q.size * itemsize,
            bandwidth,
            m,
            4 * causal_pairs * N * H,
        )
    )
    rows[-1]["note"] = (
        "compute bound: compare achieved_tflop_per_s with the device's peak; the pallas_kernels "
        "reference is not timed (it materializes K/V per query token)"
    )
    print(f"   {name}: {m.times}", flush=True)
    del k, v, m

    # -- int8 weight-only matmul: per-column scales (G = k) and an f32 scale per group of G input rows
    for rows_, kk, n in scale["matmul"]:
        for g in (kk, min(128, kk // 2)):  # per column, then the usual group (half of k on the dry run's tiny k)
            x = jnp.asarray(rng.standard_normal((rows_, kk), np.float32), dtype)
            w = jnp.asarray(rng.integers(-127, 128, size=(kk, n), dtype=np.int8))
            s = jnp.asarray(rng.uniform(1e-3, 1e-2, size=(kk // g, n)).astype(np.float32))
            w_bf16 = (w.astype(jnp.float32) * jnp.repeat(s, g, axis=0)).astype(dtype)
            kernel = jax.jit(
                lambda x, w, s, g=g: int8_matmul(x, w, s, group_size=g, backend=backend, interpret=interpret)
            )
            name = f"int8_matmul m={rows_} group_size={g}"
            m = Measurements((x, w, s), rep, errors)
            m.run(name, "kernel", kernel)
            m.run(name, "reference", jax.jit(lambda x, w, s, g=g: reference_int8_matmul(x, w, s, group_size=g)))
            m.run(name, "bf16_matmul", jax.jit(jnp.matmul), (x, w_bf16))
            rows.append(
                kernel_row(
                    "int8_matmul",
                    dict(m=rows_, k=kk, n=n, group_size=g),
                    kk * n + 4 * (kk // g) * n + (rows_ * kk + rows_ * n) * itemsize,
                    bandwidth,
                    m,
                    2 * rows_ * kk * n,
                )
            )
            rows[-1]["note"] = (
                "bytes_read: int8 values + f32 scales + x and the output; group_size = k is "
                "per-column scales; bf16_matmul: the same product with bf16 weights (twice the "
                "weight bytes)"
            )
            print(f"   {name}: {m.times}", flush=True)
            del x, w, s, w_bf16, m

    # -- int4 weight-only matmul: packed nibbles (two per byte along k), an f32 scale and bias per group
    for rows_, kk, n in scale["matmul"]:
        g = min(128, kk)  # AWQ/GPTQ's usual group
        x = jnp.asarray(rng.standard_normal((rows_, kk), np.float32), dtype)
        v = jnp.asarray(rng.integers(0, 256, size=(kk // 2, n), dtype=np.uint8))
        s = jnp.asarray(rng.uniform(1e-3, 1e-2, size=(kk // g, n)).astype(np.float32))
        b = -8 * s
        w_bf16 = jax.jit(lambda v, s, b: dequantize_int4(v, s, b, g).astype(dtype))(v, s, b)
        kernel = jax.jit(lambda x, v, s, b: int4_matmul(x, v, s, b, group_size=g, backend=backend, interpret=interpret))
        name = f"int4_matmul m={rows_}"
        m = Measurements((x, v, s, b), rep, errors)
        m.run(name, "kernel", kernel)
        m.run(name, "reference", jax.jit(lambda x, v, s, b: reference_int4_matmul(x, v, s, b, group_size=g)))
        m.run(name, "bf16_matmul", jax.jit(jnp.matmul), (x, w_bf16))
        rows.append(
            kernel_row(
                "int4_matmul",
                dict(m=rows_, k=kk, n=n, group_size=g),
                kk * n // 2 + 2 * 4 * (kk // g) * n + (rows_ * kk + rows_ * n) * itemsize,
                bandwidth,
                m,
                2 * rows_ * kk * n,
            )
        )
        rows[-1]["note"] = (
            "bytes_read: packed codes + f32 scales and biases + x and the output; "
            "bf16_matmul: the same product with bf16 weights (four times the code bytes)"
        )
        print(f"   {name}: {m.times}", flush=True)
        del x, v, s, b, w_bf16, m
    if errors:
        raise SectionFailed(RuntimeError(f"{len(errors)} measurement(s) failed: {errors[0][:300]}"), result)
    return result


# ---- tests ---------------------------------------------------------------------------------------
def run_kernel_tests(dry_run: bool, target: str | None, extra: list[str], timeout: float, out_dir: str) -> dict:
    target = target or ("tests/kernels/test_kernel_api.py" if dry_run else "tests/kernels")
    junit = os.path.join(out_dir, "gpu_check_kernel_tests.xml")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *target.split(),
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        *extra,
    ]
    env = child_env(dry_run, **({} if dry_run else {"PALLAS_TESTS_NATIVE": "1"}))
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        timed_out = True
    result = {
        "cmd": " ".join(cmd),
        "native": not dry_run,
        "returncode": proc.returncode,
        "timed_out": timed_out,
        "seconds": round(time.perf_counter() - t0, 2),
        "output_tail": (output or "")[-6000:],
    }
    if os.path.exists(junit):
        result.update(parse_junit(junit))
    return result


def parse_junit(path: str) -> dict:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = []
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                failed.append(
                    {
                        "test": f"{case.get('classname')}::{case.get('name')}",
                        "kind": tag,
                        "message": (node.get("message") or "")[:500],
                    }
                )
    counts["failed_tests"] = failed[:100]
    return counts


# ---- server --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 30.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status, json.loads(resp.read() or b"null")


def stream_completion(base: str, model: str, prompt: list[int], max_tokens: int, timeout: float) -> dict:
    """One streamed completion; times to the first and the last token chunk."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        base + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    first = last = None
    chunks, tokens = 0, None
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                break
            data = json.loads(payload)
            if "error" in data:
                raise RuntimeError(f"server error: {data['error']}")
            if data.get("usage"):
                tokens = data["usage"].get("completion_tokens")
            if data.get("choices"):
                now = time.perf_counter()
                first = now if first is None else first
                last = now
                chunks += 1
    if first is None:
        raise RuntimeError("no tokens received")
    tokens = tokens if tokens is not None else chunks
    decode = (last - first) / (tokens - 1) if tokens > 1 and last > first else None
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": tokens,
        "ttft_s": round(first - t0, 4),
        "e2e_s": round(last - t0, 4),
        "decode_s_per_token": decode,
    }


def server_smoke(dry_run: bool, model: str | None, extra: list[str], timeout: float, out_dir: str) -> dict:
    work = tempfile.mkdtemp(prefix="gpu_check_")
    if dry_run and model is None:
        model = os.path.join(work, "tiny-llama")
        os.makedirs(model)
        with open(os.path.join(model, "config.json"), "w", encoding="utf-8") as f:
            json.dump(TINY_MODEL, f)
    model = model or DEFAULT_MODEL
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise FileNotFoundError(f"{model}/config.json not found (pass --model DIR)")
    if dry_run:  # a handful of small ragged buckets (tokens 1 .. 16, 4 pages)
        limits = dict(
            max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, prompt_len=8, max_tokens=4, concurrency=[1, 2]
        )
    else:  # 64 sequence slots: the streams of every concurrency level decode in one step
        limits = dict(
            max_model_len=256,
            max_num_seqs=64,
            max_num_batched_tokens=256,
            prompt_len=64,
            max_tokens=64,
            concurrency=[1, 4, 16, 64],
        )
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "jaxserve.serve",
        "--model",
        model,
        "--load-format",
        "dummy",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(limits["max_model_len"]),
        "--max-num-seqs",
        str(limits["max_num_seqs"]),
        "--max-num-batched-tokens",
        str(limits["max_num_batched_tokens"]),
        "--page-size",
        "16",
        "--kv-cache-memory",
        "2GiB" if not dry_run else "16MiB",
        "--scan-layers",
        "true",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-access-log",
        *extra,
    ]
    log_path = os.path.join(out_dir, "gpu_check_server.log")
    result = {"cmd": " ".join(cmd), "model": model, "limits": limits, "log": log_path}
    base = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=child_env(dry_run), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
                if time.perf_counter() - t0 > timeout:
                    raise TimeoutError(f"the server was not ready after {timeout:.0f} s")
                try:
                    if http_json(base + "/health", timeout=5)[0] == 200:
                        break
                except (urllib.error.URLError, OSError, ValueError):
                    pass
                time.sleep(1.0)
            result["ready_s"] = round(time.perf_counter() - t0, 2)
            served = http_json(base + "/v1/models")[1]["data"][0]["id"]
            with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
                vocab = json.load(f)["vocab_size"]
            levels = limits["concurrency"]
            prompts = [
                [(7 + 13 * i + 31 * j) % (vocab - 10) + 5 for j in range(limits["prompt_len"])]
                for i in range(1 + sum(levels))
            ]
            request_timeout = max(60.0, timeout / 2)
            # The first request runs alone (its TTFT is a prefill on an idle server); then each concurrency
            # level sends that many streams at once (fresh prompts: no prefix-cache hits).
            result["single"] = stream_completion(base, served, prompts[0], limits["max_tokens"], request_timeout)
            result["concurrency"], used = [], 1
            for level in levels:
                batch_prompts, used = prompts[used : used + level], used + level
                c0 = time.perf_counter()
                with ThreadPoolExecutor(level) as pool:
                    batch = list(
                        pool.map(
                            lambda p: stream_completion(base, served, p, limits["max_tokens"], request_timeout),
                            batch_prompts,
                        )
                    )
                wall = time.perf_counter() - c0
                decode = [r["decode_s_per_token"] for r in batch if r["decode_s_per_token"]]
                result["concurrency"].append(
                    {
                        "streams": level,
                        "wall_s": round(wall, 3),
                        "output_tokens_per_s": round(sum(r["completion_tokens"] for r in batch) / wall, 2),
                        "ttft_s_median": statistics.median(r["ttft_s"] for r in batch),
                        "ttft_s_max": max(r["ttft_s"] for r in batch),
                        "tpot_s_median": statistics.median(decode) if decode else None,
                    }
                )
            result["concurrent"] = dict(result["concurrency"][-1], requests=levels[-1])
            one = result["concurrency"][0]["output_tokens_per_s"]
            result["throughput_vs_one_stream"] = {
                c["streams"]: round(c["output_tokens_per_s"] / one, 2) for c in result["concurrency"]
            }
            try:
                with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
                    text = resp.read().decode()
                result["metrics_excerpt"] = [
                    ln for ln in text.splitlines() if ln.startswith(("jaxserve", "vllm:")) and "_bucket" not in ln
                ][:60]
            except (urllib.error.URLError, OSError) as err:
                result["metrics_excerpt"] = f"unavailable: {err}"
        except Exception as err:  # noqa: BLE001 - re-raised with the server log attached
            failure = err
        else:
            failure = None
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            result["exit_code"] = proc.returncode
            with open(log_path, encoding="utf-8", errors="replace") as f:
                log_text = f.read()
            result["attention"] = [ln for ln in log_text.splitlines() if "attention:" in ln][:2]
            result["log_tail"] = log_text[-4000:]
            shutil.rmtree(work, ignore_errors=True)
    if failure is not None:
        raise SectionFailed(failure, result) from failure
    return result


# ---- copies in the compiled step -------------------------------------------------------------------
def hlo_copy_census(hlo_text: str, min_bytes: int = 1 << 20) -> dict:
    """Copies, dynamic slices and gathers in an optimized HLO module outside fused computations (a
    fusion's inner slices move nothing by themselves), with the bytes each produces; those of at
    least `min_bytes` are listed. Ops in while bodies (a scan over layers) run once per iteration."""
    import re

    sizes = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8}
    op = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\][^ ]* (copy|dynamic-slice|gather)\(")
    computation, fused = None, False
    found: dict[str, dict] = {}
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and "{" in line:  # a computation's header
            computation = line.split("(")[0].replace("ENTRY", "").strip().lstrip("%")
            fused = "fused" in computation or "fusion" in computation
            continue
        m = op.match(line)
        if m is None or fused:
            continue
        dtype, dims, kind = m.groups()
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        nbytes = n * sizes.get(dtype, 4)
        entry = found.setdefault(kind, {"count": 0, "bytes": 0, "large": []})
        entry["count"] += 1
        entry["bytes"] += nbytes
        if nbytes >= min_bytes:
            entry["large"].append({"shape": f"{dtype}[{dims}]", "bytes": nbytes, "in": computation})
    return found


def step_copies(dry_run: bool, model: str | None) -> dict:
    """The ragged decode step (16 rows, one token each) of the model, compiled from shapes, and the
    copy census of each variant."""
    import jax
    import jax.numpy as jnp

    from jaxserve import steps
    from jaxserve.config import ModelConfig
    from jaxserve.model.kv_cache import KVCache, RaggedBatch
    from jaxserve.model.weights import map_specs

    work = tempfile.mkdtemp(prefix="gpu_check_copies_")
    try:
        if model is None and dry_run:
            model = os.path.join(work, "tiny-llama")
            os.makedirs(model)
            with open(os.path.join(model, "config.json"), "w", encoding="utf-8") as f:
                json.dump(TINY_MODEL, f)
        cfg = ModelConfig.from_dir(model or DEFAULT_MODEL)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16
    rows, pages_per_row, page_size = (2, 4, 16) if dry_run else (16, 128, 16)  # 16 x 2,048 tokens of context
    num_pages = rows * pages_per_row + 1
    sds = jax.ShapeDtypeStruct
    stacked = map_specs(lambda a: sds(a.shape, dtype), cfg)
    unrolled = stacked.replace(
        layers=tuple(jax.tree.map(lambda a: sds(a.shape[1:], a.dtype), stacked.layers) for _ in range(cfg.num_layers))
    )
    kv = sds((1, cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim), dtype)
    cache = KVCache(k=kv, v=kv)
    i32 = lambda *d: sds((1,) + d, jnp.int32)  # noqa: E731
    batch = RaggedBatch(
        tokens=i32(rows),
        positions=i32(rows),
        slots=i32(rows),
        token_row=i32(rows),
        query_start=i32(rows + 1),
        context_lens=i32(rows),
        page_table=i32(rows, pages_per_row),
        logit_index=i32(rows),
    )
    impl = "pallas_gpu" if gpu else "reference"
    result = {
        "model": model or DEFAULT_MODEL,
        "rows": rows,
        "context_per_row": pages_per_row * page_size,
        "attention": impl,
        "cache_bytes": 2 * kv.size * 2,
        "variants": {},
    }
    for scan in (True, False):
        options = steps.StepOptions(scan_layers=scan, attention_backend=impl)
        params = stacked if scan else unrolled
        lowered = steps.ragged.trace(params, cache, batch, cfg=cfg, options=options).lower()
        for fusion in (False, True) if gpu else (None,):
            opts = {} if fusion is None else {"xla_gpu_enable_dynamic_slice_fusion": fusion}
            t0 = time.perf_counter()
            compiled = lowered.compile(opts)
            name = ("scanned" if scan else "unrolled") + (
                "" if fusion is None else f", dynamic_slice_fusion={str(fusion).lower()}"
            )
            result["variants"][name] = {
                "compile_s": round(time.perf_counter() - t0, 2),
                **hlo_copy_census(compiled.as_text()),
            }
    return result


def weight_read_bound(data: dict, model: str | None, dry_run: bool) -> dict | None:
    """Batch-1 decode (the server's lone stream) against reading every bf16 weight once per token at
    the copy bandwidth the bench section measured; None without both."""
    try:
        tpot = data["server"]["single"]["decode_s_per_token"]
        bandwidth = data["bench"]["copy_bandwidth"]["bytes_per_second"]
    except (KeyError, TypeError):
        return None
    if not tpot or not bandwidth:
        return None
    import jax

    from jaxserve.config import ModelConfig
    from jaxserve.model.weights import param_specs

    if dry_run and model is None:  # the dry run's server model (its directory is gone by now)
        cfg = ModelConfig.from_hf_dict(TINY_MODEL)
    else:
        cfg = ModelConfig.from_dir(model or DEFAULT_MODEL)
    specs = jax.tree.leaves(param_specs(cfg), is_leaf=lambda x: hasattr(x, "axes"))
    weight_bytes = 2 * sum(math.prod(s.shape) for s in specs)
    bound = weight_bytes / bandwidth
    return {
        "weight_bytes": weight_bytes,
        "bound_s_per_token": bound,
        "tpot_s": tpot,
        "fraction_of_bound": round(bound / tpot, 3),
    }


# ---- main ----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    default_out = os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else "gpu_check.json"
    p.add_argument("--out", default=default_out, help="the JSON report (default: $OUT/gpu_check.json if $OUT is set)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {SECTIONS}")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run everything on CPU with tiny shapes, kernels in interpret mode (checks the script)",
    )
    p.add_argument(
        "--tests",
        default=None,
        help="pytest target(s), space-separated (default: tests/kernels; dry run: test_kernel_api.py)",
    )
    p.add_argument("--pytest-args", default="", help="extra pytest arguments, e.g. \"-k 'gpu and not lowers'\"")
    p.add_argument("--tests-timeout", type=float, default=420.0, help="seconds for the kernel tests")
    p.add_argument("--model", default=None, help=f"model directory for the server (default: {DEFAULT_MODEL})")
    p.add_argument("--server-args", default="", help="extra `python -m jaxserve.serve` flags, e.g. '--mesh-shape 1,1'")
    p.add_argument("--server-timeout", type=float, default=480.0, help="seconds for the server to become ready")
    return p


def main(argv: list[str] | None = None) -> int:
    import shlex

    args = build_parser().parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        print(f"error: unknown sections {sorted(unknown)}; choose from {SECTIONS}", file=sys.stderr)
        return 2
    # Before jax is imported (bench): no up-front grab of most of the GPU, so the child processes fit.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, REPO)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    report = Report(args.out, args.dry_run)
    report.data["sections"] = sections
    for name in sections:
        if name == "bench":
            report.section("bench", bench, args.dry_run)
        elif name == "tests":
            report.section(
                "tests",
                run_kernel_tests,
                args.dry_run,
                args.tests,
                shlex.split(args.pytest_args),
                args.tests_timeout,
                out_dir,
            )
        elif name == "copies":
            report.section("copies", step_copies, args.dry_run, args.model)
        elif name == "server":
            report.section(
                "server",
                server_smoke,
                args.dry_run,
                args.model,
                shlex.split(args.server_args),
                args.server_timeout,
                out_dir,
            )
    bound = weight_read_bound(report.data, args.model, args.dry_run)
    if bound is not None:
        report.data["batch1_vs_weight_read_bound"] = bound
    tests = report.data.get("tests")
    report.data["ok"] = not report.data["errors"] and (tests is None or tests["returncode"] == 0)
    report.write()
    print(f"report: {args.out} ({'ok' if report.data['ok'] else 'PROBLEMS: see errors / tests'})")
    return 0 if report.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
