"""Block-size table of the int4 matmul kernels (initial guesses, to be tuned on hardware)."""

# The values are INITIAL GUESSES, not measurements (no TPU or GPU has run these
# kernels yet). block_k counts unpacked k (a block reads block_k // 2 packed rows).
# Blocks are chosen to divide k and n where the layout rules allow, because
# padding the packed weight is a copy of it in HBM on every call.

from __future__ import annotations

import math

from pallas_kernels._common import largest_divisor, next_pow2, pad_axis, round_up, tpu_sublane_tile

# backend -> [(max_m, block_m, block_n, block_k)], first row with m <= max_m wins.
TABLE = {
    "tpu": [
        (16, 16, 512, 1024),  # decode: long weight DMAs; the f32 nibble tiles of a step stay a few MiB of VMEM
        (128, 128, 512, 1024),
        (None, 256, 512, 512),  # prefill: dequantization amortized over many rows
    ],
    "gpu": [
        (16, 16, 64, 256),  # decode: narrow n blocks so that n // block_n programs fill the SMs
        (64, 64, 128, 128),
        (None, 128, 128, 64),  # prefill
    ],
}


def tpu_k_unit(group_size: int) -> int:
    """TPU block_k granule: 256 (x's 128-lane halves) and 8 whole groups (8-row tiles of scales)."""
    return math.lcm(256, 8 * group_size)


def pick_blocks(
    backend: str, m: int, k: int, n: int, x_dtype, group_size: int, block_m=None, block_n=None, block_k=None
) -> tuple[int, int, int]:
    """(block_m, block_n, block_k) from the table, fitted to the problem, user overrides kept."""
    for max_m, bm, bn, bk in TABLE[backend]:
        if max_m is None or m <= max_m:
            break
    if backend == "tpu":
        bm = min(bm, round_up(m, tpu_sublane_tile(x_dtype)))
        if n <= bn:
            bn = n  # whole n: a full-dimension block needs no lane alignment
        else:
            bn = largest_divisor(n, bn, 128) or largest_divisor(round_up(n, 128), bn, 128)
        unit = tpu_k_unit(group_size)
        bk = max(bk, unit)
        if k <= bk:
            bk = k
        else:
            bk = largest_divisor(k, bk, unit) or largest_divisor(round_up(k, unit), bk, unit)
    else:
        bm = min(bm, max(16, next_pow2(m)))
        bn = largest_divisor(n, bn, 16, pow2=True) or min(bn, max(16, next_pow2(n)))
        lo = max(32, group_size)
        bk = max(bk, lo)
        bk = largest_divisor(k, bk, lo, pow2=True) or min(bk, max(lo, next_pow2(k)))
    return block_m or bm, block_n or bn, block_k or bk


def pad_to_blocks(
    x,  # [m, k]
    values,  # u8[k // 2, n]
    scales,  # f32[k // G, n]
    biases,  # f32[k // G, n]
    group_size: int,
    blocks: tuple[int, int, int],
):
    """Zero-pads every operand up to whole blocks and splits x into its even and odd columns.

    Returns (x_lo, x_hi [mp, kp // 2], values [kp // 2, np], scales, biases [kp // G, np], (mp, np, kp)).
    x_lo multiplies the low nibbles (rows 2i), x_hi the high ones (rows 2i + 1), so the kernels never
    interleave the unpacked weight. Padded k is whole zero groups: 0 * (0 * 0 + 0) adds nothing. The
    weight is only copied when a block does not divide it (pick_blocks avoids that where it can).
    """
    m, k = x.shape
    n = values.shape[1]
    bm, bn, bk = blocks
    mp, np_, kp = round_up(m, bm), round_up(n, bn), round_up(k, bk)
    xp = pad_axis(pad_axis(x, 0, mp), 1, kp)
    x_lo, x_hi = xp[:, 0::2], xp[:, 1::2]
    vp = pad_axis(pad_axis(values, 0, kp // 2), 1, np_)
    sp = pad_axis(pad_axis(scales, 0, kp // group_size), 1, np_)
    bp = pad_axis(pad_axis(biases, 0, kp // group_size), 1, np_)
    return x_lo, x_hi, vp, sp, bp, (mp, np_, kp)
