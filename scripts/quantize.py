#!/usr/bin/env python
"""Quantize a checkpoint once to int8 weights and save it as a jaxserve orbax checkpoint.

    python scripts/quantize.py SRC OUT [--dtype bfloat16] [--quantize-lm-head] [--quantization-group-size N]

SRC is a Hugging Face directory (safetensors) or a jaxserve orbax checkpoint. OUT gets config.json,
the tokenizer files, `params/` with int8 linear weights (QuantArray: values i8, scales f32 per group of input rows; the
embeddings and norms in --dtype) and a manifest recording quantization="int8" and the group size, so that
`LLM(model=OUT, quantization="int8")` (with the same quantization_group_size) restores the int8 values as saved, straight onto the mesh,
without quantizing again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_hf_to_orbax import COPIED  # noqa: E402  (the files a checkpoint directory carries along)


def quantize_checkpoint(
    src: str, out: str, dtype: str | None = None, quantize_lm_head: bool = False, group_size: int | None = None
) -> Path:
    import shutil

    from jaxserve.loading.checkpoint import checkpoint_dtype
    from jaxserve.config import EngineConfig
    from jaxserve.loading.model_loader import load_model
    from jaxserve.loading.orbax_checkpoint import save_params
    from jaxserve.model.sharding import make_mesh

    dtype = dtype or checkpoint_dtype(src) or "float32"
    from jaxserve.model import quant

    settings = EngineConfig(
        model=src,
        dtype=dtype,
        quantization="int8",
        quantize_lm_head=quantize_lm_head,
        quantization_group_size=group_size,
    )
    loaded = load_model(settings, make_mesh((1, 1)), stacked=True)  # quantized on load, weight by weight
    dst = Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        if (Path(src) / name).is_file():
            shutil.copy(Path(src) / name, dst / name)
    save_params(
        str(dst),
        loaded.params,
        quantization="int8",
        quantize_lm_head=quantize_lm_head,
        quantization_group_size=quant.quantization_group_size("int8", group_size),
        activation_dtype=dtype,
        quantized_from=str(Path(src).resolve()),
    )
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="Hugging Face model directory or jaxserve orbax checkpoint")
    ap.add_argument("out", help="output directory")
    ap.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="dtype of the params left unquantized (embeddings, norms); default: the checkpoint's, else float32",
    )
    ap.add_argument("--quantize-lm-head", action="store_true", help="quantize an untied lm_head too")
    ap.add_argument(
        "--quantization-group-size",
        type=int,
        default=None,
        help="input rows per scale (default: the engine's int8 default; 0: per output channel)",
    )
    args = ap.parse_args(argv)
    out = quantize_checkpoint(args.src, args.out, args.dtype, args.quantize_lm_head, args.quantization_group_size)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
