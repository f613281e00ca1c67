"""The device half of LoRA serving: the resident adapters' stacks beside each layer's weights, and
writing an adapter into a device slot.

`LoRASlots.attach` gives every layer a `LayerLoRA` of zeros (`model/lora.py`: per module a f[in,
M * R], b f[M * R, out]) placed like the base weights (`sharding.lora_shardings`), before the steps
are compiled, so the steps take it as part of the params. `write` puts an adapter's A and B (rank
padded to R) into one slot's columns and rows with a `dynamic_update_slice` per array, the stacks
donated: one executable for every slot and adapter, compiled at start-up (`ModelRunner.enable_lora`), so loading or
swapping adapters never compiles a step or anything else. The write is queued on the device behind
the steps already dispatched, so a step in flight still reads what it was dispatched with.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.lora.peft_adapter import LORA_MODULES, lora_stack_bytes, served_module_dims
from jaxserve.model.lora import LayerLoRA, LoRAModule
from jaxserve.model.sharding import lora_shardings
from jaxserve.model.weights import Params


class LoRASlots:
    """`slots` (max_loras) device slots of rank `rank` (max_lora_rank) over one model's layers."""

    def __init__(
        self, cfg: ModelConfig, slots: int, rank: int, dtype: Any, mesh: Any = None, targets: tuple[str, ...] = ()
    ):
        self.cfg, self.slots, self.rank, self.dtype, self.mesh = cfg, slots, rank, jnp.dtype(dtype), mesh
        self.targets = targets  # lora_target_modules: () = every module the model has
        self.dims = served_module_dims(cfg, targets)
        self.writes = 0

    @property
    def nbytes(self) -> int:
        return lora_stack_bytes(self.cfg, self.slots, self.rank, self.dtype.itemsize, self.targets)

    def attach(self, params: Params) -> Params:
        """`params` with a zero `LayerLoRA` in every layer (stacked or a tuple, as the layers are)."""
        stacked = not isinstance(params.layers, tuple)
        L, width = self.cfg.num_layers, self.slots * self.rank
        lead = (L,) if stacked else ()

        is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
        shapes = LayerLoRA(
            **{m: LoRAModule(a=lead + (i, width), b=lead + (width, o)) for m, (i, o) in self.dims.items()},
            slots=self.slots,
            rank=self.rank,
        )
        shardings = (
            lora_shardings(self.cfg, self.mesh, shapes, stacked)
            if self.mesh is not None
            else jax.tree.map(lambda _: None, shapes, is_leaf=is_shape)
        )
        # One executable makes a layer's zeros (called once per layer when the layers are a tuple).
        layer_lora = jax.jit(
            lambda: jax.tree.map(lambda shape: jnp.zeros(shape, self.dtype), shapes, is_leaf=is_shape),
            out_shardings=shardings,
        )
        if stacked:
            return params.replace(layers=params.layers.replace(lora=layer_lora()))
        return params.replace(layers=tuple(lp.replace(lora=layer_lora()) for lp in params.layers))

    def host_values(self, adapter: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """An adapter (`lora.peft_adapter.PeftAdapter`: A f32[L, in, r], B f32[L, r, out] per module
        it targets) as every module's (A [L, in, R], B [L, R, out]) in the device dtype: rank padded
        with zeros, zeros for the modules it leaves alone (they overwrite the slot's last adapter)."""
        L, R = self.cfg.num_layers, self.rank
        values = {}
        for name, (i, o) in self.dims.items():
            a, b = np.zeros((L, i, R), self.dtype), np.zeros((L, R, o), self.dtype)
            if name in adapter.modules:
                A, B = adapter.modules[name]
                a[..., : A.shape[-1]] = A
                b[:, : B.shape[1]] = B
            values[name] = (a, b)
        return values

    def write(self, params: Params, slot: int, adapter: Any) -> Params:
        """`params` with `adapter` in device slot `slot` (its old stacks donated)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} outside [0, {self.slots})")
        values = self.host_values(adapter)
        with jax.transfer_guard_host_to_device("allow"):  # the adapter's weights: this write's one copy in
            values = jax.device_put(values, self._value_shardings(params))
            slot_value = jax.device_put(np.int32(slot))
        stacked = not isinstance(params.layers, tuple)
        layers = params.layers
        loras = layers.lora if stacked else tuple(lp.lora for lp in layers)
        loras = _write_slot(loras, slot_value, values, rank=self.rank, stacked=stacked)
        self.writes += 1
        if stacked:
            return params.replace(layers=layers.replace(lora=loras))
        return params.replace(layers=tuple(lp.replace(lora=lora) for lp, lora in zip(layers, loras)))

    def _value_shardings(self, params: Params) -> Any:
        """Where the adapter's values go: as the stacks they are written into (less the slot axis)."""
        if self.mesh is None:
            return None
        lora = params.layers.lora if not isinstance(params.layers, tuple) else params.layers[0].lora
        shardings = lora_shardings(self.cfg, self.mesh, lora, stacked=True)
        return {name: (getattr(shardings, name).a, getattr(shardings, name).b) for name in self.dims}


@functools.partial(jax.jit, static_argnames=("rank", "stacked"), donate_argnums=(0,))
def _write_slot(loras: Any, slot: jax.Array, values: dict, *, rank: int, stacked: bool) -> Any:
    """Every layer's stacks with slot `slot`'s columns of `a` and rows of `b` replaced by `values`
    (module -> (A [L, in, R], B [L, R, out]))."""
    start = slot * rank

    def layer(lora: LayerLoRA, index: Any) -> LayerLoRA:
        def module(name: str) -> LoRAModule | None:
            m = getattr(lora, name)
            if m is None:
                return None
            A, B = values[name]
            A, B = (A, B) if index is None else (A[index], B[index])
            zero = jnp.int32(0)
            lead = (zero,) if index is None else ()
            return m.replace(
                a=jax.lax.dynamic_update_slice(m.a, A.astype(m.a.dtype), lead + (zero, start)),
                b=jax.lax.dynamic_update_slice(m.b, B.astype(m.b.dtype), lead + (start, zero)),
            )

        return lora.replace(**{name: module(name) for name in LORA_MODULES})

    if stacked:
        return layer(loras, None)
    return tuple(layer(lora, i) for i, lora in enumerate(loras))
