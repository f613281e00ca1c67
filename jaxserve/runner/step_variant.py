"""What every compiled step shares, and the interface each kind of step implements.

A *step variant* is one kind of compiled step: the plain ragged step, its prompt-scoring form, the
multi-step decode scan, the speculative step. Each owns what differs between them: its executables'
keys (a bucket, `(tokens, pages)`, and the variant's tag), its input specs, how it is lowered and
called, how a step's rows are laid out for it and how its outputs become each row's run of samples.
The runner (`jaxserve.runner.runner.ModelRunner`) only picks the first variant that accepts a step's
rows and runs it: it never looks at a shape or a feature to tell variants apart.

`StepContext` is the static description every variant reads (model, buckets, shardings, whether LoRA
slots are served); `DeviceState` holds the device buffers the steps read and, donated, replace.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.engine.buckets import BucketTable, pick_step_shape, step_shapes
from jaxserve.model.kv_cache import KVCache, RaggedBatch, cache_shardings, copy_pages_padded
from jaxserve.model.transfer import Layout
from jaxserve.runner.grammar_masks import GrammarMasks
from jaxserve.runner.step_io import StepInputs, StepSamples
from jaxserve.model.step_options import StepOptions


@dataclasses.dataclass
class StepContext:
    """The static facts of one engine's steps: the same for every variant and every step."""

    cfg: ModelConfig
    options: StepOptions
    buckets: BucketTable
    num_replicas: int
    page_size: int
    shardings: Any  # jaxserve.model.sharding.Shardings, or None on one device
    cache_quantized: bool
    num_scheduler_steps: int = 1
    lora: bool = False  # each step carries its rows' LoRA slots (`RaggedBatch.row_lora`)
    grammar_masks: GrammarMasks | None = None
    # The token buckets steps may use while the others compile in the background (sorted; replaced
    # whole as each becomes ready: runner/background_compile.py); None: every bucket is ready.
    ready_tokens: tuple[int, ...] | None = None

    def __post_init__(self):
        # Token history for repetition/presence/frequency penalties, padded to one fixed length so
        # penalties never recompile (B x history_len int32s per step: small beside the weights).
        self.history_len = self.buckets.page_counts[-1] * self.page_size
        if self.grammar_masks is None:
            self.grammar_masks = GrammarMasks(self.num_replicas, self.cfg.vocab_size)
        mesh = None if self.shardings is None else self.shardings.mesh
        replicated = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        # A mesh spanning processes: the samples are made replicated in the step, since a process
        # can only read the shards on its own devices.
        self.out_sharding = replicated if mesh is not None and mesh.is_multi_process else None
        # The carried samples (what placeholders name) are small and replicated: every process reads them.
        self.carry_sharding = replicated
        # The packed inputs: over the replicas (the `data` axis) on a mesh.
        self.buffer_sharding = None if self.shardings is None else self.shardings.batch2
        self.cache_sharding = (
            None
            if self.shardings is None
            else cache_shardings(self.shardings, "int8" if self.cache_quantized else "auto")
        )

    @property
    def max_rows(self) -> int:
        return self.buckets.max_rows

    def num_logits(self, num_tokens: int) -> int:
        """Logits a step of `num_tokens` tokens returns: one per row that samples, at most one per
        token and one per row."""
        return min(num_tokens, self.buckets.max_rows)

    def i32(self, *dims: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.num_replicas,) + dims, jnp.int32)

    def ragged_spec(self, num_tokens: int, pages: int, num_logits: int, lora: bool | None = None) -> RaggedBatch:
        """The ShapeDtypeStructs of a RaggedBatch of this engine (`lora`: with the rows' adapter
        slots; by default when the engine serves LoRA)."""
        S, i32 = self.max_rows, self.i32
        with_lora = self.lora if lora is None else lora
        return RaggedBatch(
            tokens=i32(num_tokens),
            positions=i32(num_tokens),
            slots=i32(num_tokens),
            token_row=i32(num_tokens),
            query_start=i32(S + 1),
            context_lens=i32(S),
            page_table=i32(S, pages),
            logit_index=i32(num_logits),
            row_lora=i32(S) if with_lora else None,
        )

    def bucket_for(self, rows: Sequence[Any], extra_steps: Sequence[int] | None = None) -> tuple:
        """The (tokens, pages) bucket these rows pack into: the most tokens on one replica, and each
        row's pages up to its last position this call (`extra_steps`: decode steps after its first
        in the same call); pages reserved beyond it are not read."""
        ps, R = self.page_size, self.num_replicas
        extra = extra_steps or [0] * len(rows)
        need = [min(len(r.page_ids), -(-(r.start_pos + len(r.tokens) + n) // ps)) for r, n in zip(rows, extra)]
        if R == 1:
            n_tokens = sum(len(r.tokens) for r in rows)
        else:
            n_tokens = max(sum(len(r.tokens) for r in rows if r.replica == rep) for rep in range(R))
        return pick_step_shape(self.buckets, n_tokens, max(need), self.ready_tokens)


@dataclasses.dataclass
class DeviceState:
    """The device buffers a step reads: the weights, the paged KV cache (donated into every step and
    replaced by its result), the last step's samples kept on the device for the next step's
    placeholders (`jaxserve.model.placeholders`), and with a draft model its weights and cache."""

    params: Any
    cache: Any
    carried: Any  # i32[R, max_rows]
    draft_params: Any = None
    draft_cache: Any = None

    def caches(self) -> list:
        """The KV caches a page copy must update: the target's, and the draft's."""
        return [c for c in (self.cache, self.draft_cache) if c is not None]

    def copy_pages(self, replica: int, src: np.ndarray, dst: np.ndarray, width: int) -> None:
        """Copy pages src[i] -> dst[i] of one replica in every KV cache, in one compiled width."""
        self.cache = copy_pages_padded(self.cache, replica, src, dst, width)
        if isinstance(self.draft_cache, KVCache):
            self.draft_cache = copy_pages_padded(self.draft_cache, replica, src, dst, width)
        elif self.draft_cache is not None:  # an EAGLE-3 head's (spec_decode.eagle3_draft.EagleCache)
            self.draft_cache = self.draft_cache.copy_pages(replica, src, dst, width)

    def delete(self) -> None:
        """Free every buffer now: a later use raises jax's "Array has been deleted"."""
        delete_buffers((self.params, self.cache, self.carried, self.draft_params, self.draft_cache))
        self.params = self.cache = self.carried = self.draft_params = self.draft_cache = None


class StepVariant:
    """One kind of compiled step. Subclasses set `tag` (the executables' key suffix after the bucket)
    and `jitted` (the `jax.jit` of the step over `(params, cache, carried, sparse, packed inputs)`),
    and implement `accepts`, `input_specs`, `pack` and `unpack`."""

    tag: tuple = ()
    jitted: Callable | None = None

    def __init__(self, ctx: StepContext):
        self.ctx = ctx

    # ---- which executables -------------------------------------------------------------------
    def keys(self) -> list[tuple]:
        """Every executable of this variant: by default one per token bucket of the ragged step, at
        the one page-table width (`buckets.step_shapes`, the bucket table's one rule)."""
        return [key + self.tag for key in step_shapes(self.ctx.buckets, 1)]

    def owns(self, key: tuple) -> bool:
        return tuple(key[2:]) == self.tag

    def accepts(self, rows: Sequence[Any]) -> bool:
        """Whether this variant runs a step of these rows (`runner.variants` is asked in order)."""
        raise NotImplementedError

    def key_for(self, rows: Sequence[Any]) -> tuple:
        return self.ctx.bucket_for(rows) + self.tag

    # ---- compiling and calling -----------------------------------------------------------------
    def input_specs(self, key: tuple) -> tuple:
        """ShapeDtypeStructs of the step's host inputs, leading axis R (they travel packed)."""
        raise NotImplementedError

    def static(self, key: tuple) -> dict:
        """The step function's static arguments besides the layout."""
        c = self.ctx
        return dict(
            cfg=c.cfg,
            options=c.options,
            cache_sharding=c.cache_sharding,
            out_sharding=c.out_sharding,
            carry_sharding=c.carry_sharding,
        )

    def lower(self, key: tuple, state: DeviceState, layout: Layout, sparse: tuple):
        carried = jax.ShapeDtypeStruct(state.carried.shape, jnp.int32, sharding=self.ctx.carry_sharding)
        return self.jitted.trace(
            state.params,
            state.cache,
            carried,
            sparse,
            layout.spec(self.ctx.buffer_sharding),
            layout=layout,
            **self.static(key),
        ).lower()

    def call(self, executable: Any, state: DeviceState, sparse: tuple, buffer: Any) -> Any:
        """Run the executable, replacing the donated cache and the carried samples; returns its outputs."""
        out, state.cache, state.carried = executable(state.params, state.cache, state.carried, sparse, buffer)
        return out

    # ---- the host's side -----------------------------------------------------------------------
    def pack(self, rows: Sequence[Any], key: tuple, layout: Layout) -> StepInputs:
        """Lay the rows out in bucket `key` (nothing is sent yet)."""
        raise NotImplementedError

    def fetched(self, out: Any, logprobs: bool) -> Any:
        """What of the outputs comes back to the host (`logprobs` False: no row asked for them)."""
        return out

    def unpack(self, out: Any, packed: StepInputs) -> StepSamples:
        """The fetched outputs as each row's run of samples, in row order."""
        raise NotImplementedError

    def clear(self) -> None:
        """Drop what the variant keeps between steps (the engine is closing)."""


def without_logprobs(sample: Any) -> Any:
    """A SampleOutput whose logprobs stay on the device (each array fetched costs the host ~15-30 us)."""
    return sample.replace(logprobs=None, top_ids=None, top_logprobs=None)


def flat_rows(x: np.ndarray, logit_at: np.ndarray) -> np.ndarray:
    """[R, L, ...] -> [rows, ...]: each row's sample (rows that sample none take slot 0's, unread)."""
    return x.reshape((-1,) + x.shape[2:])[np.maximum(logit_at, 0)]


def delete_buffers(tree: Any) -> None:
    """Free the device buffers of every jax.Array in `tree` now (not when the last reference goes)."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()
