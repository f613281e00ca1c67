"""The EAGLE-3 head against speculators' PyTorch Eagle3 model (the referee): a tiny head it saved and
the logits it computed (tests/fixtures/eagle3_tiny*, made by scripts/make_eagle3_fixture.py), run here
through the serving path (paged K/V, the chained draft steps), and the loader's refusals."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.errors import ConfigError, ModelLoadError
from jaxserve.loading.eagle3_checkpoint import load_eagle3, save_eagle3
from jaxserve.model.eagle3 import draft_logits, fuse
from jaxserve.model.kv_cache import RaggedBatch, init_cache
from jaxserve.model.layers import ragged_attention_blocked
from jaxserve.model.ragged import RaggedRow
from jaxserve.spec_decode.eagle3_draft import _head_pass

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
TINY = os.path.join(FIXTURES, "eagle3_tiny")
# The target the fixture's head drafts for (its states are given, so only the shape matters).
TARGET = ModelConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16
)
PAGE = 4


@pytest.fixture(scope="module")
def ref():
    return dict(np.load(os.path.join(TINY, "reference.npz")))


def run_head(cfg, params, embed, rows):
    """Run the head through `_head_pass` over a paged cache: `rows` is a list of steps, each
    (tokens, positions, hidden f[T, D]) of one sequence; returns each step's draft logits."""
    kv = jax.tree.map(lambda x: x[0], init_cache(cfg.layer, 8, PAGE, jnp.float32))
    pages = list(range(1, 8))
    out = []
    for tokens, positions, hidden in rows:
        batch = RaggedBatch.build(
            [RaggedRow(list(tokens), int(positions[0]), pages)],
            page_size=PAGE,
            num_tokens=len(tokens),
            num_rows=1,
            max_pages=len(pages),
            num_logits=len(tokens),
        )
        batch = jax.tree.map(jnp.asarray, batch)
        prenorm, kv = _head_pass(
            params, cfg, kv, batch, jnp.asarray(hidden), jnp.asarray(embed)[batch.tokens], ragged_attention_blocked
        )
        out.append((np.asarray(draft_logits(params, cfg, prenorm)), np.asarray(prenorm)))
    return out


def test_head_matches_speculators_forward_and_chain(ref):
    cfg, params = load_eagle3(TINY, TARGET, np.float32)
    assert cfg.aux_layers == (0, 1, 3) and cfg.draft_vocab_size == 128 and params.embed is None
    np.testing.assert_array_equal(np.asarray(params.draft_to_target), ref["draft_ids"])
    params = jax.tree.map(jnp.asarray, params)
    g = np.asarray(fuse(params, jnp.asarray(ref["aux_hidden"])))
    # One forward over the whole sequence (step 0 of every row).
    [(logits, prenorm)] = run_head(cfg, params, ref["embed_tokens"], [(ref["input_ids"], ref["positions"], g)])
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(prenorm, ref["hidden_out"], atol=1e-4, rtol=0)
    # The chain the engine drafts: rows 0..r from the target's states, then each later step at the next
    # position from the head's own output, attending to both (speculators' training-time test).
    r = int(ref["chain_row"])
    steps = [(ref["input_ids"][: r + 1], ref["positions"][: r + 1], g[: r + 1])]
    for s in (1, 2):
        steps.append(([ref["chain_tokens"][s]], [ref["positions"][r] + s], ref["ttt_hidden_out"][s - 1, r][None]))
    results = run_head(cfg, params, ref["embed_tokens"], steps)
    for s in (1, 2):
        np.testing.assert_allclose(results[s][0][0], ref["ttt_logits"][s, r], atol=1e-4, rtol=0)
        # The greedy draft, mapped to target ids, is the token the chain fed next.
        if s + 1 < len(ref["chain_tokens"]):
            assert ref["draft_ids"][results[s][0][0].argmax()] == ref["chain_tokens"][s + 1]


def test_norm_before_residual_matches(ref, tmp_path):
    head = shutil.copytree(TINY, tmp_path / "nbr")
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "norm_before_residual": True}))
    cfg, params = load_eagle3(str(head), TARGET, np.float32)
    params = jax.tree.map(jnp.asarray, params)
    g = np.asarray(fuse(params, jnp.asarray(ref["aux_hidden"])))
    [(logits, _)] = run_head(cfg, params, ref["embed_tokens"], [(ref["input_ids"], ref["positions"], g)])
    np.testing.assert_allclose(logits, ref["nbr_ttt_logits"][0], atol=1e-4, rtol=0)


def test_heads_with_their_own_embeddings_and_in_bf16_load(ref):
    _, own = load_eagle3(os.path.join(FIXTURES, "eagle3_tiny_embed"), TARGET, np.float32)
    np.testing.assert_array_equal(own.embed, ref["embed_tokens"])
    cfg, bf16 = load_eagle3(os.path.join(FIXTURES, "eagle3_tiny_bf16"), TARGET, np.float32)
    bf16 = jax.tree.map(jnp.asarray, bf16)
    g = np.asarray(fuse(bf16, jnp.asarray(ref["aux_hidden"])))
    [(logits, _)] = run_head(cfg, bf16, ref["embed_tokens"], [(ref["input_ids"], ref["positions"], g)])
    np.testing.assert_allclose(logits, ref["logits"], atol=0.1, rtol=0)  # bf16 weights: rounding only


def test_a_head_in_the_original_eagle3_layout_loads(ref, tmp_path):
    """The original EAGLE-3 code's layout: a flat Llama config naming LlamaForCausalLMEagle3 with
    draft_vocab_size, tensors under midlayer.*."""
    from jaxserve.loading.checkpoint import iter_safetensors, write_safetensors

    head = tmp_path / "original"
    head.mkdir()
    config = json.loads(open(os.path.join(TINY, "config.json")).read())
    flat = {
        **config["transformer_layer_config"],
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": 128,
        "eagle_aux_hidden_state_layer_ids": [0, 1, 3],
    }
    (head / "config.json").write_text(json.dumps(flat))
    tensors = {
        name.replace("layers.0.", "midlayer."): np.array(x)
        for name, x in iter_safetensors(os.path.join(TINY, "model.safetensors"))
    }
    write_safetensors(str(head / "model.safetensors"), tensors)
    cfg, params = load_eagle3(str(head), TARGET, np.float32)
    params = jax.tree.map(jnp.asarray, params)
    g = np.asarray(fuse(params, jnp.asarray(ref["aux_hidden"])))
    [(logits, _)] = run_head(cfg, params, ref["embed_tokens"], [(ref["input_ids"], ref["positions"], g)])
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4, rtol=0)


def test_saved_head_round_trips(tmp_path):
    cfg, params = load_eagle3(TINY, TARGET, np.float32)
    save_eagle3(str(tmp_path / "head"), cfg, params, target_name="tiny", dtype="float32")
    cfg2, params2 = load_eagle3(str(tmp_path / "head"), TARGET, np.float32)
    assert cfg2 == dataclasses.replace(cfg, layer=dataclasses.replace(cfg.layer, bos_token_id=None, eos_token_ids=()))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"norm_before_fc": True}, "norm_before_fc"),
        ({"fc_norm": True}, "fc_norm"),
        ({"transformer_layer_config": {"num_hidden_layers": 2}}, "2 decoder layers"),
        ({"transformer_layer_config": {"vocab_size": 1000}}, "vocabulary of 1000"),
        ({"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}, "do not fit"),
        ({"speculators_model_type": "mlp"}, "not supported"),
        (
            {
                "speculators_config": {
                    "default_proposal_method": "tree",
                    "proposal_methods": [{"proposal_type": "tree"}],
                }
            },
            "tree",
        ),
    ],
)
def test_what_the_head_cannot_serve_is_refused_by_name(tmp_path, change, message):
    head = shutil.copytree(TINY, tmp_path / "head")
    config = json.loads((head / "config.json").read_text())
    for key, value in change.items():
        config[key] = (
            {**config[key], **value}
            if isinstance(value, dict) and key in config and key != "speculators_config"
            else value
        )
    (head / "config.json").write_text(json.dumps(config))
    with pytest.raises((ConfigError, ModelLoadError), match=message):
        load_eagle3(str(head), TARGET, np.float32)


def test_the_memory_plan_counts_the_head(tmp_path):
    from jaxserve.config import EngineConfig
    from jaxserve.loading.eagle3_checkpoint import head_param_count
    from jaxserve.spec_decode.decoder import draft_kv_bytes_per_token

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(
        json.dumps(
            dict(
                architectures=["LlamaForCausalLM"],
                vocab_size=512,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        )
    )
    settings = EngineConfig(
        model=str(target), speculative_method="eagle3", speculative_model=TINY, num_speculative_tokens=3
    )
    # The head's one layer (K and V of 2 heads of 16) and the fused state of 64 it drafts from, in float32.
    assert draft_kv_bytes_per_token(settings, np.float32) == (2 * 2 * 16 + 64) * 4
    D, F = 64, 128
    assert head_param_count(TINY) == 3 * D * D + 2 * D * (64 + 32 + 32) + D * 64 + 3 * D * F + 4 * D + D * 128
