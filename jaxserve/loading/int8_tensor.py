"""An int8 weight read from a GGUF file (GGML's Q8_0), already in quant.QuantArray's parts, so that the
loader copies it into int8 groups of 32 without a float detour (or dequantizes it where the model keeps
floats, or where int8 groups of another size are asked for)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import numpy as np

Q8_0_GROUP = 32  # values per Q8_0 block: an f16 scale d, then 32 int8 values q; w = d * q


@dataclasses.dataclass(frozen=True)
class Int8Tensor:
    """quant.QuantArray's parts on the host: w[k, n] = values[k, n] * scales[k // group_size, n]. It
    stands for the [out, in] weight (the checkpoint's orientation) until `.T`, as an ndarray would."""

    values: np.ndarray  # i8[in, out]
    scales: np.ndarray  # f32[in // group_size, out]
    group_size: int
    transposed: bool = True  # True: the [out, in] weight
    # The float32 [out, in] weight as the format's own library computes it; None: values * scales.
    reference: Callable[[], np.ndarray] | None = None
    out_index: np.ndarray | None = None  # the output channels' order, as taken from `reference`

    @property
    def shape(self) -> tuple[int, int]:
        k, n = self.values.shape
        return (n, k) if self.transposed else (k, n)

    @property
    def T(self) -> "Int8Tensor":  # noqa: N802 (ndarray's name)
        return dataclasses.replace(self, transposed=not self.transposed)

    def take_out(self, index: np.ndarray) -> "Int8Tensor":
        """The tensor with its output channels (the [out, in] weight's rows) reordered: out[i] = self[index[i]]."""
        order = index if self.out_index is None else self.out_index[index]
        return dataclasses.replace(self, values=self.values[:, index], scales=self.scales[:, index], out_index=order)

    def dequantize(self) -> np.ndarray:
        """The float32 weight in this orientation."""
        if self.reference is not None:
            w = self.reference()  # [out, in]
            w = w if self.out_index is None else w[self.out_index]
            return w if self.transposed else w.T
        group = np.arange(self.values.shape[0]) // self.group_size
        w = self.values.astype(np.float32) * self.scales[group]  # f32[in, out]
        return w.T if self.transposed else w


def int8_tensor(tensor: Any, dequantize: Callable[[Any], np.ndarray]) -> Int8Tensor | None:
    """A GGUF reader tensor of GGML type Q8_0 as an Int8Tensor (None for any other type); `dequantize`
    (the reader's float path) is kept as the reference."""
    from gguf import GGMLQuantizationType

    if tensor.tensor_type != GGMLQuantizationType.Q8_0:
        return None
    raw = np.asarray(tensor.data, np.uint8)
    blocks = raw.reshape(raw.shape[0], -1, 2 + Q8_0_GROUP)  # [out, in // 32, block bytes]
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)  # [out, in // 32]
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(raw.shape[0], -1)  # [out, in]
    return Int8Tensor(
        values=np.ascontiguousarray(q.T),
        scales=np.ascontiguousarray(d.T),
        group_size=Q8_0_GROUP,
        reference=functools.partial(dequantize, tensor),
    )
