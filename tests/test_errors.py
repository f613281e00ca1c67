"""Every user mistake gets an exception that names it (never a traceback from inside XLA)."""

import json
import shutil

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.errors import ConfigError, ModelLoadError, RequestError, UnsupportedModelError


@pytest.fixture(scope="module")
def llm(hf_model_dir):
    path, _ = hf_model_dir("llama")
    return LLM(
        path,
        dtype="float32",
        page_size=8,
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        num_pages=5,
        warm_up=False,
    )


def copy_model(hf_model_dir, tmp_path):
    path, _ = hf_model_dir("llama")
    dest = tmp_path / "model"
    shutil.copytree(path, dest)
    return dest


def test_missing_directory():
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM("/nonexistent/model", warm_up=False)


def test_missing_config(hf_model_dir, tmp_path):
    dest = copy_model(hf_model_dir, tmp_path)
    (dest / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(str(dest), warm_up=False)


def test_missing_weights(hf_model_dir, tmp_path):
    dest = copy_model(hf_model_dir, tmp_path)
    (dest / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        LLM(str(dest), warm_up=False)


def test_pickle_checkpoint_is_refused(hf_model_dir, tmp_path):
    dest = copy_model(hf_model_dir, tmp_path)
    (dest / "model.safetensors").rename(dest / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="safetensors only"):
        LLM(str(dest), warm_up=False)


def test_truncated_weights(hf_model_dir, tmp_path):
    dest = copy_model(hf_model_dir, tmp_path)
    (dest / "model.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(ModelLoadError, match="not a valid safetensors"):
        LLM(str(dest), warm_up=False)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "not supported"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 10000.0}}, "longrope"),
    ],
)
def test_unsupported_model(hf_model_dir, tmp_path, change, message):
    dest = copy_model(hf_model_dir, tmp_path)
    config = json.loads((dest / "config.json").read_text())
    config.update(change)
    (dest / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=message):
        LLM(str(dest), warm_up=False)


def test_contradictory_settings(hf_model_dir):
    path, _ = hf_model_dir("llama")
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        LLM(path, max_model_len=10**6, warm_up=False)
    with pytest.raises(ConfigError, match="not both"):
        LLM(path, num_pages=8, kv_cache_memory="1MiB", warm_up=False)
    with pytest.raises(ConfigError, match="unknown setting"):
        LLM(path, max_num_seq=4, warm_up=False)


def test_request_errors(llm):
    greedy = SamplingParams(max_tokens=4, temperature=0)
    with pytest.raises(RequestError, match="maximum context length is 64 tokens"):
        llm.generate(prompt_token_ids=[[1] * 64], sampling_params=greedy)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.generate(prompt_token_ids=[[1, 2, 512]], sampling_params=greedy)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.generate(prompt_token_ids=[[-1]], sampling_params=greedy)
    with pytest.raises(RequestError, match="at least one token"):
        llm.generate(prompt_token_ids=[[]], sampling_params=greedy)
    with pytest.raises(RequestError, match="KV pages"):  # 4 usable pages of 8 tokens
        llm.generate(prompt_token_ids=[[1] * 20], sampling_params=SamplingParams(max_tokens=30))
    with pytest.raises(RequestError, match="no tokenizer"):
        llm.generate("hello", greedy)
    assert llm.blocks.num_free_pages(0) == 4  # nothing was allocated by the refused requests


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**kwargs)
