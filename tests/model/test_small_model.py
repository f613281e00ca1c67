"""The tests' small model (checkpoints/small): it loads through the public API, scores its
held-out file as its README says, matches transformers after export, and restores onto a mesh."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.model.llama import forward_dense
from jaxserve.loading.model_loader import load_model
from jaxserve.model.sharding import make_mesh

from corpus import iter_texts
from hf_models import assert_same_greedy, hf_greedy

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "checkpoints" / "small"
DRAFT = ROOT / "checkpoints" / "small-draft"
COMMON = dict(dtype="float32", page_size=16, max_num_seqs=8, max_num_batched_tokens=256, warm_up=False)


def readme_figure(path: Path) -> float:
    match = re.search(r"mean loss ([0-9.]+)", (path / "README.md").read_text())
    assert match, f"{path}/README.md quotes no score-file loss"
    return float(match.group(1))


@pytest.fixture(scope="module")
def llm():
    return LLM(str(DEFAULT), max_model_len=2048, enable_prompt_logprobs=True, **COMMON)


@pytest.mark.parametrize("checkpoint", [DEFAULT, DRAFT], ids=["default", "draft"])
def test_scoring_the_held_out_file_reproduces_the_readme_loss(checkpoint, llm):
    scorer = (
        llm
        if checkpoint == DEFAULT
        else LLM(str(checkpoint), max_model_len=2048, enable_prompt_logprobs=True, **COMMON)
    )
    text = (DEFAULT / "heldout_score.py").read_text()  # one score file, shipped with the target
    tok = scorer.engine.tokenizer
    ids = tok.encode(text) + [tok.eos_token_ids[0]]  # <s> text </s>, as the README's figure was computed
    out = scorer.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    losses = [-entry[t] for t, entry in zip(ids[1:], out.prompt_logprobs[1:])]
    assert np.mean(losses) == pytest.approx(readme_figure(checkpoint), rel=0.01)


def test_exported_model_gives_the_same_greedy_tokens_in_transformers(llm, tmp_path):
    import sys

    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "scripts"))
    from export_orbax_to_hf import export

    model = AutoModelForCausalLM.from_pretrained(str(export(str(DEFAULT), str(tmp_path / "hf"))), dtype=torch.float32)
    tok = llm.engine.tokenizer
    prompts = [tok.encode(text[:200]) for _, text in list(iter_texts("heldout"))[:8]]
    outs = llm.generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    )
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ref, gaps = hf_greedy(model, prompt, 24)
        assert_same_greedy(out.outputs[0].token_ids, ref, gaps, f"held-out prompt {i}")


def test_restore_onto_a_1x2_mesh_gives_the_same_logits():
    tokens = jnp.asarray(np.random.RandomState(0).randint(4, 8192, size=(2, 32)), jnp.int32)
    logits = []
    for shape in ((1, 1), (1, 2)):
        loaded = load_model(EngineConfig(model=str(DEFAULT), dtype="float32"), make_mesh(shape), stacked=True)
        logits.append(np.asarray(jax.jit(forward_dense, static_argnames="cfg")(loaded.params, tokens, cfg=loaded.cfg)))
    np.testing.assert_allclose(logits[1], logits[0], atol=1e-4, rtol=0)


# Function headers in the style of the standard library (the training corpus).
HEADERS = [
    "def __repr__(self):\n",
    "def __init__(self, name, value=None):\n",
    "def close(self):\n",
    "def get(self, key, default=None):\n",
    "def __len__(self):\n",
    "def _check_name(name):\n",
    "def read_lines(path):\n",
    "def is_valid(self, value):\n",
]


def function_parses(header: str, completion: str, finished: bool) -> bool:
    """Whether header + completion is a function that parses. The body is the completion's lines up to
    the first non-blank one indented less than the body's first line: where the function ends (the
    model writes methods, so the next `def` often comes at 4 spaces after a body at 8). If generation
    stopped inside the body, its last (maybe incomplete) line is dropped. An empty body does not count."""
    import ast

    lines = completion.split("\n")
    first = next((line for line in lines if line.strip()), "")
    if not first[:1].isspace():
        return False
    indent = len(first) - len(first.lstrip())
    body = []
    for line in lines:
        if line.strip() and len(line) - len(line.lstrip()) < indent:
            finished = True
            break
        body.append(line)
    if not finished and body:
        body.pop()
    if not any(line.strip() for line in body):
        return False
    try:
        ast.parse(header + "\n".join(body) + "\n")
    except SyntaxError:
        return False
    return True


def parsing_completions(scorer) -> int:
    outs = scorer.generate(HEADERS, SamplingParams(max_tokens=64, temperature=0))
    return sum(
        function_parses(h, o.outputs[0].text, o.outputs[0].finish_reason == "stop") for h, o in zip(HEADERS, outs)
    )


def test_function_headers_complete_to_python_more_often_than_with_random_weights(llm):
    trained = parsing_completions(llm)
    random = parsing_completions(LLM(str(DEFAULT), load_format="dummy", max_model_len=256, **COMMON))
    assert trained > random, (trained, random)
