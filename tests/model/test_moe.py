"""The mixture-of-experts MLP against Hugging Face's Qwen3-MoE and Mixtral blocks on the same weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.moe import MoEParams, moe_mlp, route

torch = pytest.importorskip("torch")


def hf_block(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        cfg = Qwen3MoeConfig(
            hidden_size=32, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False
        )
        block = Qwen3MoeSparseMoeBlock(cfg)
    else:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = MixtralConfig(hidden_size=32, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
        block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():  # wide-spread weights: well-separated router choices, outputs far from zero
        for w in block.parameters():
            w.normal_(0.0, 0.5)
    return block.eval()


@pytest.mark.parametrize("kind, normalize", [("qwen3_moe", False), ("mixtral", True)])
def test_moe_mlp_matches_hf(kind, normalize):
    block = hf_block(kind)
    x = np.random.default_rng(1).normal(size=(1, 13, 32)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.from_numpy(x)).numpy()[0]
    p = MoEParams.from_hf(
        block.gate.weight.detach().numpy(),
        block.experts.gate_up_proj.detach().numpy(),
        block.experts.down_proj.detach().numpy(),
    )
    fn = jax.jit(lambda x, p: moe_mlp(x, p, top_k=2, normalize=normalize))
    got = np.asarray(fn(jnp.asarray(x[0]), p))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # Another routing (other tokens), the same executable: shapes depend on the token count only.
    y = np.random.default_rng(2).normal(size=(13, 32)).astype(np.float32)
    with torch.no_grad():
        want_y = block(torch.from_numpy(y[None])).numpy()[0]
    np.testing.assert_allclose(np.asarray(fn(jnp.asarray(y), p)), want_y, rtol=1e-4, atol=1e-4)
    assert fn._cache_size() == 1


@pytest.mark.parametrize("tokens", [1, 3])  # 1 x 2 and 3 x 2 assignments <= 8 experts: the gathered path
def test_few_tokens_read_only_their_experts(tokens):
    block = hf_block("qwen3_moe", seed=3)
    x = np.random.default_rng(4).normal(size=(1, tokens, 32)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.from_numpy(x)).numpy()[0]
    p = MoEParams.from_hf(
        block.gate.weight.detach().numpy(),
        block.experts.gate_up_proj.detach().numpy(),
        block.experts.down_proj.detach().numpy(),
    )
    got = jax.jit(lambda x, p: moe_mlp(x, p, top_k=2, normalize=False))(jnp.asarray(x[0]), p)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)

    def jaxpr(n):
        return str(jax.make_jaxpr(lambda x, p: moe_mlp(x, p, top_k=2, normalize=False))(jnp.zeros((n, 32)), p))

    assert "ragged_dot" not in jaxpr(tokens) and "ragged_dot" in jaxpr(13)  # 26 assignments: grouped


def test_route_renormalises_only_when_asked():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 8)), jnp.float32)
    router = jnp.asarray(np.random.default_rng(1).normal(size=(8, 6)), jnp.float32)
    w, e = route(x, router, 2, normalize=True)
    np.testing.assert_allclose(np.asarray(w.sum(-1)), 1.0, rtol=1e-6)
    raw, e2 = route(x, router, 2, normalize=False)
    assert (np.asarray(e) == np.asarray(e2)).all() and (np.asarray(raw.sum(-1)) < 1).all()
    probs = jax.nn.softmax(x @ router, axis=-1)
    assert (np.asarray(e[:, 0]) == np.asarray(jnp.argmax(probs, -1))).all()
