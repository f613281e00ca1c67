"""Train a small deterministic BPE tokenizer (sentencepiece or byte-level) on the Python stdlib sources."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

try:
    from tokenizer_training import train_tokenizer
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tokenizer_training import train_tokenizer


def make_tokenizer(
    out_dir,
    vocab_size: int,
    kind: str = "sentencepiece",
    max_bytes: int | None = None,
    seed: int = 0,
    split: str = "all",
) -> Path:
    """See `tokenizer_training.train_tokenizer`; returns the output directory."""
    return train_tokenizer(out_dir, vocab_size, kind, max_bytes=max_bytes, seed=seed, split=split)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, help="output directory (created if missing)")
    ap.add_argument("--vocab-size", type=int, required=True, help="exact vocabulary size of the result")
    ap.add_argument(
        "--kind",
        choices=("sentencepiece", "bytelevel"),
        default="sentencepiece",
        help="sentencepiece -> tokenizer.model; bytelevel -> tokenizer.json (default: %(default)s)",
    )
    ap.add_argument(
        "--max-bytes",
        type=int,
        default=None,
        help="cap the training corpus at this many bytes (faster; default: whole stdlib)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--split",
        choices=("all", "train"),
        default="all",
        help="corpus files: all, or train (leaves the held-out 5%% unseen; default: %(default)s)",
    )
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    out = make_tokenizer(
        args.out, args.vocab_size, args.kind, max_bytes=args.max_bytes, seed=args.seed, split=args.split
    )
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"wrote {args.kind} tokenizer (vocab {args.vocab_size}) to {out}: {files} in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
