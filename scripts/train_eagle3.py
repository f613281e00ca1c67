#!/usr/bin/env python
"""Train an EAGLE-3 head for a target from scripts/eagle3_data.py's data, within a time budget,
resumable, and save it in the speculators format.

The head (jaxserve.model.eagle3) starts as speculators' trainer starts one: its lm_head is the
target's lm_head restricted to the draft vocabulary (frozen unless --train-lm-head), the token
embeddings are the target's (frozen, not saved), and the rest is new; we also start its final norm
from the target's (the lm_head it feeds expects the target's scale). Training runs the
training-time test (scripts/eagle3_ttt.py) with AdamW, linear warm-up then cosine decay, gradient
clipping. Every --checkpoint-minutes the whole state (params, optimizer, data position, log) goes to
--state-dir (DATA/train_state/<OUT's name>, outside the head's folder; written, then renamed); the
same command run again continues from it (same data order, same noise: both derive from the seed,
the epoch and the step). Every --eval-minutes the
held-out split is scored (greedy acceptance by draft position at k = --eval-k, simulated: no engine
needed). At the end: OUT/config.json + model.safetensors (bf16, no embed_tokens),
training_log.json and README.md.

    python scripts/train_eagle3.py --data ~/.cache/jaxserve/eagle3 --out checkpoints/eagle3-smollm2-135m \\
        --time-budget 120
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import eagle3_data

# ---- packed rows from the data's shards ----


@dataclasses.dataclass
class Corpus:
    """Every sequence of a split: (shard arrays, start, end, prompt length) per sequence."""

    shards: list[dict]
    docs: list[tuple[int, int, int, int]]

    @classmethod
    def load(cls, work: Path, split: str, max_docs: int | None = None) -> Corpus:
        shards = [eagle3_data.read_shard(p) for p in eagle3_data.shard_dirs(work, split)]
        docs = [
            (n, int(s["offsets"][j]), int(s["offsets"][j + 1]), int(s["prompt_lens"][j]), 0)
            for n, s in enumerate(shards)
            for j in range(len(s["prompt_lens"]))
        ]
        if not docs:
            raise SystemExit(f"no {split} data under {work}: run scripts/eagle3_data.py first")
        return cls(shards, docs[:max_docs] if max_docs else docs)

    @property
    def tokens(self) -> int:
        return sum(end - start - 1 - skip for _, start, end, _, skip in self.docs)

    def trimmed(self, context: int | None) -> Corpus:
        """The same sequences, each starting `context` indices before its first answer token (all of a
        shorter prompt): the prompt indices carry no loss and are most of a sequence, so training
        spends its time on answers; positions stay the true ones."""
        if not context:
            return self
        docs = [(n, start, end, plen, max(0, plen - 1 - context)) for n, start, end, plen, _ in self.docs]
        return Corpus(self.shards, docs)


def pack(corpus: Corpus, order: list[int], seq_len: int) -> list[list[tuple[int, int]]]:
    """Rows of at most `seq_len` indices: (doc, kept length) first-fit in `order`; a sequence longer
    than a row keeps its first `seq_len` indices."""
    rows: list[list[tuple[int, int]]] = []
    room: list[int] = []
    for d in order:
        _, start, end, _, skip = corpus.docs[d]
        n = min(end - start - 1 - skip, seq_len)  # indices of a sequence of n + 1 tokens
        for r in range(max(0, len(rows) - 8), len(rows)):  # the last few open rows
            if room[r] >= n:
                rows[r].append((d, n))
                room[r] -= n
                break
        else:
            rows.append([(d, n)])
            room.append(seq_len - n)
    return rows


def make_batch(corpus: Corpus, rows: list[list[tuple[int, int]]], seq_len: int) -> dict:
    """Host arrays of eagle3_ttt.Batch for `rows` (each index i: the token at i + 1, aux states at i,
    final state and greedy token at i + 1; counted where the token at i + 1 is an answer token and
    not the sequence's last)."""
    B = len(rows)
    s0 = corpus.shards[0]
    Da, D = s0["aux"].shape[1], s0["final"].shape[1]
    out = {
        "tokens": np.zeros((B, seq_len), np.int32),
        "positions": np.zeros((B, seq_len), np.int32),
        "doc": np.full((B, seq_len), -1, np.int32),
        "aux": np.zeros((B, seq_len, Da), np.float32),
        "final": np.zeros((B, seq_len, D), np.float32),
        "greedy": np.full((B, seq_len), -1, np.int32),
        "mask": np.zeros((B, seq_len), bool),
    }
    for r, row in enumerate(rows):
        at = 0
        for k, (d, n) in enumerate(row):
            shard, start, end, plen, skip = corpus.docs[d]
            s = corpus.shards[shard]
            sl = slice(at, at + n)
            first = start + skip  # the sequence's index `skip` is the row's first
            out["tokens"][r, sl] = s["tokens"][first + 1 : first + 1 + n]
            out["positions"][r, sl] = np.arange(skip + 1, skip + n + 1)
            out["doc"][r, sl] = k
            out["aux"][r, sl] = s["aux"][first : first + n]
            out["final"][r, sl] = s["final"][first + 1 : first + 1 + n]
            out["greedy"][r, sl] = s["greedy"][first + 1 : first + 1 + n]
            index = np.arange(skip + 1, skip + n + 1)  # the position of each index's token
            out["mask"][r, sl] = (index >= plen) & (index < end - start - 1)
            at += n
    return out


def epoch_rows(corpus: Corpus, epoch: int, seed: int, seq_len: int) -> list[list[tuple[int, int]]]:
    order = np.random.default_rng([seed, epoch]).permutation(len(corpus.docs)).tolist()
    rows = pack(corpus, order, seq_len)
    np.random.default_rng([seed, epoch, 1]).shuffle(rows)
    return rows


# ---- the model side ----


def build(args, work: Path):
    """(head cfg, initial trainable params, frozen params, target embed, target lm_head rows)."""
    import jax
    import jax.numpy as jnp

    from jaxserve.model import eagle3

    cfg_t, target, _ = eagle3_data.load_target(args.model)
    d2t = np.load(work / "d2t.npy")
    info = json.loads((work / "target.json").read_text())
    cfg = dataclasses.replace(
        eagle3.Eagle3Config.for_target(cfg_t, len(d2t), tuple(info["aux_layers"])),
        norm_before_residual=args.norm_before_residual,
    )
    head = eagle3.init_params(cfg, jax.random.key(args.seed), jnp.float32, d2t)
    table = target.embed if target.lm_head is None else target.lm_head.T  # [V, D]
    rows = jnp.asarray(table)[jnp.asarray(d2t)].T.astype(jnp.float32)  # [D, Vd]
    head = dataclasses.replace(head, lm_head=rows, norm=jnp.asarray(target.final_norm, jnp.float32))
    return cfg, head, jnp.asarray(target.embed, jnp.float32), rows


def split_params(head, train_lm_head: bool):
    trainable = {"fc": head.fc, "hidden_norm": head.hidden_norm, "layer": head.layer, "norm": head.norm}
    if train_lm_head:
        trainable["lm_head"] = head.lm_head
    return trainable


def join_params(head, trainable):
    return dataclasses.replace(head, **trainable)


_COMPILED: dict = {}  # one compiled pair per (head shape, hyperparameters): runs in one process share them


def make_steps(args, cfg, head, embed, rows, total_steps: int):
    """(optimizer, train_step(trainable, opt_state, batch, step) -> (trainable, opt_state, metrics),
    eval_step(trainable, batch) -> (accepted by position, starts, loss, accuracy by step))."""
    key = (cfg, args.lr, args.warmup, args.weight_decay, args.ttt_steps, args.decay, args.noise_std, args.seed)
    key += (args.eval_k, total_steps)
    if key not in _COMPILED:
        _COMPILED[key] = _compile_steps(args, cfg, total_steps)
    optimizer, train_jit, eval_jit = _COMPILED[key]
    frozen = (head, embed, rows)
    return (
        optimizer,
        lambda trainable, opt_state, batch, step: train_jit(trainable, opt_state, frozen, batch, step),
        lambda trainable, batch: eval_jit(trainable, frozen, batch),
    )


def _compile_steps(args, cfg, total_steps: int):
    import eagle3_ttt as ttt
    import jax
    import jax.numpy as jnp
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(args.warmup, max(total_steps // 10, 1)), max(total_steps, 2), end_value=args.lr * 0.1
    )
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=args.weight_decay))
    ttt_steps, decay, noise_std, seed, eval_k = args.ttt_steps, args.decay, args.noise_std, args.seed, args.eval_k

    def loss_fn(trainable, frozen, batch, noise):
        head, embed, rows = frozen
        return ttt.ttt_loss(join_params(head, trainable), cfg, embed, rows, batch, ttt_steps, decay, noise)

    @jax.jit
    def train_step(trainable, opt_state, frozen, batch, step):
        noise = None
        if noise_std > 0:
            key = jax.random.fold_in(jax.random.key(seed + 1), step)
            noise = noise_std * jax.random.normal(key, batch.aux.shape, batch.aux.dtype)
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, frozen, batch, noise)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        metrics["lr"] = schedule(step)
        return optax.apply_updates(trainable, updates), opt_state, metrics

    @jax.jit
    def eval_step(trainable, frozen, batch):
        head, embed, rows = frozen
        params = join_params(head, trainable)
        accepted, starts = ttt.acceptance_counts(params, cfg, embed, batch, eval_k)
        _, metrics = ttt.ttt_loss(params, cfg, embed, rows, batch, ttt_steps, decay)
        return accepted, starts, metrics["loss"], jnp.stack([metrics[f"acc_{s}"] for s in range(ttt_steps)])

    return optimizer, train_step, eval_step


def to_batch(arrays: dict):
    import eagle3_ttt as ttt
    import jax.numpy as jnp

    return ttt.Batch(**{k: jnp.asarray(v) for k, v in arrays.items()})


def conditional(by_position: np.ndarray) -> np.ndarray:
    """P(draft s accepted | drafts before it accepted) from the chained rates."""
    before = np.concatenate([[1.0], by_position[:-1]])
    return np.where(before > 0, by_position / np.maximum(before, 1e-12), 0.0)


def evaluate(eval_step, trainable, corpus: Corpus, args) -> dict:
    """Held-out figures: greedy acceptance by draft position (chained), mean accepted drafts and
    tokens per target step at k = eval_k, the TTT loss and its per-step accuracy."""
    rows = pack(corpus, list(range(len(corpus.docs))), args.seq_len)
    accepted = np.zeros(args.eval_k)
    starts, losses, accs = 0.0, [], []
    for i in range(0, len(rows), args.rows):
        chunk = rows[i : i + args.rows]
        chunk = chunk + [[]] * (args.rows - len(chunk))  # one shape: empty rows are padding
        a, s, loss, acc = eval_step(trainable, to_batch(make_batch(corpus, chunk, args.seq_len)))
        accepted += np.asarray(a)
        starts += float(s)
        losses.append(float(loss))
        accs.append(np.asarray(acc))
    by_position = accepted / max(starts, 1)
    return {
        "acceptance_by_position": [round(float(x), 4) for x in by_position],
        "conditional_acceptance": [round(float(c), 4) for c in conditional(by_position)],
        "mean_accepted_drafts": round(float(by_position.sum()), 4),
        "tokens_per_target_step": round(float(1 + by_position.sum()), 4),
        "draft_starts": int(starts),
        "loss": round(float(np.mean(losses)), 4),
        "ttt_accuracy": [round(float(x), 4) for x in np.mean(accs, axis=0)],
    }


# ---- state on disk ----


def save_state(folder: Path, trainable, opt_state, meta: dict) -> None:
    """Every leaf of the trainable params and the optimizer state in one .npz, beside meta.json
    (step, data position, schedule length, elapsed seconds, log); written to a temporary folder and
    renamed, so an interruption leaves the previous state whole."""
    import jax

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    leaves = jax.tree.leaves((trainable, opt_state))
    np.savez(tmp / "arrays.npz", **{f"a{i}": np.asarray(x) for i, x in enumerate(leaves)})
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    old = folder.with_name(folder.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def load_state(folder: Path, trainable, opt_state):
    """(trainable, opt_state, meta) from `folder`, shaped like the given fresh ones."""
    import jax
    import jax.numpy as jnp

    for candidate in (folder, folder.with_name(folder.name + ".old")):  # .old: cut between renames
        if (candidate / "meta.json").is_file():
            folder = candidate
            break
    else:
        return None
    arrays = np.load(folder / "arrays.npz")
    leaves, treedef = jax.tree.flatten((trainable, opt_state))
    restored = [jnp.asarray(arrays[f"a{i}"], dtype=x.dtype) for i, x in enumerate(leaves)]
    trainable, opt_state = jax.tree.unflatten(treedef, restored)
    return trainable, opt_state, json.loads((folder / "meta.json").read_text())


def warm_start(folder: Path, trainable, opt_state, vocab: str):
    """The trainable weights of another run's state (its optimizer state and step are dropped), so a
    finished run can go on under a new schedule; refused when its draft vocabulary differs."""
    state = load_state(folder, trainable, opt_state)
    if state is None:
        raise SystemExit(f"--init-from {folder}: no training state there (meta.json and arrays.npz)")
    weights, _, meta = state
    if meta.get("draft_vocab") != vocab:
        raise SystemExit(f"--init-from {folder}: trained with another draft vocabulary")
    print(f"weights from {folder} (step {meta['step']} of its run)", flush=True)
    return weights


# ---- the run ----


def write_outputs(out: Path, args, cfg, head, trainable, meta: dict, work: Path) -> None:
    from jaxserve.loading.eagle3_checkpoint import save_eagle3

    save_eagle3(
        str(out),
        cfg,
        join_params(head, trainable),
        target_name=args.target_name,
        dtype="bfloat16",
        include_embed=False,
        num_speculative_tokens=args.ttt_steps,
    )
    data = {
        name: json.loads((work / f"{name}.json").read_text())
        for name in ("stats", "vocab", "target")
        if (work / f"{name}.json").is_file()
    }
    log = {"args": vars(args), "data": data, **meta}
    (out / "training_log.json").write_text(json.dumps(log, indent=1))
    last = meta["evals"][-1] if meta["evals"] else {}
    first = meta["evals"][0] if meta["evals"] else {}
    (out / "README.md").write_text(
        f"# EAGLE-3 head for {args.target_name}\n\n"
        "Trained by `scripts/train_eagle3.py` on the target's own greedy answers to chat prompts built from the "
        "Python standard library (`scripts/eagle3_data.py`); recipe, data and splits: docs/eagle3_training.md. "
        "speculators format, bf16, without embed_tokens (the target's are shared).\n\n"
        f"- steps: {meta['step']}, training tokens seen: {meta['tokens_seen']}, "
        f"minutes: {meta['elapsed_seconds'] / 60:.1f}\n"
        + (
            f"- a warm restart (fresh schedule and optimizer) from the weights in {args.init_from}\n"
            if args.init_from
            else ""
        )
        + f"- draft vocabulary: {cfg.draft_vocab_size} tokens, coverage of answer tokens: "
        f"train {data.get('vocab', {}).get('coverage_train')}, held-out {data.get('vocab', {}).get('coverage_heldout')}\n"
        f"- held-out greedy acceptance by draft position (k = {args.eval_k}, chained): "
        f"{last.get('acceptance_by_position')} (at the start: {first.get('acceptance_by_position')})\n"
        f"- held-out tokens per target step at k = {args.eval_k} (simulated): {last.get('tokens_per_target_step')}\n\n"
        "Serve: `jaxserve serve --speculative-config "
        f'\'{{"method": "eagle3", "model": "{out}", "num_speculative_tokens": 4}}\'`\n'
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.path.expanduser("~/.cache/jaxserve/eagle3"), help="eagle3_data's --work-dir")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None, help="the target (default: the default model)")
    ap.add_argument("--target-name", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--time-budget", type=float, default=120.0, help="minutes of training (evaluations included)")
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (else the budget)")
    ap.add_argument("--total-steps", type=int, default=None, help="the schedule's length (else from the budget)")
    ap.add_argument("--rows", type=int, default=2, help="packed rows per batch")
    ap.add_argument("--seq-len", type=int, default=1024, help="indices per packed row")
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--decay", type=float, default=1.0, help="loss weight decay ** step (speculators: 1.0)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--noise-std", type=float, default=0.05, help="Gaussian noise on the aux states (speculators)")
    ap.add_argument("--norm-before-residual", type=int, default=1, help="1: speculators' trainer default")
    ap.add_argument("--train-lm-head", action="store_true", help="train the lm_head too (speculators freezes it)")
    ap.add_argument("--eval-k", type=int, default=4)
    ap.add_argument("--eval-docs", type=int, default=None, help="held-out sequences scored (default: all)")
    ap.add_argument("--eval-minutes", type=float, default=15.0)
    ap.add_argument("--checkpoint-minutes", type=float, default=5.0)
    ap.add_argument(
        "--prompt-context",
        type=int,
        default=64,
        help="train on each sequence from this many indices before its answer (0: all of it; held-out: all)",
    )
    ap.add_argument("--train-docs", type=int, default=None, help="use only the first N training sequences")
    ap.add_argument(
        "--state-dir", default=None, help="the resumable state (default: DATA/train_state/<OUT's name>, outside OUT)"
    )
    ap.add_argument(
        "--init-from",
        default=None,
        help="start from the weights of another run's --state-dir (a fresh schedule and optimizer: a warm restart)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.norm_before_residual = bool(args.norm_before_residual)
    work, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state_dir = Path(args.state_dir) if args.state_dir else work / "train_state" / out.resolve().name

    train = Corpus.load(work, "train", args.train_docs).trimmed(args.prompt_context)
    heldout = Corpus.load(work, "heldout", args.eval_docs)
    cfg, head, embed, rows = build(args, work)
    trainable = split_params(head, args.train_lm_head)
    print(
        f"train: {len(train.docs)} sequences, {train.tokens} indices; held-out: {len(heldout.docs)} sequences",
        flush=True,
    )

    optimizer, _, _ = make_steps(args, cfg, head, embed, rows, 10**9)  # the state's shape only
    opt_state = optimizer.init(trainable)
    resumed = load_state(state_dir, trainable, opt_state)
    vocab = hashlib.sha256(np.asarray(head.draft_to_target).tobytes()).hexdigest()[:16]
    if resumed is not None:
        trainable, opt_state, meta = resumed
        if meta.get("draft_vocab") != vocab:  # the data's vocabulary was rebuilt: the lm_head rows moved
            raise SystemExit(
                f"{state_dir} was trained with another draft vocabulary than {work / 'd2t.npy'}'s; "
                "start afresh with another --out or --state-dir"
            )
        print(f"resumed at step {meta['step']} ({meta['elapsed_seconds'] / 60:.1f} min done)", flush=True)
    else:
        if args.init_from:
            trainable = warm_start(Path(args.init_from), trainable, opt_state, vocab)
        meta = {
            "step": 0,
            "epoch": 0,
            "row_in_epoch": 0,
            "tokens_seen": 0,
            "elapsed_seconds": 0.0,
            "total_steps": args.total_steps,
            "draft_vocab": vocab,
            "train_log": [],
            "evals": [],
            "throughput": {},
        }
    return run(args, meta, trainable, opt_state, train, heldout, cfg, head, embed, rows, out, state_dir, work)


def run(args, meta, trainable, opt_state, train, heldout, cfg, head, embed, rows, out, state_dir, work) -> int:
    budget = args.time_budget * 60
    started = time.perf_counter() - meta["elapsed_seconds"]
    # without --total-steps the schedule's length is fixed once a few steps' pace is known (below)
    _, train_step, eval_step = make_steps(args, cfg, head, embed, rows, meta["total_steps"] or 10**9)
    last_save = last_eval = time.perf_counter()
    if not meta["evals"]:
        t = time.perf_counter()
        meta["evals"].append({"step": 0, **evaluate(eval_step, trainable, heldout, args)})
        meta["throughput"]["eval_seconds"] = round(time.perf_counter() - t, 1)
        print("eval step 0:", json.dumps(meta["evals"][-1]), flush=True)
    epoch_cache = {}
    window = []
    while True:
        elapsed = time.perf_counter() - started
        if elapsed >= budget or (args.max_steps is not None and meta["step"] >= args.max_steps):
            break
        if meta["total_steps"] is not None and meta["step"] >= meta["total_steps"]:
            break
        if meta["epoch"] not in epoch_cache:
            epoch_cache = {meta["epoch"]: epoch_rows(train, meta["epoch"], args.seed, args.seq_len)}
        epoch = epoch_cache[meta["epoch"]]
        chunk = epoch[meta["row_in_epoch"] : meta["row_in_epoch"] + args.rows]
        if len(chunk) < args.rows:  # the epoch's last partial batch is dropped
            meta["epoch"] += 1
            meta["row_in_epoch"] = 0
            continue
        t = time.perf_counter()
        batch = make_batch(train, chunk, args.seq_len)
        trainable, opt_state, metrics = train_step(trainable, opt_state, to_batch(batch), meta["step"])
        metrics = {k: float(v) for k, v in metrics.items()}
        step_seconds = time.perf_counter() - t
        meta["step"] += 1
        meta["row_in_epoch"] += args.rows
        n_tokens = int(np.sum(batch["doc"] >= 0))
        meta["tokens_seen"] += n_tokens
        if meta["step"] > 1:  # the first step compiles
            window.append((step_seconds, n_tokens))
        if meta["total_steps"] is None and len(window) >= 5:
            pace = sum(s for s, _ in window) / len(window)
            meta["total_steps"] = max(int((budget - (time.perf_counter() - started)) / pace) + meta["step"], 10)
            _, train_step, eval_step = make_steps(args, cfg, head, embed, rows, meta["total_steps"])
            print(f"{pace:.2f} s/step: the schedule runs {meta['total_steps']} steps", flush=True)
        if meta["step"] % 10 == 0 or meta["step"] == 1:
            entry = {
                "step": meta["step"],
                "epoch": meta["epoch"],
                "minutes": round((time.perf_counter() - started) / 60, 2),
                **{k: round(v, 4) for k, v in metrics.items()},
            }
            meta["train_log"].append(entry)
            print(json.dumps(entry), flush=True)
        if window:
            meta["throughput"]["train_tokens_per_second"] = round(
                sum(n for _, n in window[-50:]) / sum(s for s, _ in window[-50:]), 1
            )
        now = time.perf_counter()
        if now - last_eval >= args.eval_minutes * 60:
            meta["evals"].append({"step": meta["step"], **evaluate(eval_step, trainable, heldout, args)})
            print("eval:", json.dumps(meta["evals"][-1]), flush=True)
            last_eval = time.perf_counter()
        if now - last_save >= args.checkpoint_minutes * 60:
            meta["elapsed_seconds"] = time.perf_counter() - started
            save_state(state_dir, trainable, opt_state, meta)
            last_save = time.perf_counter()
    if meta["evals"][-1]["step"] != meta["step"]:
        meta["evals"].append({"step": meta["step"], **evaluate(eval_step, trainable, heldout, args)})
        print("eval:", json.dumps(meta["evals"][-1]), flush=True)
    meta["elapsed_seconds"] = time.perf_counter() - started
    save_state(state_dir, trainable, opt_state, meta)
    write_outputs(out, args, cfg, head, trainable, meta, work)
    print(f"saved {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
