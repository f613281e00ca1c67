"""Data-parallel replicas sample their own rows: the compiled steps of a (2, 1) mesh move no
replica's logits, draft distributions or token histories to the other replica's device
(`sharding.per_replica`), and speculative decoding on two replicas gives one replica's tokens."""

import re

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

SETTINGS = dict(
    dtype="float32",
    page_size=8,
    max_model_len=64,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    warm_up=False,
    enable_prefix_caching=False,
)
COLLECTIVE = re.compile(r"= (\S+) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")


def speculation(kind: str, path: str) -> dict:
    if kind == "plain":
        return {}
    if kind == "ngram":
        return dict(speculative_method="ngram", num_speculative_tokens=3)
    return dict(speculative_method="draft", speculative_model=path, num_speculative_tokens=3)


def collectives(llm: LLM, shape: tuple) -> list[tuple[str, str]]:
    """(result type, collective) of every collective in the optimised program of bucket `shape`."""
    return COLLECTIVE.findall(llm.runner.compile(shape).as_text())


def dims(hlo_type: str) -> list[int]:
    """The dimensions of an HLO array type such as f32[8,512]{1,0} (a tuple's arrays together)."""
    return [int(d) for shape in re.findall(r"\[([\d,]*)\]", hlo_type) for d in shape.split(",") if d]


def workload():
    rng = np.random.RandomState(11)
    base = rng.randint(0, 512, size=6).tolist()
    prompts = [base * 3, rng.randint(0, 512, size=9).tolist(), base * 2 + [5, 6], [7, 8, 9, 7, 8, 9, 7, 8]]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.mark.parametrize("kind", ["plain", "ngram", "draft"])
def test_replicas_sample_their_own_rows(hf_model_dir, kind):
    path, _ = hf_model_dir("llama")
    prompts, params = workload()
    with LLM(path, **SETTINGS, **speculation(kind, path)) as one:
        want = [
            o.outputs[0].token_ids
            for o in one.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        ]
    with LLM(path, **SETTINGS, **speculation(kind, path), mesh_shape=(2, 1)) as two:
        got = [
            o.outputs[0].token_ids
            for o in two.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        ]
        vocab, history = two.engine.runner.cfg.vocab_size, two.engine.runner.history_len
        for shape in [(1, 8), (32, 8)]:
            moved = [(t, op) for t, op in collectives(two, shape) if vocab in dims(t) or history in dims(t)]
            assert not moved, (shape, moved)
    assert got == want
