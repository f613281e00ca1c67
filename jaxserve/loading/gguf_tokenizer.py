"""A GGUF file's tokenizer, rebuilt from its metadata as a Hugging Face `tokenizers` tokenizer that
encodes text exactly as llama.cpp does (llama.cpp is what GGUF files are made for, so its tokenizer
is the reference, not the original checkpoint's tokenizer.json).

Two vocabulary types are supported, as llama.cpp reads them (`src/llama-vocab.cpp`):

* `tokenizer.ggml.model == "gpt2"`: byte-level BPE from the token list and the merges. Text is split
  into words by the regexes llama.cpp associates with `tokenizer.ggml.pre`, applied one after the
  other, each to the pieces the previous one left (the matches and the text between them), and each
  word is then merged by merge rank. This is a `Sequence` of isolating `Split`s and a byte-level step.
* `tokenizer.ggml.model == "llama"`: llama.cpp's "SPM" tokenizer, which repeatedly joins the adjacent
  pair of symbols whose concatenation is the highest-scoring vocabulary entry (scores from
  `tokenizer.ggml.scores`, ties to the leftmost pair), with spaces written as U+2581 and characters
  missing from the vocabulary written as `<0xXX>` byte tokens. That is BPE whose merges are every
  split of every vocabulary entry, ranked by the entry's score, with byte fallback. Every piece of
  text (the whole input, and each stretch that follows a special token) gets a leading space when
  `tokenizer.ggml.add_space_prefix` is true (the default); a `Prepend` normalizer does the same,
  since `tokenizers` normalizes each stretch between added tokens separately.

Tokens typed control (3), user-defined (4) or unknown (2) match as whole strings before any of this,
longest first, as llama.cpp's special-token pass does; control and unknown ones are "special" (not
matched when special-token parsing is off, dropped by `skip_special_tokens`), user-defined ones not.

Known differences from llama.cpp, all outside ordinary text:
* Unicode classes follow Oniguruma's Unicode version, llama.cpp's follow its own tables: U+1B4E,
  U+1B4F and U+1B7F (Unicode 16) are punctuation here and unassigned there, which matters only to the
  pre-tokenizers with a punctuation class of their own ("default", "falcon", "deepseek-coder").
* SPM: llama.cpp can also join a character that is not itself in the vocabulary, and breaks score
  ties between different entries by position, where BPE ranks by token id; sentencepiece-made
  vocabularies have neither (every character of an entry is an entry; BPE scores are distinct).
* llama.cpp's per-model token attributes chosen by `general.name` (phi-3's rstrip, jina's <mask>
  lstrip) and its gpt-oss special cases are not reproduced.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

__all__ = ["SUPPORTED_PRE_TOKENIZERS", "gguf_tokenizer", "tokenizer_files", "eog_token_ids"]

# llama_token_type values of tokenizer.ggml.token_type.
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

_P_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_P_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_P_QWEN2 = _P_LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
# llama.cpp writes GPT-4o's and Tekken's \p{Lu}/\p{Ll} classes as "a letter but not a-z" / "a letter but
# not A-Z" (its regex engine has no case classes), so outside ASCII either class takes any letter.
# The same lookaheads are used here, to split where llama.cpp splits.
_UPPERISH, _LOWERISH = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_P_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}*{_LOWERISH}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}+{_LOWERISH}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_P_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}*{_LOWERISH}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}+{_LOWERISH}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_P_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_DEEPSEEK_LETTERS = (  # written with escapes: several of these characters change under NFC
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
    "\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    "\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b"
    "\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787"
    "\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
# Before matching a regex without \p{..} classes, llama.cpp turns non-ASCII whitespace into "\v", so a
# literal class never matches it there (U+2009 lies in DeepSeek's U+0800-U+4E00 "CJK" range): such
# classes are guarded with this lookahead (llama.cpp's non-ASCII whitespace, unicode-data.cpp).
_NO_WIDE_SPACE = "(?![\u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000])"
_CJK = f"(?:{_NO_WIDE_SPACE}[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff])+"

_DEEPSEEK_LLM = (
    "[\r\n]",
    rf"\s?[{_DEEPSEEK_LETTERS}]+",
    rf"\s?(?:{_NO_WIDE_SPACE}[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002])+",
    r"\s+\z",  # `$` in llama.cpp's ECMAScript regex: the end of the piece, which is \z in Oniguruma
    _CJK,
    r"\p{N}+",
)

# Each family: (regexes in order, ignore_merges, add BOS by default) and the `tokenizer.ggml.pre`
# names llama.cpp gives it. ignore_merges: a word that is itself in the vocabulary is one token.
_FAMILIES: list[tuple[tuple[str, ...], bool, bool, tuple[str, ...]]] = [
    ((r"[\p{P}\$\+<=>\^~\|]+", _P_GPT2, r"\p{N}+", "[0-9][0-9][0-9]"), False, False, ("default",)),
    (
        (_P_GPT2,),
        False,
        False,
        (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
        ),
    ),
    (
        (r"\p{N}", _P_GPT2),
        False,
        False,
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
    ),
    (
        (_P_LLAMA3,),
        True,
        True,
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
    ),
    ((_P_LLAMA3,), False, False, ("dbrx", "smaug-bpe")),
    (
        (_P_QWEN2,),
        False,
        False,
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"),
    ),
    ((_P_GPT4O,), False, False, ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2")),
    ((_P_TEKKEN,), True, True, ("tekken",)),
    ((r"[\p{P}\$\+<=>\^~\|`]+", _P_GPT2, "[0-9][0-9][0-9]"), False, False, ("falcon",)),
    (_DEEPSEEK_LLM, False, False, ("deepseek-llm",)),
    (("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"), False, False, ("deepseek-coder",)),
    ((_P_BLOOM,), False, False, ("bloom", "gpt3-finnish", "poro-chat")),
    ((_P_BLOOM, r"\p{N}"), False, False, ("viking",)),
]
_PRE: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    name: (regexes, ignore, bos) for regexes, ignore, bos, names in _FAMILIES for name in names
}
SUPPORTED_PRE_TOKENIZERS: tuple[str, ...] = tuple(sorted(_PRE))

# Token texts llama.cpp treats as end-of-generation whatever the file says, and as control tokens
# (so they are parsed as special tokens) even when the file types them normal.
_EOG_TEXTS = frozenset(
    (
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    )
)


def _vocab(md: Mapping[str, Any]) -> tuple[list[str], list[int]]:
    """Token texts and types as llama.cpp sees them after loading."""
    tokens = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens: the file carries no tokenizer")
    # llama.cpp renames empty tokens, which no text could produce anyway.
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    types = list(md.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    types += [1] * (len(tokens) - len(types))
    for i, t in enumerate(tokens):
        if t in _EOG_TEXTS and types[i] not in (_CONTROL, _USER_DEFINED, _UNKNOWN):
            types[i] = _CONTROL
    return tokens, types


def _special_id(md: Mapping[str, Any], key: str, default: int | None, n: int) -> int | None:
    v = md.get(f"tokenizer.ggml.{key}")
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n:
        return v
    return default if default is not None and 0 <= default < n else None


def _bos_eos(md: Mapping[str, Any], n: int) -> tuple[int | None, int | None, bool, bool]:
    """(bos id, eos id, add_bos, add_eos) with llama.cpp's defaults for keys the file lacks."""
    if md.get("tokenizer.ggml.model") == "llama":
        bos_default, eos_default, add_bos = 1, 2, True
    else:  # llama.cpp's defaults for BPE vocabularies, used only when the file names no ids
        bos_default, eos_default = 11, 11
        add_bos = _PRE.get(md.get("tokenizer.ggml.pre") or "default", ((), False, False))[2]
    bos = _special_id(md, "bos_token_id", bos_default, n)
    eos = _special_id(md, "eos_token_id", eos_default, n)
    add_bos = md.get("tokenizer.ggml.add_bos_token", add_bos)
    add_eos = md.get("tokenizer.ggml.add_eos_token", False)
    return bos, eos, bool(add_bos) and bos is not None, bool(add_eos) and eos is not None


def _added_tokens(tokens: list[str], types: list[int]) -> list[AddedToken]:
    return [
        AddedToken(t, special=ty != _USER_DEFINED, normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (_CONTROL, _USER_DEFINED, _UNKNOWN)
    ]


def _post_processor(tokens: list[str], bos: int | None, eos: int | None, add_bos: bool, add_eos: bool):
    if not (add_bos or add_eos):
        return None
    pieces, special = ["$A"], []
    if add_bos:
        pieces.insert(0, tokens[bos])
        special.append((tokens[bos], bos))
    if add_eos:
        pieces.append(tokens[eos])
        special.append((tokens[eos], eos))
    pair = pieces + [p if p != "$A" else "$B" for p in pieces]
    return processors.TemplateProcessing(
        single=" ".join(pieces), pair=" ".join(pair), special_tokens=list(dict.fromkeys(special))
    )


def _bpe_tokenizer(md: Mapping[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    pre = md.get("tokenizer.ggml.pre") or "default"  # llama.cpp's fallback for files without the key
    if pre not in _PRE:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; supported: "
            + ", ".join(SUPPORTED_PRE_TOKENIZERS)
        )
    regexes, ignore_merges, _ = _PRE[pre]
    vocab = {t: i for i, t in enumerate(tokens)}  # a repeated text maps to its last id, as in llama.cpp
    merges = []
    for m in md.get("tokenizer.ggml.merges") or ():
        k = m.find(" ", 1)  # llama.cpp splits at the first space after the first character
        a, b = m[:k], m[k + 1 :]
        # A merge whose parts or result are not tokens cannot yield a token; `tokenizers` rejects it.
        if k > 0 and a in vocab and b in vocab and a + b in vocab:
            merges.append((a, b))
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_tokenizer(md: Mapping[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    scores = list(md.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    # llama.cpp may join any two adjacent symbols into a vocabulary entry, best score first: as BPE,
    # every split of every entry into two entries, ranked by the entry's score.
    ranked = []
    for i, t in enumerate(tokens):
        if vocab[t] != i:  # a repeated text: llama.cpp looks up its last id
            continue
        for k in range(1, len(t)):
            if t[:k] in vocab and t[k:] in vocab:
                ranked.append((-scores[i], i, k))
    ranked.sort()
    merges = [(tokens[i][:k], tokens[i][k:]) for _, i, k in ranked]
    unk = _special_id(md, "unknown_token_id", 0, len(tokens))
    tok = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = md.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(dec + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def gguf_tokenizer(metadata: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """The tokenizer of a GGUF file from its metadata (`gguf_file.read_metadata`), encoding like
    llama.cpp: `encode(text, add_special_tokens=True)` equals llama.cpp's
    `llama_tokenize(text, add_special=true, parse_special=true)`, BOS/EOS included when the file (or
    llama.cpp's default for its vocabulary type) asks for them. Set `encode_special_tokens = True` on
    the result for llama.cpp's `parse_special=false`.

    Raises ValueError for vocabulary types other than "gpt2" and "llama", and for a
    `tokenizer.ggml.pre` this module has no regexes for.
    """
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(
            f"GGUF tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; supported: "
            "'gpt2' (byte-level BPE) and 'llama' (SentencePiece)"
        )
    tokens, types = _vocab(metadata)
    tok = _bpe_tokenizer(metadata, tokens) if kind == "gpt2" else _spm_tokenizer(metadata, tokens)
    tok.add_tokens(_added_tokens(tokens, types))
    bos, eos, add_bos, add_eos = _bos_eos(metadata, len(tokens))
    post = _post_processor(tokens, bos, eos, add_bos, add_eos)
    if post is not None:
        tok.post_processor = post
    return tok


def eog_token_ids(metadata: Mapping[str, Any]) -> list[int]:
    """The ids llama.cpp ends generation on: EOS first, then the end-of-turn / end-of-message / FIM
    end tokens the file names, then every token whose text llama.cpp recognises as an end marker."""
    tokens, _ = _vocab(metadata)
    n = len(tokens)
    _, eos, _, _ = _bos_eos(metadata, n)
    ids = [eos] + [
        _special_id(metadata, k, None, n)
        for k in ("eot_token_id", "eom_token_id", "fim_pad_token_id", "fim_rep_token_id", "fim_sep_token_id")
    ]
    ids += [i for i, t in enumerate(tokens) if t in _EOG_TEXTS]
    return list(dict.fromkeys(i for i in ids if i is not None))


def tokenizer_files(metadata: Mapping[str, Any]) -> dict[str, str]:
    """File name -> text of a tokenizer directory equivalent to the GGUF file's tokenizer, for
    `jaxserve.loading.tokenizer.load_tokenizer`:

    * ``tokenizer.json``: `gguf_tokenizer(metadata)`.
    * ``tokenizer_config.json``: bos/eos/pad/unk token strings, add_bos_token/add_eos_token (llama.cpp's
      defaults when the file has no such keys: BOS for "llama" vocabularies and the llama3/tekken
      pre-tokenizers), and the chat template(s).
    * ``generation_config.json``: bos/pad ids and the list of end-of-generation ids
      (`eog_token_ids`): load_tokenizer takes extra EOS ids only from this file (or config.json),
      and llama.cpp stops on all of them, not only on EOS. Where the model directory already has a
      generation_config.json (sampling defaults), merge these keys into it rather than replace it.
    """
    tok = gguf_tokenizer(metadata)
    tokens, _ = _vocab(metadata)
    n = len(tokens)
    bos, eos, add_bos, add_eos = _bos_eos(metadata, n)
    kind = metadata.get("tokenizer.ggml.model")
    pad = _special_id(metadata, "padding_token_id", None, n)
    unk = _special_id(metadata, "unknown_token_id", 0 if kind == "llama" else None, n)

    def text(i: int | None) -> str | None:
        return tokens[i] if i is not None else None

    config: dict[str, Any] = {
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": text(bos),
        "eos_token": text(eos),
        "pad_token": text(pad),
        "unk_token": text(unk),
        "clean_up_tokenization_spaces": False,
    }
    # llama.cpp's default template, plus any named ones (tokenizer.chat_template.<name>), in the list
    # form tokenizer_config.json uses for several templates.
    template = metadata.get("tokenizer.chat_template")
    prefix = "tokenizer.chat_template."
    named = [
        {"name": k[len(prefix) :], "template": v}
        for k, v in metadata.items()
        if k.startswith(prefix) and isinstance(v, str)
    ]
    if named:
        default = [{"name": "default", "template": template}] if isinstance(template, str) else []
        config["chat_template"] = default + named
    elif isinstance(template, str):
        config["chat_template"] = template
    generation = {"bos_token_id": bos, "eos_token_id": eog_token_ids(metadata), "pad_token_id": pad}
    return {
        "tokenizer.json": tok.to_str(),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
        "generation_config.json": json.dumps(generation, indent=2) + "\n",
    }
