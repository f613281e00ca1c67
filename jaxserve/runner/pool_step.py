"""The pooling step: prompt-only rows through the engine's paged ragged step, returning each row's
pooled final hidden state instead of a sample (embeddings: `engine/pooling.py` drives it).

`PoolStep` is a step variant (`step_variant.StepVariant`) compiled from `ragged_step` with a
`HiddenStates` output (`model/hidden_states.py`): the final-normed state at one token per row (its
last for LAST pooling, its first for CLS) or, for MEAN, its sum over the row's tokens in this step.
It packs its own inputs from each row's (token ids, start position, page ids) with
`model.ragged.pack_ragged`, so it depends on no engine-side row type. `PoolingRunner` holds the
device state of a pooling engine (weights, a KV cache that only lives for a prompt's chunks) and the
variant's executables, one per token bucket, compiled at start-up.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from jaxserve.engine.buckets import BucketTable, step_shapes
from jaxserve.engine.pooling import PoolRow
from jaxserve.model.hidden_states import HiddenStates
from jaxserve.model.kv_cache import KVCache, RaggedBatch
from jaxserve.model.ragged import RaggedRow, pack_ragged
from jaxserve.model.ragged_step import ragged_step
from jaxserve.model.step_options import StepOptions
from jaxserve.model.transfer import Layout, from_buffer
from jaxserve.runner.compilation import CompileCounter, release_compiled_code, step_compiler_options
from jaxserve.runner.executables import ExecutableTable
from jaxserve.runner.step_variant import DeviceState, StepContext, StepVariant, delete_buffers

POOL = "pool"  # the pooling variant's tag in its executables' keys
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclasses.dataclass
class PooledRows:
    """A pooling step's results on the host, in row order (float32)."""

    states: np.ndarray | None  # f32[rows, D]: the final-normed state at each row's chosen token
    sums: np.ndarray | None  # f32[rows, D]: the final-normed states summed over each row's tokens


def states_for(pooling_type: str) -> HiddenStates:
    """The step output a pooling type needs (no logits: the vocabulary matmul is skipped)."""
    if pooling_type not in POOLING_TYPES:
        raise ValueError(f"pooling type {pooling_type!r}: one of {', '.join(POOLING_TYPES)}")
    mean = pooling_type == "MEAN"
    return HiddenStates(final=not mean, row_sums=mean, logits=False)


def _pool_step(params, cache, batch, state_index, cfg, options, states, cache_sharding=None):
    """One ragged step of prompt chunks returning `HiddenOutput` [R, ...] (no sampling); the cache
    is donated and returned."""
    out, cache = ragged_step(params, cache, batch, cfg, options, states=states, state_index=state_index)
    if cache_sharding is not None:
        cache = jax.lax.with_sharding_constraint(cache, cache_sharding)
    return out, cache


pool_step = jax.jit(
    from_buffer(_pool_step, 2),
    static_argnames=("layout", "cfg", "options", "states", "cache_sharding"),
    donate_argnums=(1,),
)


class PoolStep(StepVariant):
    """The pooling variant: one executable per token bucket at the one page-table width, taking a
    `RaggedBatch` (no logits) and each row's chosen token i32[R, S]."""

    tag = (POOL,)
    jitted = pool_step

    def __init__(self, ctx: StepContext, pooling_type: str):
        super().__init__(ctx)
        self.pooling_type = pooling_type
        self.states = states_for(pooling_type)

    def keys(self) -> list[tuple]:
        return [key + self.tag for key in step_shapes(self.ctx.buckets, 1)]

    def accepts(self, rows: Sequence[Any]) -> bool:
        return bool(rows) and all(isinstance(r, PoolRow) for r in rows)

    def input_specs(self, key: tuple) -> tuple:
        N, P = key[:2]
        return (self.ctx.ragged_spec(N, P, 1, lora=False), self.ctx.i32(self.ctx.max_rows))

    def static(self, key: tuple) -> dict:
        return dict(
            cfg=self.ctx.cfg, options=self.ctx.options, states=self.states, cache_sharding=self.ctx.cache_sharding
        )

    def lower(self, key: tuple, state: DeviceState, layout: Layout, sparse: tuple = ()):
        spec = layout.spec(self.ctx.buffer_sharding)
        return self.jitted.trace(state.params, state.cache, spec, layout=layout, **self.static(key)).lower()

    def call(self, executable: Any, state: DeviceState, sparse: tuple, buffer: Any) -> Any:
        out, state.cache = executable(state.params, state.cache, buffer)
        return out

    def pack(self, rows: Sequence[PoolRow], key: tuple, layout: Layout) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """(the packed input buffer, each row's (replica, row slot))."""
        c = self.ctx
        R, S, N, P = c.num_replicas, c.max_rows, key[0], key[1]
        per_replica: list[list[int]] = [[] for _ in range(R)]
        for i, r in enumerate(rows):
            per_replica[r.replica].append(i)
        arrays, at = [], [(0, 0)] * len(rows)
        state_index = np.zeros((R, S), np.int32)
        ps = c.page_size
        for rep, indices in enumerate(per_replica):
            ragged = [
                RaggedRow(
                    rows[i].tokens,
                    rows[i].start_pos,
                    rows[i].page_ids[: -(-(rows[i].start_pos + len(rows[i].tokens)) // ps)],
                    num_logits=0,
                )
                for i in indices
            ]
            a = pack_ragged(ragged, page_size=ps, num_tokens=N, num_rows=S, max_pages=P, num_logits=1)
            arrays.append(a)
            for slot, i in enumerate(indices):
                at[i] = (rep, slot)
                first, n = int(a.query_start[slot]), len(rows[i].tokens)
                state_index[rep, slot] = first + n - 1 if self.pooling_type == "LAST" else first
        batch = RaggedBatch(
            **{f.name: np.stack([getattr(a, f.name) for a in arrays]) for f in dataclasses.fields(arrays[0])},
            row_lora=None,
        )
        return layout.pack((batch, state_index)), at

    def unpack(self, out: Any, at: list[tuple[int, int]]) -> PooledRows:
        reps = np.asarray([rep for rep, _ in at])
        slots = np.asarray([slot for _, slot in at])
        pick = lambda x: None if x is None else np.asarray(x, np.float32)[reps, slots]
        return PooledRows(states=pick(out.final), sums=pick(out.row_sums))


class PoolingRunner:
    """The device half of a pooling engine: weights, the paged KV cache (pages live only while their
    prompt's chunks run), the pooling variant's executables; `run(rows)` is one step, waited for."""

    def __init__(
        self,
        cfg: Any,
        params: Any,
        cache: KVCache,
        buckets: BucketTable,
        pooling_type: str,
        options: StepOptions = StepOptions(),
        shardings: Any = None,
    ):
        self.ctx = StepContext(cfg, options, buckets, cache.num_replicas, cache.page_size, shardings, cache.quantized)
        self.buckets, self.num_replicas, self.page_size = buckets, cache.num_replicas, cache.page_size
        self.state = DeviceState(params, cache, carried=None)
        self.variant = PoolStep(self.ctx, pooling_type)
        self.platform = jax.default_backend()
        self.table = ExecutableTable(self._lower, step_compiler_options(self.platform), self.platform)
        self.compiles_at_warm_up: int | None = None
        self.closed = False
        CompileCounter.install()

    @property
    def max_rows(self) -> int:
        return self.buckets.max_rows

    @property
    def max_tokens(self) -> int:
        return self.buckets.token_counts[-1]

    @property
    def max_pages(self) -> int:
        return self.buckets.page_counts[-1]

    def _lower(self, key: tuple) -> tuple[Any, Layout]:
        layout = Layout.of(self.variant.input_specs(key))
        return self.variant.lower(key, self.state, layout), layout

    def warm_up(self, progress: bool = True) -> list[tuple]:
        """Compile every bucket and call each once on zeros (every token on the padding page)."""
        keys = self.variant.keys()
        timings = self.table.compile_all(keys, progress)
        for key in keys:
            zeros = self.table.layouts[key].zeros(self.ctx.buffer_sharding)
            self.variant.call(self.table.executables[key], self.state, (), zeros)
            self.table.ran.add(key)
        jax.block_until_ready(self.state.cache)
        self.compiles_at_warm_up = CompileCounter.requests
        return timings

    def run(self, rows: Sequence[PoolRow]) -> PooledRows:
        """One step of these prompt chunks; waits for it and returns each row's states."""
        if self.closed:
            raise RuntimeError("this pooling engine is closed")
        key = self.ctx.bucket_for(rows) + self.variant.tag
        executable = self.table.get(key, planned=False)
        buffer, at = self.variant.pack(rows, key, self.table.layout(key))
        self.table.first_run(key)
        with jax.transfer_guard_host_to_device("allow"):
            out = self.variant.call(executable, self.state, (), jax.device_put(buffer, self.ctx.buffer_sharding))
        return self.variant.unpack(jax.device_get(out), at)

    def num_executables(self) -> int:
        return len(self.table)

    def stats(self) -> dict:
        after = None if self.compiles_at_warm_up is None else CompileCounter.requests - self.compiles_at_warm_up
        return dict(compiles_after_warmup=after, executables=self.num_executables())

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.table.clear()
        delete_buffers((self.state.params, self.state.cache))
        self.state.params = self.state.cache = None
        release_compiled_code()
