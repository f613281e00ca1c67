"""How the KV cache is sized: pages from `num_pages` or `kv_cache_memory`, and the plan logged at start-up."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.errors import ConfigError

DEFAULT_KV_CACHE_MEMORY = 2 * 2**30  # used only when neither num_pages nor kv_cache_memory is set
RESERVED_PAGES = 1  # page 0 of each replica is the padding page


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    param_bytes: int
    kv_bytes_per_token: int
    page_size: int
    num_pages: int  # per replica, the padding page included
    max_model_len: int
    max_pages_per_seq: int

    @property
    def tokens_that_fit(self) -> int:
        return (self.num_pages - RESERVED_PAGES) * self.page_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_pages * self.page_size * self.kv_bytes_per_token

    def describe(self) -> str:
        gib = 2**30
        return (
            f"memory plan: params {self.param_bytes / gib:.3f} GiB; KV {self.kv_bytes_per_token} bytes/token; "
            f"{self.num_pages} pages x {self.page_size} tokens = {self.kv_cache_bytes / gib:.3f} GiB per replica, "
            f"{self.tokens_that_fit} tokens fit; max_model_len {self.max_model_len} "
            f"({self.max_pages_per_seq} pages/sequence)"
        )


def plan_memory(cfg: ModelConfig, settings: EngineConfig, dtype: Any, param_bytes: int) -> MemoryPlan:
    max_model_len = settings.max_model_len or cfg.max_position_embeddings
    if max_model_len > cfg.max_position_embeddings:
        raise ConfigError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={cfg.max_position_embeddings}"
        )
    page_size = settings.page_size
    kv_per_token = cfg.kv_bytes_per_token(jnp.dtype(dtype).itemsize)
    max_pages_per_seq = math.ceil(max_model_len / page_size)
    if settings.num_pages is not None:
        num_pages = settings.num_pages
    else:
        budget = settings.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
        num_pages = budget // (kv_per_token * page_size)
        if settings.kv_cache_memory is None:  # no need to hold more than every slot at full length
            num_pages = min(num_pages, settings.max_num_seqs * max_pages_per_seq + RESERVED_PAGES)
    if num_pages <= RESERVED_PAGES:
        raise ConfigError(
            f"the KV cache would hold {num_pages} page(s) of {page_size} tokens; at least 2 are needed "
            "(page 0 is reserved): raise num_pages or kv_cache_memory"
        )
    return MemoryPlan(param_bytes, kv_per_token, page_size, int(num_pages), max_model_len, max_pages_per_seq)
