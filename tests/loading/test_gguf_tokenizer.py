"""jaxserve.loading.gguf_tokenizer against llama.cpp's own tokenizer.

The referee's ids are recorded in data/llamacpp_tokens.json by scripts/record_llamacpp_tokens.py
(llama-cpp-python takes minutes to build, too long for CI); where llama_cpp is importable the same
comparisons also run live, on the corpus and on generated strings.
"""

from __future__ import annotations

import importlib.util
import json
import random

import pytest

from jaxserve.loading import resources
from jaxserve.loading.gguf_file import open_gguf, read_metadata
from jaxserve.loading.gguf_tokenizer import SUPPORTED_PRE_TOKENIZERS, gguf_tokenizer, tokenizer_files
from jaxserve.loading.tokenizer import load_tokenizer

from gguf_testlib import CORPUS, GOLDEN, VARIANTS, variant_file, variant_metadata, write_sentencepiece_gguf

# transformers' own GGUF tokenizer (AutoTokenizer.from_pretrained(dir, gguf_file=...)) is no referee:
# for "gpt2" vocabularies it keeps GPT-2's split whatever tokenizer.ggml.pre says, so on SmolLM2 it
# joins a space to a following non-ASCII digit (" ١٢٣" -> "ĠÙ", ...) where llama.cpp's "smollm"
# split isolates every \p{N}: 1 of the corpus texts, ~1% of generated strings.
HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
SMOLLM2_FILE = resources.default_model_file()


@pytest.fixture(scope="module")
def base_metadata(tmp_path_factory):
    """Metadata of the two base vocabularies, read back from GGUF files as a server would."""
    assert SMOLLM2_FILE is not None, f"the SmolLM2 GGUF is missing: {resources.DEFAULT_MODEL_INSTALL}"
    spm = write_sentencepiece_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf")
    return {"smollm2": read_metadata(open_gguf(SMOLLM2_FILE)), "spm": read_metadata(open_gguf(spm))}


@pytest.fixture(scope="module")
def golden():
    with open(GOLDEN, encoding="utf-8") as f:
        data = json.load(f)
    assert data["corpus"] == CORPUS, "corpus changed: rerun scripts/record_llamacpp_tokens.py"
    assert set(data["variants"]) == set(VARIANTS), "variants changed: rerun scripts/record_llamacpp_tokens.py"
    return data["variants"]


def metadata_of(base_metadata, name):
    return variant_metadata(base_metadata[VARIANTS[name][0]], name)


def ours(tok, texts):
    """Our ids in the two modes the goldens record: llama.cpp's (add_special, parse_special) =
    (True, True) and (False, False)."""
    special = [tok.encode(t, add_special_tokens=True).ids for t in texts]
    tok.encode_special_tokens = True
    try:
        plain = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    finally:
        tok.encode_special_tokens = False
    return {"special": special, "plain": plain}


def assert_same_ids(texts, got, want, tok):
    bad = []
    for mode in want:
        for text, g, w in zip(texts, got[mode], want[mode]):
            if g != w:
                bad.append(
                    f"{mode} {text!r}:\n  ours     {g} {[tok.id_to_token(i) for i in g]}"
                    f"\n  llama.cpp {w} {[tok.id_to_token(i) for i in w]}"
                )
    if bad:
        pytest.fail(f"{len(bad)} texts tokenize differently:\n" + "\n".join(bad[:10]), pytrace=False)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_llamacpp_goldens(base_metadata, golden, name):
    tok = gguf_tokenizer(metadata_of(base_metadata, name))
    assert_same_ids(CORPUS, ours(tok, CORPUS), golden[name], tok)


@pytest.mark.parametrize("name", ["smollm2", "smollm2@llama-bpe", "spm", "spm@no-space-prefix"])
def test_tokenizer_files_load_and_encode_like_llamacpp(base_metadata, golden, tmp_path, name):
    md = metadata_of(base_metadata, name)
    files = tokenizer_files(md)
    assert set(files) == {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    for file, text in files.items():
        (tmp_path / file).write_text(text, encoding="utf-8")
    tok = load_tokenizer(tmp_path)
    assert [tok.encode(t) for t in CORPUS] == golden[name]["special"]
    tokens = md["tokenizer.ggml.tokens"]
    if VARIANTS[name][0] == "smollm2":
        assert (tok.bos_token_id, tok.eos_token_ids) == (1, (2, 0))  # <|im_end|>, then <|endoftext|>
        assert tok.add_bos_token == (name == "smollm2@llama-bpe")  # llama3's default: add BOS
        assert tok.pad_token_id == 2
    else:
        assert [tokens[i] for i in (tok.bos_token_id, *tok.eos_token_ids, tok.pad_token_id)] == ["<s>", "</s>", "<pad>"]
        assert tok.add_bos_token and not tok.add_eos_token
    assert tok.chat_template == md["tokenizer.chat_template"]


@pytest.mark.parametrize("name", ["smollm2", "smollm2@qwen2", "spm", "spm@no-space-prefix"])
def test_decode_inverts_encode(base_metadata, name):
    md = metadata_of(base_metadata, name)
    tok = gguf_tokenizer(md)
    specials = [t for t, ty in zip(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]) if ty in (2, 3)]
    texts = [t for t in CORPUS if not any(s in t for s in specials)]
    assert len(texts) > 25
    for text in texts:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text


def test_end_of_generation_ids(base_metadata):
    md = dict(base_metadata["spm"])
    assert json.loads(tokenizer_files(md)["generation_config.json"])["eos_token_id"] == [2]
    md["tokenizer.ggml.eot_token_id"] = 100
    md["tokenizer.ggml.eom_token_id"] = 101
    md["tokenizer.ggml.add_bos_token"] = False
    gen = json.loads(tokenizer_files(md)["generation_config.json"])
    assert gen["eos_token_id"] == [2, 100, 101]
    assert json.loads(tokenizer_files(md)["tokenizer_config.json"])["add_bos_token"] is False


def test_named_chat_templates(base_metadata, tmp_path):
    md = dict(base_metadata["spm"], **{"tokenizer.chat_template.tool_use": "{{ tools }}"})
    for file, text in tokenizer_files(md).items():
        (tmp_path / file).write_text(text, encoding="utf-8")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == [
        {"name": "default", "template": md["tokenizer.chat_template"]},
        {"name": "tool_use", "template": "{{ tools }}"},
    ]
    assert load_tokenizer(tmp_path).chat_template == md["tokenizer.chat_template"]


def test_unsupported_pre_tokenizer_is_named(base_metadata):
    md = dict(base_metadata["smollm2"], **{"tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(ValueError, match=r"'no-such-pre'.*supported: .*smollm"):
        gguf_tokenizer(md)
    assert {
        "default",
        "gpt-2",
        "llama-bpe",
        "qwen2",
        "smollm",
        "starcoder",
        "refact",
        "command-r",
        "codeshell",
        "exaone",
        "minerva-7b",
        "deepseek-llm",
        "gpt-4o",
        "tekken",
    } <= set(SUPPORTED_PRE_TOKENIZERS)


@pytest.mark.parametrize("model", ["bert", "t5", "rwkv", None])
def test_unsupported_tokenizer_model_is_named(base_metadata, model):
    md = dict(base_metadata["spm"], **{"tokenizer.ggml.model": model})
    with pytest.raises(ValueError, match=f"{model!r}.*not supported"):
        gguf_tokenizer(md)


def test_metadata_without_tokens_is_an_error():
    with pytest.raises(ValueError, match="no tokenizer.ggml.tokens"):
        gguf_tokenizer({"tokenizer.ggml.model": "gpt2"})


# --- live comparison, defined only where llama-cpp-python is installed ----------------------------


def fuzz_texts(n=300, seed=0):
    """Strings of mixed scripts, digits, punctuation and whitespace runs, and special tokens."""
    rng = random.Random(seed)
    pool = (
        list("abcXYZ  \t\n\r0123456789'.,;:!?-_()[]{}<>/\\\"#$%^&*+=|~`")
        + list("éÀßçøΩσ日本語中한글🙂👍🏽\u200d\u00a0\u3000\u0301\u2009١")
        + ["'s", "'LL", "   ", "\r\n", "<|im_start|>", "<|im_end|>", "<s>", "</s>", "<0x41>", "▁"]
    )
    return ["".join(rng.choice(pool) for _ in range(rng.randint(0, 40))) for _ in range(n)]


if HAVE_LLAMA_CPP:

    @pytest.fixture(scope="module")
    def live_files(tmp_path_factory):
        tmp = tmp_path_factory.mktemp("live")
        return {name: variant_file(name, tmp, SMOLLM2_FILE) for name in VARIANTS}

    @pytest.mark.parametrize("name", list(VARIANTS))
    def test_matches_llamacpp_live(base_metadata, live_files, name):
        import llama_cpp

        texts = CORPUS + fuzz_texts()
        llm = llama_cpp.Llama(model_path=str(live_files[name]), vocab_only=True, verbose=False)
        try:
            want = {
                "special": [llm.tokenize(t.encode(), add_bos=True, special=True) for t in texts],
                "plain": [llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts],
            }
        finally:
            llm.close()
        tok = gguf_tokenizer(metadata_of(base_metadata, name))
        assert_same_ids(texts, ours(tok, texts), want, tok)
