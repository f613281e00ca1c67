"""EAGLE-3 in the engine: greedy outputs identical to plain decoding under preemption, prefix caching,
penalties and mixed batches, with a head trained here on the tiny target's own continuations (so drafts
are both accepted and rejected), and the head's states and K/V following pages."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from spec_testlib import assert_overlapped, record_dispatches, toggle_drafting

from jaxserve import LLM, SamplingParams
from jaxserve.config import ModelConfig
from jaxserve.errors import ConfigError
from jaxserve.loading.eagle3_checkpoint import save_eagle3
from jaxserve.model.eagle3 import Eagle3Config, draft_logits, fuse, head_layer, init_params
from jaxserve.model.layers import causal_attention, rope_cos_sin

BASE = dict(dtype="float32", page_size=8, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, warm_up=False)
SMALL_POOL = dict(num_pages=12)  # 11 usable pages (88 tokens) for 4 sequences of up to 54: preemption
AUX = (1, 2, 3)
K = 3


def requests(n=24, seed=0):
    """Greedy requests of varied length; a quarter share a prefix (prefix caching), a quarter use
    penalties (exact through verification)."""
    rng = np.random.RandomState(seed)
    shared = rng.randint(0, 512, size=17).tolist()
    prompts, params = [], []
    for i in range(n):
        prompt = rng.randint(0, 512, size=int(rng.randint(1, 30))).tolist()
        if i % 4 == 1:
            prompt = shared + prompt[:9]
        penalties = dict(repetition_penalty=1.3, frequency_penalty=0.4) if i % 4 == 3 else {}
        params.append(SamplingParams(max_tokens=int(rng.randint(4, 25)), temperature=0, ignore_eos=True, **penalties))
        prompts.append(prompt)
    return prompts, params


def token_ids(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def target(hf_model_dir):
    return hf_model_dir("llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def reference(target):
    with LLM(target[0], **BASE) as llm:
        prompts, params = requests()
        return token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))


def train_head(target, sequences, prompt_lens, out_dir, steps=300):
    """A head trained on the target's own continuations (step 0 of EAGLE-3 only: enough for drafts
    that are often right), with the target's states from transformers (the referee's forward)."""
    path, model = target
    cfg = ModelConfig.from_dir(path)
    T = max(len(s) for s in sequences)
    ids = np.zeros((len(sequences), T), np.int64)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = s
    with torch.no_grad():
        states = model(torch.from_numpy(ids), output_hidden_states=True).hidden_states
    aux = np.concatenate([states[i].numpy() for i in AUX], axis=-1)  # [B, T, 3D]
    vocab = sorted({t for s in sequences for t in s} | set(range(64)))[:256]
    hcfg = Eagle3Config.for_target(cfg, len(vocab), AUX)
    to_draft = np.full(cfg.vocab_size, -1, np.int64)
    to_draft[vocab] = np.arange(len(vocab))
    # Position p reads g_p and the token at p + 1 and predicts the token at p + 2 (generated ones only).
    inputs, labels = ids[:, 1:-1], to_draft[ids[:, 2:]]
    mask = np.zeros_like(labels, bool)
    for i, (s, n) in enumerate(zip(sequences, prompt_lens)):
        mask[i, max(n - 2, 0) : len(s) - 2] = True
    mask &= labels >= 0
    embed = jnp.asarray(model.model.embed_tokens.weight.detach().numpy())
    cos, sin = rope_cos_sin(jnp.arange(T - 2)[None], hcfg.layer)

    def loss_fn(p):
        x = head_layer(p, hcfg, embed[inputs], fuse(p, jnp.asarray(aux[:, :-2])), cos, sin, causal_attention)
        logp = jax.nn.log_softmax(draft_logits(p, hcfg, x))
        nll = -jnp.take_along_axis(logp, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
        return jnp.sum(nll * mask) / mask.sum()

    d2t = np.asarray(vocab)
    params = init_params(hcfg, jax.random.PRNGKey(0), jnp.float32, d2t).replace(draft_to_target=None)
    opt = optax.adam(3e-3)
    state = opt.init(params)

    @jax.jit
    def step(p, s):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    first = None
    for _ in range(steps):
        params, state, loss = step(params, state)
        first = float(loss) if first is None else first
    assert float(loss) < 0.5 * first, (first, float(loss))
    params = params.replace(draft_to_target=jnp.asarray(d2t, jnp.int32))
    save_eagle3(out_dir, hcfg, params, target_name=path, dtype="float32")
    return out_dir


@pytest.fixture(scope="module")
def head_dir(target, reference, tmp_path_factory):
    prompts, _ = requests()
    sequences = [p + o for p, o in zip(prompts, reference)]
    return train_head(target, sequences, [len(p) for p in prompts], str(tmp_path_factory.mktemp("eagle3")))


@pytest.fixture(scope="module")
def eagle3_llm(target, head_dir):
    spec = {"method": "eagle3", "model": head_dir, "num_speculative_tokens": K}
    with LLM(target[0], **BASE, **SMALL_POOL, speculative_config=spec, speculative_adaptive=False) as llm:
        yield llm


def test_eagle3_is_greedy_exact_under_preemption_and_prefix_caching(eagle3_llm, reference):
    llm = eagle3_llm
    prompts, params = requests()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert token_ids(outputs) == reference
    engine = llm.engine
    stats = engine.stats()
    assert engine.scheduler.num_preemptions > 0
    assert engine.blocks.num_prefix_hit_tokens > 0
    # The trained head's drafts are accepted often, whole runs too, and rejected too.
    assert 0.2 < stats["spec_decode_acceptance_rate"] < 0.99, stats
    assert stats["spec_decode_mean_accepted_length"] > 1.5, stats
    blocks = engine.blocks
    assert blocks.num_free_pages(0) == blocks.num_usable_pages
    blocks.check_invariants()
    # One at a time too: each sequence's drafts from its own states only.
    single = llm.generate(prompt_token_ids=prompts[:3], sampling_params=params[:3], use_tqdm=False)
    assert token_ids(single) == reference[:3]
    # Sleep frees the head's K/V and stored states with the pool; awake, the same outputs.
    llm.sleep(1)
    llm.wake_up()
    again = llm.generate(prompt_token_ids=prompts[:3], sampling_params=params[:3], use_tqdm=False)
    assert token_ids(again) == reference[:3]
    # New target weights (here a copy of the same): the head is kept and says so; a head's new
    # weights are refused rather than ignored.
    report = llm.update_weights(engine.runner.state.params, copy=True)
    assert report.draft == "kept"
    with pytest.raises(ValueError, match="EAGLE-3 head is served as loaded"):
        llm.update_weights(engine.runner.state.params, draft_params={})
    updated = llm.generate(prompt_token_ids=prompts[:3], sampling_params=params[:3], use_tqdm=False)
    assert token_ids(updated) == reference[:3]


def test_eagle3_overlaps_steps_that_verify_nothing(eagle3_llm, reference, monkeypatch):
    """Drafting switched on and off every few steps: a step that verifies nothing runs beside the one
    before it (its pending tokens, the head's start and catch-up alike, taken on the device), a
    drafting step after the one before it is processed; greedy outputs as plain decoding's, single
    and batched, async scheduling on and off, and no page lost."""
    llm = eagle3_llm
    toggle_drafting(monkeypatch, llm.engine)
    seen = record_dispatches(monkeypatch, llm)
    accepted = llm.engine.stats()["spec_decode_num_accepted_tokens"]
    prompts, params = requests()
    assert token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)) == reference
    assert_overlapped(seen)
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > accepted
    single = llm.generate(prompt_token_ids=prompts[:1], sampling_params=params[:1], use_tqdm=False)
    assert token_ids(single) == reference[:1]
    seen.clear()
    monkeypatch.setattr(llm.overlap, "async_scheduling", False)
    assert (
        token_ids(llm.generate(prompt_token_ids=prompts[:4], sampling_params=params[:4], use_tqdm=False))
        == (reference[:4])
    )
    assert seen and all(depth == 0 for depth, _ in seen)
    blocks = llm.engine.blocks
    assert blocks.num_free_pages(0) == blocks.num_usable_pages
    blocks.check_invariants()


def test_eagle3_settings_are_checked(target, head_dir):
    with pytest.raises(ConfigError, match="enable_prompt_logprobs"):
        LLM(
            target[0],
            **BASE,
            speculative_config={"method": "eagle3", "model": head_dir, "num_speculative_tokens": 2},
            enable_prompt_logprobs=True,
        )
    with pytest.raises(ConfigError, match='needs "model"'):
        LLM(target[0], **BASE, speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="EAGLE-1"):
        LLM(target[0], **BASE, speculative_config={"method": "eagle", "model": head_dir})
