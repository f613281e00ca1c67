"""New weights for a running engine, without a restart: what a training loop calls between rollouts.

`WeightUpdater` owns one model's served params (the target's, or a draft model's) and replaces them
tensor by tensor from any of the forms a trainer holds:

- a `Params` pytree in the engine's layout (stacked layers or a tuple of per-layer ones: either is
  turned into the engine's), float or already quantized like the engine's;
- a mapping from Hugging Face tensor names to arrays, or an iterator of (name, array) chunks (what a
  trainer holding an HF-layout model streams, and what `update_weights_from_disk` reads from files).

Why tensor by tensor: each new tensor is checked (shape, a deleted array), the old one freed, then the
new one placed (resharded onto the engine's sharding, cast to its dtype, quantized for an int8 / int4
engine) before the next is read, so device memory never holds more than the served weights (an int8
/ int4 engine: plus one float tensor while it is quantized), never two copies of the model. Nothing is
compiled for the steps: every new leaf has the shape, dtype and sharding the executables were
compiled for, so they take it as they took the old one.

Why adoption: a `jax.Array` already on the engine's devices with an equivalent sharding, shape and
dtype is served as it is (the same object; no copy, no time). The engine then shares it with the
caller, and a trainer step that donates it deletes the engine's weight: `check()` (before every
step) raises `WeightsDeletedError` naming it instead of an XLA error inside the step. Adopted arrays
are never deleted here; the engine's own copies are deleted as soon as they are replaced.

Sleep (`offload`, `restore`): level 1 keeps a copy of every weight in host memory (NumPy) and frees
the device buffers; level 2 frees them with no copy, and only `update` brings weights back.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.config import ModelConfig
from jaxserve.errors import ConfigError, EngineSleepingError, ModelLoadError, WeightsDeletedError
from jaxserve.loading.checkpoint import expert_parts, hf_weight_field
from jaxserve.model import quant
from jaxserve.model.weights import LayerParams, Params

TOP_FIELDS = ("embed", "final_norm", "lm_head")
LAYER_FIELDS = tuple(f for f in LayerParams.__dataclass_fields__ if f != "lora")  # LoRA slots are the engine's
Key = tuple[str, "int | None"]  # (field, layer); layer None: a top-level weight, or a whole stacked one


@dataclasses.dataclass
class UpdateReport:
    """What one `update_weights` did."""

    weight_version: int | str
    tensors: int = 0  # served tensors replaced
    adopted: int = 0  # of them, the caller's arrays served as they are (no copy)
    copied: int = 0  # placed on the engine's devices (moved, resharded or cast)
    quantized: int = 0  # quantized as they were placed (an int8 / int4 engine given floats)
    seconds: float = 0.0  # placing the tensors (the prefix cache's reset not included)
    draft: str = "none"  # a draft model's weights: "updated", "kept", or "none" (no draft model)


class WeightUpdater:
    """The served params of one model, replaceable while the engine runs.

    `get` / `put` read and replace the params the steps take (`runner.state.params`, or
    `draft_params`); `layout` is what every new tensor must become: the ShapeDtypeStructs, with
    shardings, of the params the engine loaded (a QuantArray / Int4Array where the engine quantized)."""

    def __init__(self, get: Callable[[], Params], put: Callable[[Params], None], cfg: ModelConfig, name: str = "model"):
        self._get, self._put, self.cfg, self.name = get, put, cfg, name
        params = get()
        self.stacked = not isinstance(params.layers, tuple)
        self.layout = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
        self.foreign: dict[int, tuple[str, jax.Array]] = {}  # id -> (weight, the caller's array) served now
        self.host: Params | None = None  # sleep level 1: the weights in host memory
        self.on_device = True  # False while asleep (offloaded or discarded)
        self.lost: set[str] = set()  # weights freed by an update that failed before placing their new values
        self._quantizers: dict[Any, Callable] = {}
        self._writers: dict[Any, Callable] = {}

    # ---- checks -----------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise WeightsDeletedError if an adopted array was deleted since (a trainer's donation), or an
        update failed half-way."""
        if self.lost:
            raise WeightsDeletedError(
                f"the {self.name} lacks {', '.join(sorted(self.lost))}: an update_weights failed after freeing "
                "them; call update_weights again with every weight it lacks"
            )
        for weight, array in self.foreign.values():
            if array.is_deleted():
                raise WeightsDeletedError(
                    f"the {self.name}'s weight {weight} was deleted after update_weights adopted it without a "
                    "copy (the caller's array, on the engine's devices and sharding, is served as it is; a "
                    "later computation that donates it, such as a trainer step with donate_argnums, deletes "
                    "the engine's weight too). Call update_weights again with live arrays, or with copy=True "
                    "to give the engine copies of its own"
                )

    # ---- updating ---------------------------------------------------------------------------------
    def update(self, new: Any, copy: bool = False, report: UpdateReport | None = None) -> UpdateReport:
        """Replace the served weights with `new` (a Params pytree, a mapping of HF names to arrays, or
        an iterable of (name, array)); those it does not name keep their values (all must be named
        while the weights are off the devices). `copy`: never adopt the caller's arrays. Returns the
        report (counts and the seconds spent)."""
        report = report or UpdateReport(weight_version=0)
        start = time.perf_counter()
        slots = self._slots(self._get())
        replaced: set[Key] = set()
        try:
            for field, layer, value in self._pieces(new):
                key = self._key(field, layer)
                if key not in slots:
                    if field == "lm_head" and self.layout.lm_head is None:
                        continue  # an lm_head beside tied embeddings: the same table
                    raise ModelLoadError(f"the {self.name} has no weight {_name(field, layer)}")
                slots[key] = self._replace(slots[key], field, layer, value, copy, report)
                replaced.add(key)
        finally:
            self._put(self._assemble(slots))
        missing = sorted(set(slots) - replaced, key=str)
        if not self.on_device:
            if missing:
                raise EngineSleepingError(
                    f"the {self.name}'s weights were discarded (sleep level 2), and this update leaves out "
                    f"{len(missing)} of them ({', '.join(_name(*k) for k in missing[:4])}, ...): give all of them"
                )
            self.on_device, self.host = True, None
        report.seconds += time.perf_counter() - start
        return report

    def _key(self, field: str, layer: int | None) -> Key:
        return (field, None) if field in TOP_FIELDS else (field, None if self.stacked else layer)

    def _slots(self, params: Params) -> dict[Key, Any]:
        """The served tensors by (field, layer): per layer when the layers are a tuple, whole when stacked."""
        slots: dict[Key, Any] = {(f, None): getattr(params, f) for f in TOP_FIELDS if getattr(params, f) is not None}
        layers = params.layers
        for i, lp in enumerate(layers if not self.stacked else [layers]):
            for f in LAYER_FIELDS:
                if getattr(lp, f) is not None:
                    slots[(f, None if self.stacked else i)] = getattr(lp, f)
        return slots

    def _assemble(self, slots: dict[Key, Any]) -> Params:
        params = self._get()
        layers = params.layers
        if self.stacked:
            layers = layers.replace(**{f: slots[(f, None)] for f in LAYER_FIELDS if (f, None) in slots})
        else:
            layers = tuple(
                lp.replace(**{f: slots[(f, i)] for f in LAYER_FIELDS if (f, i) in slots}) for i, lp in enumerate(layers)
            )
        return params.replace(layers=layers, **{f: slots[(f, None)] for f in TOP_FIELDS if (f, None) in slots})

    def _pieces(self, new: Any) -> Iterator[tuple[str, int | None, Any]]:
        """(field, layer, value in our [in, out] layout) for every tensor `new` gives; layer None for a
        top-level weight or a whole stacked one."""
        if isinstance(new, Params):
            yield from self._tree_pieces(new)
            return
        items: Iterable = new.items() if isinstance(new, Mapping) else new
        experts = _ExpertLayers(self.cfg.num_experts)
        for name, tensor in items:
            if hasattr(tensor, "dequantize") and not isinstance(tensor, jax.Array):  # a GGUF / AWQ tensor
                tensor = tensor.dequantize()
            if self.cfg.is_moe and (parts := _hf_expert_parts(name, tensor, self.cfg)) is not None:
                for field, layer, expert, array in parts:
                    whole = array if expert is None else experts.add(field, layer, expert, array, name)
                    if whole is not None:
                        yield field, layer, whole
                continue
            where = hf_weight_field(name, self.cfg)
            if where is None:
                continue
            field, layer, transpose = where
            yield field, layer, (tensor.T if transpose else tensor)
        experts.check_complete()

    def _tree_pieces(self, new: Params) -> Iterator[tuple[str, int | None, Any]]:
        for f in TOP_FIELDS:
            if getattr(new, f) is not None:
                yield f, None, getattr(new, f)
        layers, L = new.layers, self.cfg.num_layers
        if isinstance(layers, tuple):
            if len(layers) != L:
                raise ModelLoadError(f"the params have {len(layers)} layers; the {self.name} has {L}")
            for i, lp in enumerate(layers):
                for f in LAYER_FIELDS:
                    if getattr(lp, f) is not None:
                        yield f, i, getattr(lp, f)
            return
        for f in LAYER_FIELDS:
            value = getattr(layers, f)
            if value is None:
                continue
            if self.stacked:
                yield f, None, value
            else:  # a stacked trainer's weight into the unrolled engine's layers, one layer at a time
                for i in range(L):
                    yield f, i, jax.tree.map(lambda x, i=i: x[i], value)

    def _replace(self, old: Any, field: str, layer: int | None, value: Any, copy: bool, report: UpdateReport) -> Any:
        """The new served tensor for one slot; the old one's buffers deleted (unless the caller's)."""
        spec = self._spec(field, layer)
        whole = not self.stacked or field in TOP_FIELDS or layer is None
        if whole:  # checked, then the old tensor freed before the new one is placed: no peak beyond it
            self._check(value, spec, field, layer)
            self._release(old, keep=value)
            self.lost.add(_name(field, layer))  # until it is placed: a failure below leaves it lost
            new = self._place(value, spec, field, layer, copy, report)
            self.lost.discard(_name(field, layer))
        else:  # one layer of a stacked weight: written into the engine's stacked array
            new = self._write_layer(old, layer, self._place(value, _layer_spec(spec), field, layer, True, report))
            self._release(old, keep=new)
        report.tensors += 1
        for leaf in jax.tree.leaves(new):
            if not _owned_by(leaf, value):
                self.foreign[id(leaf)] = (_name(field, layer), leaf)
        return new

    def _spec(self, field: str, layer: int | None) -> Any:
        if field in TOP_FIELDS:
            return getattr(self.layout, field)
        layers = self.layout.layers
        return getattr(layers if self.stacked else layers[layer], field)

    def _check(self, value: Any, spec: Any, field: str, layer: int | None) -> None:
        """What `_place` would refuse, refused before the served tensor is freed."""
        name = _name(field, layer)
        if quant.is_quant(spec) and quant.is_quant(value):
            if type(value) is not type(spec) or value.group_size != spec.group_size:
                raise ModelLoadError(f"{name} is quantized differently from the engine's ({type(spec).__name__})")
            pairs = list(zip(jax.tree.leaves(value), jax.tree.leaves(spec)))
        elif quant.is_quant(spec):
            shape = tuple(np.shape(value))
            pairs = [(None, None)] if field == "embed" and shape == tuple(spec.shape[::-1]) else [(value, spec)]
        elif quant.is_quant(value):
            raise ModelLoadError(f"{name} is quantized, but this engine serves it as {spec.dtype} floats")
        else:
            pairs = [(value, spec)]
        for v, sp in pairs:
            if sp is not None and tuple(np.shape(v)) != tuple(sp.shape):
                raise ModelLoadError(f"{name} has shape {tuple(np.shape(v))}; the {self.name} serves {tuple(sp.shape)}")
            if isinstance(v, jax.Array) and v.is_deleted():
                raise WeightsDeletedError(f"the array given for {name} was deleted (donated) before update_weights")

    def _place(self, value: Any, spec: Any, field: str, layer: int | None, copy: bool, report: UpdateReport) -> Any:
        """`value` as the engine serves it: adopted when it already is, else placed, cast and quantized."""
        name = _name(field, layer)
        if not quant.is_quant(spec):
            if quant.is_quant(value):
                raise ModelLoadError(f"{name} is quantized, but this engine serves it as {spec.dtype} floats")
            return self._place_array(value, spec, name, copy, report)
        if quant.is_quant(value):  # already quantized like the engine's: each part placed
            if type(value) is not type(spec) or value.group_size != spec.group_size:
                raise ModelLoadError(f"{name} is quantized differently from the engine's ({type(spec).__name__})")
            parts = jax.tree.map(lambda v, s: self._place_array(v, s, name, copy, report), value, spec)
            return parts
        if isinstance(spec, quant.Int4Array) and spec.perm is not None:
            raise ConfigError(f"{name}: an act-order int4 engine cannot requantize new float weights")
        shape = spec.shape
        if field == "embed" and tuple(np.shape(value)) == tuple(shape[::-1]):  # the tied head, quantized [D, V]
            value = value.T
        float_spec = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=spec.values.sharding)
        if tuple(np.shape(value)) != tuple(shape):
            raise ModelLoadError(f"{name} has shape {tuple(np.shape(value))}; the {self.name} serves {tuple(shape)}")
        placed = self._place_array(value, float_spec, name, True, None)
        out = self._quantizer(spec)(placed)
        placed.delete()  # freed once the quantize that reads it is done
        report.quantized += 1
        return out

    def _place_array(self, value: Any, spec: Any, name: str, copy: bool, report: UpdateReport | None) -> jax.Array:
        if tuple(np.shape(value)) != tuple(spec.shape):
            raise ModelLoadError(
                f"{name} has shape {tuple(np.shape(value))}; the {self.name} serves {tuple(spec.shape)}"
            )
        if isinstance(value, jax.Array):
            if value.is_deleted():
                raise WeightsDeletedError(f"the array given for {name} was deleted (donated) before update_weights")
            same = value.dtype == spec.dtype and value.sharding.is_equivalent_to(spec.sharding, value.ndim)
            if same and not copy:
                if report is not None:
                    report.adopted += 1
                return value
            if value.dtype != spec.dtype:
                value = value.astype(spec.dtype)  # on the caller's devices, before it moves
            out = jax.device_put(value, spec.sharding, may_alias=False)
        else:
            # A private copy first: on a CPU the device array would alias the caller's memory (its NumPy
            # array, or a checkpoint's memory map), which the caller may change or rewrite later.
            host = np.array(value, dtype=spec.dtype, copy=True)
            with jax.transfer_guard_host_to_device("allow"):
                out = jax.device_put(host, spec.sharding)
        if report is not None:
            report.copied += 1
        return out

    def _quantizer(self, spec: Any) -> Callable:
        """A jitted quantize of one float weight into `spec`'s format and shardings (compiled once)."""
        shardings = jax.tree.map(lambda s: s.sharding, spec)
        key = (type(spec).__name__, spec.group_size, spec.shape, jax.tree.leaves(shardings).__repr__())
        if key not in self._quantizers:
            if isinstance(spec, quant.Int4Array):
                fn = lambda w: quant.quantize_int4(w, spec.group_size)
            else:
                fn = lambda w: quant.quantize(w, spec.group_size)
            self._quantizers[key] = jax.jit(fn, out_shardings=shardings)
        return self._quantizers[key]

    def _write_layer(self, stacked: Any, layer: int, value: Any) -> Any:
        """`stacked` with layer `layer` replaced by `value`, in place (donated) when the engine owns it."""
        owned = all(id(x) not in self.foreign for x in jax.tree.leaves(stacked))
        shardings = jax.tree.map(lambda x: x.sharding, stacked)
        key = (owned, str(jax.tree.structure(stacked)), repr(jax.tree.leaves(shardings)))
        if key not in self._writers:
            write = lambda s, v, i: jax.tree.map(lambda a, b: a.at[i].set(b), s, v)
            self._writers[key] = jax.jit(write, out_shardings=shardings, donate_argnums=(0,) if owned else ())
        return self._writers[key](stacked, value, np.int32(layer))

    def _release(self, old: Any, keep: Any) -> None:
        """Delete the old tensor's buffers the engine owns (not the caller's adopted ones, not reused)."""
        kept = {id(x) for x in jax.tree.leaves(keep)}
        for leaf in jax.tree.leaves(old):
            if id(leaf) in kept or not isinstance(leaf, jax.Array):
                continue
            if self.foreign.pop(id(leaf), None) is None and not leaf.is_deleted():
                leaf.delete()

    # ---- sleep ------------------------------------------------------------------------------------
    def offload(self, keep_on_host: bool) -> None:
        """Free the weights' device buffers; with `keep_on_host` (sleep level 1) first copy them all to
        host memory, for `restore`. Without (level 2) only the model's weights go, the ones
        `update` brings back: LoRA slots stay. The caller's adopted arrays are dropped, never deleted."""
        if not self.on_device:
            return
        params = self._get()
        # Copies: on a CPU device_get's arrays are views of the buffers about to be deleted.
        self.host = jax.tree.map(lambda x: np.array(x, copy=True), params) if keep_on_host else None
        freed = params if keep_on_host else list(self._slots(params).values())
        for leaf in jax.tree.leaves(freed):
            if isinstance(leaf, jax.Array) and self.foreign.pop(id(leaf), None) is None and not leaf.is_deleted():
                leaf.delete()
        self.foreign.clear()
        self.on_device = False

    def restore(self) -> None:
        """Put the weights `offload(keep_on_host=True)` kept back on the devices, on their shardings."""
        if self.on_device:
            return
        if self.host is None:
            raise EngineSleepingError(
                f"the {self.name}'s weights were discarded (sleep level 2): load new ones with update_weights"
            )
        with jax.transfer_guard_host_to_device("allow"):
            params = jax.tree.map(lambda h, s: jax.device_put(h, s.sharding), self.host, self.layout)
        self._put(params)
        self.host, self.on_device = None, True


def _hf_expert_parts(name: str, tensor: Any, cfg: ModelConfig) -> list[tuple[str, int, int | None, Any]] | None:
    """(field, layer, expert or None for all of them, array in our [in, out] layout) of an HF expert
    tensor (Qwen3-MoE / Mixtral's one expert at a time, or the fused f[E, ...] layouts); None for any
    other tensor."""
    if not name.startswith("model.layers."):
        return None
    index, _, rest = name[len("model.layers.") :].partition(".")
    parts = expert_parts(rest, tensor) if index.isdigit() else None
    if parts is None:
        return None
    layer = int(index)
    if layer >= cfg.num_layers or any(e is not None and e >= cfg.num_experts for _, e, _ in parts):
        raise ModelLoadError(f"unexpected tensor {name!r} ({cfg.num_layers} layers, {cfg.num_experts} experts)")
    return [(field, layer, expert, array) for field, expert, array in parts]


class _ExpertLayers:
    """A layer's experts given one at a time (HF names), gathered on the host into the layer's
    f[E, ...] weight; handed on when its last expert arrives, so the host holds one layer of an
    expert weight at a time."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.open: dict[tuple[str, int], tuple[np.ndarray, set[int]]] = {}

    def add(self, field: str, layer: int, expert: int, array: Any, name: str) -> np.ndarray | None:
        key = (field, layer)
        if key not in self.open:
            self.open[key] = (np.empty((self.num_experts, *np.shape(array)), np.asarray(array).dtype), set())
        buffer, seen = self.open[key]
        if np.shape(array) != buffer.shape[1:]:
            raise ModelLoadError(f"{name} has shape {tuple(np.shape(array))}; expected {buffer.shape[1:]}")
        buffer[expert] = np.asarray(array)
        seen.add(expert)
        if len(seen) < self.num_experts:
            return None
        del self.open[key]
        return buffer

    def check_complete(self) -> None:
        """An expert weight is replaced whole: a layer given only some of its experts is refused."""
        if self.open:
            (field, layer), (_, seen) = next(iter(self.open.items()))
            missing = sorted(set(range(self.num_experts)) - seen)
            raise ModelLoadError(
                f"{_name(field, layer)}: the update gives {len(seen)} of its {self.num_experts} experts "
                f"(missing {missing[:8]}); an expert weight is replaced with all its experts"
            )


def _layer_spec(spec: Any) -> Any:
    """The spec of one layer of a stacked weight's spec (the layer axis dropped)."""

    def one(s: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        sharding = s.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
        return jax.ShapeDtypeStruct(s.shape[1:], s.dtype, sharding=sharding)

    return jax.tree.map(one, spec)


def _owned_by(leaf: Any, value: Any) -> bool:
    """Whether a new served leaf is the engine's own (not one of the caller's arrays, adopted)."""
    return not any(leaf is x for x in jax.tree.leaves(value))


def _name(field: str, layer: int | None) -> str:
    return field if layer is None else f"layers[{layer}].{field}"
