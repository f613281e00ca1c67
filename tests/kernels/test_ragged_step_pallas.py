"""`ragged_step` (the engine's step body) on the Pallas kernels equals it on the reference attention.

Mixed rows (decodes with context, a first prompt chunk, the last chunk of a partly prefilled prompt,
a verification of 3 tokens, padding tokens and rows), scanned and unrolled, with a sliding window, with
Gemma 3's local and global layers (window, softmax scale and RoPE table per layer, scanned operands)
and with an int8 cache; on one device, and per device under `shard_map` on meshes of 2 (data) x 2 (model)
and 1 x 4 (model axis wider than the KV heads: they are replicated). Slots no row writes start NaN.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.model.kv_cache import KVCache, RaggedBatch, cache_shape
from jaxserve.model.weights import init_dummy_params, unstack_layers
from jaxserve.model.ragged import RaggedRow
from jaxserve.model.ragged_step import ragged_step
from jaxserve.model.sharding import make_mesh
from jaxserve.model.step_options import StepOptions
from kernels_testlib import FAST_COMPILE, engine_attention_impl

PAGE, P, N, S, L = 4, 8, 32, 8, 8  # page size, pages per row, token bucket, rows, logits
# (history already cached, new tokens, logits returned)
ROWS = [(13, 1, 1), (30, 1, 1), (0, 9, 0), (11, 7, 1), (20, 3, 3)]


def make_cfg(**kw):
    # head_dim 16, power-of-two pages: the GPU (Triton) kernel's layout rules
    return ModelConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        **kw,
    )


def replica_batch(cfg, rng):
    """One replica's rows on pages of its own, and a cache whose history slots are filled (random)
    and every other slot NaN (int8 caches fill in `nan_cache`)."""
    need = [-(-(h + n) // PAGE) for h, n, _ in ROWS]
    ids = rng.permutation(np.arange(1, 1 + sum(need)))
    pages, c = [], 0
    for k in need:
        pages.append([int(x) for x in ids[c : c + k]])
        c += k
    rows = [RaggedRow(rng.integers(0, cfg.vocab_size, n).tolist(), h, pg, nl) for (h, n, nl), pg in zip(ROWS, pages)]
    history = [(pg, h) for (h, _, _), pg in zip(ROWS, pages)]
    return RaggedBatch.build(rows, page_size=PAGE, num_tokens=N, num_rows=S, max_pages=P, num_logits=L), history


def make_cache(cfg, history, num_replicas, kv, rng):
    num_pages = 2 + sum(-(-(h + n) // PAGE) for h, n, _ in ROWS)  # page 0 and one more stay NaN
    shape = cache_shape(cfg, num_pages, PAGE, num_replicas)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    for r, rows in enumerate(history):
        for pg, h in rows:
            for t in range(h):  # the cached history of each row: random K/V
                for x in (k, v):
                    x[r, :, :, pg[t // PAGE], t % PAGE] = rng.standard_normal(x.shape[1:3] + x.shape[-1:])
    if kv == "fp8":  # float8 pages (NaN stays NaN), scales per layer and KV head that are not 1
        L, K = shape[1:3]
        ks = np.linspace(0.5, 1.5, L * K, dtype=np.float32).reshape(1, L, K, 1, 1).repeat(num_replicas, 0)
        stored = lambda x, s: jnp.asarray(x / s[..., None]).astype(jnp.float8_e4m3fn)  # noqa: E731
        return KVCache(k=stored(k, ks), v=stored(v, 2 * ks), k_scale=jnp.asarray(ks), v_scale=jnp.asarray(2 * ks))
    if kv != "int8":
        return KVCache(k=jnp.asarray(k), v=jnp.asarray(v))
    scale = lambda x: np.where(np.isnan(x).any(-1), np.nan, np.abs(np.nan_to_num(x)).max(-1) / 127 + 1e-3)  # noqa
    ks, vs = scale(k), scale(v)
    quant = lambda x, s: np.where(np.isnan(x), 127, np.round(np.nan_to_num(x) / np.nan_to_num(s, nan=1)[..., None]))
    return KVCache(
        k=jnp.asarray(quant(k, ks), jnp.int8),
        v=jnp.asarray(quant(v, vs), jnp.int8),
        k_scale=jnp.asarray(ks, jnp.float32),
        v_scale=jnp.asarray(vs, jnp.float32),
    )


def scenario(cfg, num_replicas, kv="auto", seed=0):
    rng = np.random.default_rng(seed)
    batches, histories = zip(*(replica_batch(cfg, rng) for _ in range(num_replicas)))
    return make_cache(cfg, histories, num_replicas, kv, rng), RaggedBatch.stack(list(batches))


STEP = jax.jit(ragged_step, static_argnames=("cfg", "options"), compiler_options=FAST_COMPILE)
CFG = make_cfg()
PARAMS = init_dummy_params(CFG, seed=1, dtype=jnp.float32, std=0.15)


def run(params, cache, batch, cfg, impl, scan, mesh=None):
    options = StepOptions(scan_layers=scan, attention_backend=impl, mesh=mesh)
    logits, cache = STEP(params, cache, batch, cfg=cfg, options=options)
    return np.asarray(logits), jax.tree.map(np.asarray, cache)


def assert_same(got, ref):
    (gl, gc), (rl, rc) = got, ref
    n = sum(nl for _, _, nl in ROWS)
    assert np.all(np.isfinite(gl[:, :n])), "NaN from unused slots reached the logits"
    np.testing.assert_allclose(gl[:, :n], rl[:, :n], atol=2e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(gc), jax.tree.leaves(rc)):  # the same writes (NaN where none)
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)  # float8 pages compare as their values
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, equal_nan=True)


GEMMA3 = make_cfg(
    architecture="Gemma3ForCausalLM",
    layer_types=("sliding_attention", "full_attention"),
    sliding_window=6,
    rope_theta=1e6,
    rope_local_theta=1e4,
    query_pre_attn_scalar=24.0,
    qk_norm=True,
    sandwich_norms=True,
    norm_weight_offset=1.0,
    scale_embeddings=True,
    hidden_act="gelu_pytorch_tanh",
    tie_word_embeddings=True,
)


@pytest.mark.parametrize("variant", ["scan", "unrolled", "sliding_window", "gemma3_layers", "int8_kv", "fp8_kv"])
def test_pallas_ragged_step_equals_reference(variant):
    cfg = {"sliding_window": make_cfg(sliding_window=6), "gemma3_layers": GEMMA3}.get(variant, CFG)
    params = PARAMS if variant != "unrolled" else unstack_layers(PARAMS)
    if variant == "gemma3_layers":
        params = init_dummy_params(cfg, seed=1, dtype=jnp.float32, std=0.15)
    cache, batch = scenario(cfg, 1, kv=variant[:-3] if variant.endswith("_kv") else "auto")
    scan = variant != "unrolled"
    ref = run(params, cache, batch, cfg, "reference", scan)
    assert_same(run(params, cache, batch, cfg, engine_attention_impl(), scan), ref)


@pytest.mark.parametrize("mesh_shape,kv", [((2, 2), "auto"), ((1, 4), "auto"), ((2, 2), "fp8")])
def test_pallas_ragged_step_per_shard(mesh_shape, kv):
    """(2, 2): replicas on `data`, heads and KV heads split on `model`; (1, 4): 2 KV heads replicated,
    each device takes the one its query head reads; fp8: float8 pages, their per-head scales applied
    outside the kernels (kv_cache.attend) on the whole step's q and output."""
    mesh = make_mesh(mesh_shape)
    cache, batch = scenario(CFG, mesh_shape[0], kv, seed=3)
    ref = run(PARAMS, cache, batch, CFG, "reference", True)
    assert_same(run(PARAMS, cache, batch, CFG, "pallas_interpret", True, mesh=mesh), ref)


def test_unknown_backend():
    cache, batch = scenario(CFG, 1)
    with pytest.raises(ValueError, match="unknown attention"):
        run(PARAMS, cache, batch, CFG, "pallas", True)
