"""Helpers shared by every kernel family: backend choice, interpret plumbing, small integer math."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

BACKENDS = ("tpu", "gpu")

# A finite "minus infinity": masked logits use it so that `m_new - m_old` never
# becomes `-inf - -inf = NaN` in the online softmax.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def largest_divisor(total: int, cap: int, unit: int, pow2: bool = False) -> int | None:
    """Largest multiple of `unit` (a power of two if `pow2`) that is <= cap and divides `total` (None: none)."""
    best = None
    b = unit
    while b <= cap:
        if total % b == 0:
            best = b
        b = b * 2 if pow2 else b + unit
    return best


def is_pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def pad_axis(x, axis: int, size: int):  # x: any-shape array
    """Zero-pads `axis` of x at the end up to `size` (no-op when it is already that long)."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def resolve_backend(backend: str | None, interpret: bool, *, fn_name: str) -> str:
    """Returns "tpu" or "gpu"; picks from the default JAX backend when `backend` is None."""
    if backend is None:
        platform = jax.default_backend()
        if platform == "tpu":
            return "tpu"
        if platform in ("gpu", "cuda", "rocm"):
            return "gpu"
        raise ValueError(
            f"{fn_name}: no Pallas backend for the default JAX platform {platform!r}. "
            f"Pass backend='tpu' or backend='gpu' together with interpret=True to run the "
            f"kernel in the Pallas interpreter on this machine, or call "
            f"pallas_kernels.reference_{fn_name} for the plain-JAX version."
        )
    if backend not in BACKENDS:
        raise ValueError(f"{fn_name}: backend must be one of {BACKENDS} or None, got {backend!r}.")
    return backend


def tpu_interpret_arg(interpret: bool):
    """The `interpret=` value for a Mosaic TPU pallas_call.

    TPU kernels use DMAs, semaphores and scratch memory that the generic HLO
    interpreter cannot model, so interpret mode needs the TPU simulator
    (`InterpretParams`; uninitialized VMEM reads NaN there, which catches reads of
    buffers the kernel never filled).
    """
    return pltpu.InterpretParams() if interpret else False


def tpu_sublane_tile(dtype) -> int:
    """Rows of one native TPU (sublane x 128 lane) tile: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def check_int32(name: str, x, fn_name: str) -> None:  # x: any-shape array
    if jnp.dtype(x.dtype) != jnp.int32:
        raise ValueError(f"{fn_name}: {name} must be int32, got {x.dtype}.")


def check_float_dtype(name: str, x, fn_name: str) -> None:  # x: any-shape array
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"{fn_name}: {name} must be float32, bfloat16 or float16, got {x.dtype}.")


def check_matmul_blocks(fn_name: str, backend: str | None, x_dtype, **blocks: int | None) -> None:
    """The block sizes every quantized matmul kernel shares rules for (None = default): positive
    ints; on TPU block_m whole sublane tiles of x; on GPU (Triton) powers of two >= 16."""
    for name, b in blocks.items():
        if b is not None and (int(b) != b or b < 1):
            raise ValueError(f"{fn_name}: {name} must be a positive int, got {b!r}.")
    block_m = blocks.get("block_m")
    if backend == "tpu" and block_m is not None and block_m % tpu_sublane_tile(x_dtype):
        raise ValueError(
            f"{fn_name}: on TPU block_m must be a multiple of {tpu_sublane_tile(x_dtype)} for "
            f"{jnp.dtype(x_dtype).name} x."
        )
    if backend == "gpu":
        for name, b in blocks.items():
            if b is not None and (not is_pow2(b) or b < 16):
                raise ValueError(f"{fn_name}: on GPU {name} must be a power of two >= 16 (Triton), got {b}.")
