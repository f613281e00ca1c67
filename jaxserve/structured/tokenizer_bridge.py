"""The tokenizer bridge: an llguidance LLTokenizer built from a jaxserve Tokenizer (HF tokenizer.json or sentencepiece)."""

from __future__ import annotations

import re

import llguidance

from jaxserve.loading.tokenizer import Tokenizer

__all__ = ["ll_tokenizer", "sentencepiece_token_bytes"]

# llguidance's marker for a special token's byte string: 0xFF never occurs in UTF-8, so grammar
# text can never produce one; a special token is reachable only where a grammar names it (EOS).
_SPECIAL_PREFIX = b"\xff"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int | None = None) -> llguidance.LLTokenizer:
    """The LLTokenizer for `tokenizer`; bitmasks from it have ceil(vocab_size / 32) words.

    vocab_size: the model's logits width when its embedding table is padded past the tokenizer
    (ids past the tokenizer are never allowed); default the tokenizer's own size. Costs ~0.1-1 s
    (it builds the token trie), so build it once per engine. EOS is every id in
    `tokenizer.eos_token_ids`: a finished grammar allows exactly those.
    """
    n = tokenizer.vocab_size if vocab_size is None else int(vocab_size)
    if n < tokenizer.vocab_size:
        raise ValueError(f"vocab_size {n} is smaller than the tokenizer's {tokenizer.vocab_size} ids")
    eos = list(tokenizer.eos_token_ids)
    if not eos:
        raise ValueError("the tokenizer has no EOS token, so a finished grammar could not end the output")
    if tokenizer.kind == "hf":
        # llguidance reads tokenizer.json itself (byte-level BPE, Metaspace and byte fallback alike)
        # and tokenizes forced text with the same Rust tokenizers library jaxserve uses.
        hf = tokenizer.backend
        return llguidance.LLTokenizer(hf.to_str(), n_vocab=n, eos_token=eos)
    if tokenizer.kind == "sentencepiece":
        return llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_SentencePieceVocab(tokenizer)), n_vocab=n, eos_token=eos
        )
    raise ValueError(f"no llguidance bridge for tokenizer kind {tokenizer.kind!r}")


def sentencepiece_token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """The bytes each id adds to the output, in id order: "▁" is a space, "<0xAB>" one byte,
    control/unknown/unused pieces (and the tokenizer's BOS/EOS/pad) are special (0xFF-prefixed)."""
    sp = tokenizer.backend
    special = set(tokenizer.all_special_ids)
    out: list[bytes] = []
    for i in range(sp.vocab_size()):
        piece = sp.id_to_piece(i)
        if i in special or sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
            out.append(_SPECIAL_PREFIX + piece.encode("utf-8"))
        elif sp.is_byte(i):
            out.append(bytes([int(_BYTE_PIECE.fullmatch(piece).group(1), 16)]))
        else:
            out.append(piece.replace("\u2581", " ").encode("utf-8"))
    return out


class _SentencePieceVocab:
    """What llguidance.TokenizerWrapper reads: tokens (bytes per id), BOS/EOS, special ids, and
    a callable that tokenizes text into ids whose bytes concatenate to exactly that text."""

    def __init__(self, tokenizer: Tokenizer):
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2 as pb

        sp = tokenizer.backend
        self.tokens = sentencepiece_token_bytes(tokenizer)
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = [i for i, t in enumerate(self.tokens) if t.startswith(_SPECIAL_PREFIX)]
        # llguidance tokenizes forced text in the middle of an output, where sentencepiece's dummy
        # prefix (a space before the first word) would add a byte the grammar did not ask for.
        proto = pb.ModelProto()
        proto.ParseFromString(sp.serialized_model_proto())
        proto.normalizer_spec.add_dummy_prefix = False
        proto.normalizer_spec.remove_extra_whitespaces = False
        self._sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        self._longest = max(map(len, self.tokens))
        self._by_bytes = {t: i for i, t in enumerate(self.tokens) if t and not t.startswith(_SPECIAL_PREFIX)}

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            # TokenizerWrapper probes with bytes once; refusing them makes it pass str.
            raise TypeError("pass text as str")
        ids = self._sp.encode(text)
        data = text.encode("utf-8")
        if b"".join(self.tokens[i] for i in ids) == data:
            return ids
        return self._greedy(data)  # a normalizer rewrote the text; fall back to exact bytes

    def _greedy(self, data: bytes) -> list[int]:
        ids, pos = [], 0
        while pos < len(data):
            for k in range(min(self._longest, len(data) - pos), 0, -1):
                i = self._by_bytes.get(data[pos : pos + k])
                if i is not None:
                    ids.append(i)
                    pos += k
                    break
            else:
                raise ValueError(f"byte {data[pos]:#04x} has no token (a sentencepiece model without byte fallback)")
        return ids
