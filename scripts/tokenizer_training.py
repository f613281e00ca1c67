"""Train small deterministic BPE tokenizers (sentencepiece or byte-level) on the stdlib sources, for tests,
dummy-weight models and the default model's training; `scripts/make_tokenizer.py` is its command line.

A tool, not part of the jaxserve package (which only loads tokenizers, `jaxserve.loading.tokenizer.load_tokenizer`):
the scripts import it as a module from this directory, and the tests through pytest's `pythonpath`.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

from corpus import iter_texts

from jaxserve.loading.tokenizer import TOKENIZER_FILES

__all__ = ["train_tokenizer", "iter_stdlib_texts", "SENTENCEPIECE_SPECIALS", "BYTELEVEL_SPECIALS"]


# Ids 0..3 of a trained sentencepiece tokenizer (Llama-style, plus a real pad piece).
SENTENCEPIECE_SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")
# Ids 0..3 of a trained byte-level tokenizer: GPT-2's end-of-text doubles as BOS, ChatML markers
# are there so chat templates can be exercised.
BYTELEVEL_SPECIALS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")

# Fixed rather than os.cpu_count(): sentencepiece records it in the model file, and the output
# must be byte-identical on every machine.
_SP_THREADS = 4


def iter_stdlib_texts(max_bytes: int | None = None, split: str = "all") -> Iterator[str]:
    """The stdlib sources of `split` (see `corpus`), in sorted path order, up to `max_bytes`."""
    return (text for _, text in iter_texts(split, max_bytes))


def _sp_sentences(texts: Iterable[str], target: int = 1024) -> Iterator[str]:
    # sentencepiece trains on "sentences"; multi-line chunks let it learn newline+indent pieces
    # instead of seeing every line in isolation.
    for text in texts:
        buf: list[str] = []
        n = 0
        for line in text.splitlines(keepends=True):
            buf.append(line)
            n += len(line)
            if n >= target:
                yield "".join(buf)
                buf, n = [], 0
        if buf:
            yield "".join(buf)


def _train_sentencepiece(vocab_size: int, texts: Iterable[str], seed: int) -> bytes:
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    spm.set_random_generator_seed(seed)
    out = io.BytesIO()
    options = dict(
        model_type="bpe",
        vocab_size=vocab_size,
        # Identity normalisation + no whitespace folding + byte fallback: every string
        # round-trips exactly, which the tests and a serving stack need.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        byte_fallback=True,
        split_digits=True,
        # Code is full of indentation; whole runs of spaces should be single pieces.
        allow_whitespace_only_pieces=True,
        # Rare characters go to byte fallback rather than spending vocabulary on them.
        character_coverage=0.9995,
        max_sentencepiece_length=16,
        max_sentence_length=1 << 14,
        # Fewer pieces than asked is allowed (small corpus); we pad below to make the size exact.
        hard_vocab_limit=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        unk_piece=SENTENCEPIECE_SPECIALS[0],
        bos_piece=SENTENCEPIECE_SPECIALS[1],
        eos_piece=SENTENCEPIECE_SPECIALS[2],
        pad_piece=SENTENCEPIECE_SPECIALS[3],
        num_threads=_SP_THREADS,
        minloglevel=2,
    )
    try:
        with open(os.devnull, "w") as devnull:
            spm.SentencePieceTrainer.train(
                sentence_iterator=_sp_sentences(texts), model_writer=out, logstream=devnull, **options
            )
    except RuntimeError as e:
        raise ValueError(f"sentencepiece training failed for vocab_size={vocab_size}: {e}") from e
    m = pb.ModelProto()
    m.ParseFromString(out.getvalue())
    k = 0
    while len(m.pieces) < vocab_size:
        p = m.pieces.add()
        p.piece = f"<unused{k}>"
        p.type = pb.ModelProto.SentencePiece.UNUSED
        p.score = 0.0
        k += 1
    if len(m.pieces) != vocab_size:
        raise ValueError(f"sentencepiece produced {len(m.pieces)} pieces, wanted {vocab_size}")
    m.trainer_spec.vocab_size = vocab_size
    return m.SerializeToString(deterministic=True)


def _train_bytelevel(vocab_size: int, texts: Iterable[str]) -> Any:
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    from tokenizers import trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(BYTELEVEL_SPECIALS):
        raise ValueError(
            f"vocab_size={vocab_size} is below the {len(alphabet)} byte symbols plus "
            f"{len(BYTELEVEL_SPECIALS)} special tokens a byte-level BPE needs"
        )
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in BYTELEVEL_SPECIALS],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    n = tok.get_vocab_size(with_added_tokens=True)
    if n < vocab_size:
        tok.add_special_tokens(
            [AddedToken(f"<|unused_{k}|>", special=True, normalized=False) for k in range(vocab_size - n)]
        )
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise ValueError(f"byte-level BPE produced {got} tokens, wanted {vocab_size}")
    return tok


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def train_tokenizer(
    out_dir: str | os.PathLike,
    vocab_size: int,
    kind: str = "sentencepiece",
    max_bytes: int | None = None,
    seed: int = 0,
    split: str = "all",
) -> Path:
    """Train a BPE tokenizer of exactly `vocab_size` ids on the stdlib sources; write it to `out_dir`.

    kind="sentencepiece": tokenizer.model, ids 0..3 = <unk> <s> </s> <pad>, BOS added on encode,
    byte fallback, Llama-style leading-space convention; unused tail pieces are "<unusedK>".
    kind="bytelevel": tokenizer.json (GPT-2-style byte-level BPE), ids 0..3 = <|endoftext|>
    (BOS and EOS, BOS not added on encode) <|pad|> <|im_start|> <|im_end|>; unused tail ids are
    "<|unusedK|>" special tokens.
    Both also get a tokenizer_config.json. Same arguments on the same interpreter give
    byte-identical files (the corpus is the interpreter's stdlib, so another Python version gives
    another, equally deterministic, tokenizer). `seed` only feeds sentencepiece's RNG, which the
    full-corpus BPE trainer does not actually draw from; it is there for forward compatibility.
    `split` picks the corpus files ("all", or "train" to keep the held-out files unseen).
    """
    if kind not in ("sentencepiece", "bytelevel"):
        raise ValueError(f"kind must be 'sentencepiece' or 'bytelevel', not {kind!r}")
    vocab_size = int(vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # A leftover file of the other kind would shadow ours (tokenizer.json is loaded first).
    for name in TOKENIZER_FILES:
        (out / name).unlink(missing_ok=True)
    texts = iter_stdlib_texts(max_bytes, split)
    if kind == "sentencepiece":
        proto = _train_sentencepiece(vocab_size, texts, seed)
        (out / "tokenizer.model").write_bytes(proto)
        unk, bos, eos, pad = SENTENCEPIECE_SPECIALS
        config = {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": bos,
            "eos_token": eos,
            "unk_token": unk,
            "pad_token": pad,
            "clean_up_tokenization_spaces": False,
            "legacy": False,
            "model_max_length": 1 << 20,
            "tokenizer_class": "LlamaTokenizer",
        }
    else:
        tok = _train_bytelevel(vocab_size, texts)
        (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
        eot, pad, _, _ = BYTELEVEL_SPECIALS
        config = {
            "add_bos_token": False,
            "add_eos_token": False,
            "bos_token": eot,
            "eos_token": eot,
            "pad_token": pad,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1 << 20,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
    _write_json(out / "tokenizer_config.json", config)
    return out
