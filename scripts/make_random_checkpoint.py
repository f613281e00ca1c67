"""Write a Hugging Face model directory with seeded random weights: config.json, model.safetensors and
a tokenizer, which the server loads as it would a real checkpoint (`--load-format auto`).

`--load-format dummy` makes random weights on the device without a file, so a start under it reads
nothing from disk; measuring what a start costs against reading the weights (issue 52: a 1B-parameter
Llama-shaped model's warm start <= 3x the time to read its weights) needs the weights in a file. The
tensors are made and written one at a time (normal(0.02) matrices, unit norms, as `init_dummy_params`),
so writing a model takes about one tensor's memory beside it.

    python scripts/make_random_checkpoint.py --config configs/models/llama-3.2-1b --out out/llama-3.2-1b-random
    python -m jaxserve.serve --config configs/llama-3.2-1b-random.yaml

The tokenizer (default: the dummy default's 8192-id byte-level BPE, configs/models/smollm2-135m/tokenizer)
covers the low ids only: random weights' ids past it decode to nothing, as for any model whose
embedding table is larger than its tokenizer's vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.loading.checkpoint import hf_tensor_shapes, write_safetensors_streamed  # noqa: E402

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
DEFAULT_TOKENIZER = "configs/models/smollm2-135m/tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def make_checkpoint(
    config_dir: str, out: str, seed: int = 0, dtype: str = "bfloat16", tokenizer: str | None = DEFAULT_TOKENIZER
) -> dict:
    """Write `out` (created; an existing model.safetensors is replaced) and return what was written."""
    cfg = ModelConfig.from_dir(config_dir)
    np_dtype = np.dtype(DTYPES[dtype])
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(config_dir, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    hf["torch_dtype"] = dtype
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf, f, indent=2)
        f.write("\n")
    copied = []
    if tokenizer:
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(tokenizer, name)):
                shutil.copyfile(os.path.join(tokenizer, name), os.path.join(out, name))
                copied.append(name)
    shapes = hf_tensor_shapes(cfg)
    rng = np.random.default_rng(seed)

    def make(name: str) -> np.ndarray:
        shape, init = shapes[name]
        if init == "ones":
            return np.ones(shape, np_dtype)
        if init == "zeros":
            return np.zeros(shape, np_dtype)
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)).astype(np_dtype)

    path = os.path.join(out, "model.safetensors")
    tmp = path + ".partial"
    start = time.perf_counter()
    write_safetensors_streamed(tmp, {n: (s, np_dtype) for n, (s, _) in shapes.items()}, make)
    os.replace(tmp, path)  # a half-written file is never taken for the model
    return dict(
        out=out,
        tensors=len(shapes),
        parameters=int(sum(np.prod(s, dtype=np.int64) for s, _ in shapes.values())),
        bytes=os.path.getsize(path),
        dtype=dtype,
        tokenizer=copied,
        seconds=round(time.perf_counter() - start, 1),
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/models/llama-3.2-1b", help="a directory holding config.json")
    parser.add_argument("--out", default="out/llama-3.2-1b-random")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="a directory whose tokenizer files are copied")
    parser.add_argument("--no-tokenizer", action="store_true")
    args = parser.parse_args(argv)
    result = make_checkpoint(
        args.config, args.out, args.seed, args.dtype, None if args.no_tokenizer else args.tokenizer
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
