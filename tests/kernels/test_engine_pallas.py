"""End to end: greedy generation with the Pallas kernels (interpret mode on CPU) equals the reference."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.runner.backends import resolve_attention
from kernels_testlib import engine_attention_impl


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # mistral: sliding window through the ragged kernel
def test_pallas_attention_matches_reference(hf_model_dir, arch):
    path, _ = hf_model_dir(arch)
    settings = dict(
        dtype="float32", page_size=8, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, warm_up=False
    )
    prompts = [np.random.RandomState(i).randint(0, 512, size=n).tolist() for i, n in enumerate((7, 19))]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outputs = {}
    for backend in ("reference", "pallas"):
        llm = LLM(path, attention_backend=backend, **settings)
        outputs[backend] = [
            o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
        ]
    assert llm.runner.options.attention_backend == engine_attention_impl()
    assert outputs["pallas"] == outputs["reference"]


def test_auto_choice_is_explicit():
    assert resolve_attention("auto", "cpu", (1, 1)) == "reference"
    assert resolve_attention("auto", "tpu", (1, 1)) == "pallas_tpu"
    assert resolve_attention("auto", "gpu", (1, 4)) == "pallas_gpu"  # per device under shard_map
    assert resolve_attention("pallas", "cpu", (1, 1)) == "pallas_interpret"
    assert resolve_attention("pallas", "gpu", (2, 2)) == "pallas_gpu"
    assert resolve_attention("pallas", "cpu", (2, 2)) == "pallas_interpret"
