"""Export a jaxserve orbax checkpoint to a Hugging Face directory (config.json + model.safetensors + tokenizer).

    python scripts/export_orbax_to_hf.py checkpoints/small /tmp/default-hf [--dtype float32]

`transformers.AutoModelForCausalLM.from_pretrained(out)` loads the result.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOKENIZER_FILES = (
    "tokenizer.model",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def export(src: str, out: str, dtype: str = "float32") -> Path:
    import jax.numpy as jnp

    from jaxserve.loading.checkpoint import hf_tensors, write_safetensors
    from jaxserve.config import ModelConfig
    from jaxserve.loading.orbax_checkpoint import abstract_params, restore_params

    cfg = ModelConfig.from_dir(src)
    params = restore_params(src, abstract_params(cfg, jnp.dtype(dtype), None))
    dst = Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    write_safetensors(str(dst / "model.safetensors"), hf_tensors(params, cfg))
    hf = json.loads((Path(src) / "config.json").read_text())
    hf["torch_dtype"] = dtype
    (dst / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy(Path(src) / name, dst / name)
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="jaxserve orbax checkpoint directory")
    ap.add_argument("out", help="output Hugging Face directory")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = ap.parse_args(argv)
    print(f"wrote {export(args.src, args.out, args.dtype)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
