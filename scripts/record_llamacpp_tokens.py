"""Record llama.cpp's own token ids for the GGUF tokenizer tests (tests/loading/data/llamacpp_tokens.json).

llama.cpp is the referee for jaxserve.loading.gguf_tokenizer, but building llama-cpp-python takes
minutes, so CI compares against ids recorded here. Run it in a venv that has llama-cpp-python, gguf
and sentencepiece (jaxserve itself is not needed):

    python3 -m venv /tmp/llamacpp && /tmp/llamacpp/bin/pip install llama-cpp-python gguf sentencepiece
    /tmp/llamacpp/bin/python scripts/record_llamacpp_tokens.py \
        --smollm2 "$(.venv/bin/python -c 'from jaxserve import resources; print(resources.default_model_file())')"

For every vocabulary variant and corpus text of tests/loading/gguf_testlib.py it stores
`tokenize(text, add_special=True, parse_special=True)` ("special") and
`tokenize(text, add_special=False, parse_special=False)` ("plain").
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "loading"))

import gguf_testlib  # noqa: E402


def tokenize_all(path: Path, texts: list[str]) -> dict[str, list[list[int]]]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        return {
            "special": [llm.tokenize(t.encode("utf-8"), add_bos=True, special=True) for t in texts],
            "plain": [llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in texts],
        }
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2", required=True, help="path of SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", default=str(gguf_testlib.GOLDEN))
    args = ap.parse_args(argv)

    import llama_cpp

    texts = gguf_testlib.CORPUS
    out = {
        "llama_cpp_python": llama_cpp.__version__,
        "smollm2_file": Path(args.smollm2).name,
        "corpus": texts,
        "variants": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in gguf_testlib.VARIANTS:
            path = gguf_testlib.variant_file(name, tmp, args.smollm2)
            out["variants"][name] = tokenize_all(path, texts)
            print(f"{name}: {sum(map(len, out['variants'][name]['special']))} ids", file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        # one line per id list keeps the file small and its diffs readable
        f.write("{\n")
        head = {k: v for k, v in out.items() if k != "variants"}
        for k, v in head.items():
            f.write(f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)},\n")
        f.write('  "variants": {\n')
        for i, (name, runs) in enumerate(out["variants"].items()):
            f.write(f"    {json.dumps(name)}: {{\n")
            for j, (mode, lists) in enumerate(runs.items()):
                rows = ",\n".join("        " + json.dumps(ids) for ids in lists)
                f.write(f"      {json.dumps(mode)}: [\n{rows}\n      ]{',' if j < len(runs) - 1 else ''}\n")
            f.write(f"    }}{',' if i < len(out['variants']) - 1 else ''}\n")
        f.write("  }\n}\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
