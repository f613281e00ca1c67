"""Fixtures for the structured-output tests: the shipped tokenizers and their grammar compilers (built once)."""

import pytest

from jaxserve.loading.resources import small_checkpoint, shipped_dir
from jaxserve.structured import GrammarCompiler
from jaxserve.loading.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def sp_tokenizer():
    """The shipped default model's sentencepiece tokenizer (8192 ids, byte fallback)."""
    return load_tokenizer(small_checkpoint())


@pytest.fixture(scope="session")
def hf_tokenizer():
    """The shipped byte-level BPE (tokenizer.json, 8192 ids) of the dummy SmolLM2 default."""
    return load_tokenizer(shipped_dir("configs") / "models" / "smollm2-135m" / "tokenizer")


@pytest.fixture(scope="session")
def compiler(sp_tokenizer):
    with GrammarCompiler(sp_tokenizer) as c:
        yield c


@pytest.fixture(scope="session", params=["sentencepiece", "hf"])
def any_compiler(request, sp_tokenizer, hf_tokenizer):
    """Both tokenizer bridges: (compiler, tokenizer)."""
    tok = sp_tokenizer if request.param == "sentencepiece" else hf_tokenizer
    with GrammarCompiler(tok) as c:
        yield c, tok
