"""Tokenizers for jaxserve: HF tokenizer.json / sentencepiece loading and streaming detokenization (training: scripts/tokenizer_training.py)."""

from __future__ import annotations

import json
import numbers
import os
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = [
    "TOKENIZER_FILES",
    "Tokenizer",
    "IncrementalDetokenizer",
    "load_tokenizer",
]

# Looked for in this order: a tokenizer.json is what HF checkpoints treat as authoritative when
# both are shipped (it carries the post-processor and added tokens the .model file lacks).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")

_REPLACEMENT = "\ufffd"


# --------------------------------------------------------------------------------------------
# Backends: the smallest surface Tokenizer needs from each library.
# --------------------------------------------------------------------------------------------


class _HFBackend:
    kind = "hf"

    def __init__(self, tok: Any):
        self.tok = tok
        vocab = tok.get_vocab(with_added_tokens=True)
        # Added tokens may leave holes in the id space, so the size a model must cover is max id + 1.
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def default_bos(self) -> int | None:
        return None

    def default_eos(self) -> int | None:
        return None


class _SPBackend:
    kind = "sentencepiece"

    def __init__(self, model_proto: bytes):
        import sentencepiece as spm

        self._proto = model_proto
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self._sp_cont = None
        self.vocab_size = self.sp.vocab_size()
        sp = self.sp
        self.special_ids = frozenset(
            i for i in range(self.vocab_size) if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)
        )
        # sentencepiece itself never parses "<s>" etc. in input text; HF's slow tokenizers do, and
        # chat templates rely on it, so special pieces are split out before encoding.
        names = sorted((sp.id_to_piece(i) for i in self.special_ids), key=len, reverse=True)
        self._special_by_piece = {sp.id_to_piece(i): i for i in self.special_ids}
        self._special_re = re.compile("|".join(map(re.escape, names))) if names else None

    @property
    def sp_cont(self):
        # A copy without the dummy-prefix space, for text that follows a special token inside one
        # sequence; that text is a continuation, not a new sentence (HF's legacy=False behaviour).
        if self._sp_cont is None:
            import sentencepiece as spm
            from sentencepiece import sentencepiece_model_pb2 as pb

            m = pb.ModelProto()
            m.ParseFromString(self._proto)
            m.normalizer_spec.add_dummy_prefix = False
            m.normalizer_spec.remove_extra_whitespaces = False
            self._sp_cont = spm.SentencePieceProcessor(model_proto=m.SerializeToString())
        return self._sp_cont

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        del add_special_tokens  # BOS/EOS are added by Tokenizer for this backend
        if self._special_re is None or self._special_re.search(text) is None:
            return self.sp.encode(text)
        ids: list[int] = []
        pos = 0
        first = True
        for m in self._special_re.finditer(text):
            seg = text[pos : m.start()]
            if seg:
                ids.extend((self.sp if first else self.sp_cont).encode(seg))
            first = False
            ids.append(self._special_by_piece[m.group(0)])
            pos = m.end()
        seg = text[pos:]
        if seg:
            ids.extend(self.sp_cont.encode(seg))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        n = self.vocab_size
        special = self.special_ids
        if skip_special_tokens:
            return self.sp.decode([i for i in ids if 0 <= i < n and i not in special])
        out: list[str] = []
        run: list[int] = []
        first = True
        for i in ids:
            if not 0 <= i < n:
                continue
            if i in special:
                if run:
                    out.append((self.sp if first else self.sp_cont).decode(run))
                    run = []
                first = False
                out.append(self.sp.id_to_piece(i))
            else:
                run.append(i)
        if run:
            out.append((self.sp if first else self.sp_cont).decode(run))
        return "".join(out)

    def id_to_token(self, i: int) -> str | None:
        return self.sp.id_to_piece(i) if 0 <= i < self.vocab_size else None

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.piece_to_id(token)
        # piece_to_id maps unknown strings to unk_id; only the real unk piece should map there.
        if i == self.sp.unk_id() and token != self.sp.id_to_piece(i):
            return None
        return i

    def default_bos(self) -> int | None:
        i = self.sp.bos_id()
        return i if i >= 0 else None

    def default_eos(self) -> int | None:
        i = self.sp.eos_id()
        return i if i >= 0 else None


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


class Tokenizer:
    """Text <-> token ids for one model, with its BOS/EOS conventions resolved."""

    def __init__(
        self,
        backend: _HFBackend | _SPBackend,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        path: str | None = None,
    ):
        self._backend = backend
        self.kind: str = backend.kind
        self.path = path
        self.bos_token_id: int | None = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.pad_token_id: int | None = pad_token_id
        self.chat_template = chat_template
        # Whether the tokenizer.json post-processor already inserts BOS; that decides whether we
        # must add it ourselves or strip it to honour an explicit add_bos_token=false.
        self._pp_adds_bos = False
        if backend.kind == "hf" and bos_token_id is not None:
            self._pp_adds_bos = backend.encode("", True)[:1] == [bos_token_id]
        if add_bos_token is None:
            add_bos_token = self._pp_adds_bos if backend.kind == "hf" else bos_token_id is not None
        self.add_bos_token: bool = bool(add_bos_token) and bos_token_id is not None
        self.add_eos_token: bool = bool(add_eos_token) and self.eos_token_id is not None
        special = set(backend.special_ids)
        special.update(i for i in (bos_token_id, pad_token_id, *self.eos_token_ids) if i is not None)
        self.all_special_ids: tuple[int, ...] = tuple(sorted(special))
        # Ids the backend's own skip_special_tokens would not drop (e.g. an EOS that a config file
        # names but tokenizer.json does not mark special).
        self._extra_skip = frozenset(special - backend.special_ids)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, tok: Any, **kwargs: Any) -> "Tokenizer":
        """Wrap an in-memory `tokenizers.Tokenizer`."""
        return cls(_HFBackend(tok), **kwargs)

    @classmethod
    def from_sentencepiece(cls, model_proto: bytes, **kwargs: Any) -> "Tokenizer":
        """Wrap a serialized sentencepiece ModelProto (the bytes of a tokenizer.model)."""
        backend = _SPBackend(model_proto)
        kwargs.setdefault("bos_token_id", backend.default_bos())
        kwargs.setdefault("eos_token_ids", _opt_tuple(backend.default_eos()))
        kwargs.setdefault("pad_token_id", _nonneg(backend.sp.pad_id()))
        return cls(backend, **kwargs)

    # -- properties ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def backend(self) -> Any:
        """The underlying `tokenizers.Tokenizer` or `SentencePieceProcessor`."""
        b = self._backend
        return b.tok if isinstance(b, _HFBackend) else b.sp

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (
            f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={self.eos_token_ids}, add_bos={self.add_bos_token}, path={self.path!r})"
        )

    # -- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(self._backend.encode(text, add_special_tokens))
        if not add_special_tokens:
            return ids
        bos = self.bos_token_id
        if self.add_bos_token:
            if not (self._pp_adds_bos and ids[:1] == [bos]):
                ids.insert(0, bos)
        elif self._pp_adds_bos and ids[:1] == [bos]:
            ids.pop(0)
        if self.add_eos_token and ids[-1:] != [self.eos_token_id]:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens and self._extra_skip:
            ids = [i for i in ids if i not in self._extra_skip]
        return self._backend.decode(ids, skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary string of id `i` (None when out of range)."""
        return self._backend.id_to_token(int(i))

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def detokenizer(self, **kwargs: Any) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, **kwargs)


def _nonneg(i: int) -> int | None:
    return i if i >= 0 else None


def _opt_tuple(i: int | None) -> tuple[int, ...]:
    return () if i is None else (i,)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _token_content(v: Any) -> str | None:
    # Older transformers serialise special tokens as AddedToken dicts rather than plain strings.
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _id_list(v: Any) -> list[int]:
    if isinstance(v, bool):
        return []
    if isinstance(v, int):
        return [v]
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v if isinstance(x, int) and not isinstance(x, bool)]
    return []


def _model_config(d: dict) -> dict:
    # Multimodal checkpoints keep the language model's ids under text_config.
    if "eos_token_id" not in d and isinstance(d.get("text_config"), dict):
        return d["text_config"]
    return d


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer from a checkpoint directory or a tokenizer.json / tokenizer.model file.

    BOS/EOS come from tokenizer_config.json, special_tokens_map.json, generation_config.json and
    config.json next to the tokenizer file, in that order of preference (EOS ids from all of them
    are kept, so generation stops on any of them).
    """
    p = Path(path)
    if p.is_dir():
        for name in TOKENIZER_FILES:
            if (p / name).is_file():
                file = p / name
                break
        else:
            raise FileNotFoundError(
                f"no tokenizer found in directory {str(p)!r}: looked for " + " and ".join(TOKENIZER_FILES)
            )
        d = p
    elif p.is_file():
        file, d = p, p.parent
    else:
        raise FileNotFoundError(
            f"tokenizer path {str(p)!r} does not exist (expected a directory containing "
            + " or ".join(TOKENIZER_FILES)
            + ", or one of those files)"
        )

    if file.suffix == ".json":
        from tokenizers import Tokenizer as HFTokenizer

        backend: _HFBackend | _SPBackend = _HFBackend(HFTokenizer.from_file(str(file)))
    else:
        backend = _SPBackend(file.read_bytes())

    tcfg = _read_json(d / "tokenizer_config.json")
    smap = _read_json(d / "special_tokens_map.json")
    gcfg = _model_config(_read_json(d / "generation_config.json"))
    mcfg = _model_config(_read_json(d / "config.json"))

    added = {}
    for k, v in (tcfg.get("added_tokens_decoder") or {}).items():
        c = _token_content(v)
        if c is not None and str(k).isdigit():
            added[c] = int(k)

    def tok_id(name: str) -> int | None:
        for src in (tcfg, smap):
            c = _token_content(src.get(name))
            if c is not None:
                i = backend.token_to_id(c)
                if i is None:
                    i = added.get(c)
                if i is not None:
                    return i
        return None

    def cfg_ids(key: str) -> list[int]:
        return _id_list(gcfg.get(key)) + _id_list(mcfg.get(key))

    bos = tok_id("bos_token")
    if bos is None:
        bos = next(iter(cfg_ids("bos_token_id")), backend.default_bos())
    eos_primary = tok_id("eos_token")
    eos = ([eos_primary] if eos_primary is not None else []) + cfg_ids("eos_token_id")
    if not eos and backend.default_eos() is not None:
        eos = [backend.default_eos()]
    pad = tok_id("pad_token")
    if pad is None:
        pad = next(iter(cfg_ids("pad_token_id")), None)
    if pad is None and isinstance(backend, _SPBackend):
        pad = _nonneg(backend.sp.pad_id())

    add_bos = tcfg.get("add_bos_token")
    add_eos = tcfg.get("add_eos_token")
    chat_template = tcfg.get("chat_template")
    if isinstance(chat_template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
        chat_template = named.get("default")
    if not isinstance(chat_template, str) and (d / "chat_template.jinja").is_file():
        chat_template = (d / "chat_template.jinja").read_text(encoding="utf-8")
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_ids=eos,
        pad_token_id=pad,
        add_bos_token=add_bos if isinstance(add_bos, bool) else None,
        add_eos_token=add_eos if isinstance(add_eos, bool) else False,
        chat_template=chat_template if isinstance(chat_template, str) else None,
        path=str(file),
    )


# --------------------------------------------------------------------------------------------
# Streaming detokenization
# --------------------------------------------------------------------------------------------


# Tokens a detokenizer's decode window grows to before it starts again at the newest ones: a decode's
# cost barely depends on its length at this size, while starting again costs a decode of its own.
WINDOW_TOKENS = 8


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into a stream of text deltas.

    Each step decodes only a short window of recent tokens and emits what the newest tokens add
    to it. Text whose last character is U+FFFD is held back, because it is usually the start of a
    multi-byte character split over byte tokens; it is released once a later token completes it,
    or by `flush()` at the end of the stream (for a genuinely invalid byte sequence). The window
    never starts on tokens that decode to nothing, so leading-space stripping (sentencepiece's
    dummy prefix, Metaspace/Strip decoders) applies to the same token in every decode of a window.
    Concatenating every `add()` result and the final `flush()` gives exactly
    `tokenizer.decode(all_ids, skip_special_tokens)`, or, with `prompt_ids`, the text that the
    generated ids add after the prompt (so the first word keeps its leading space).

    One known divergence: HF's ByteFallback decoder turns a whole run of byte tokens into U+FFFDs
    when any byte in the run is invalid, so if a model emits e.g. "é" as bytes followed by a stray
    invalid byte, the stream shows "é\ufffd" where a full decode shows "\ufffd\ufffd\ufffd". Valid
    text (anything that came from encoding a string) is never affected, nor are sentencepiece
    models or byte-level BPE.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] | None = None,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._n_context = 0
        self._prefix_text = ""
        if prompt_ids:
            # Enough prompt tail for its decode to be non-empty and not to start inside a
            # multi-byte character (byte-fallback decoders garble a whole cut byte run, so a
            # window must start on a character boundary). Growing geometrically keeps this cheap
            # even for long runs of special or byte tokens.
            prompt = [int(i) for i in prompt_ids]
            k = 4
            while True:
                ctx = prompt[-k:]
                text = self._decode(ctx)
                if (text and not text.startswith(_REPLACEMENT)) or k >= len(prompt):
                    break
                k *= 2
            self._ids = ctx
            self._n_context = len(ctx)
            self._prefix_text = text
        self._prefix = 0  # window start
        self._read = len(self._ids)  # ids before this have been turned into emitted text
        self._chunks: list[str] = []
        self._text_cache: str | None = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: int | Iterable[int]) -> str:
        """Feed the ids generated this step; return the text they complete (possibly "")."""
        if isinstance(new_ids, numbers.Integral):
            new = [int(new_ids)]
        else:
            new = [int(i) for i in new_ids]
        if not new:
            return ""
        self._ids.extend(new)
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT) or not text.startswith(self._prefix_text):
            return ""
        delta = text[len(self._prefix_text) :]
        self._commit(delta, text)
        return delta

    def _commit(self, delta: str, window_text: str) -> None:
        if delta:
            self._chunks.append(delta)
            self._text_cache = None
        new_start = self._read
        self._read = len(self._ids)
        # The window moves up to the tokens just committed only once it holds WINDOW_TOKENS: until
        # then its own text is the next prefix, and each step costs one decode, not two.
        if new_start < self._read and self._read - self._prefix >= WINDOW_TOKENS:
            isolated = self._decode(self._ids[new_start : self._read])
            if isolated:
                self._prefix, self._prefix_text = new_start, isolated
                return
        self._prefix_text = window_text

    def flush(self) -> str:
        """End of stream: return any held-back text (e.g. a trailing invalid byte sequence)."""
        if self._read == len(self._ids):
            return ""
        text = self._decode(self._ids[self._prefix :])
        if text.startswith(self._prefix_text):
            delta = text[len(self._prefix_text) :]
        else:  # not reached with prefix-stable decoders; keep what differs rather than lose it
            n = len(os.path.commonprefix([text, self._prefix_text]))
            delta = text[n:]
        self._chunks.append(delta)
        self._text_cache = None
        self._read = len(self._ids)
        self._prefix_text = text
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
            self._chunks = [self._text_cache]
        return self._text_cache

    @property
    def token_ids(self) -> list[int]:
        """The generated ids fed so far (prompt context excluded)."""
        return self._ids[self._n_context :]

    @property
    def pending(self) -> bool:
        """Whether some fed ids have not produced their text yet."""
        return self._read < len(self._ids)
