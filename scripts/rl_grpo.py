"""GRPO with optax, rollouts through the engine (issue 53, part 5; docs/training_loop.md).

    python scripts/rl_grpo.py [--model PATH] [--iterations 30] [--prompts 4] [--group 8] [--out out/grpo]

Each iteration: sample a group of completions per prompt through `LLM.chat` (each row its own seed:
one seed shared by a group would draw the same completion for all of it and leave every advantage
zero), reward them on a task a small model can learn (the sum of two one-digit numbers), take one
clipped policy-gradient step (GRPO: advantages are rewards normalised within each prompt's group)
through the dense forward (`forward_dense`), and hand the new params to the engine with
`update_weights` (the trainer's arrays are adopted without a copy; the train step donates the old
ones, which the engine then no longer serves).

The reward has two parts, both verifiable: correctness (1 when the last number of the completion is
the sum: "8 + 6 = 14" and "14" both count) and format (0.5 when the completion is that number alone,
ended by the model's end of turn). The rollouts sample at --temperature from the distribution the
engine reports logprobs of (`logprobs_mode="processed_logprobs"`: after temperature), and the trainer
scores the same distribution (its logits divided by the temperature), so the importance ratio starts
at 1; there is no KL term (beta = 0, as DAPO and Dr. GRPO) and one gradient step per batch.

Printed per iteration: rollout / train / sync seconds, the mean reward with its correctness and
format parts, the groups with mixed rewards (only those carry a gradient), and the largest
difference between the engine's rollout logprobs and the trainer's on the same weights. The curve
is saved as PNG and JSON in --out.
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


FORMAT_WEIGHT = 0.5  # the format part's share of the reward; correctness gives 1


def correct(text: str, answer: str) -> bool:
    """The last number of the completion is the answer ("8 + 6 = 14", "The answer is 14.", "14")."""
    found = re.findall(r"\d+", text)
    return bool(found) and found[-1] == answer


def well_formed(text: str, finish_reason: str | None) -> bool:
    """The completion is a number alone (a final period allowed), ended by the model itself (EOS or
    end of turn), not cut off by max_tokens."""
    return finish_reason == "stop" and re.fullmatch(r"\s*\d+\s*\.?\s*", text) is not None


def reward(text: str, answer: str, finish_reason: str | None = "stop") -> float:
    """Correctness (1) plus format (FORMAT_WEIGHT): in [0, 1.5]."""
    return float(correct(text, answer)) + FORMAT_WEIGHT * float(well_formed(text, finish_reason))


STYLES = {  # the chat each sum is asked as: (system turn, user turn)
    "question": ("Answer with the number only.", "What is {a}+{b}?"),
    # The model answers a bare number more often here (about 8% of samples at temperature 0.7 against
    # none), so the format part of the reward can be learned too.
    "calculator": ("You are a calculator. Reply with the result only.", "{a}+{b}"),
}


def question(prompt: str, style: str = "question") -> list[dict]:
    """The chat the model is asked (an instruct model answers a question, not a bare "3+4="); a short
    system turn of our own keeps the prompt at 27-29 tokens (the template's default one makes it 43,
    and the train step's cost grows with the width)."""
    system, user = STYLES[style]
    a, b = prompt[:-1].split("+")
    return [{"role": "system", "content": system}, {"role": "user", "content": user.format(a=a, b=b)}]


def token_logprobs(params, tokens, positions, cfg, temperature: float):
    """f32[B, K]: log p(tokens[b, positions[b, k] + 1] | the tokens before) under the dense forward, of
    the distribution the rollouts sampled from (logits / temperature). Only the completions' positions
    reach the vocabulary-wide head (`logits_at`): the prompts' logits are never needed."""
    logits = forward_dense(params, tokens, cfg=cfg, logits_at=positions) / temperature
    targets = jnp.take_along_axis(tokens, positions + 1, axis=1)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]


def make_train_step(cfg, optimizer, temperature: float, clip: float = 0.2):
    def loss_fn(params, tokens, positions, mask, advantages, old_logprobs):
        logprobs = token_logprobs(params, tokens, positions, cfg, temperature)
        ratio = jnp.exp(logprobs - old_logprobs)
        a = advantages[:, None]
        objective = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - clip, 1 + clip) * a)
        return -jnp.sum(objective * mask) / jnp.maximum(jnp.sum(mask), 1.0), logprobs

    def step(params, opt_state, tokens, positions, mask, advantages, old_logprobs):
        (loss, logprobs), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, tokens, positions, mask, advantages, old_logprobs
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, logprobs

    # The old params and optimizer state are donated: the engine serves the new ones from update_weights on.
    return jax.jit(step, donate_argnums=(0, 1))


def batch_of(rollouts: list[tuple[list[int], list[int], np.ndarray]], width: int, k: int):
    """Pad (prompt ids, completion ids, completion logprobs) rows to tokens i32[B, width]; the positions
    i32[B, k] whose next token is a completion token, the mask of those that are, and the engine's
    logprobs of those tokens (aligned with token_logprobs). `width` holds every prompt and k tokens."""
    B = len(rollouts)
    tokens = np.zeros((B, width), np.int32)
    positions = np.zeros((B, k), np.int32)
    mask = np.zeros((B, k), np.float32)
    old = np.zeros((B, k), np.float32)
    for i, (prompt, completion, logprobs) in enumerate(rollouts):
        n = len(completion)
        if len(prompt) + k > width or n > k:
            raise ValueError(f"a rollout of {len(prompt)} + {n} tokens does not fit {width} (k = {k})")
        tokens[i, : len(prompt) + n] = prompt + completion
        positions[i] = np.minimum(len(prompt) - 1 + np.arange(k), width - 2)  # past the end: masked
        mask[i, :n] = 1.0
        old[i, :n] = logprobs
    return tokens, positions, mask, old


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model directory (default: the default model)")
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per iteration")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--max-tokens", type=int, default=10, help='"8 + 6 = 14" and its end of turn fit in 10')
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--lr", type=float, default=1e-5, help="Adam's, full fine-tuning")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=64)
    ap.add_argument("--show", type=int, default=0, help="print this many rollouts of each iteration")
    ap.add_argument(
        "--eval-every",
        type=int,
        default=5,
        help="greedy answers to --eval-prompts fixed sums before training, every this many steps and at the end",
    )
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--out", default="out/grpo")
    ap.add_argument("--no-chat", dest="chat", action="store_false", help='bare "3+4=" prompts, no chat template')
    ap.add_argument("--style", choices=sorted(STYLES), default="question", help="how the chat asks each sum")
    ap.add_argument(
        "--engine-tp",
        type=int,
        default=1,
        help="the engine tensor-parallel over this many devices while the trainer is data-parallel over all of "
        "them (params replicated, each device a slice of the rollouts): every update_weights reshards (on a "
        "CPU: 4 virtual devices)",
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
        logprobs_mode="processed_logprobs",  # of the distribution sampled from: after the temperature
    )
    cfg = llm.model_config
    # The trainer's own copy of the weights and its optimizer state, made by jitted functions so that they
    # are placed as the train step's outputs will be (one compile of the step, not two): on the engine's
    # devices and shardings, or (--engine-tp) replicated over every device, shardings the engine does not use.
    copy = lambda p: jax.tree.map(lambda x: x + 0, p)
    rows = None  # --engine-tp: the rollouts' sharding, split over every device (a data-parallel trainer)
    if args.engine_tp > 1:
        mesh = Mesh(np.asarray(jax.devices()), ("all",))
        if (args.prompts * args.group) % mesh.size:
            raise SystemExit(f"--prompts x --group must be a multiple of the {mesh.size} devices with --engine-tp")
        rows = NamedSharding(mesh, PartitionSpec("all"))
        params = jax.jit(copy)(jax.device_put(llm.runner.params, NamedSharding(mesh, PartitionSpec())))
    else:
        params = jax.jit(copy)(llm.runner.params)
    # Adam with the global gradient norm clipped at 1 (TRL's GRPO default max_grad_norm).
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(args.lr))
    opt_state = jax.jit(optimizer.init)(params)
    train_step = make_train_step(cfg, optimizer, args.temperature)
    llm.update_weights(params, weight_version=0)  # the engine serves the trainer's arrays from now on
    rng = np.random.default_rng(args.seed)
    history: list[dict] = []
    os.makedirs(args.out, exist_ok=True)
    fixed = task(np.random.default_rng(args.seed + 1), args.eval_prompts)  # the same sums at every evaluation
    evals = [evaluate(llm, fixed, args, steps=0)]
    for it in range(args.iterations):
        problems = task(rng, args.prompts)
        prompts = [p for p, _ in problems for _ in range(args.group)]
        seeds = rng.integers(2**31, size=len(prompts))
        sampling = [
            SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, logprobs=0, seed=int(s))
            for s in seeds
        ]
        start = time.perf_counter()
        if args.chat:
            outs = llm.chat([question(p, args.style) for p in prompts], sampling, use_tqdm=False)
        else:
            outs = llm.generate(prompts, sampling, use_tqdm=False)
        rollout_s = time.perf_counter() - start
        answers = [a for _, a in problems for _ in range(args.group)]
        texts = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
        right = np.asarray([correct(t, a) for (t, _), a in zip(texts, answers)], np.float32)
        formed = np.asarray([well_formed(t, f) for t, f in texts], np.float32)
        rewards = right + FORMAT_WEIGHT * formed
        grouped = rewards.reshape(args.prompts, args.group)
        advantages = ((grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, keepdims=True) + 1e-4)).reshape(-1)
        rollouts = [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].sampled_logprobs()) for o in outs]
        # One width while the prompts keep their length (one compile of the train step), a multiple of 8.
        width = -(-(max(len(p) for p, _, _ in rollouts) + args.max_tokens) // 8) * 8
        batch = (*batch_of(rollouts, width, args.max_tokens), advantages.astype(np.float32))
        tokens, positions, mask, old, advantages = batch if rows is None else jax.device_put(batch, rows)
        start = time.perf_counter()
        params, opt_state, loss, trainer_logprobs = train_step(
            params, opt_state, tokens, positions, mask, advantages, old
        )
        loss = float(loss)
        train_s = time.perf_counter() - start
        # The trainer's logprobs of the rollouts, on the weights that sampled them (before this step).
        mismatch = float(np.max(np.abs(np.asarray(trainer_logprobs) - np.asarray(old)) * np.asarray(mask)))
        start = time.perf_counter()
        report = llm.update_weights(params, weight_version=it + 1)
        sync_s = time.perf_counter() - start
        record = {
            "iteration": it + 1,
            "mean_reward": float(rewards.mean()),
            "correct": float(right.mean()),
            "format": float(formed.mean()),
            "mixed_groups": int(np.sum(grouped.min(1) < grouped.max(1))),
            "completion_tokens": float(np.mean([len(o.outputs[0].token_ids) for o in outs])),
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
            f"iter {it + 1:4d}  reward {record['mean_reward']:.3f} (correct {record['correct']:.2f}, "
            f"format {record['format']:.2f}, mixed groups {record['mixed_groups']}/{args.prompts})  "
            f"loss {loss:+.4f}  rollout {rollout_s:.2f}s  train {train_s:.2f}s  "
            f"sync {sync_s * 1e3:.1f}ms ({report.adopted} adopted)  logprob mismatch {mismatch:.1e}",
            flush=True,
        )
        for (text, reason), a in list(zip(texts, answers))[:: max(1, len(texts) // max(1, args.show))][: args.show]:
            print(f"    {a:>3} <- {text!r} ({reason})", flush=True)
        if (it + 1) % args.eval_every == 0 or it + 1 == args.iterations:
            evals.append(evaluate(llm, fixed, args, steps=it + 1))
    with open(os.path.join(args.out, "grpo.json"), "w") as f:
        json.dump({"args": vars(args), "iterations": history, "evals": evals}, f, indent=1)
    plot(history, evals, os.path.join(args.out, "grpo_reward.png"))
    llm.close()
    return history


def evaluate(llm, problems: list[tuple[str, str]], args, steps: int) -> dict:
    """Greedy answers to fixed sums (not trained on as such: each iteration draws its own): the fraction
    correct and the fraction that is the number alone, on the weights after `steps` train steps."""
    prompts = [p for p, _ in problems]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    if args.chat:
        outs = llm.chat([question(p, args.style) for p in prompts], greedy, use_tqdm=False)
    else:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
    texts = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
    result = {
        "steps": steps,
        "correct": float(np.mean([correct(t, a) for (t, _), (_, a) in zip(texts, problems)])),
        "format": float(np.mean([well_formed(t, f) for t, f in texts])),
        "seconds": time.perf_counter() - start,
        "examples": [t for t, _ in texts[:4]],
    }
    print(
        f"eval after {steps} steps: greedy correct {result['correct']:.2f}, number alone {result['format']:.2f} "
        f"({len(prompts)} fixed sums, {result['seconds']:.1f}s); e.g. {result['examples']}",
        flush=True,
    )
    return result


def plot(history: list[dict], evals: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = max(1, len(history) // 10)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = np.arange(1, len(history) + 1)
    parts = [  # the reward, then its two parts as fractions of the rollouts (drawn under it where they coincide)
        ("mean_reward", "mean reward", 3.0, "-"),
        ("correct", "correct (1)", 1.2, ":"),
        ("format", "number alone (0.5)", 1.2, ":"),
    ]
    for key, label, width, style in parts:
        values = np.asarray([h.get(key, np.nan) for h in history])
        line = ax.plot(x, values, alpha=0.25, linewidth=1)[0]
        smooth = np.convolve(values, np.ones(window) / window, mode="valid")
        ax.plot(
            x[window - 1 :], smooth, style, color=line.get_color(), linewidth=width, label=f"{label}, mean of {window}"
        )
    steps = [e["steps"] for e in evals]
    ax.plot(steps, [e["correct"] for e in evals], "k--o", markersize=3, label="greedy on fixed sums: correct")
    ax.set_xlabel("iteration (greedy evals: after that many steps)")
    ax.set_ylabel("reward / fraction of rollouts")
    ax.set_title("GRPO through jaxserve: sum of two digits")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
