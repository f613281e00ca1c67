#!/usr/bin/env python
"""Peers benchmark: jaxserve against the engines a user would pick instead, same weights, one run.

Engines (all on the SmolLM2-135M-shaped dummy model, seeded random weights):

* jaxserve          `LLM.generate` at batch 1 (as scripts/bench_decode.py) and batch 16, and its
                    OpenAI server (`python -m jaxserve.serve --config ...`);
* Hugging Face      `transformers` `generate`, batch 1 and batch 16;
* llama.cpp         through `llama-cpp-python` (`Llama.generate`) at batch 1, and `llama-server`
                    under the same OpenAI load as jaxserve's server (`jaxserve bench serve`), with
                    as many slots (`-np`) as jaxserve's `max_num_seqs` (and any others given).

Same weights everywhere: jaxserve's own dummy params (load_format=dummy, --seed) are written as a
Hugging Face directory (config.json + model.safetensors + a locally trained sentencepiece
tokenizer, which llama.cpp's converter needs), HF loads that directory, and llama.cpp's
`convert_hf_to_gguf.py` (from the llama.cpp vendored in the llama-cpp-python sdist) turns it into
f32 / bf16 GGUF files. A check compares the last-position logits of one prompt across engines.

Workload: fresh random prompts for every request (no prefix-cache hits), --prompt-len tokens in,
--new-tokens out, greedy, EOS ignored. Batch-1/16 timings: TTFT = median wall time of a
1-token generate; decode = (median n-token time - median 1-token time) / (n - 1) (per row, x16
for batch 16). Server: --num-prompts requests, at most --concurrency in flight, all sent at once.
Ratios are jaxserve/peer on each metric: above 1 is better for tokens/s, below 1 for latencies.

Build artifacts (HF export, GGUF, llama-server) live in --work-dir, outside the repository.

    # one-off preparation (export + GGUF conversion), no timing
    python scripts/bench_peers.py --prepare-only
    # the measurement (shared machine: one timed run at a time)
    flock /tmp/jaxserve-bench.lock env LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \\
        python scripts/bench_peers.py --llama-server ~/.cache/jaxserve/peers/build-server/bin/llama-server \\
        --out out/bench_peers.json

Optional dependencies: `pip install -e .[bench]` (llama-cpp-python builds from source; gguf).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent
DEFAULT_CONFIG = REPO / "configs" / "smollm2-135m-dummy.yaml"
DEFAULT_WORK = Path(os.path.expanduser("~/.cache/jaxserve/peers"))
SCHEMA = "jaxserve-bench-peers/1"

# GGUF tensor types and the dtype names the other engines use for them.
GGUF_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
DTYPE_GGUF = {v: k for k, v in GGUF_DTYPES.items()}

# Metrics: (section, key, label, better). "higher": tokens/s; "lower": latency.
BATCH1_METRICS = (("decode_tokens_per_s", "decode tok/s", "higher"), ("ttft_ms", "TTFT ms", "lower"))
BATCH16_METRICS = (("output_tokens_per_s", "output tok/s", "higher"),)
SERVER_METRICS = (
    ("output_throughput", "output tok/s", "higher"),
    ("p50_ttft_ms", "TTFT p50 ms", "lower"),
    ("p50_tpot_ms", "TPOT p50 ms", "lower"),
)
TARGETS = {"batch1_decode_vs_llamacpp": 1.0, "server_throughput_vs_llama_server": 2.0, "batch16_vs_hf": 5.0}


# ---- pure report arithmetic (tests/test_bench_peers.py) ------------------------------------------
def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs, or None when either is missing, not finite, or theirs is zero."""
    if ours is None or theirs is None:
        return None
    try:
        ours, theirs = float(ours), float(theirs)
    except (TypeError, ValueError):
        return None
    if not (math.isfinite(ours) and math.isfinite(theirs)) or theirs == 0:
        return None
    return ours / theirs


def batch_summary(t1: list[float], tn: list[float], n: int, batch: int = 1) -> dict:
    """TTFT and decode rates (s -> ms, tokens/s) from wall times of 1-token and n-token generates of
    `batch` rows each: decode counts the n-1 tokens after the first of every row."""
    if n < 2 or not t1 or not tn:
        raise ValueError("need n >= 2 and at least one timing of each kind")
    m1, mn = statistics.median(t1), statistics.median(tn)
    decode_s = (mn - m1) / (n - 1)  # one step of all rows
    return {
        "batch": batch,
        "ttft_ms": m1 * 1e3,
        "total_ms": mn * 1e3,
        "decode_ms_per_step": decode_s * 1e3,
        "decode_tokens_per_s": batch / decode_s if decode_s > 0 else float("nan"),
        "output_tokens_per_s": batch * n / mn if mn > 0 else float("nan"),
        "raw_1_token_s": list(t1),
        "raw_n_tokens_s": list(tn),
    }


def _entries(report: dict, section: str, engine: str) -> list[dict]:
    return [e for e in report.get(section, []) if e.get("engine") == engine and not e.get("error")]


def best_entry(entries: list[dict], key: str) -> dict | None:
    """The entry with the highest finite `key` (the peer's best setting), or None."""
    ok = [e for e in entries if isinstance(e.get(key), (int, float)) and math.isfinite(e[key])]
    return max(ok, key=lambda e: e[key]) if ok else None


def comparisons(report: dict) -> list[dict]:
    """One row per (section, metric, dtype, peer setting): absolute figures and jaxserve/peer."""
    rows = []

    def add(section, metric, label, better, ours, peer, peer_name, setting):
        rows.append(
            {
                "section": section,
                "metric": metric,
                "label": label,
                "better": better,
                "dtype": ours.get("dtype"),
                "peer": peer_name,
                "peer_setting": setting,
                "jaxserve": ours.get(metric),
                "peer_value": peer.get(metric),
                "ratio": ratio(ours.get(metric), peer.get(metric)),
            }
        )

    for section, metrics, peers in (
        ("batch1", BATCH1_METRICS, ("llama.cpp", "hf")),
        ("batch16", BATCH16_METRICS, ("hf",)),
    ):
        for ours in _entries(report, section, "jaxserve"):
            for peer_name in peers:
                for peer in _entries(report, section, peer_name):
                    if section == "batch1" and peer.get("dtype") != ours.get("dtype"):
                        continue  # batch 1: same dtype only
                    for metric, label, better in metrics:
                        add(section, metric, label, better, ours, peer, peer_name, peer.get("dtype"))
    for ours in _entries(report, "server", "jaxserve"):
        for peer in _entries(report, "server", "llama-server"):
            for metric, label, better in SERVER_METRICS:
                add(
                    "server",
                    metric,
                    label,
                    better,
                    ours,
                    peer,
                    "llama-server",
                    f"{peer.get('dtype')}, -np {peer.get('slots')}",
                )
    return rows


def evaluate_targets(report: dict) -> list[dict]:
    """The issue's targets against the measured ratios; `met` is None when a side is missing."""
    out = []
    # 1. batch-1 decode >= 1.0x llama.cpp, same dtype (each dtype measured on both sides).
    for ours in _entries(report, "batch1", "jaxserve"):
        peer = next((p for p in _entries(report, "batch1", "llama.cpp") if p.get("dtype") == ours.get("dtype")), None)
        r = ratio(ours.get("decode_tokens_per_s"), (peer or {}).get("decode_tokens_per_s"))
        need = TARGETS["batch1_decode_vs_llamacpp"]
        out.append(
            {
                "target": "batch1_decode_vs_llamacpp",
                "dtype": ours.get("dtype"),
                "threshold": need,
                "ratio": r,
                "met": None if r is None else r >= need,
                "text": f"batch-1 decode tok/s >= {need:g}x llama.cpp ({ours.get('dtype')})",
            }
        )
    # 2. server output throughput >= 2x llama-server's best setting, at no worse p50 TTFT and TPOT.
    ours = best_entry(_entries(report, "server", "jaxserve"), "output_throughput")
    peer = best_entry(_entries(report, "server", "llama-server"), "output_throughput")
    need = TARGETS["server_throughput_vs_llama_server"]
    r = ratio((ours or {}).get("output_throughput"), (peer or {}).get("output_throughput"))
    r_ttft = ratio((ours or {}).get("p50_ttft_ms"), (peer or {}).get("p50_ttft_ms"))
    r_tpot = ratio((ours or {}).get("p50_tpot_ms"), (peer or {}).get("p50_tpot_ms"))
    met = None if None in (r, r_ttft, r_tpot) else (r >= need and r_ttft <= 1.0 and r_tpot <= 1.0)
    out.append(
        {
            "target": "server_throughput_vs_llama_server",
            "dtype": (ours or {}).get("dtype"),
            "threshold": need,
            "ratio": r,
            "ttft_p50_ratio": r_ttft,
            "tpot_p50_ratio": r_tpot,
            "peer_setting": None if peer is None else f"{peer.get('dtype')}, -np {peer.get('slots')}",
            "met": met,
            "text": f"server output tok/s >= {need:g}x llama-server (best setting), p50 TTFT and TPOT no worse",
        }
    )
    # 3. batch-16 output throughput >= 5x HF generate at batch 16 (against HF's faster dtype).
    ours = best_entry(_entries(report, "batch16", "jaxserve"), "output_tokens_per_s")
    peer = best_entry(_entries(report, "batch16", "hf"), "output_tokens_per_s")
    need = TARGETS["batch16_vs_hf"]
    r = ratio((ours or {}).get("output_tokens_per_s"), (peer or {}).get("output_tokens_per_s"))
    out.append(
        {
            "target": "batch16_vs_hf",
            "dtype": (ours or {}).get("dtype"),
            "threshold": need,
            "ratio": r,
            "peer_setting": (peer or {}).get("dtype"),
            "met": None if r is None else r >= need,
            "text": f"batch-16 output tok/s >= {need:g}x HF generate batch 16 (HF's faster dtype)",
        }
    )
    return out


def _fmt(x: Any, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if isinstance(x, (int, float)):
        return f"{x:,.{digits}f}"
    return str(x)


def format_table(rows: list[dict], targets: list[dict] | None = None) -> str:
    """Plain-text table of `comparisons` rows (and the targets under it)."""
    head = ("section", "metric", "dtype", "peer (setting)", "jaxserve", "peer", "jaxserve/peer")
    body = []
    for r in rows:
        arrow = "^" if r["better"] == "higher" else "v"
        body.append(
            (
                r["section"],
                f"{r['label']} ({arrow})",
                r.get("dtype") or "-",
                f"{r['peer']} ({r['peer_setting']})",
                _fmt(r["jaxserve"]),
                _fmt(r["peer_value"]),
                "-" if r["ratio"] is None else f"{r['ratio']:.2f}x",
            )
        )
    widths = [max(len(str(x[i])) for x in body + [head]) for i in range(len(head))]
    line = lambda xs: "  ".join(
        str(x).rjust(w) if i > 3 else str(x).ljust(w) for i, (x, w) in enumerate(zip(xs, widths))
    )
    out = [line(head), line(["-" * w for w in widths])] + [line(b) for b in body]
    out.append("(^: higher is better, jaxserve/peer > 1 wins; v: lower is better, jaxserve/peer < 1 wins)")
    for t in targets or []:
        status = {True: "MET", False: "NOT MET", None: "not measured"}[t["met"]]
        extra = ""
        if "ttft_p50_ratio" in t:
            extra = f"; TTFT p50 {_fmt(t['ttft_p50_ratio'], 2)}x, TPOT p50 {_fmt(t['tpot_p50_ratio'], 2)}x"
        out.append(f"target: {t['text']}: {_fmt(t['ratio'], 2)}x{extra} -> {status}")
    return "\n".join(out)


def markdown_table(rows: list[dict]) -> str:
    """The same rows as a Markdown table (docs/BENCHMARKS.md)."""
    out = [
        "| section | metric | dtype | peer (setting) | jaxserve | peer | jaxserve/peer |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        arrow = "higher better" if r["better"] == "higher" else "lower better"
        ratio_s = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        out.append(
            f"| {r['section']} | {r['label']} ({arrow}) | {r.get('dtype') or '-'} | {r['peer']} "
            f"({r['peer_setting']}) | {_fmt(r['jaxserve'])} | {_fmt(r['peer_value'])} | {ratio_s} |"
        )
    return "\n".join(out)


REPORT_KEYS = ("schema", "config", "machine", "weights", "batch1", "batch16", "server", "comparisons", "targets")
ENTRY_KEYS = {
    "batch1": ("engine", "dtype", "ttft_ms", "decode_tokens_per_s"),
    "batch16": ("engine", "dtype", "batch", "output_tokens_per_s"),
    "server": ("engine", "dtype", "slots", "output_throughput", "p50_ttft_ms", "p50_tpot_ms"),
}


def validate_report(report: dict) -> list[str]:
    """Schema problems of a report (empty when fine): top-level keys, and each measured entry's keys."""
    problems = [f"missing key {k!r}" for k in REPORT_KEYS if k not in report]
    if report.get("schema") != SCHEMA:
        problems.append(f"schema is {report.get('schema')!r}, not {SCHEMA!r}")
    for section, keys in ENTRY_KEYS.items():
        for i, e in enumerate(report.get(section, [])):
            if e.get("error"):
                continue
            problems += [f"{section}[{i}] lacks {k!r}" for k in keys if k not in e]
    return problems


def finish_report(report: dict) -> dict:
    report["comparisons"] = comparisons(report)
    report["targets"] = evaluate_targets(report)
    return report


# ---- helpers -------------------------------------------------------------------------------------
def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def timed(fn) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


class Prompts:
    """A stream of fresh random prompts (token ids in [low, vocab)); never the same one twice."""

    def __init__(self, seed: int, length: int, vocab: int, low: int = 10):
        self.rng = np.random.default_rng(seed)
        self.length, self.vocab, self.low = length, vocab, low

    def take(self, n: int = 1) -> list[list[int]]:
        return self.rng.integers(self.low, self.vocab, (n, self.length)).tolist()


def time_generate(gen, prompts: Prompts, batch: int, n: int, repeats: int) -> dict:
    """`gen(list_of_prompts, k)` -> tokens of row 0; untimed warm-up, then `repeats` of each length,
    every call on fresh prompts. The warm-up of a batch is shorter (the shapes are the same)."""
    gen(prompts.take(batch), 1)
    gen(prompts.take(batch), n if batch == 1 else min(n, 8))
    t1, tn = [], []
    for _ in range(repeats):
        t1.append(timed(lambda: gen(prompts.take(batch), 1))[0])
        tn.append(timed(lambda: gen(prompts.take(batch), n))[0])
    return batch_summary(t1, tn, n, batch)


def import_script(name: str):
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return __import__(name)


def load_settings(config: Path) -> dict:
    import yaml

    settings = yaml.safe_load(config.read_text()) or {}
    model = Path(settings["model"])
    settings["model"] = str(model if model.is_absolute() else (REPO / model))
    return settings


# ---- weights: jaxserve dummy params -> HF directory -> GGUF ---------------------------------------
def find_llama_cpp(work: Path, given: str | None) -> Path | None:
    if given:
        return Path(given)
    for d in sorted(work.glob("llama_cpp_python-*/vendor/llama.cpp"), reverse=True):
        if (d / "convert_hf_to_gguf.py").is_file():
            return d
    return None


def export_hf(params, model_dir: str, tokenizer_dir: Path, out: Path) -> Path:
    """jaxserve params -> a float32 Hugging Face directory (with the tokenizer llama.cpp's converter needs)."""
    from jaxserve.loading.checkpoint import hf_tensors, write_safetensors
    from jaxserve.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: np.asarray(v, np.float32) for k, v in hf_tensors(params, cfg).items()}
    write_safetensors(str(tmp / "model.safetensors"), tensors)
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    hf["torch_dtype"] = "float32"
    # The sentencepiece tokenizer's ids: 0 <unk>, 1 <s>, 2 </s>, 3 <pad>. EOS is ignored everywhere.
    hf.update(bos_token_id=1, eos_token_id=2, pad_token_id=3)
    (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp / f.name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def make_tokenizer(work: Path, vocab: int) -> Path:
    out = work / f"tokenizer-sp-{vocab}"
    if not (out / "tokenizer.model").is_file():
        from tokenizer_training import train_tokenizer

        log(f"training a sentencepiece tokenizer of {vocab} ids (for the GGUF converter) -> {out}")
        train_tokenizer(out, vocab, "sentencepiece", max_bytes=4_000_000)
    return out


def convert_gguf(llama_cpp: Path, hf_dir: Path, out: Path, outtype: str) -> Path:
    if out.is_file():
        return out
    log(f"converting {hf_dir} -> {out} ({outtype}) with {llama_cpp / 'convert_hf_to_gguf.py'}")
    tmp = out.with_name(out.name + ".tmp")
    subprocess.run(
        [
            sys.executable,
            str(llama_cpp / "convert_hf_to_gguf.py"),
            str(hf_dir),
            "--outfile",
            str(tmp),
            "--outtype",
            outtype,
        ],
        check=True,
    )
    tmp.rename(out)
    return out


# ---- jaxserve ------------------------------------------------------------------------------------
def jaxserve_llm(args, settings: dict, dtype: str, batch: int):
    import logging

    from jaxserve import LLM

    if batch == 1:  # as scripts/bench_decode.py: one row, one prefill chunk, just long enough
        llm = LLM(
            model=settings["model"],
            load_format="dummy",
            dtype=dtype,
            seed=args.seed,
            max_num_seqs=1,
            max_num_batched_tokens=args.prompt_len,
            max_model_len=args.prompt_len + args.new_tokens,
            warm_up=False,
        )
    else:  # the serving configuration (its buckets are in the persistent compile cache after a server run)
        s = dict(settings, dtype=dtype, seed=args.seed, load_format="dummy")
        s["max_num_seqs"] = max(int(s.get("max_num_seqs", batch)), batch)
        llm = LLM(warm_up=False, **s)
    logging.getLogger("jaxserve.runner.runner").setLevel(logging.ERROR)  # "compiling unplanned shape"
    return llm


def jaxserve_gen(llm):
    from jaxserve import SamplingParams

    def gen(prompts: list[list[int]], k: int) -> list[int]:
        sp = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == k for o in outs)
        return list(outs[0].outputs[0].token_ids)

    return gen


# ---- Hugging Face --------------------------------------------------------------------------------
def hf_model(hf_dir: Path, dtype: str):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # exactly max_new_tokens, as ignore_eos does
    model.generation_config.pad_token_id = 3
    return model


def hf_gen(model):
    import torch

    def gen(prompts: list[list[int]], k: int) -> list[int]:
        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=k,
                min_new_tokens=k,
                do_sample=False,
                num_beams=1,
            )
        assert out.shape[1] == ids.shape[1] + k
        return out[0, ids.shape[1] :].tolist()

    return gen


def hf_logits(model, prompt: list[int]) -> np.ndarray:
    import torch

    with torch.inference_mode():
        return model(input_ids=torch.tensor([prompt])).logits[0, -1].float().numpy()


# ---- llama.cpp (llama-cpp-python) ----------------------------------------------------------------
def llama_cpp_model(gguf: Path, args, kv_type: str):
    import llama_cpp

    bf16 = getattr(llama_cpp, "GGML_TYPE_BF16", 30)  # ggml.h's value; the bindings do not export it
    kv = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16, "bf16": bf16}[kv_type]
    return llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=args.prompt_len + args.new_tokens + 16,
        n_batch=512,
        n_ubatch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        type_k=kv,
        type_v=kv,
        seed=args.seed,
        verbose=False,
    )


def llama_cpp_gen(llm):
    def gen(prompts: list[list[int]], k: int) -> list[int]:
        assert len(prompts) == 1
        out = []
        for tok in llm.generate(prompts[0], temp=0.0, top_k=1, reset=True):  # no EOS check: ignore_eos
            out.append(int(tok))
            if len(out) == k:
                break
        return out

    return gen


def llama_cpp_logits(llm, prompt: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(prompt)  # without logits_all only the last position's logits exist (and are not copied out)
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).astype(np.float32)


def logits_check(ours: np.ndarray, theirs: np.ndarray, k: int = 5) -> dict:
    top = lambda x: np.argsort(-x)[:k].tolist()
    return {
        "max_abs_diff": float(np.max(np.abs(ours - theirs))),
        "logit_std": float(np.std(theirs)),
        f"top{k}_same": top(ours) == top(theirs),
        "top1": [int(np.argmax(ours)), int(np.argmax(theirs))],
    }


# ---- servers -------------------------------------------------------------------------------------
class Server:
    """A server subprocess started by this script (and only ever stopped by its own pid)."""

    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path, env: dict | None = None):
        self.name, self.port, self.log_path = name, port, log_path
        log(f"starting {name}: {' '.join(cmd)}  (log {log_path})")
        self.log_file = open(log_path, "w", encoding="utf-8")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log_file, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{port}"

    def wait_healthy(self, timeout: float) -> float:
        try:
            return import_script("bench_serving").wait_for_health(self.url, self.proc, timeout)
        except RuntimeError as err:
            raise RuntimeError(f"{self.name}: {err}; see {self.log_path}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()


def serving_load(args, url: str, label: str, vocab: int) -> dict:
    """`jaxserve bench serve` (jaxserve.bench.serve) against `url`: an untimed warm-up on other prompts,
    then the load; the summary also under the keys this report used before (duration_s)."""
    from jaxserve.bench import serve as bench_serve

    common = [
        "--base-url",
        url,
        "--label",
        label,
        "--random-input-len",
        str(args.prompt_len),
        "--random-token-range",
        f"10:{vocab}",
        "--temperature",
        "0",
        "--max-concurrency",
        str(args.concurrency),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--metric-percentiles",
        "50,90,99",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--disable-tqdm",
        "--ready-check-timeout-sec",
        "60",
    ]

    def run(flags: list[str]) -> dict:
        parser = bench_serve.build_parser()
        ns = parser.parse_args(common + flags)
        return asyncio.run(bench_serve.benchmark(ns, bench_serve.checked(ns, parser)))

    run(["--num-prompts", str(min(args.concurrency, 8)), "--random-output-len", "8", "--seed", str(args.seed + 1000)])
    summary = run(
        ["--num-prompts", str(args.num_prompts), "--random-output-len", str(args.new_tokens), "--seed", str(args.seed)]
    )
    summary["duration_s"] = summary["duration"]
    if summary["failed"]:
        raise RuntimeError(f"{label}: {summary['failed']} requests failed: {summary.get('error_kinds')}")
    if summary["total_output_tokens"] != args.num_prompts * args.new_tokens:
        raise RuntimeError(
            f"{label}: {summary['total_output_tokens']} output tokens, expected {args.num_prompts * args.new_tokens}"
        )
    return summary


def server_entry(engine: str, dtype: str, slots: int, summary: dict, **extra) -> dict:
    keys = (
        "output_throughput",
        "p50_ttft_ms",
        "p50_tpot_ms",
        "p90_ttft_ms",
        "p90_tpot_ms",
        "p99_tpot_ms",
        "mean_ttft_ms",
        "mean_tpot_ms",
        "duration_s",
        "completed",
        "total_output_tokens",
    )
    return {
        "engine": engine,
        "dtype": dtype,
        "slots": slots,
        **{k: summary[k] for k in keys},
        "summary": summary,
        **extra,
    }


# ---- the run -------------------------------------------------------------------------------------
def run(args) -> dict:
    bd = import_script("bench_decode")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    settings = load_settings(Path(args.config))
    from jaxserve.config import ModelConfig

    cfg = ModelConfig.from_dir(settings["model"])
    vocab = cfg.vocab_size
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "config": {k: v for k, v in vars(args).items()},
        "machine": bd.machine_info(),
        "weights": {},
        "batch1": [],
        "batch16": [],
        "server": [],
        "notes": [],
    }
    m = report["machine"]
    m["load_average_start"] = os.getloadavg()
    try:
        import llama_cpp

        m["llama_cpp_python"] = llama_cpp.__version__
    except ImportError:
        llama_cpp = None
    log(
        f"{m['cpu']}, {m['cores']} cores; jax {m['jax']}, torch {m['torch']}, transformers {m['transformers']}, "
        f"llama-cpp-python {m.get('llama_cpp_python', 'missing')}; tcmalloc {m['tcmalloc_preloaded']}; "
        f"load {m['load_average_start'][0]:.1f}"
    )
    prompts = Prompts(args.seed, args.prompt_len, vocab)
    check_prompt = prompts.take(1)[0]
    logits: dict[str, np.ndarray] = {}
    jax_dtypes = split(args.jaxserve_dtypes)
    hf_dtypes = split(args.hf_dtypes)
    gguf_types = split(args.gguf_types)

    # -- weights + jaxserve batch 1 (the float32 LLM's params are the exported weights) --
    hf_dir = work / f"hf-{Path(settings['model']).name}-seed{args.seed}"
    llama_dir = find_llama_cpp(work, args.llama_cpp_dir)
    for dtype in ["float32"] + [d for d in jax_dtypes if d != "float32"]:
        log(f"jaxserve {dtype}: building LLM (batch 1)")
        llm = jaxserve_llm(args, settings, dtype, 1)
        if dtype == "float32":
            if not (hf_dir / "model.safetensors").is_file() or args.re_export:
                tok = make_tokenizer(work, vocab)
                log(f"exporting jaxserve's dummy params (seed {args.seed}) -> {hf_dir}")
                export_hf(llm.runner.params, settings["model"], tok, hf_dir)
                for t in GGUF_DTYPES:
                    (work / f"{hf_dir.name}-{t}.gguf").unlink(missing_ok=True)
            logits["jaxserve"] = bd.prompt_logits(llm, check_prompt, np.float32)
        if args.prepare_only or dtype not in jax_dtypes or args.skip_batch1:
            del llm
            gc.collect()
            continue
        log(f"jaxserve {dtype}: batch 1, {args.repeats} x (1 and {args.new_tokens} tokens)")
        entry = time_generate(jaxserve_gen(llm), prompts, 1, args.new_tokens, args.repeats)
        report["batch1"].append({"engine": "jaxserve", "dtype": dtype, "what": "LLM.generate", **entry})
        log(f"  decode {entry['decode_tokens_per_s']:.1f} tok/s, TTFT {entry['ttft_ms']:.0f} ms")
        del llm
        gc.collect()
    ggufs = {}
    if llama_dir is None:
        report["notes"].append("no llama.cpp sources (convert_hf_to_gguf.py) found: llama.cpp skipped")
    else:
        for t in sorted(set(gguf_types) | {args.server_gguf}):
            ggufs[t] = convert_gguf(llama_dir, hf_dir, work / f"{hf_dir.name}-{t}.gguf", t)
    report["weights"] = {
        "hf_dir": str(hf_dir),
        "gguf": {k: str(v) for k, v in ggufs.items()},
        "seed": args.seed,
        "llama_cpp_dir": str(llama_dir),
    }
    if args.prepare_only:
        return report

    # -- Hugging Face batch 1 and 16 --
    for dtype in hf_dtypes:
        log(f"HF {dtype}: loading {hf_dir}")
        model = hf_model(hf_dir, dtype)
        if dtype == "float32":
            logits["hf"] = hf_logits(model, check_prompt)
        gen = hf_gen(model)
        if not args.skip_batch1:
            entry = time_generate(gen, prompts, 1, args.new_tokens, args.repeats)
            report["batch1"].append({"engine": "hf", "dtype": dtype, "what": "generate", **entry})
            log(f"  batch 1: decode {entry['decode_tokens_per_s']:.1f} tok/s, TTFT {entry['ttft_ms']:.0f} ms")
        if not args.skip_batch16:
            entry = time_generate(gen, prompts, args.batch, args.new_tokens, args.repeats_batch)
            report["batch16"].append({"engine": "hf", "dtype": dtype, "what": "generate", **entry})
            log(f"  batch {args.batch}: output {entry['output_tokens_per_s']:.1f} tok/s")
        del model, gen
        gc.collect()

    # -- llama.cpp batch 1 --
    if llama_cpp is None:
        report["notes"].append("llama-cpp-python not installed: llama.cpp batch 1 skipped")
    else:
        for t in gguf_types:
            if t not in ggufs:
                continue
            log(f"llama.cpp {t}: loading {ggufs[t]}")
            kv = t if args.llama_kv == "same" else args.llama_kv
            llm = llama_cpp_model(ggufs[t], args, kv)
            if t == "f32":
                logits["llama.cpp"] = llama_cpp_logits(llm, check_prompt)
            if not args.skip_batch1:
                entry = time_generate(llama_cpp_gen(llm), prompts, 1, args.new_tokens, args.repeats)
                report["batch1"].append(
                    {
                        "engine": "llama.cpp",
                        "dtype": GGUF_DTYPES[t],
                        "gguf": t,
                        "kv_cache": kv,
                        "what": "llama-cpp-python Llama.generate",
                        "threads": args.threads,
                        **entry,
                    }
                )
                log(f"  decode {entry['decode_tokens_per_s']:.1f} tok/s, TTFT {entry['ttft_ms']:.0f} ms")
            llm.close() if hasattr(llm, "close") else None
            del llm
            gc.collect()

    # same weights? last-position logits of one prompt in float32
    if "jaxserve" in logits:
        report["weights"]["logits_check_vs_jaxserve_f32"] = {
            k: logits_check(logits["jaxserve"], v) for k, v in logits.items() if k != "jaxserve"
        }
        log(f"logits check (float32, vs jaxserve): {report['weights']['logits_check_vs_jaxserve_f32']}")

    # -- jaxserve batch 16 (the serving configuration, offline) --
    if not args.skip_batch16 and "float32" in jax_dtypes:
        log(f"jaxserve float32: batch {args.batch} (serving settings of {args.config})")
        llm = jaxserve_llm(args, settings, "float32", args.batch)
        entry = time_generate(jaxserve_gen(llm), prompts, args.batch, args.new_tokens, args.repeats_batch)
        report["batch16"].append({"engine": "jaxserve", "dtype": "float32", "what": "LLM.generate", **entry})
        log(f"  output {entry['output_tokens_per_s']:.1f} tok/s")
        del llm
        gc.collect()

    # -- servers under the same load --
    if not args.skip_server:
        slots = int(settings.get("max_num_seqs", 16))
        env = dict(os.environ)
        srv = Server(
            "jaxserve",
            [
                sys.executable,
                "-m",
                "jaxserve.serve",
                "--config",
                str(args.config),
                "--port",
                str(args.port),
                "--no-access-log",
            ],
            args.port,
            work / "jaxserve-server.log",
            env,
        )
        try:
            up = srv.wait_healthy(args.server_timeout)
            log(
                f"jaxserve server healthy after {up:.0f} s; load: {args.num_prompts} requests, "
                f"concurrency {args.concurrency}"
            )
            summary = serving_load(args, srv.url, "jaxserve", vocab)
            report["server"].append(server_entry("jaxserve", "float32", slots, summary, startup_s=up))
        except Exception as err:  # keep the rest of the report
            report["server"].append({"engine": "jaxserve", "error": repr(err)})
            log(f"jaxserve server failed: {err!r}")
        finally:
            srv.stop()
        llama_server = args.llama_server
        if not llama_server or not Path(llama_server).is_file():
            report["notes"].append(f"llama-server binary not found ({llama_server}): llama-server skipped")
        elif args.server_gguf not in ggufs:
            report["notes"].append(f"no {args.server_gguf} GGUF: llama-server skipped")
        else:
            env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
            kv = args.server_gguf if args.llama_kv == "same" else args.llama_kv
            for np_slots in [slots] + [s for s in map(int, split(args.llama_server_extra_slots)) if s != slots]:
                ctx = np_slots * args.ctx_per_slot
                cmd = [
                    llama_server,
                    "-m",
                    str(ggufs[args.server_gguf]),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(args.port + 1),
                    "-np",
                    str(np_slots),
                    "-c",
                    str(ctx),
                    "-t",
                    str(args.threads),
                    "-tb",
                    str(args.threads),
                    "-ctk",
                    kv,
                    "-ctv",
                    kv,
                    "--no-webui",
                ]
                srv = Server(
                    f"llama-server -np {np_slots}", cmd, args.port + 1, work / f"llama-server-np{np_slots}.log", env
                )
                try:
                    up = srv.wait_healthy(args.server_timeout)
                    summary = serving_load(args, srv.url, f"llama-server-np{np_slots}", vocab)
                    report["server"].append(
                        server_entry(
                            "llama-server",
                            GGUF_DTYPES[args.server_gguf],
                            np_slots,
                            summary,
                            ctx=ctx,
                            kv_cache=kv,
                            startup_s=up,
                            threads=args.threads,
                        )
                    )
                except Exception as err:
                    report["server"].append({"engine": "llama-server", "slots": np_slots, "error": repr(err)})
                    log(f"llama-server -np {np_slots} failed: {err!r}")
                finally:
                    srv.stop()
    m["load_average_end"] = os.getloadavg()
    return finish_report(report)


def split(text: str) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="jaxserve YAML (model, serving settings)")
    p.add_argument("--work-dir", default=str(DEFAULT_WORK), help="exports, GGUF files, logs (outside the repo)")
    p.add_argument(
        "--llama-cpp-dir",
        default=None,
        help="llama.cpp sources with convert_hf_to_gguf.py; default: the sdist unpacked in --work-dir",
    )
    p.add_argument("--llama-server", default=str(DEFAULT_WORK / "build-server" / "bin" / "llama-server"))
    p.add_argument("--seed", type=int, default=0, help="dummy weights' seed; prompts are drawn from it too")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each length at batch 1 (median)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats-batch", type=int, default=1, help="timed runs of each length at --batch")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads (its default is half)")
    p.add_argument("--jaxserve-dtypes", default="float32,bfloat16")
    p.add_argument("--hf-dtypes", default="bfloat16,float32")
    p.add_argument("--gguf-types", default="f32,bf16", help="GGUF types for llama-cpp-python batch 1")
    p.add_argument("--server-gguf", default="f32", help="GGUF type for llama-server (jaxserve serves float32)")
    p.add_argument("--llama-kv", default="same", help="llama.cpp KV-cache type: 'same' as the weights, or f16 ...")
    p.add_argument("--llama-server-extra-slots", default="", help="more -np settings to try, e.g. 32")
    p.add_argument("--ctx-per-slot", type=int, default=512, help="llama-server -c = slots x this")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--port", type=int, default=8311, help="jaxserve server port; llama-server uses port + 1")
    p.add_argument("--server-timeout", type=float, default=1800)
    p.add_argument("--skip-batch1", action="store_true")
    p.add_argument("--skip-batch16", action="store_true")
    p.add_argument("--skip-server", action="store_true")
    p.add_argument("--prepare-only", action="store_true", help="export + convert the weights, then stop")
    p.add_argument("--re-export", action="store_true", help="export and convert again even if cached")
    p.add_argument("--out", default=None, help="write the JSON report here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.new_tokens < 2:
        raise SystemExit("--new-tokens must be at least 2")
    report = run(args)
    if args.prepare_only:
        print(json.dumps(report["weights"], indent=1))
        return 0
    for note in report["notes"]:
        log(f"note: {note}")
    print()
    print(format_table(report["comparisons"], report["targets"]))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1, default=str)
        log(f"wrote {args.out}")
    problems = validate_report(report)
    for p in problems:
        log(f"report problem: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
