"""Convert a Hugging Face checkpoint (safetensors) of a supported architecture to a jaxserve orbax checkpoint.

    python scripts/convert_hf_to_orbax.py /path/to/hf-model /path/to/out [--dtype bfloat16]

The output holds config.json, the tokenizer files, `params/` (orbax) and the layout manifest; it loads
with `LLM(model=out)` or `python -m jaxserve.serve --model out`, restoring straight onto the mesh.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COPIED = (
    "config.json",
    "tokenizer.model",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def convert(src: str, out: str, dtype: str | None = None) -> Path:
    import jax.numpy as jnp

    from jaxserve.loading.checkpoint import checkpoint_dtype, load_hf_params
    from jaxserve.config import ModelConfig
    from jaxserve.loading.orbax_checkpoint import save_params

    cfg = ModelConfig.from_dir(src)
    dtype = dtype or checkpoint_dtype(src) or "float32"
    params = load_hf_params(src, cfg, jnp.dtype(dtype))
    dst = Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        if (Path(src) / name).is_file():
            shutil.copy(Path(src) / name, dst / name)
    save_params(str(dst), params, stored_dtypes=[dtype], converted_from=str(Path(src).resolve()))
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="Hugging Face model directory (config.json + safetensors)")
    ap.add_argument("out", help="output directory")
    ap.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="stored dtype (default: the checkpoint's, else float32)",
    )
    args = ap.parse_args(argv)
    print(f"wrote {convert(args.src, args.out, args.dtype)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
