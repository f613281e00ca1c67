"""Train the shipped default model and its draft on the Python standard library, with jaxserve's own model code.

    python scripts/train_small_model.py --work-dir ~/.cache/jaxserve/train --out checkpoints

Steps (each resumable: rerunning the same command continues where it stopped):
1. a sentencepiece BPE tokenizer (byte fallback) on the training split of the stdlib sources;
2. the corpus tokenized once (documents = files, each <s> ... </s>), cached as .npy;
3. the target and the draft trained with AdamW (warm-up + cosine), seeded batches drawn per step,
   held-out loss logged every `--eval-every` steps, training state saved with orbax;
3b. optionally (`--copy-steps N`, off in the shipped recipe) a copy stage of N more steps at a
   constant `--copy-lr`: each row ends with a training-split function, a comment asking for it
   again, and the function re-typed, to teach the model to copy code it was shown (what editing code
   in a prompt needs and n-gram speculation exploits; the 2000-step model re-types ~30% of a copy's
   tokens). It has not helped enough yet to ship: see docs/BENCHMARKS.md, speculative decoding;
3c. optionally (`--copy-every N`, off in the shipped recipe) the same copy batches mixed into the
   main run, one step in N, some of their rows (`--copy-repeats R`) a random segment repeated
   instead (repeat_row); tried, not shipped either (same place);
4. `checkpoints/small` and `checkpoints/small-draft` written: orbax params in bfloat16, HF
   config.json, tokenizer, generation_config.json, README.md; plus the loss curves (PNG, JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from corpus import HELDOUT_PERCENT, iter_texts  # noqa: E402  (this directory)

VOCAB_SIZE = 8192
BOS, EOS = 1, 2  # sentencepiece ids from tokenizer_training.SENTENCEPIECE_SPECIALS
SCORE_FILE = "heldout_score.py"  # the held-out file the checkpoint README quotes a loss for


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    steps: int
    peak_lr: float
    copy_steps: int = 0  # the optional copy stage, after `steps` (see copy_batch_at)
    copy_lr: float = 3e-4  # its constant learning rate
    copy_every: int = 0  # if > 0, every copy_every-th step of the main run is a copy batch
    copy_repeats: int = 0  # rows of each copy batch that are repeat_row's instead of function copies

    def hf_config(self, max_len: int) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": VOCAB_SIZE,
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.hidden // self.heads,
            "hidden_act": "silu",
            "max_position_embeddings": max_len,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": BOS,
            "eos_token_id": EOS,
            "pad_token_id": 3,
            "torch_dtype": "float32",  # the training dtype; the stored weights are bfloat16 (see manifest)
        }


# Sized for 2 CPU cores: ~4M tokens (2000 steps) take about 1 h 45 min on a quiet machine (target
# ~2.2 s/step, draft ~0.8 s/step); `--steps 800` fits in about an hour but reaches only perplexity
# ~80, whose greedy completions do not parse as Python. At these budgets a 4-layer model reaches a
# lower held-out loss than a deeper one. The draft is ~4x cheaper per token.
SHAPES = {
    "small": ModelShape("small", layers=4, hidden=256, heads=4, kv_heads=2, ffn=768, steps=2000, peak_lr=3e-3),
    "small-draft": ModelShape(
        "small-draft", layers=1, hidden=128, heads=2, kv_heads=1, ffn=384, steps=2000, peak_lr=3e-3
    ),
}


# ----------------------------------------------------------------------------- data


def build_tokenizer(work: Path, max_bytes: int) -> Path:
    from tokenizer_training import train_tokenizer

    out = work / "tokenizer"
    if not (out / "tokenizer.model").is_file():
        t0 = time.time()
        train_tokenizer(out, VOCAB_SIZE, "sentencepiece", max_bytes=max_bytes, split="train")
        print(f"tokenizer: trained on {max_bytes / 1e6:.0f} MB of the training split in {time.time() - t0:.0f}s")
    return out


def tokenize_split(work: Path, tokenizer_dir: Path, split: str) -> np.ndarray:
    """All files of `split` as one id stream, each file wrapped in <s> ... </s>."""
    cache = work / f"{split}_tokens.npy"
    if cache.is_file():
        return np.load(cache)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "tokenizer.model"))
    keys, texts = zip(*iter_texts(split))
    ids = sp.encode(list(texts), num_threads=2)
    stream = np.concatenate([np.asarray([BOS] + d + [EOS], np.uint16) for d in ids])
    np.save(cache, stream)
    print(f"corpus {split}: {len(keys)} files, {stream.size / 1e6:.2f}M tokens")
    return stream


def batch_at(stream: np.ndarray, step: int, batch: int, seq: int, seed: int) -> np.ndarray:
    """Batch `step`: random windows of seq+1 tokens; a pure function of (seed, step), so resuming
    draws exactly the batches an uninterrupted run would."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, stream.size - seq - 1, size=batch)
    return np.stack([stream[s : s + seq + 1] for s in starts]).astype(np.int32)


def eval_windows(stream: np.ndarray, count: int, seq: int) -> np.ndarray:
    """`count` evenly spaced, fixed held-out windows."""
    starts = np.linspace(0, stream.size - seq - 2, count).astype(np.int64)
    return np.stack([stream[s : s + seq + 1] for s in starts]).astype(np.int32)


# Comments that introduce a re-typed function in copy-stage rows (one drawn per row).
COPY_PROMPTS = (
    "\n\n# The same function, copied unchanged:\n",
    "\n\n# Again, exactly as above:\n",
    "\n\n# A verbatim copy of the function above:\n",
    "\n\n# Repeated without changes:\n",
)
COPY_MIN_LINES, COPY_MAX_LINES = 6, 60


def copy_examples(sp, split: str, max_tokens: int, seed: int) -> list[np.ndarray]:
    """Token ids of "function, copy prompt, the same function" for `split`'s top-level functions that
    fit in `max_tokens` (one prompt per function, drawn with `seed`)."""
    from corpus import top_level_functions

    rng = np.random.default_rng(seed)
    found = []
    for f in top_level_functions(split, COPY_MIN_LINES, COPY_MAX_LINES):
        ids = sp.encode(f + COPY_PROMPTS[rng.integers(len(COPY_PROMPTS))] + f + "\n")
        if len(ids) <= max_tokens:
            found.append(np.asarray(ids, np.int32))
    return found


def copy_batch_at(
    examples: list[np.ndarray], stream: np.ndarray, step: int, batch: int, seq: int, seed: int, repeats: int = 0
) -> np.ndarray:
    """Copy batch `step`: each row a copy example preceded by a random window of plain text up to seq+1
    tokens, except the last `repeats` rows, which are repeat_row's; a pure function of (seed, step)
    like batch_at (the function rows do not depend on `repeats`)."""
    rng = np.random.default_rng([seed, step, 1])
    rows = []
    for i in rng.integers(0, len(examples), size=batch):
        fill = seq + 1 - len(examples[i])
        start = int(rng.integers(0, stream.size - fill))
        rows.append(np.concatenate([stream[start : start + fill].astype(np.int32), examples[i]]))
    repeat_rng = np.random.default_rng([seed, step, 2])
    for r in range(batch - repeats, batch):
        rows[r] = repeat_row(repeat_rng, stream, seq + 1)
    return np.stack(rows)


def repeat_row(rng: np.random.Generator, stream: np.ndarray, length: int) -> np.ndarray:
    """A short window of plain text, then one segment of 16-128 uniformly random token ids repeated to
    the row's end. After its first occurrence the segment is predictable only by looking back for the
    previous token and copying what followed it (an induction head), the circuit a model needs to
    re-type code from its prompt. (The 5M model did not form it in a few hundred steps of such rows.)"""
    fill = int(rng.integers(0, length // 4))
    start = int(rng.integers(0, stream.size - fill))
    segment = rng.integers(4, VOCAB_SIZE, size=int(rng.integers(16, 129))).astype(np.int32)
    body = np.tile(segment, -(-(length - fill) // segment.size))[: length - fill]
    return np.concatenate([stream[start : start + fill].astype(np.int32), body])


@functools.lru_cache(maxsize=None)
def greedy_predictions(cfg):
    """The jitted argmax next tokens of `cfg`'s model, one per config: copy_accuracy runs at every
    evaluation of a run that trains copying, and compiles only the first time."""
    import jax
    import jax.numpy as jnp

    from jaxserve.model.llama import forward_dense

    return jax.jit(lambda params, tokens: jnp.argmax(forward_dense(params, tokens, cfg=cfg), axis=-1))


def copy_accuracy(cfg, params, examples: list[np.ndarray], length: int) -> float:
    """Share of the copies' tokens the model predicts exactly (greedy, given the true prefix): about the
    acceptance rate n-gram speculation sees when the model re-types code from its prompt. Examples are
    right-padded to `length` (causal attention: padding never affects the scored positions)."""
    import jax.numpy as jnp

    predicted = greedy_predictions(cfg)
    right = total = 0
    for ids in examples:
        padded = np.zeros((1, length), np.int32)
        padded[0, : len(ids)] = ids
        guess = np.asarray(predicted(params, jnp.asarray(padded)))[0, : len(ids) - 1]
        n = (len(ids) - 1) // 2  # the second half: the copy (and a little of the prompt)
        right += int((guess[-n:] == ids[1:][-n:]).sum())
        total += n
    return right / total


# ----------------------------------------------------------------------------- training


def make_fns(cfg, shape: ModelShape, args):
    import jax
    import jax.numpy as jnp
    import optax

    from jaxserve.model.llama import forward_dense

    warmup = min(args.warmup, shape.steps // 2)
    main_schedule = optax.warmup_cosine_decay_schedule(0.0, shape.peak_lr, warmup, shape.steps, shape.peak_lr * 0.1)
    schedule = lambda count: jnp.where(count < shape.steps, main_schedule(count), shape.copy_lr)  # noqa: E731
    # Decay matrices only: norms (1-D) keep their scale.
    decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731
    opt = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask)
    )

    def loss_fn(params, tokens):
        logits = forward_dense(params, tokens[:, :-1], cfg=cfg)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        return nll.mean()

    @jax.jit
    def train_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return opt, train_step, jax.jit(loss_fn)


def train_model(
    shape: ModelShape,
    train: np.ndarray,
    heldout: np.ndarray,
    copies: list[np.ndarray],
    heldout_copies: list[np.ndarray],
    work: Path,
    args,
) -> tuple:
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from jaxserve.config import ModelConfig
    from jaxserve.model.weights import init_dummy_params, unstack_layers

    cfg = ModelConfig.from_hf_dict(shape.hf_config(args.max_len))
    opt, train_step, eval_loss = make_fns(cfg, shape, args)
    params = unstack_layers(init_dummy_params(cfg, args.seed, jnp.float32, std=0.02))
    state = {"params": params, "opt_state": opt.init(params), "step": 0}
    log: list[dict] = []
    manager = ocp.CheckpointManager(
        (work / shape.name / "state").absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=1)
    )
    if manager.latest_step() is not None:
        state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(state))
        log = json.loads((work / shape.name / "log.json").read_text())
        print(f"{shape.name}: resumed at step {int(state['step'])}")
    windows = eval_windows(heldout, args.eval_windows, args.seq)

    def evaluate(params) -> float:
        return float(
            np.mean(
                [
                    eval_loss(params, jnp.asarray(windows[i : i + args.batch]))
                    for i in range(0, len(windows), args.batch)
                ]
            )
        )

    params, opt_state, step = state["params"], state["opt_state"], int(state["step"])
    n_params = sum(x.size for x in jax.tree.leaves(params))
    total = shape.steps + shape.copy_steps
    copy_shape = f"{args.batch // 2}x{2 * args.seq}"
    print(
        f"{shape.name}: {n_params / 1e6:.2f}M params, {shape.steps} steps of {args.batch}x{args.seq} tokens"
        + (f", one in {shape.copy_every} a copy batch of {copy_shape}" if shape.copy_every else "")
        + (f" then {shape.copy_steps} copy-stage steps of {copy_shape}" if shape.copy_steps else "")
    )
    t0, losses = time.time(), []
    while step < total:
        mixed_in = shape.copy_every and step % shape.copy_every == shape.copy_every - 1
        if step < shape.steps and not mixed_in:
            tokens = jnp.asarray(batch_at(train, step, args.batch, args.seq, args.seed))
        else:  # same tokens per step: half the rows, twice as long (a function and its copy fit)
            tokens = jnp.asarray(
                copy_batch_at(copies, train, step, args.batch // 2, 2 * args.seq, args.seed, shape.copy_repeats)
            )
        params, opt_state, loss = train_step(params, opt_state, tokens)
        losses.append(loss)
        step += 1
        if step % args.eval_every == 0 or step in (shape.steps, total):
            entry = {
                "step": step,
                "train_loss": float(np.mean([float(x) for x in losses])),
                "heldout_loss": evaluate(params),
                "seconds": round(time.time() - t0, 1),
            }
            if copies:  # the copying curve, when copying is trained
                entry["copy_accuracy"] = copy_accuracy(cfg, params, heldout_copies, 2 * args.seq)
            losses = []
            log.append(entry)
            print(
                f"{shape.name} step {step}: train {entry['train_loss']:.3f} heldout {entry['heldout_loss']:.3f} "
                + (f"copying {100 * entry['copy_accuracy']:.1f}% " if copies else "")
                + f"({entry['seconds']:.0f}s this session)",
                flush=True,
            )
            manager.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state, "step": step}))
            manager.wait_until_finished()
            (work / shape.name / "log.json").write_text(json.dumps(log, indent=1))
    manager.close()
    return cfg, params, log


# ----------------------------------------------------------------------------- export


def mean_loss(cfg, params, windows: np.ndarray, batch: int) -> float:
    """Mean next-token loss (f32) over rows of token ids (all the same length)."""
    import jax
    import jax.numpy as jnp

    from jaxserve.model.llama import forward_dense

    @jax.jit
    def loss(params, tokens):
        logp = jax.nn.log_softmax(forward_dense(params, tokens[:, :-1], cfg=cfg))
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

    return float(np.mean([loss(params, jnp.asarray(windows[i : i + batch])) for i in range(0, len(windows), batch)]))


def greedy_agreement(cfg_a, params_a, cfg_b, params_b, windows: np.ndarray, batch: int) -> float:
    """Fraction of positions where two models' argmax next tokens agree: the acceptance rate a draft
    would get in greedy speculative decoding against a target, at every position of `windows`."""
    import jax
    import jax.numpy as jnp

    from jaxserve.model.llama import forward_dense

    @jax.jit
    def same(pa, pb, tokens):
        a = jnp.argmax(forward_dense(pa, tokens, cfg=cfg_a), axis=-1)
        return jnp.mean((a == jnp.argmax(forward_dense(pb, tokens, cfg=cfg_b), axis=-1)).astype(jnp.float32))

    return float(
        np.mean(
            [same(params_a, params_b, jnp.asarray(windows[i : i + batch, :-1])) for i in range(0, len(windows), batch)]
        )
    )


def as_shipped(params):
    """The params as the checkpoint stores them (bfloat16), back in f32: what the README's figures describe."""
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)


def export(shape: ModelShape, cfg, params, log, tokenizer_dir: Path, out: Path, args, extra_readme: str) -> None:
    import jax
    import jax.numpy as jnp

    from jaxserve.loading.orbax_checkpoint import save_params

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    hf = shape.hf_config(args.max_len)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": 3, "do_sample": False}, indent=2) + "\n"
    )
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    save_params(
        str(out),
        jax.tree.map(lambda x: x.astype(jnp.bfloat16), params),
        stored_dtypes=["bfloat16"],
        trained_steps=log[-1]["step"],
    )
    final = log[-1]
    copy_mix = (
        f"; one step in {shape.copy_every} a copy batch ({shape.copy_repeats} of its {args.batch // 2} rows "
        f"repeated random segments)"
        if shape.copy_every
        else ""
    )
    copy_stage = copy_mix + (
        f"; then a copy stage of {shape.copy_steps} steps x {args.batch // 2} x {2 * args.seq} "
        f"tokens at lr {shape.copy_lr:g}"
        if shape.copy_steps
        else ""
    )
    (out / "README.md").write_text(f"""# {shape.name}

A Llama-architecture model trained by jaxserve on the Python standard library sources of CPython
{sys.version.split()[0]} (`*.py` files; {HELDOUT_PERCENT}% of files held out by a hash of their path,
see `scripts/corpus.py`), with jaxserve's own model code.

| | |
| --- | --- |
| parameters | {sum(x.size for x in jax.tree.leaves(params)) / 1e6:.2f}M ({shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, {shape.kv_heads} KV heads, FFN {shape.ffn}, tied embeddings) |
| tokenizer | sentencepiece BPE, {VOCAB_SIZE} pieces, byte fallback |
| training | {shape.steps} steps x {args.batch} x {args.seq} tokens, AdamW, peak lr {shape.peak_lr}, f32{copy_stage} |
| held-out loss | {final["heldout_loss"]:.4f} nats/token (perplexity {math.exp(final["heldout_loss"]):.2f}) on {args.eval_windows} fixed windows of {args.seq} tokens |
| weights | bfloat16, orbax (`params/`), layout version in `jaxserve_checkpoint.json` |
{extra_readme}
Made by: `python scripts/train_small_model.py {" ".join(args.argv)}`
""")


def plot(logs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, log in logs.items():
        steps = [e["step"] for e in log]
        ax.plot(steps, [e["train_loss"] for e in log], label=f"{name} train")
        ax.plot(steps, [e["heldout_loss"] for e in log], "--", label=f"{name} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_ylim(top=min(8.0, ax.get_ylim()[1]))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", default="~/.cache/jaxserve/train", help="tokens, training state, logs")
    ap.add_argument("--out", default="checkpoints", help="writes OUT/small and OUT/small-draft")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=2048, help="max_position_embeddings of the shipped config")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--tokenizer-bytes", type=int, default=16_000_000)
    ap.add_argument("--steps", type=int, default=None, help="override both models' step counts (smoke runs)")
    ap.add_argument("--copy-steps", type=int, default=None, help="override both models' copy-stage steps")
    ap.add_argument("--copy-lr", type=float, default=None, help="override both models' copy-stage learning rate")
    ap.add_argument(
        "--copy-every",
        type=int,
        default=None,
        help="override both models' copy mix: every N-th main-run step is a copy batch (0: none)",
    )
    ap.add_argument(
        "--copy-repeats",
        type=int,
        default=None,
        help="override both models' number of repeated-random-segment rows per copy batch",
    )
    ap.add_argument("--only", choices=sorted(SHAPES), default=None, help="train just this model")
    args = ap.parse_args(argv)
    args.argv = argv
    work = Path(os.path.expanduser(args.work_dir))
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    tokenizer_dir = build_tokenizer(work, args.tokenizer_bytes)
    train, heldout = tokenize_split(work, tokenizer_dir, "train"), tokenize_split(work, tokenizer_dir, "heldout")

    shapes = [SHAPES[args.only]] if args.only else list(SHAPES.values())
    if args.steps:
        shapes = [dataclasses.replace(s, steps=args.steps) for s in shapes]
    copy_flags = {name: getattr(args, name) for name in ("copy_steps", "copy_lr", "copy_every", "copy_repeats")}
    shapes = [dataclasses.replace(s, **{k: v for k, v in copy_flags.items() if v is not None}) for s in shapes]
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "tokenizer.model"))
    copy_len = 2 * args.seq
    copies = (
        copy_examples(sp, "train", copy_len - 32, args.seed)  # at least 33 tokens of plain text first
        if any(s.copy_steps or s.copy_every for s in shapes)
        else []
    )
    heldout_copies = copy_examples(sp, "heldout", copy_len, args.seed)
    results = {s.name: train_model(s, train, heldout, copies, heldout_copies, work, args) for s in shapes}

    out = Path(args.out)
    # The score file: the first held-out file of 500-1500 tokens (the checkpoint test scores it).
    score_key, score_text, score_ids = next(
        (k, t, ids) for k, t in iter_texts("heldout") if 500 <= len(ids := [BOS] + sp.encode(t) + [EOS]) <= 1500
    )
    windows = eval_windows(heldout, args.eval_windows, args.seq)
    agreement = None
    if {"small", "small-draft"} <= set(results):
        (cfg_t, p_t, _), (cfg_d, p_d, _) = results["small"], results["small-draft"]
        agreement = greedy_agreement(cfg_t, as_shipped(p_t), cfg_d, as_shipped(p_d), windows, args.batch)
    for shape in shapes:
        cfg, params, log = results[shape.name]
        shipped = as_shipped(params)
        score = mean_loss(cfg, shipped, np.asarray([score_ids]), 1)
        shipped_heldout = mean_loss(cfg, shipped, windows, args.batch)
        copying = copy_accuracy(cfg, shipped, heldout_copies, copy_len)
        extra = (
            f"| held-out loss of the stored bf16 weights | {shipped_heldout:.4f} (perplexity "
            f"{math.exp(shipped_heldout):.2f}) |\n"
            f"| `default/{SCORE_FILE}` | the held-out stdlib file `{score_key}`, {len(score_ids)} tokens with <s> and "
            f"</s>: mean loss {score:.4f} (stored weights, scored in float32) |\n"
            f"| copying | {100 * copying:.1f}% of the tokens of {len(heldout_copies)} held-out functions re-typed "
            f"after a copy prompt predicted exactly (greedy, teacher-forced; `copy_accuracy`) |\n"
        )
        if agreement is not None:
            extra += (
                f"| greedy agreement of the draft with the target | {100 * agreement:.1f}% of next-token "
                f"argmaxes on the held-out windows (the draft's expected greedy acceptance rate) |\n"
            )
        export(shape, cfg, params, log, tokenizer_dir, out / shape.name, args, extra)
        if shape.name == "small":  # one copy, shipped with the target; the draft's README points at it
            (out / shape.name / SCORE_FILE).write_text(score_text)
        print(
            f"{shape.name}: wrote {out / shape.name} (held-out loss {shipped_heldout:.4f} as stored, "
            f"{SCORE_FILE} loss {score:.4f})"
        )
    plot({s.name: results[s.name][2] for s in shapes}, out / "training_loss.png")
    (out / "training_log.json").write_text(json.dumps({s.name: results[s.name][2] for s in shapes}, indent=1))
    print(f"done in {time.time() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
