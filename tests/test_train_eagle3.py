"""scripts/eagle3_data.py and scripts/train_eagle3.py on a tiny random Llama (float32): the hidden
states the data keeps are HF transformers' `hidden_states` at the aux layers, the training-time-test
loss falls under a few optimizer steps on a fixed batch, and a run resumed from its checkpoint ends
in the same state as one that was never interrupted. No timing assertions (training figures come
from the scripts themselves, docs/eagle3_training.md)."""

import json

import eagle3_data as ed
import eagle3_ttt as ttt
import jax
import numpy as np
import pytest
import train_eagle3 as te

AUX = (1, 2, 3)


@pytest.fixture(scope="module")
def tiny(hf_model_dir):
    path, model = hf_model_dir("llama", num_hidden_layers=4)
    cfg, params, _ = ed.load_target(path)
    return path, model, cfg, params


def _sequences(vocab: int, count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=int(rng.integers(20, 60))).tolist() for _ in range(count)]


def test_states_equal_hf_hidden_states(tiny):
    import torch

    _, model, cfg, params = tiny
    seqs = _sequences(cfg.vocab_size, 3, 0)
    got = ed.compute_states(ed.make_states_fn(cfg, AUX), params, seqs, tokens_per_batch=128, bucket=32)
    for seq, (aux, final, greedy) in zip(seqs, got):
        with torch.no_grad():
            out = model(torch.tensor([seq]), output_hidden_states=True)
        want = np.concatenate([out.hidden_states[i][0].numpy() for i in AUX], axis=-1)
        # float32 over states of magnitude ~30 (the tiny model's wide-spread weights): a tolerance to scale
        np.testing.assert_allclose(aux, want, rtol=1e-4, atol=2e-5 * np.abs(want).max())
        final_want = out.hidden_states[-1][0].numpy()
        np.testing.assert_allclose(final, final_want, rtol=1e-4, atol=2e-5 * np.abs(final_want).max())
        np.testing.assert_array_equal(greedy, out.logits[0].argmax(-1).numpy())


@pytest.fixture(scope="module")
def work(tiny, tmp_path_factory):
    """A data directory as eagle3_data writes it: random 'conversations' (prompt of 8 tokens), their
    states, a draft vocabulary of 128 ids (from answer frequencies, as the vocab phase builds it)."""
    _, _, cfg, params = tiny
    root = tmp_path_factory.mktemp("eagle3-data")
    states_fn = ed.make_states_fn(cfg, AUX)
    for split, count, seed in (("train", 12, 1), ("heldout", 4, 2)):
        seqs = _sequences(cfg.vocab_size, count, seed)
        records = [{"id": str(i), "prompt_ids": s[:8], "answer_ids": s[8:]} for i, s in enumerate(seqs)]
        ed.write_shard(root / "states" / split / f"{split}-00000", records, ed.compute_states(states_fn, params, seqs))
    (root / "target.json").write_text(json.dumps({"vocab_size": cfg.vocab_size, "aux_layers": list(AUX)}))
    d2t = ed.build_vocab(ed.answer_counts(root, "train", cfg.vocab_size), 128, {0, 1})
    assert len(d2t) == 128 and list(d2t) == sorted(d2t) and {0, 1} <= set(d2t.tolist())
    np.save(root / "d2t.npy", d2t)
    return root


def _args(tiny_path, work, out, **extra):
    args = ["--data", str(work), "--out", str(out), "--model", tiny_path, "--target-name", "tiny"]
    args += ["--rows", "2", "--seq-len", "96", "--total-steps", "20", "--warmup", "2", "--lr", "3e-3"]
    args += ["--eval-k", "3", "--checkpoint-minutes", "0"]
    for key, value in extra.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def test_loss_falls_on_a_fixed_batch(tiny, work):
    path, _, _, _ = tiny
    ns = _namespace(path, work)
    cfg, head, embed, rows = te.build(ns, work)
    trainable = te.split_params(head, False)
    optimizer, train_step, _ = te.make_steps(ns, cfg, head, embed, rows, 20)
    opt_state = optimizer.init(trainable)
    corpus = te.Corpus.load(work, "train")
    batch = te.to_batch(te.make_batch(corpus, te.epoch_rows(corpus, 0, 0, 96)[:2], 96))
    losses = []
    for step in range(6):
        trainable, opt_state, metrics = train_step(trainable, opt_state, batch, step)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.8 * losses[0], losses


def _namespace(path, work):
    import argparse

    return argparse.Namespace(
        model=path,
        seed=0,
        norm_before_residual=True,
        lr=3e-3,
        warmup=2,
        weight_decay=0.01,
        ttt_steps=3,
        decay=1.0,
        noise_std=0.05,
        eval_k=3,
    )


def test_ttt_attention_sees_its_chain():
    """A query at step 2 sees step 0's keys of its sequence up to itself and its own index's keys of
    steps 1 and 2: changing any other key leaves its output alone."""
    rng = np.random.default_rng(0)
    B, T, N, K, H = 1, 6, 2, 1, 4
    doc = jax.numpy.asarray([[0, 0, 0, 1, 1, -1]])
    q = rng.normal(size=(B, T, N, H)).astype(np.float32)
    ks = [rng.normal(size=(B, T, K, H)).astype(np.float32) for _ in range(3)]
    vs = [rng.normal(size=(B, T, K, H)).astype(np.float32) for _ in range(3)]
    base = np.asarray(ttt.ttt_attention(q, ks[2], vs[2], doc, ks[:2], vs[:2], 0.5))
    for step, index in ((0, 2), (0, 3), (1, 0), (1, 2), (2, 4)):  # keys query 1 must not see
        ks2 = [k.copy() for k in ks]
        vs2 = [v.copy() for v in vs]
        vs2[step][0, index] += 10.0
        changed = np.asarray(ttt.ttt_attention(q, ks2[2], vs2[2], doc, ks2[:2], vs2[:2], 0.5))
        np.testing.assert_allclose(changed[0, 1], base[0, 1], rtol=1e-6, atol=1e-6)
    for step, index in ((0, 0), (0, 1), (1, 1), (2, 1)):  # keys it must see
        vs2 = [v.copy() for v in vs]
        vs2[step][0, index] += 10.0
        changed = np.asarray(ttt.ttt_attention(q, ks[2], vs2[2], doc, ks[:2], vs2[:2], 0.5))
        assert np.abs(changed[0, 1] - base[0, 1]).max() > 1e-3


def test_resume_ends_in_the_same_state(tiny, work, tmp_path):
    from jaxserve.loading.eagle3_checkpoint import load_eagle3

    path, _, cfg, _ = tiny
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert te.main(_args(path, work, straight, max_steps=4)) == 0
    assert te.main(_args(path, work, cut, max_steps=2)) == 0
    state = work / "train_state"  # the default: beside the data, not in the head's folder
    assert json.loads((state / "cut" / "meta.json").read_text())["step"] == 2
    assert te.main(_args(path, work, cut, max_steps=4)) == 0
    a, b = np.load(state / "straight" / "arrays.npz"), np.load(state / "cut" / "arrays.npz")
    assert sorted(a.files) == sorted(b.files)
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    log = json.loads((cut / "training_log.json").read_text())
    assert log["step"] == 4 and len(log["evals"][-1]["acceptance_by_position"]) == 3
    assert sorted(p.name for p in cut.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
        "training_log.json",
    ]
    meta = json.loads((state / "cut" / "meta.json").read_text())
    (state / "cut" / "meta.json").write_text(json.dumps({**meta, "draft_vocab": "another"}))
    with pytest.raises(SystemExit, match="another draft vocabulary"):  # a rebuilt vocabulary is not resumed
        te.main(_args(path, work, cut, max_steps=6))
    head_cfg, head = load_eagle3(str(cut), cfg, np.float32)  # the saved head loads as serving loads it
    assert head_cfg.aux_layers == AUX and head.embed is None
    np.testing.assert_array_equal(np.asarray(head.draft_to_target), np.load(work / "d2t.npy"))


def test_trimmed_prompts_keep_the_counted_indices(work):
    """Training rows start a few indices before the answer: the counted indices carry the same token,
    position, states and target as in the whole sequence, and the prompt context before them is cut."""
    corpus = te.Corpus.load(work, "train")
    trimmed = corpus.trimmed(3)
    full = te.make_batch(corpus, te.pack(corpus, [0], 96), 96)
    cut = te.make_batch(trimmed, te.pack(trimmed, [0], 96), 96)
    assert cut["mask"].sum() == full["mask"].sum() > 0
    assert (cut["doc"] >= 0).sum() == (full["doc"] >= 0).sum() - (8 - 1 - 3)  # prompt of 8: 4 indices cut
    for name in ("tokens", "positions", "aux", "final", "greedy"):
        np.testing.assert_array_equal(cut[name][cut["mask"]], full[name][full["mask"]], err_msg=name)


def test_init_from_starts_a_new_schedule_at_another_runs_weights(tiny, work, tmp_path):
    """--init-from takes a finished run's weights (not its optimizer or step) and refuses another
    vocabulary's."""
    import jax.numpy as jnp

    path, _, _, _ = tiny
    assert te.main(_args(path, work, tmp_path / "first", max_steps=2)) == 0
    state = work / "train_state"
    ns = _namespace(path, work)
    cfg, head, embed, rows = te.build(ns, work)
    trainable = te.split_params(head, False)
    optimizer, _, _ = te.make_steps(ns, cfg, head, embed, rows, 20)
    vocab = json.loads((state / "first" / "meta.json").read_text())["draft_vocab"]
    weights = te.warm_start(state / "first", trainable, optimizer.init(trainable), vocab)
    saved, _, _ = te.load_state(state / "first", trainable, optimizer.init(trainable))
    for a, b in zip(jax.tree.leaves(weights), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not jnp.array_equal(a, b) for a, b in zip(jax.tree.leaves(weights), jax.tree.leaves(trainable)))
    assert te.main(_args(path, work, tmp_path / "second", max_steps=1, init_from=state / "first")) == 0
    assert json.loads((state / "second" / "meta.json").read_text())["step"] == 1
    assert "a warm restart" in (tmp_path / "second" / "README.md").read_text()
    with pytest.raises(SystemExit, match="another draft vocabulary"):
        te.warm_start(state / "first", trainable, optimizer.init(trainable), "another")
