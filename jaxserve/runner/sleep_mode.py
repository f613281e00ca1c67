"""Sleep mode's device half: the weights and the KV cache taken off the devices and brought back.

The host's half (what a sleeping engine refuses, what `pause` does to requests) is
`jaxserve.engine.pause`. Here: level 1 copies the weights to host memory and frees their device
buffers, level 2 frees them with no copy (new weights come with `update_weights`); both free the KV
cache's pages (the target's, a draft model's, an EAGLE-3 head's and its stored states), which are re-created as zeros on `wake_up`, the
state `init_cache` made at start-up. A float8 cache's per-layer scales (a few floats, read from the
checkpoint) stay. Nothing is compiled for the steps: every buffer comes back with the shape, dtype
and sharding the executables were compiled for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.runner.weight_update import WeightUpdater


class DeviceSleep:
    """Frees and restores one engine's device buffers (`runner.state`) for sleep and wake_up."""

    def __init__(self, state: Any, weights: Sequence[WeightUpdater]):
        self.state = state  # runner.state (DeviceState): params, cache, draft_cache
        self.weights = list(weights)  # the target's updater, and a draft model's
        self.cache_layout: dict[str, dict[str, jax.ShapeDtypeStruct]] = {}  # cache name -> discarded page arrays

    @property
    def cache_on_device(self) -> bool:
        return not self.cache_layout

    def sleep(self, level: int) -> None:
        """Level 1: weights to host memory; level 2: weights discarded; the KV cache discarded in both."""
        for updater in self.weights:
            updater.offload(keep_on_host=level == 1)
        self.discard_cache()

    def wake_up(self, tags: Sequence[str]) -> None:
        """Bring back "weights" (level 1's host copy; level 2's need update_weights) and "kv_cache"."""
        if "weights" in tags:
            for updater in self.weights:
                updater.restore()
        if "kv_cache" in tags:
            self.restore_cache()

    @property
    def weights_on_device(self) -> bool:
        return all(updater.on_device for updater in self.weights)

    def discard_cache(self) -> None:
        """Delete every KV cache's page arrays (and an int8 cache's per-slot scales), keeping their
        shapes and shardings for `restore_cache`."""
        for name in ("cache", "draft_cache"):
            cache = getattr(self.state, name)
            if cache is None or name in self.cache_layout:
                continue
            pages = _page_arrays(cache)
            self.cache_layout[name] = {
                f: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for f, x in pages.items()
            }
            for x in pages.values():
                if not x.is_deleted():
                    x.delete()

    def restore_cache(self) -> None:
        """The discarded page arrays again, as zeros on their shardings (no sequence holds a page)."""
        for name, layout in self.cache_layout.items():
            fresh = {f: jnp.zeros(s.shape, s.dtype, device=s.sharding) for f, s in layout.items()}
            setattr(self.state, name, _with_page_arrays(getattr(self.state, name), fresh))
        self.cache_layout.clear()


def _page_arrays(cache: Any) -> dict[str, jax.Array]:
    """A cache's per-page arrays by name: a KVCache's; an EAGLE-3 head's (`EagleCache`) K/V as
    "kv.<field>" and its stored states as "hidden"."""
    if hasattr(cache, "kv"):
        return {**{f"kv.{f}": x for f, x in _page_arrays(cache.kv).items()}, "hidden": cache.hidden}
    return {f: getattr(cache, f) for f in ("k", "v", "k_scale", "v_scale") if _is_pages(cache, f)}


def _with_page_arrays(cache: Any, arrays: dict[str, jax.Array]) -> Any:
    """`cache` with the arrays `_page_arrays` named replaced."""
    if hasattr(cache, "kv"):
        kv = {name[3:]: x for name, x in arrays.items() if name.startswith("kv.")}
        return cache.replace(kv=cache.kv.replace(**kv), hidden=arrays.get("hidden", cache.hidden))
    return cache.replace(**arrays)


def _is_pages(cache: Any, field: str) -> bool:
    """Whether a KVCache field holds per-page data (K, V, int8 per-slot scales), not per-layer scales."""
    x = getattr(cache, field)
    return x is not None and x.ndim >= 5 and x.shape[3] == cache.num_pages
