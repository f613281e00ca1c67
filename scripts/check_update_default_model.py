"""After `update_weights(new)`, does the default model answer as a fresh engine started on `new`?
(issue 53; the tests check it on the tiny model, this on the real one: a few minutes of compiling.)

    python scripts/check_update_default_model.py [--quantization int8] [--noise 0.01]

`new` is the default model's weights with noise added (relative to each tensor's spread), written
as a Hugging Face directory (safetensors, the default model's config and tokenizer) for the fresh
engine; the running engine gets the same arrays as a mapping of HF names. Greedy outputs of a few
prompts are compared token by token; exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.loading.checkpoint import hf_tensors, write_safetensors

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Two plus two equals", "Once upon a time"]
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4"])
    ap.add_argument("--noise", type=float, default=0.01, help="noise added, relative to each tensor's std")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    settings = {
        "dtype": "float32",
        "max_model_len": 64,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 32,
        "page_size": 8,
        "quantization": args.quantization,
    }
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    def generate(llm):
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]

    float_llm = LLM(**{**settings, "quantization": "none"}, warm_up=False)  # the float weights to perturb
    rng = np.random.default_rng(0)
    new = {
        name: (x + rng.normal(0, args.noise * float(x.std()) + 1e-12, x.shape)).astype(x.dtype)
        for name, x in hf_tensors(float_llm.runner.params, float_llm.model_config).items()
    }
    source = float_llm.config.model
    float_llm.close()
    with tempfile.TemporaryDirectory() as tmp:
        for name in COPIED:
            if os.path.exists(os.path.join(source, name)):
                shutil.copy(os.path.join(source, name), tmp)
        write_safetensors(os.path.join(tmp, "model.safetensors"), new)
        with LLM(**settings) as running, LLM(tmp, **settings) as fresh:  # both open: the second compiles nothing
            before = generate(running)
            want = generate(fresh)
            report = running.update_weights(new)
            got = generate(running)
    same = got == want
    print(
        f"quantization={args.quantization}: {report.tensors} tensors ({report.quantized} quantized) in "
        f"{report.seconds * 1e3:.0f} ms; outputs changed by the update: {before != got}; equal to the "
        f"fresh engine's: {same} ({sum(a == b for a, b in zip(got, want))}/{len(PROMPTS)} prompts)"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
