"""A 4-bit weight read from a checkpoint, already in quant.Int4Array's parts, so the loader copies it
into int4 without a float detour (or dequantizes it where the model keeps floats).

GGUF Q4_0 / Q4_1 files (loading/gguf_weights.py) and AWQ / GPTQ safetensors checkpoints
(loading/int4_checkpoint.py) both produce one; the loader (loading/checkpoint.py) consumes it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Int4Tensor:
    """quant.Int4Array's parts on the host: two codes per byte along `in` (row 2i the low nibble, 2i + 1
    the high one), w = q * scale + bias per group of `group_size` stored rows. It stands for the
    [out, in] weight (the checkpoint's and transformers' orientation) until `.T`, as an ndarray would.

    `perm` (GPTQ act-order): stored row j is the weight's row perm[j] (quant.Int4Array.perm)."""

    values: np.ndarray  # u8[in // 2, out]
    scales: np.ndarray  # f32[in // group_size, out]
    biases: np.ndarray  # f32[in // group_size, out]
    group_size: int
    transposed: bool = True  # True: the [out, in] weight
    perm: np.ndarray | None = None  # i32[in] or None (identity)
    # The float32 [out, in] weight exactly as the format's own library computes it, where that may
    # differ by an ulp from q * scale + bias (GGUF Q4_0's (q - 8) * d); None: q * scale + bias is exact.
    reference: Callable[[], np.ndarray] | None = None
    out_index: np.ndarray | None = None  # the output channels' order, as taken from `reference`

    @property
    def shape(self) -> tuple[int, int]:
        k, n = 2 * self.values.shape[0], self.values.shape[1]
        return (n, k) if self.transposed else (k, n)

    @property
    def T(self) -> "Int4Tensor":  # noqa: N802 (ndarray's name)
        return dataclasses.replace(self, transposed=not self.transposed)

    def take_out(self, index: np.ndarray) -> "Int4Tensor":
        """The tensor with its output channels (the [out, in] weight's rows) reordered: out[i] = self[index[i]]."""
        order = index if self.out_index is None else self.out_index[index]
        return dataclasses.replace(
            self,
            values=self.values[:, index],
            scales=self.scales[:, index],
            biases=self.biases[:, index],
            out_index=order,
        )

    def dequantize(self) -> np.ndarray:
        """The float32 weight in this orientation (rows in the weight's own order)."""
        if self.reference is not None:
            w = self.reference()  # [out, in]
            w = w if self.out_index is None else w[self.out_index]
            return w if self.transposed else w.T
        codes = np.stack([self.values & 0xF, self.values >> 4], axis=1).reshape(-1, self.values.shape[1])
        group = np.arange(codes.shape[0]) // self.group_size
        stored = codes.astype(np.float32) * self.scales[group] + self.biases[group]  # f32[in, out]
        w = stored if self.perm is None else np.empty_like(stored)
        if self.perm is not None:
            w[self.perm] = stored
        return w.T if self.transposed else w
