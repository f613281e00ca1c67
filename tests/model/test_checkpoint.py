"""Loading: sharded safetensors equal the single file, and text prompts go through the model's tokenizer."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizer_training import train_tokenizer

from jaxserve import LLM, SamplingParams
from jaxserve.loading.checkpoint import load_hf_params, safetensors_files
from jaxserve.config import ModelConfig
from jaxserve.loading.tokenizer import load_tokenizer


def test_sharded_checkpoint_equals_single_file(hf_model_dir, tmp_path):
    path, model = hf_model_dir("qwen2")
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = safetensors_files(str(tmp_path))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    cfg = ModelConfig.from_dir(path)
    single = load_hf_params(path, cfg, jnp.float32)
    sharded = load_hf_params(str(tmp_path), cfg, jnp.float32)
    for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(sharded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_missing_shard_is_named(hf_model_dir, tmp_path):
    _, model = hf_model_dir("qwen2")
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    victim = safetensors_files(str(tmp_path))[-1]
    (tmp_path / victim.split("/")[-1]).unlink()
    with pytest.raises(Exception, match="missing shard"):
        safetensors_files(str(tmp_path))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(out, vocab_size=512, kind="bytelevel", max_bytes=300_000)
    return out


def test_text_prompts_use_the_model_tokenizer(hf_model_dir, tokenizer_dir, tmp_path):
    path, _ = hf_model_dir("llama")
    model_dir = tmp_path / "with-tokenizer"
    shutil.copytree(path, model_dir)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, model_dir / f.name)
    tok = load_tokenizer(model_dir)
    llm = LLM(
        str(model_dir),
        dtype="float32",
        page_size=8,
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        warm_up=False,
    )
    out = llm.generate(["def main():"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == tok.encode("def main():")
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
    # tokenizer=PATH overrides the model directory's (here the model dir has none)
    llm2 = LLM(
        path,
        tokenizer=str(tokenizer_dir),
        dtype="float32",
        page_size=8,
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        warm_up=False,
    )
    assert llm2.tokenizer.vocab_size == 512
