"""A step's host inputs in one host->device copy.

`jax.device_put` costs ~70 us per array on a CPU (measured, jax 0.10), and a step's inputs are ~20
small arrays: tokens, positions, the page table and a dozen sampling parameters. That was 1.5-2.5 ms
per step, a third of a small model's 5 ms decode step. So the host packs them into one int32 array
[R, N] (float32 and uint32 bit-cast, bools widened) and the compiled step slices them back out, which
XLA fuses into their consumers. The leading axis stays the replica axis, so a mesh still shards the
buffer over `data` as it sharded each input.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

_WORD = np.dtype(np.int32)
_BITCAST = {np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.float32)}  # 4-byte: carried bit for bit
_WIDENED = {np.dtype(np.bool_)}  # carried as 0/1 words


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of an input pytree lies in the packed [R, width] buffer (static: part of the
    compiled step's signature)."""

    treedef: Any
    fields: tuple[tuple[tuple[int, ...], str], ...]  # per leaf: shape after the replica axis, dtype
    replicas: int

    @classmethod
    def of(cls, tree: Any) -> Layout:
        """The layout of a pytree of arrays or ShapeDtypeStructs, all with the same leading axis R."""
        leaves, treedef = jax.tree.flatten(tree)
        if not leaves:
            raise ValueError("nothing to pack")
        replicas = leaves[0].shape[0]
        fields = []
        for leaf in leaves:
            dtype = np.dtype(leaf.dtype)
            if dtype not in _BITCAST | _WIDENED:
                raise TypeError(f"cannot pack a {dtype} input (packable: int32, uint32, float32, bool)")
            if not leaf.shape or leaf.shape[0] != replicas:
                raise ValueError(f"every input needs the leading replica axis {replicas}, got shape {leaf.shape}")
            fields.append((tuple(leaf.shape[1:]), dtype.name))
        return cls(treedef, tuple(fields), replicas)

    @functools.cached_property
    def _dtypes(self) -> tuple[np.dtype, ...]:
        return tuple(np.dtype(dtype) for _, dtype in self.fields)

    @property
    def width(self) -> int:
        return sum(math.prod(shape) for shape, _ in self.fields)

    def spec(self, sharding: Any = None) -> jax.ShapeDtypeStruct:
        """The packed buffer's ShapeDtypeStruct, for ahead-of-time lowering."""
        return jax.ShapeDtypeStruct((self.replicas, self.width), jnp.int32, sharding=sharding)

    def pack(self, tree: Any) -> np.ndarray:
        """Host side: the pytree's NumPy arrays as one int32 [R, width] array (checked against the layout)."""
        leaves, treedef = jax.tree.flatten(tree)
        if treedef != self.treedef:
            raise ValueError(f"inputs {treedef} do not match the compiled layout {self.treedef}")
        words = []
        for leaf, (shape, dtype), expected in zip(leaves, self.fields, self._dtypes):
            leaf = np.asarray(leaf)
            # dtype objects compared, not their names: numpy's dtype.name costs ~4 us, 23 leaves a step
            if leaf.shape[1:] != shape or leaf.shape[0] != self.replicas or leaf.dtype != expected:
                raise ValueError(
                    f"input {leaf.dtype}{list(leaf.shape)} does not match the compiled layout "
                    f"{dtype}{[self.replicas, *shape]}"
                )
            flat = np.ascontiguousarray(leaf).reshape(self.replicas, -1)
            words.append(flat.view(_WORD) if leaf.dtype in _BITCAST else flat.astype(_WORD))
        return np.concatenate(words, axis=1)

    def views(self, buffer: np.ndarray) -> Any:
        """Host side: the pytree as NumPy views into a packed int32 [R, width] buffer, so that writing
        a leaf writes the buffer (`jaxserve.runner.input_batch` keeps one per bucket). float32 and
        uint32 leaves are seen bit-cast; bool leaves as their int32 words (0/1)."""
        if buffer.shape != (self.replicas, self.width) or buffer.dtype != _WORD:
            raise ValueError(
                f"a buffer of int32[{self.replicas}, {self.width}] is needed, got {buffer.dtype}{list(buffer.shape)}"
            )
        leaves, at = [], 0
        for (shape, _), dtype in zip(self.fields, self._dtypes):
            size = math.prod(shape)
            word = buffer[:, at : at + size].reshape((self.replicas,) + shape)
            if not np.shares_memory(word, buffer):  # numpy copied: writes would be lost
                raise AssertionError(f"leaf {shape} is not a view of the buffer")
            at += size
            leaves.append(word.view(dtype) if dtype in _BITCAST else word)
        return jax.tree.unflatten(self.treedef, leaves)

    def put(self, tree: Any, sharding: Any = None) -> jax.Array:
        """`pack(tree)` copied to the device in one explicit transfer (`sharding`: over the replicas)."""
        return jax.device_put(self.pack(tree), sharding)

    def zeros(self, sharding: Any = None) -> jax.Array:
        """All-zero inputs on the device: every row on the padding page (warm-up calls)."""
        return jax.device_put(np.zeros((self.replicas, self.width), np.int32), sharding)

    def unpack(self, buffer: jax.Array) -> Any:
        """Device side (traced): the pytree back from the packed buffer."""
        leaves, at = [], 0
        for shape, dtype in self.fields:
            size = math.prod(shape)
            word = buffer[:, at : at + size].reshape((self.replicas,) + shape)
            at += size
            if dtype == "bool":
                leaves.append(word != 0)
            elif dtype == "int32":
                leaves.append(word)
            else:
                leaves.append(jax.lax.bitcast_convert_type(word, jnp.dtype(dtype)))
        return jax.tree.unflatten(self.treedef, leaves)


def from_buffer(step: Callable, num_leading: int) -> Callable:
    """`step(*leading, *inputs, **static)` as `run(*leading, buffer, layout=..., **static)`: the inputs
    after the first `num_leading` arguments (params, caches) arrive packed in one buffer, whose layout
    is that of the tuple `inputs`."""

    def run(*args, layout: Layout, **static):
        if len(args) != num_leading + 1:
            raise TypeError(f"expected {num_leading} arguments and the packed buffer, got {len(args)}")
        return step(*args[:num_leading], *layout.unpack(args[num_leading]), **static)

    run.__name__ = getattr(step, "__name__", "step")
    run.__doc__ = step.__doc__
    return run


# The sampling inputs that are padding in most steps: each row's penalty history and logit-bias slots
# (together 95% of a step's input words when no row uses them). They travel apart from the packed
# buffer, as 2-D [R, L * width] operands, so that a step needing none of them reuses arrays already
# on the device and copies nothing (`InputTransfer.put_sparse`).
SPARSE_FIELDS = ("history", "bias_ids", "bias_values")


def with_sparse(sampling: Any, sparse: tuple) -> Any:
    """The SamplingTensors with its sparse fields back from their [R, L * width] operands."""
    R, L = sampling.temperature.shape
    return sampling.replace(**{name: x.reshape(R, L, -1) for name, x in zip(SPARSE_FIELDS, sparse)})
