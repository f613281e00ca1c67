"""The ragged step with adapters resident: each row's tokens get their own adapter's update.

A batch mixing rows of two adapters (of different ranks and target modules) and the base model gives,
at every row, the logits of the base weights with that row's adapter merged in (W + A B), stacked or
unrolled layers, on one device and on a (1, 2) mesh; writing a slot never recompiles the write.
"""

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.model.kv_cache import KVCache, RaggedBatch, cache_shape
from jaxserve.model import llama
from jaxserve.model.weights import init_dummy_params, unstack_layers
from jaxserve.runner.compilation import CompileCounter
from jaxserve.lora.peft_adapter import served_module_dims as module_dims
from jaxserve.runner.lora import LoRASlots

PAGE, P, N, S = 4, 8, 32, 4
forward_ragged = jax.jit(llama.forward_ragged, static_argnames=("cfg", "scan_layers"))
FIELDS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down"}


@dataclasses.dataclass
class FakeAdapter:  # what runner.lora reads of a PeftAdapter
    modules: dict


def make_cfg():
    return ModelConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
    )


def random_adapter(cfg, rank, targets, seed):
    rng = np.random.default_rng(seed)
    dims = module_dims(cfg)
    return FakeAdapter(
        {
            m: (
                rng.normal(0, 0.3, (cfg.num_layers, dims[m][0], rank)).astype(np.float32),
                rng.normal(0, 0.3, (cfg.num_layers, rank, dims[m][1])).astype(np.float32),
            )
            for m in targets
        }
    )


def merged(params, adapter):
    """The base params with the adapter's A B added into each targeted weight (stacked layers)."""
    layers = params.layers
    for m, (A, B) in adapter.modules.items():
        w = getattr(layers, FIELDS[m])
        layers = layers.replace(**{FIELDS[m]: w + jnp.einsum("lir,lro->lio", A, B)})
    return params.replace(layers=layers)


def batch_of(rows, row_lora):
    return RaggedBatch.build(rows, page_size=PAGE, num_tokens=N, num_rows=S, max_pages=P, num_logits=S).replace(
        row_lora=np.asarray(row_lora, np.int32)
    )


ROWS = [(list(range(5, 12)), 0, [1, 2]), (list(range(20, 29)), 0, [3, 4, 5]), ([7, 9, 11], 0, [6])]


@pytest.mark.parametrize("stacked", [True, False])
def test_rows_of_different_adapters_match_merged_weights(stacked):
    cfg = make_cfg()
    base = init_dummy_params(cfg, 0, jnp.float32, std=0.2)
    adapters = [random_adapter(cfg, 4, ["q", "v"], 1), random_adapter(cfg, 8, list(FIELDS), 2)]
    slots = LoRASlots(cfg, slots=3, rank=8, dtype=jnp.float32)
    params = slots.attach(base if stacked else unstack_layers(base))
    params = slots.write(params, 2, adapters[0])
    params = slots.write(params, 0, adapters[1])
    cache = KVCache(k=jnp.zeros(cache_shape(cfg, 8, PAGE)[1:]), v=jnp.zeros(cache_shape(cfg, 8, PAGE)[1:]))
    mixed, _ = forward_ragged(params, cache, batch_of(ROWS, [2, 0, -1, -1]), cfg=cfg, scan_layers=stacked)
    for r, params_r in enumerate([merged(base, adapters[0]), merged(base, adapters[1]), base]):
        alone, _ = forward_ragged(params_r, cache, batch_of(ROWS, [-1] * S), cfg=cfg)
        np.testing.assert_allclose(mixed[r], alone[r], rtol=2e-5, atol=2e-5)
    base_logits, _ = forward_ragged(base, cache, batch_of(ROWS, [-1] * S), cfg=cfg)
    assert np.abs(np.asarray(mixed[0]) - np.asarray(base_logits[0])).max() > 1e-2  # the adapter moved them


def test_rewriting_a_slot_replaces_the_adapter_and_compiles_once():
    cfg = make_cfg()
    base = unstack_layers(init_dummy_params(cfg, 0, jnp.float32, std=0.2))
    big, small = random_adapter(cfg, 8, list(FIELDS), 3), random_adapter(cfg, 2, ["o"], 4)
    slots = LoRASlots(cfg, slots=2, rank=8, dtype=jnp.float32)
    params = slots.write(slots.attach(base), 1, big)
    CompileCounter.install()
    before = CompileCounter.requests
    params = slots.write(params, 1, small)  # the old adapter's modules and rank columns cleared
    params = slots.write(params, 0, big)
    assert CompileCounter.requests == before  # one executable for every slot and adapter
    cache = KVCache(k=jnp.zeros(cache_shape(cfg, 8, PAGE)[1:]), v=jnp.zeros(cache_shape(cfg, 8, PAGE)[1:]))
    got, _ = forward_ragged(params, cache, batch_of(ROWS[:1], [1, -1, -1, -1]), cfg=cfg)
    want, _ = forward_ragged(
        merged(init_dummy_params(cfg, 0, jnp.float32, std=0.2), small), cache, batch_of(ROWS[:1], [-1] * S), cfg=cfg
    )
    np.testing.assert_allclose(got[0], want[0], rtol=2e-5, atol=2e-5)


def test_int8_base_weights_take_the_update_as_float_ones_do():
    """int8 weights (groups of 32): the update adds to the quantized projection's output, so the
    logits are those of the dequantized weights with the adapter merged in."""
    from jaxserve.model import quant

    cfg = make_cfg()
    base = init_dummy_params(cfg, 0, jnp.float32, std=0.2)
    q = quant.quantize_params(base, group_size=32)
    dequantized = quant.map_linear(q, lambda w: quant.dequantize(w, jnp.float32))
    adapter = random_adapter(cfg, 8, list(FIELDS), 5)
    slots = LoRASlots(cfg, slots=2, rank=8, dtype=jnp.float32)
    params = slots.write(slots.attach(unstack_layers(q)), 1, adapter)
    cache = KVCache(k=jnp.zeros(cache_shape(cfg, 8, PAGE)[1:]), v=jnp.zeros(cache_shape(cfg, 8, PAGE)[1:]))
    got, _ = forward_ragged(params, cache, batch_of(ROWS, [1, -1, 1, -1]), cfg=cfg)
    want, _ = forward_ragged(merged(dequantized, adapter), cache, batch_of(ROWS, [-1] * S), cfg=cfg)
    plain, _ = forward_ragged(dequantized, cache, batch_of(ROWS, [-1] * S), cfg=cfg)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[1], plain[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stacked", [True, False])
def test_tensor_parallel_mesh_matches_one_device(stacked):
    """On a (1, 2) mesh column-parallel modules split b on its output and row-parallel ones a on its
    input (as their base weights), and the step's logits are one device's."""
    from jaxserve.model.sharding import MODEL, make_mesh, make_shardings

    cfg = make_cfg()
    base = init_dummy_params(cfg, 0, jnp.float32, std=0.2)
    base = base if stacked else unstack_layers(base)
    adapters = [random_adapter(cfg, 4, ["q", "v", "down"], 6), random_adapter(cfg, 8, list(FIELDS), 7)]
    want_slots = LoRASlots(cfg, slots=2, rank=8, dtype=jnp.float32)
    one = want_slots.attach(base)
    for slot, adapter in enumerate(adapters):
        one = want_slots.write(one, slot, adapter)
    mesh = make_mesh((1, 2))
    placed = jax.device_put(base, make_shardings(cfg, mesh, stacked=stacked).params)
    slots = LoRASlots(cfg, slots=2, rank=8, dtype=jnp.float32, mesh=mesh)
    params = slots.attach(placed)
    for slot, adapter in enumerate(adapters):
        params = slots.write(params, slot, adapter)
    lora = params.layers.lora if stacked else params.layers[0].lora
    lead = (None,) if stacked else ()

    def spec(x):  # trailing Nones spelled out
        return tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))

    assert spec(lora.q.a) == (*lead, None, None) and spec(lora.q.b) == (*lead, None, MODEL)
    assert spec(lora.o.a) == (*lead, MODEL, None) and spec(lora.down.b) == (*lead, None, None)
    cache = KVCache(k=jnp.zeros(cache_shape(cfg, 8, PAGE)[1:]), v=jnp.zeros(cache_shape(cfg, 8, PAGE)[1:]))
    batch = batch_of(ROWS, [0, 1, -1, -1])
    got, _ = forward_ragged(params, cache, batch, cfg=cfg, scan_layers=stacked)
    want, _ = forward_ragged(one, cache, batch, cfg=cfg, scan_layers=stacked)
    np.testing.assert_allclose(got[:3], want[:3], rtol=2e-5, atol=2e-5)
