"""Tokenizer-only GGUF files for the tokenizer tests, shared with scripts/record_llamacpp_tokens.py
(which runs in a separate venv holding llama-cpp-python, so this module needs only `gguf` and
`sentencepiece`, never jaxserve or jax).

Vocabularies ("variants") compared against llama.cpp:
* "smollm2": the real SmolLM2 GGUF (byte-level BPE, pre "smollm"), and copies of its tokenizer
  metadata with another `tokenizer.ggml.pre`, to check each pre-tokenizer's regexes on one vocabulary;
* "spm": the tests' sentencepiece model (checkpoints/small/tokenizer.model, 8192 pieces, byte fallback)
  written as a "llama" vocabulary, with and without `add_space_prefix`.
"""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path
from typing import Any, Iterable, Mapping

REPO = Path(__file__).resolve().parents[2]
SPM_MODEL = REPO / "checkpoints" / "small" / "tokenizer.model"
GOLDEN = Path(__file__).resolve().parent / "data" / "llamacpp_tokens.json"

CORPUS: list[str] = [
    "",
    " ",
    "   ",
    "\n",
    "Hello world",
    " Hello world",
    "Hello  world   ",
    "   leading and trailing   ",
    "def f(x):\n    if x:\n        return x  # done\n\treturn None\n\n\n",
    "class A:\n\tdef __init__(self):\n\t\tself.x = {'a': [1, 2]}\n",
    "line one\r\nline two\r\n\r\nend",
    "tabs\t\t\tand\vvertical\fform feed",
    "trailing spaces   \n  next",
    "café naïve résumé Ångström",
    unicodedata.normalize("NFD", "café naïve résumé Ångström"),
    "日本語のテキスト、中文字符。한국어 텍스트",
    "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 ok, emoji🙂glued",
    "12345678901234567890 3.14159 1,000,000 ١٢٣ ٣٤٥",
    "I'm don't WE'LL they'RE It'S y'all you've",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b <|im_end|>c",
    "<s>Hello</s> <unk> <pad>x",
    "x\u00a0y\u3000z\u2009w\u200bv\u0085u",
    "Ünïcödé ÀB Àb ǅemal ΣΊΣΥΦΟΣ σίσυφος",
    "$$$ +++ <=> ^~| ``` ((([[[{{{",
    "mixedCASE camelCaseWords HTTPServer iPhone XMLHttpRequest",
    "¡Hola! ¿Qué tal? «quoted» — dash… ellipsis",
    "Ω≈ç√∫˜µ≤≥÷ ∑∏ ∞ ℝ ℕ",
    "עברית العربية हिन्दी ไทย",
    'printf("%d\\n", a[i]); // x<<=2; y->z;',
    "    four spaces\n        eight spaces\n",
    "\n\n\n\n",
    "a\n b\n  c\n   d",
    "https://example.com/path?q=1&r=two#frag",
    "\x1b[0m escape \x07 bell",
]

# name -> (base vocabulary, metadata keys to set, metadata keys to remove)
VARIANTS: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "smollm2": ("smollm2", {}, ()),
    "smollm2@default": ("smollm2", {"tokenizer.ggml.pre": "default"}, ()),
    "smollm2@gpt-2": ("smollm2", {"tokenizer.ggml.pre": "gpt-2"}, ()),
    # without add_bos_token, so llama.cpp's llama3 default (add BOS) applies
    "smollm2@llama-bpe": ("smollm2", {"tokenizer.ggml.pre": "llama-bpe"}, ("tokenizer.ggml.add_bos_token",)),
    "smollm2@qwen2": ("smollm2", {"tokenizer.ggml.pre": "qwen2"}, ()),
    "smollm2@gpt-4o": ("smollm2", {"tokenizer.ggml.pre": "gpt-4o"}, ()),
    "smollm2@tekken": ("smollm2", {"tokenizer.ggml.pre": "tekken"}, ()),
    "smollm2@deepseek-llm": ("smollm2", {"tokenizer.ggml.pre": "deepseek-llm"}, ()),
    "smollm2@deepseek-coder": ("smollm2", {"tokenizer.ggml.pre": "deepseek-coder"}, ()),
    "smollm2@falcon": ("smollm2", {"tokenizer.ggml.pre": "falcon"}, ()),
    "smollm2@bloom": ("smollm2", {"tokenizer.ggml.pre": "bloom"}, ()),
    "spm": ("spm", {}, ()),
    "spm@no-space-prefix": ("spm", {"tokenizer.ggml.add_space_prefix": False}, ()),
}


def variant_metadata(base: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The metadata of variant `name`, given its base vocabulary's metadata."""
    _, overrides, drop = VARIANTS[name]
    md = {k: v for k, v in base.items() if k not in drop}
    md.update(overrides)
    return md


def _gguf():
    import gguf

    return gguf


def _write(path: str | os.PathLike, arch: str, fields: Iterable[tuple[str, Any, Any, Any]]) -> Path:
    """Write a GGUF file holding only key-value metadata: fields are (key, value, type, array item type)."""
    gguf = _gguf()
    w = gguf.GGUFWriter(str(path), arch)
    for key, value, vtype, sub in fields:
        if key != "general.architecture":
            w.add_key_value(key, value, vtype, sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _infer_type(value: Any):
    T = _gguf().GGUFValueType
    if isinstance(value, bool):
        return T.BOOL
    if isinstance(value, int):
        return T.UINT32
    if isinstance(value, float):
        return T.FLOAT32
    return T.STRING


def copy_vocab_only(src: str | os.PathLike, dst: str | os.PathLike, name: str) -> Path:
    """A metadata-only copy of GGUF file `src` (types preserved) with variant `name`'s changes."""
    gguf = _gguf()
    _, overrides, drop = VARIANTS[name]
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    fields = []
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in drop:
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        value = overrides[key] if key in overrides else f.contents()
        fields.append((key, value, f.types[0], sub))
    fields += [(k, v, _infer_type(v), None) for k, v in overrides.items() if k not in reader.fields]
    return _write(dst, arch, fields)


def sentencepiece_fields(model_path: str | os.PathLike = SPM_MODEL) -> list[tuple[str, Any, Any, Any]]:
    """GGUF tokenizer metadata for a sentencepiece model, as llama.cpp's converter writes it (type
    1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte), plus the llama
    hyperparameters a loader may look for."""
    import sentencepiece as spm

    T = _gguf().GGUFValueType
    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    n = sp.vocab_size()
    pieces = [sp.id_to_piece(i) for i in range(n)]
    scores = [float(sp.get_score(i)) for i in range(n)]

    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        if sp.is_unused(i):
            return 5
        return 1

    def opt(i: int) -> list:
        return [i] if i >= 0 else []

    return [
        ("general.name", "jaxserve-test-spm", T.STRING, None),
        ("llama.context_length", 2048, T.UINT32, None),
        ("llama.embedding_length", 64, T.UINT32, None),
        ("llama.block_count", 1, T.UINT32, None),
        ("llama.feed_forward_length", 128, T.UINT32, None),
        ("llama.attention.head_count", 4, T.UINT32, None),
        ("llama.attention.head_count_kv", 4, T.UINT32, None),
        ("llama.attention.layer_norm_rms_epsilon", 1e-5, T.FLOAT32, None),
        ("llama.vocab_size", n, T.UINT32, None),
        ("tokenizer.ggml.model", "llama", T.STRING, None),
        ("tokenizer.ggml.tokens", pieces, T.ARRAY, T.STRING),
        ("tokenizer.ggml.scores", scores, T.ARRAY, T.FLOAT32),
        ("tokenizer.ggml.token_type", [kind(i) for i in range(n)], T.ARRAY, T.INT32),
        *[("tokenizer.ggml.bos_token_id", i, T.UINT32, None) for i in opt(sp.bos_id())],
        *[("tokenizer.ggml.eos_token_id", i, T.UINT32, None) for i in opt(sp.eos_id())],
        *[("tokenizer.ggml.unknown_token_id", i, T.UINT32, None) for i in opt(sp.unk_id())],
        *[("tokenizer.ggml.padding_token_id", i, T.UINT32, None) for i in opt(sp.pad_id())],
        ("tokenizer.chat_template", "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}", T.STRING, None),
    ]


def write_sentencepiece_gguf(
    dst: str | os.PathLike, model_path: str | os.PathLike = SPM_MODEL, name: str = "spm"
) -> Path:
    """A vocabulary-only "llama" GGUF of a sentencepiece model, with variant `name`'s changes."""
    _, overrides, drop = VARIANTS[name]
    fields = [f for f in sentencepiece_fields(model_path) if f[0] not in drop and f[0] not in overrides]
    fields += [(k, v, _infer_type(v), None) for k, v in overrides.items()]
    return _write(dst, "llama", fields)


def variant_file(name: str, tmpdir: str | os.PathLike, smollm2: str | os.PathLike) -> Path:
    """A GGUF file of variant `name` under `tmpdir` (the real SmolLM2 file for "smollm2")."""
    base = VARIANTS[name][0]
    dst = Path(tmpdir) / (name.replace("@", "_") + ".gguf")
    if base == "spm":
        return write_sentencepiece_gguf(dst, name=name)
    if name == "smollm2":
        return Path(smollm2)
    return copy_vocab_only(smollm2, dst, name)
