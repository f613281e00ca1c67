"""scripts/rl_grpo.py, three iterations on the small model (issue 53, part 5): the loop runs, the engine
serves the trainer's arrays after every step (adopted, no copy), each rollout carries the version
of the weights that sampled it, and the engine's rollout logprobs equal the trainer's on those
weights. Whether the reward rises is the full run's question (docs/training_loop.md), not this test's."""

import json
import os

import rl_grpo

from jaxserve.loading import resources


def test_three_iterations_sync_the_weights_and_agree_on_logprobs(tmp_path):
    out = str(tmp_path / "grpo")
    argv = ["--model", str(resources.small_checkpoint()), "--iterations", "3", "--prompts", "2", "--group", "4"]
    history = rl_grpo.main(argv + ["--no-chat", "--max-model-len", "32", "--out", out])  # bare prompts: short
    assert [h["iteration"] for h in history] == [1, 2, 3]
    assert [h["weight_version"] for h in history] == [0, 1, 2]  # rollouts of iteration k: the weights after k - 1
    assert all(h["adopted"] == 38 for h in history)  # every tensor of the small model, no copy
    assert max(h["logprob_mismatch"] for h in history) < 1e-4
    assert all(0.0 <= h["mean_reward"] <= 1.0 for h in history)
    assert os.path.getsize(os.path.join(out, "grpo_reward.png")) > 0
    with open(os.path.join(out, "grpo.json")) as f:
        assert json.load(f) == history


def test_trainer_and_engine_on_different_shardings(tmp_path):
    """--engine-tp 2: the engine tensor-parallel over two virtual devices, the trainer's params
    replicated over four; every update reshards (nothing adopted) and the logprobs still agree."""
    argv = ["--model", str(resources.small_checkpoint()), "--iterations", "2", "--prompts", "2", "--group", "2"]
    history = rl_grpo.main(argv + ["--no-chat", "--max-model-len", "32", "--engine-tp", "2", "--out", str(tmp_path)])
    assert [h["adopted"] for h in history] == [0, 0]
    assert [h["weight_version"] for h in history] == [0, 1]
    assert max(h["logprob_mismatch"] for h in history) < 1e-4


def test_the_reward_reads_the_first_number():
    assert rl_grpo.reward(" 7 apples", "7") == 1.0
    assert rl_grpo.reward("The answer is 7.", "7") == 1.0
    assert rl_grpo.reward("17", "7") == 0.0
    assert rl_grpo.reward("seven", "7") == 0.0
