"""GRPO with optax, rollouts through the engine (issue 53, part 5; docs/training_loop.md).

    python scripts/rl_grpo.py [--model PATH] [--iterations 100] [--prompts 8] [--group 8] [--out out/grpo]

Each iteration: sample a group of completions per prompt through `LLM.generate` (temperature 1, the
sampled tokens' logprobs as arrays), reward them on a task a small model can learn (the sum of two
one-digit numbers, asked through the chat template; the first number in the completion is the answer), take one clipped policy-gradient
step (GRPO: advantages are rewards normalised within each prompt's group) through the dense forward
(`forward_dense`), and hand the new params to the engine with `update_weights` (the trainer's arrays
are adopted without a copy; the train step donates the old ones, which the engine then no longer
serves). Printed per iteration: rollout / train / sync seconds, the mean reward, and the largest
difference between the engine's rollout logprobs and the trainer's on the same weights (they must
agree: the importance ratio starts at 1). The reward curve is saved as PNG and JSON in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # --engine-tp on a CPU
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve import LLM, SamplingParams
from jaxserve.model.llama import forward_dense


def task(rng: np.random.Generator, n: int) -> list[tuple[str, str]]:
    """n (prompt, answer) pairs: "3+4=" and "7"."""
    pairs = rng.integers(0, 10, size=(n, 2))
    return [(f"{a}+{b}=", str(a + b)) for a, b in pairs]


def reward(text: str, answer: str) -> float:
    """1 when the first number in the completion is the answer, else 0."""
    found = re.search(r"\d+", text)
    return float(found is not None and found.group() == answer)


def question(prompt: str) -> list[dict]:
    """The chat the model is asked (an instruct model answers a question, not a bare "3+4=")."""
    return [{"role": "user", "content": f"What is {prompt[:-1]}? Answer with the number only."}]


def token_logprobs(params, tokens, cfg):
    """f32[B, T-1]: log p(tokens[:, t+1] | tokens[:, :t+1]) under the dense forward."""
    logits = forward_dense(params, tokens[:, :-1], cfg=cfg)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, 1:, None], axis=-1)[..., 0]


def make_train_step(cfg, optimizer, clip: float = 0.2):
    def loss_fn(params, tokens, mask, advantages, old_logprobs):
        logprobs = token_logprobs(params, tokens, cfg)
        ratio = jnp.exp(logprobs - old_logprobs)
        a = advantages[:, None]
        objective = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - clip, 1 + clip) * a)
        return -jnp.sum(objective * mask) / jnp.maximum(jnp.sum(mask), 1.0), logprobs

    def step(params, opt_state, tokens, mask, advantages, old_logprobs):
        (loss, logprobs), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, tokens, mask, advantages, old_logprobs
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, logprobs

    # The old params and optimizer state are donated: the engine serves the new ones from update_weights on.
    return jax.jit(step, donate_argnums=(0, 1))


def batch_of(rollouts: list[tuple[list[int], list[int], np.ndarray]], width: int):
    """Pad (prompt ids, completion ids, completion logprobs) rows to [B, width]: tokens, the mask of
    predicted completion tokens and the engine's logprobs at them (aligned with token_logprobs)."""
    B = len(rollouts)
    tokens = np.zeros((B, width), np.int32)
    mask = np.zeros((B, width - 1), np.float32)
    old = np.zeros((B, width - 1), np.float32)
    for i, (prompt, completion, logprobs) in enumerate(rollouts):
        seq = (prompt + completion)[:width]
        tokens[i, : len(seq)] = seq
        start, end = len(prompt) - 1, min(len(seq), width) - 1
        mask[i, start:end] = 1.0
        old[i, start:end] = logprobs[: end - start]
    return tokens, mask, old


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model directory (default: the default model)")
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per iteration")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=64)
    ap.add_argument("--out", default="out/grpo")
    ap.add_argument("--no-chat", dest="chat", action="store_false", help='bare "3+4=" prompts, no chat template')
    ap.add_argument(
        "--engine-tp",
        type=int,
        default=1,
        help="the engine tensor-parallel over this many devices while the trainer keeps its params replicated "
        "over all of them: every update_weights reshards (on a CPU: 4 virtual devices)",
    )
    args = ap.parse_args(argv)

    llm = LLM(
        args.model,
        dtype="float32",
        max_model_len=args.max_model_len,
        max_num_seqs=min(64, args.prompts * args.group),
        max_num_batched_tokens=max(64, args.prompts * args.group),
        page_size=8,
        tensor_parallel_size=args.engine_tp,
    )
    cfg = llm.model_config
    # The trainer's own copy of the weights and its optimizer state, made by jitted functions so that they
    # are placed as the train step's outputs will be (one compile of the step, not two): on the engine's
    # devices and shardings, or (--engine-tp) replicated over every device, shardings the engine does not use.
    copy = lambda p: jax.tree.map(lambda x: x + 0, p)
    if args.engine_tp > 1:
        everywhere = NamedSharding(Mesh(np.asarray(jax.devices()), ("all",)), PartitionSpec())
        params = jax.jit(copy)(jax.device_put(llm.runner.params, everywhere))
    else:
        params = jax.jit(copy)(llm.runner.params)
    optimizer = optax.adam(args.lr)
    opt_state = jax.jit(optimizer.init)(params)
    train_step = make_train_step(cfg, optimizer)
    llm.update_weights(params, weight_version=0)  # the engine serves the trainer's arrays from now on
    rng = np.random.default_rng(args.seed)
    width = args.max_model_len
    history: list[dict] = []
    os.makedirs(args.out, exist_ok=True)
    for it in range(args.iterations):
        problems = task(rng, args.prompts)
        prompts = [p for p, _ in problems for _ in range(args.group)]
        chats = [question(p) for p in prompts]
        sampling = SamplingParams(
            temperature=1.0, max_tokens=args.max_tokens, logprobs=0, seed=int(rng.integers(2**31)), ignore_eos=True
        )
        start = time.perf_counter()
        outs = (
            llm.chat(chats, sampling, use_tqdm=False) if args.chat else llm.generate(prompts, sampling, use_tqdm=False)
        )
        rollout_s = time.perf_counter() - start
        answers = [a for _, a in problems for _ in range(args.group)]
        rewards = np.asarray([reward(o.outputs[0].text, a) for o, a in zip(outs, answers)])
        grouped = rewards.reshape(args.prompts, args.group)
        advantages = ((grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, keepdims=True) + 1e-4)).reshape(-1)
        rows = [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].sampled_logprobs()) for o in outs]
        tokens, mask, old = batch_of(rows, width)
        start = time.perf_counter()
        params, opt_state, loss, trainer_logprobs = train_step(
            params, opt_state, tokens, mask, advantages.astype(np.float32), old
        )
        loss = float(loss)
        train_s = time.perf_counter() - start
        # The trainer's logprobs of the rollouts, on the weights that sampled them (before this step).
        mismatch = float(np.max(np.abs(np.asarray(trainer_logprobs) - old) * mask))
        start = time.perf_counter()
        report = llm.update_weights(params, weight_version=it + 1)
        sync_s = time.perf_counter() - start
        record = {
            "iteration": it + 1,
            "mean_reward": float(rewards.mean()),
            "loss": loss,
            "rollout_s": rollout_s,
            "train_s": train_s,
            "sync_s": sync_s,
            "adopted": report.adopted,
            "logprob_mismatch": mismatch,
            "weight_version": outs[0].weight_version,
        }
        history.append(record)
        print(
            f"iter {it + 1:4d}  reward {record['mean_reward']:.3f}  loss {loss:+.4f}  rollout {rollout_s:.2f}s  "
            f"train {train_s:.2f}s  sync {sync_s * 1e3:.1f}ms ({report.adopted} adopted)  "
            f"logprob mismatch {mismatch:.1e}",
            flush=True,
        )
    with open(os.path.join(args.out, "grpo.json"), "w") as f:
        json.dump(history, f, indent=1)
    plot(history, os.path.join(args.out, "grpo_reward.png"))
    llm.close()
    return history


def plot(history: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rewards = [h["mean_reward"] for h in history]
    window = max(1, len(rewards) // 10)
    smooth = np.convolve(rewards, np.ones(window) / window, mode="valid")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(rewards) + 1), rewards, alpha=0.35, label="mean reward")
    ax.plot(range(window, len(rewards) + 1), smooth, label=f"moving mean ({window})")
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    ax.set_title("GRPO through jaxserve: sum of two digits")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
