"""scripts/rl_grpo.py, three iterations on the small model (issue 53, part 5): the loop runs, the engine
serves the trainer's arrays after every step (adopted, no copy), each rollout carries the version
of the weights that sampled it, and the engine's rollout logprobs equal the trainer's on those
weights. Whether the reward rises is the full run's question (docs/training_loop.md), not this test's."""

import json
import os

import pytest
import rl_grpo

from jaxserve.loading import resources


def test_three_iterations_sync_the_weights_and_agree_on_logprobs(tmp_path):
    out = str(tmp_path / "grpo")
    argv = [
        "--model",
        str(resources.small_checkpoint()),
        "--iterations",
        "3",
        "--prompts",
        "2",
        "--group",
        "4",
        "--eval-prompts",
        "4",
    ]
    history = rl_grpo.main(argv + ["--no-chat", "--max-model-len", "32", "--out", out])  # bare prompts: short
    assert [h["iteration"] for h in history] == [1, 2, 3]
    assert [h["weight_version"] for h in history] == [0, 1, 2]  # rollouts of iteration k: the weights after k - 1
    assert all(h["adopted"] == 38 for h in history)  # every tensor of the small model, no copy
    assert max(h["logprob_mismatch"] for h in history) < 1e-4
    for h in history:  # the reward's parts as fractions of the rollouts; correctness 1, format 0.5
        assert 0.0 <= h["correct"] <= 1.0 and 0.0 <= h["format"] <= 1.0
        assert h["mean_reward"] == pytest.approx(h["correct"] + rl_grpo.FORMAT_WEIGHT * h["format"])
    assert os.path.getsize(os.path.join(out, "grpo_reward.png")) > 0
    with open(os.path.join(out, "grpo.json")) as f:
        saved = json.load(f)
    assert saved["iterations"] == history
    assert [e["steps"] for e in saved["evals"]] == [0, 3]  # the fixed sums, greedy, before and after training


def test_trainer_and_engine_on_different_shardings(tmp_path):
    """--engine-tp 2: the engine tensor-parallel over two virtual devices, the trainer data-parallel
    over four (params replicated, rollouts split); every update reshards (nothing adopted) and the
    logprobs still agree."""
    argv = [
        "--model",
        str(resources.small_checkpoint()),
        "--iterations",
        "2",
        "--prompts",
        "2",
        "--group",
        "2",
        "--eval-prompts",
        "4",
    ]
    history = rl_grpo.main(argv + ["--no-chat", "--max-model-len", "32", "--engine-tp", "2", "--out", str(tmp_path)])
    assert [h["adopted"] for h in history] == [0, 0]
    assert [h["weight_version"] for h in history] == [0, 1]
    assert max(h["logprob_mismatch"] for h in history) < 1e-4


def test_the_reward_reads_the_last_number_and_the_format():
    assert rl_grpo.reward("14", "14") == 1.5  # correct, and the number alone
    assert rl_grpo.reward(" 14.", "14") == 1.5
    assert rl_grpo.reward("8 + 6 = 14", "14") == 1.0  # correct, not the number alone
    assert rl_grpo.reward("The answer is 14.", "14") == 1.0
    assert rl_grpo.reward("14", "14", finish_reason="length") == 1.0  # cut off: not known to be alone
    assert rl_grpo.reward("8 + 6 = 15", "14") == 0.0
    assert rl_grpo.reward("15", "14") == 0.5  # the format alone
    assert rl_grpo.reward("fourteen", "14") == 0.0
