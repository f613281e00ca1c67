"""Host buffers that quantize a weight as the loader reads it (loading/checkpoint.py fills them): int8
(`QuantizedHost`) and int4 (`Int4Host`) values and scales on the host, each tensor quantized alone on
the host's CPU device as it arrives, so that loading a quantized model never holds a float copy of
it; tensors a file already holds in the buffer's format (GGUF Q8_0 / Q4_0 / Q4_1, AWQ / GPTQ) are
copied. `assign` returns the error of what it requantized, which the loader reports
(`RequantizationReport`): quantizing a file's values again (a K-quant into int8, say) is lossy, and
the user should see how much.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.errors import ConfigError, ModelLoadError
from jaxserve.loading.int4_checkpoint import Int4Format
from jaxserve.loading.int4_tensor import Int4Tensor
from jaxserve.loading.int8_tensor import Int8Tensor
from jaxserve.model import quant

logger = logging.getLogger(__name__)


class QuantizedHost:
    """A stacked weight quantized as it is read: int8 values and f32 scales per group of input rows on
    the host, each tensor quantized alone (by quant.quantize, on the host's CPU device) as it arrives,
    so that loading an int8 model never holds a float copy of it: the host holds the int8 model plus
    one float tensor. A GGUF Q8_0 tensor (int8_tensor.Int8Tensor) whose blocks are the groups is copied."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, group_size: int):
        *lead, k, n = shape
        quant.check_group_size(k, group_size)
        self.group_size, self.dtype = group_size, dtype
        self.values = np.empty(shape, np.int8)
        self.scales = np.empty((*lead, k // group_size if group_size else 1, n), np.float32)

    shape = property(lambda self: self.values.shape)

    def __getitem__(self, index: int) -> "QuantizedHost":
        view = object.__new__(QuantizedHost)
        view.group_size, view.dtype = self.group_size, self.dtype
        view.values, view.scales = self.values[index], self.scales[index]
        return view

    def assign(self, src: Any) -> tuple[float, float] | None:
        """Copy or quantize `src` in; (squared error, squared norm) of a quantization, None for a copy."""
        error = None
        if isinstance(src, Int8Tensor) and src.group_size == self.group_size and not src.transposed:
            q = src
        else:
            if isinstance(src, Int8Tensor):
                src = src.dequantize()
            with jax.default_device(host_device()):
                # first in the serving dtype, as quantizing the loaded float weight would see it
                w = jnp.asarray(np.asarray(src, self.dtype))
                q = _quantize_jit(w, self.group_size)
                error = _squared_error(w, quant.dequantize(q))
        self.values[...] = np.asarray(q.values)
        self.scales[...] = np.asarray(q.scales)
        return error

    def place(self, sharding: Any) -> quant.QuantArray:
        if sharding is None:
            values, scales = jnp.asarray(self.values), jnp.asarray(self.scales)
        else:
            values, scales = jax.device_put(self.values, sharding.values), jax.device_put(self.scales, sharding.scales)
        return quant.QuantArray(values=values, scales=scales, group_size=self.group_size)


_quantize_jit = jax.jit(quant.quantize, static_argnums=1)


def _squared_error(w: jax.Array, back: jax.Array) -> tuple[float, float]:
    w32 = w.astype(jnp.float32)
    return float(jnp.sum(jnp.square(back - w32))), float(jnp.sum(jnp.square(w32)))


_quantize_int4_jit = jax.jit(quant.quantize_int4, static_argnums=1)


class Int4Host(QuantizedHost):
    """As QuantizedHost, for quantization="int4": packed u8 values, f32 scales and biases per group
    of `group_size` input rows (and with `permuted`, an act-order GPTQ checkpoint's, each weight's row
    permutation). A GGUF Q4_0/Q4_1 or AWQ/GPTQ tensor arrives already in that form (Int4Tensor) and is
    copied, never through float; a float one is quantized."""

    def __init__(
        self, shape: tuple[int, ...], dtype: np.dtype, group_size: int = quant.INT4_GROUP_SIZE, permuted: bool = False
    ):
        *lead, k, n = shape
        if k % group_size:
            raise ModelLoadError(f"int4 groups of {group_size} rows do not divide a weight's {k} input rows")
        self.group_size, self.dtype = group_size, dtype
        self.values = np.empty((*lead, k // 2, n), np.uint8)
        self.scales = np.empty((*lead, k // group_size, n), np.float32)
        self.biases = np.empty((*lead, k // group_size, n), np.float32)
        self.perm = np.empty((*lead, k), np.int32) if permuted else None

    shape = property(lambda self: (*self.values.shape[:-2], 2 * self.values.shape[-2], self.values.shape[-1]))

    def __getitem__(self, index: int) -> "Int4Host":
        view = object.__new__(Int4Host)
        view.group_size, view.dtype = self.group_size, self.dtype
        view.values, view.scales, view.biases = self.values[index], self.scales[index], self.biases[index]
        view.perm = None if self.perm is None else self.perm[index]
        return view

    def assign(self, src: Any) -> tuple[float, float] | None:
        error = None
        if isinstance(src, Int4Tensor) and src.group_size != self.group_size and src.perm is None:
            src = src.dequantize()  # a GGUF Q4 file asked for in other groups: quantized again from its values
        if isinstance(src, Int4Tensor):  # already [in, out] groups: copied as they are
            if src.group_size != self.group_size:
                raise ModelLoadError(f"an int4 tensor in groups of {src.group_size}, expected {self.group_size}")
            if src.perm is not None and self.perm is None:
                raise ModelLoadError("an act-order int4 tensor (rows permuted) where the layout has no permutation")
            q = src
        else:
            with jax.default_device(host_device()):
                w = jnp.asarray(np.asarray(src, self.dtype))
                q = _quantize_int4_jit(w, self.group_size)
                error = _squared_error(w, quant.dequantize_int4(q))
        self.values[...] = np.asarray(q.values)
        self.scales[...] = np.asarray(q.scales)
        self.biases[...] = np.asarray(q.biases)
        if self.perm is not None:
            perm = getattr(q, "perm", None)
            self.perm[...] = np.arange(self.perm.shape[-1]) if perm is None else perm
        return error

    def place(self, sharding: Any) -> quant.Int4Array:
        arrays = (self.values, self.scales, self.biases) + ((self.perm,) if self.perm is not None else ())
        if sharding is None:
            placed = [jnp.asarray(a) for a in arrays]
        else:
            rows = 2 * sharding.values.shard_shape(self.values.shape)[-2]
            if rows % self.group_size:
                raise ConfigError(
                    f"int4 groups of {self.group_size} input rows cannot be split over the mesh: a "
                    f"device would hold {rows} rows of a weight; choose a model axis that divides "
                    "the weight's groups"
                )
            targets = (sharding.values, sharding.scales, sharding.biases, sharding.perm)
            placed = [jax.device_put(a, sh) for a, sh in zip(arrays, targets)]
        return quant.Int4Array(
            values=placed[0],
            scales=placed[1],
            biases=placed[2],
            perm=placed[3] if len(placed) > 3 else None,
            group_size=self.group_size,
        )


def int4_buffer(
    field: str, shape: tuple[int, ...], dtype: np.dtype, fmt: Int4Format | None, group_size: int
) -> Int4Host:
    """An int4 field's host buffer: in the checkpoint's own groups for the layers an AWQ / GPTQ
    checkpoint quantizes (the dense linear ones), else in `group_size`."""
    if fmt is None or field not in quant.DENSE_FIELDS:
        return Int4Host(shape, dtype, group_size)
    return Int4Host(shape, dtype, fmt.group_for(shape[-2]), fmt.act_order)


def host_device() -> Any:
    """The host's CPU device where JAX has one (it does unless JAX_PLATFORMS leaves it out), else the default."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return jax.devices()[0]


class RequantizationReport:
    """The error of the weights a load quantized from float values (a safetensors checkpoint's, or a
    GGUF file's K-quants and other types dequantized first): relative RMS over all of them and the worst
    tensor, logged once at the end of the load."""

    def __init__(self, quantization: str, group_size: int):
        self.quantization, self.group_size = quantization, group_size
        self.error = self.norm = 0.0
        self.count, self.worst = 0, (0.0, "")

    def add(self, name: str, error: tuple[float, float] | None) -> None:
        if error is None:
            return
        err, norm = error
        self.error, self.norm, self.count = self.error + err, self.norm + norm, self.count + 1
        self.worst = max(self.worst, ((err / norm) ** 0.5 if norm else 0.0, name))

    @property
    def relative_rms(self) -> float:
        return (self.error / self.norm) ** 0.5 if self.norm else 0.0

    def describe(self) -> str:
        groups = f"groups of {self.group_size}" if self.group_size else "a scale per output channel"
        return (
            f"quantized {self.count} tensors to {self.quantization} ({groups}) from float values: relative "
            f"RMS error {100 * self.relative_rms:.2f}% (worst {self.worst[1]}: {100 * self.worst[0]:.2f}%)"
        )

    def log(self) -> None:
        if self.count:
            logger.info(self.describe())
