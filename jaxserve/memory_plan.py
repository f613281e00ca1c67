"""How the KV cache is sized: pages from `num_pages` or `kv_cache_memory`, and the plan logged at start-up.

Bytes come from ModelConfig's arithmetic (`param_bytes`, `kv_bytes_per_token`), shared with the
planner, for the chosen dtype, weight quantization and KV-cache dtype."""

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
    dtype: str = "float32"  # the model dtype
    quantization: str = "none"  # weights: "none" | "int8"
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) | "int8"
    kv_bytes_per_token_model_dtype: int | None = None  # what a cache in the model dtype would take
    draft_kv_bytes_per_token: int = 0  # speculative decoding: the draft's cache, in the same pages
    num_layers: int = 0
    num_sliding_layers: int = 0  # layers that see only the last `sliding_window` keys (Mistral: all; Gemma 3: the local ones)
    sliding_window: int | None = None

    @property
    def window_unread_bytes(self) -> int:
        """Bytes of this cache no query reads when it is full of max_model_len sequences: the sliding
        layers' share of each sequence's pages behind its window. One pool gives every layer the
        whole context; only where every layer is windowed does the block manager hand those pages
        back (`BlockManager.release_outside_window`); a mixed model (Gemma 3) would need a pool per
        layer group to use them."""
        if not (self.num_sliding_layers and self.sliding_window) or self.max_model_len <= self.sliding_window:
            return 0
        behind = (self.max_model_len - self.sliding_window) / self.max_model_len
        return int(self.kv_cache_bytes * self.num_sliding_layers / self.num_layers * behind)

    @property
    def tokens_in_model_dtype(self) -> int:
        """Tokens the same cache bytes would hold in the model dtype (whole pages, padding page excluded)."""
        per_token = self.kv_bytes_per_token_model_dtype or self.kv_bytes_per_token
        return max(self.kv_cache_bytes // (per_token * self.page_size) - RESERVED_PAGES, 0) * self.page_size

    @property
    def tokens_that_fit(self) -> int:
        return (self.num_pages - RESERVED_PAGES) * self.page_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_pages * self.page_size * self.kv_bytes_per_token

    def describe(self) -> str:
        gib = 2**30
        weights = "int8 linear layers" if self.quantization == "int8" else self.dtype
        kv = "int8 + f32 scales" if self.kv_cache_dtype == "int8" else self.dtype
        text = (
            f"memory plan: params {self.param_bytes / gib:.3f} GiB ({weights}, {self.dtype} activations); "
            f"KV {self.kv_bytes_per_token} bytes/token ({kv}); "
            f"{self.num_pages} pages x {self.page_size} tokens = {self.kv_cache_bytes / gib:.3f} GiB per replica, "
            f"{self.tokens_that_fit} tokens fit; max_model_len {self.max_model_len} "
            f"({self.max_pages_per_seq} pages/sequence)"
        )
        if self.draft_kv_bytes_per_token:
            draft = self.num_pages * self.page_size * self.draft_kv_bytes_per_token
            text += (f"; draft model KV {self.draft_kv_bytes_per_token} bytes/token in the same pages "
                     f"(+{draft / gib:.3f} GiB)")
        if self.window_unread_bytes:
            every = self.num_sliding_layers == self.num_layers
            fate = ("the block manager can release the pages behind it" if every
                    else "one pool for local and global layers holds them anyway")
            who = "every layer sees" if every else f"{self.num_sliding_layers} of {self.num_layers} layers see"
            text += (f"; {who} only the last {self.sliding_window} tokens: at max_model_len "
                     f"{self.window_unread_bytes / gib:.3f} GiB of this cache is never read ({fate})")
        if self.kv_cache_dtype == "int8" and self.kv_bytes_per_token_model_dtype:
            base = self.tokens_in_model_dtype
            more = self.tokens_that_fit - base
            ratio = f", {self.tokens_that_fit / base:.2f}x" if base else ""
            text += (f"; int8 KV: {more} more tokens fit than in {self.dtype} "
                     f"({self.kv_bytes_per_token_model_dtype} bytes/token: {base} tokens in these bytes{ratio})")
        return text


def plan_memory(cfg: ModelConfig, settings: EngineConfig, dtype: Any, param_bytes: int | None = None,
                draft_kv_bytes_per_token: int = 0) -> MemoryPlan:
    """Pages per replica and the byte figures; `param_bytes` defaults to ModelConfig's arithmetic for
    the settings' quantization (the engine checks it against the loaded params). A speculative draft
    model keeps its K/V in the same pages, so a memory budget buys pages of both."""
    max_model_len = settings.max_model_len or cfg.max_position_embeddings
    if max_model_len > cfg.max_position_embeddings:
        raise ConfigError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={cfg.max_position_embeddings}"
        )
    page_size = settings.page_size
    itemsize = jnp.dtype(dtype).itemsize
    kv_per_token = cfg.kv_bytes_per_token(itemsize, settings.kv_cache_dtype)
    if param_bytes is None:
        param_bytes = cfg.param_bytes(itemsize, settings.quantization, settings.quantize_lm_head)
    max_pages_per_seq = math.ceil(max_model_len / page_size)
    if settings.num_pages is not None:
        num_pages = settings.num_pages
    else:
        budget = settings.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
        num_pages = budget // ((kv_per_token + draft_kv_bytes_per_token) * page_size)
        if settings.kv_cache_memory is None:  # no need to hold more than every slot at full length
            num_pages = min(num_pages, settings.max_num_seqs * max_pages_per_seq + RESERVED_PAGES)
    if num_pages <= RESERVED_PAGES:
        raise ConfigError(
            f"the KV cache would hold {num_pages} page(s) of {page_size} tokens; at least 2 are needed "
            "(page 0 is reserved): raise num_pages or kv_cache_memory"
        )
    return MemoryPlan(param_bytes, kv_per_token, page_size, int(num_pages), max_model_len, max_pages_per_seq,
                      dtype=jnp.dtype(dtype).name, quantization=settings.quantization,
                      kv_cache_dtype=settings.kv_cache_dtype,
                      kv_bytes_per_token_model_dtype=cfg.kv_bytes_per_token(itemsize),
                      draft_kv_bytes_per_token=draft_kv_bytes_per_token, num_layers=cfg.num_layers,
                      num_sliding_layers=cfg.num_sliding_layers, sliding_window=cfg.sliding_window)
