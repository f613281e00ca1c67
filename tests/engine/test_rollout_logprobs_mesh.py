"""Rollout logprobs on a (2, 2) mesh (issue 53 part 4): two data-parallel replicas, each tensor-parallel
over two virtual devices, sample rows whose logprobs equal the dense forward's on the same weights
(float32, within 1e-4), whichever replica ran them."""

import jax
import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.model.llama import forward_dense

SETTINGS = {
    "dtype": "float32",
    "page_size": 8,
    "max_model_len": 32,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 16,
    "compilation_cache_dir": "none",
    "mesh_shape": [2, 2],
}
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14]]


def test_rollout_logprobs_on_a_data_parallel_mesh_equal_the_dense_forward(hf_model_dir):
    path, _ = hf_model_dir("llama")
    with LLM(path, **SETTINGS) as llm:
        params = SamplingParams(max_tokens=5, temperature=1.0, seed=11, logprobs=0, ignore_eos=True)
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
        assert llm.engine.num_replicas == 2
        host = jax.device_get(llm.runner.params)  # the trainer's view: the same weights, on one device
        cfg = llm.model_config
        worst = 0.0
        for prompt, out in zip(PROMPTS, outs):
            sample = out.outputs[0]
            tokens = np.asarray([prompt + sample.token_ids], np.int32)
            table = np.asarray(jax.nn.log_softmax(forward_dense(host, tokens, cfg=cfg), axis=-1))[0]
            want = table[np.arange(len(prompt) - 1, tokens.shape[1] - 1), sample.token_ids]
            worst = max(worst, float(np.abs(sample.sampled_logprobs() - want).max()))
        print(f"(2, 2) mesh: largest difference from the dense forward {worst:.2e}")
        assert worst < 1e-4
