"""The jit-compiled steps: prefill a chunk / decode one token for every sequence of every replica.

These are the public step-level API for research code. They take `(params, cache, batch)` and return
`(logits, cache)`; the cache is donated (updated in place) unless you call a `*_nodonate` variant.
The model config and step options are static, so one compilation serves every batch of a shape.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jaxserve.config import ModelConfig
from jaxserve.kv_cache import KVCache, StepBatch
from jaxserve.model.layers import paged_attention_reference
from jaxserve.model.llama import forward
from jaxserve.model.weights import Params


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Static choices of how a step is computed (hashable: part of the compilation key)."""

    scan_layers: bool = False
    all_logits: bool = False
    attention_backend: str = "reference"


def attention_impl(backend: str):
    if backend == "reference":
        return paged_attention_reference
    raise ValueError(f"attention_backend {backend!r} is not available in this build")


def model_step(
    params: Params, cache: KVCache, batch: StepBatch, cfg: ModelConfig, options: StepOptions = StepOptions()
) -> tuple[jax.Array, KVCache]:
    """logits f32[R, B, V] (or f32[R, B, T, V] with all_logits) and the updated cache."""
    fwd = functools.partial(
        forward,
        cfg=cfg,
        scan_layers=options.scan_layers,
        all_logits=options.all_logits,
        attention=attention_impl(options.attention_backend),
    )
    logits, k, v = jax.vmap(fwd, in_axes=(None, 0, 0, 0, 0, 0, 0))(
        params, cache.k, cache.v, batch.tokens, batch.start_pos, batch.num_new, batch.page_table
    )
    return logits, KVCache(k=k, v=v)


def _check_decode(batch: StepBatch) -> None:
    if batch.tokens.shape[-1] != 1:
        raise ValueError(f"decode takes one token per sequence; got tokens of shape {batch.tokens.shape}")


def _decode(params, cache, batch, cfg, options=StepOptions()):
    _check_decode(batch)
    return model_step(params, cache, batch, cfg, options)


_STATIC = ("cfg", "options")
prefill = jax.jit(model_step, static_argnames=_STATIC, donate_argnames=("cache",))
decode = jax.jit(_decode, static_argnames=_STATIC, donate_argnames=("cache",))
prefill_nodonate = jax.jit(model_step, static_argnames=_STATIC)
decode_nodonate = jax.jit(_decode, static_argnames=_STATIC)
