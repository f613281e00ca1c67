"""Block-size table of the int8 matmul kernels (initial guesses, to be tuned on hardware) and how the scales meet a K block."""

# The values are INITIAL GUESSES, not measurements: they follow the usual shape
# of such tables (small-m decode rows vs large-m prefill tiles, lane-dense n) and
# must be replaced by numbers tuned on real TPUs/GPUs. Blocks are chosen to
# divide k and n where the layout rules allow, because padding the weight is a
# copy of it in HBM on every call.

from __future__ import annotations

import math

from pallas_kernels._common import largest_divisor, next_pow2, pad_axis, round_up, tpu_sublane_tile

# backend -> [(max_m, block_m, block_n, block_k)], first row with m <= max_m wins.
# Large-k / large-n weights stream through; m is the batch of tokens.
TABLE = {
    "tpu": [
        (16, 16, 512, 1024),  # decode: few rows, wide weight tiles to keep DMAs long
        (128, 128, 512, 512),
        (None, 256, 512, 512),  # prefill
    ],
    "gpu": [
        (16, 16, 128, 128),  # decode: tl.dot minimum m
        (64, 64, 128, 64),
        (None, 128, 128, 64),  # prefill
    ],
}

# How a K block of bk rows meets the scales (group size G):
COLUMN = "column"  # G = k: one scale per column, applied once to the f32 accumulator at the end
BLOCK = "block"  # G a multiple of bk: the block lies in one group; its row scales the block's f32 partial product
TILE = "tile"  # bk a multiple of G (> G): the block spans bk // G groups; its weight tile is dequantized before the dot


def scale_mode(k: int, group_size: int, block_k: int) -> str:
    if group_size == k:
        return COLUMN
    return BLOCK if group_size % block_k == 0 else TILE


def _tpu_block_k(k: int, group_size: int, cap: int) -> int:
    """k itself when it fits; else the largest multiple of 128 <= cap that divides k and nests with the groups
    (a multiple of G, or a divisor of it); else k itself up to twice the cap (SmolLM2's 576 under a 512 cap:
    a full-dimension block beats a padded copy of the weight); else (k padded) a multiple of lcm(128, G)."""
    if k <= cap:
        return k
    per_column = group_size == k
    best = None
    for b in range(128, cap + 1, 128):
        if k % b == 0 and (per_column or b % group_size == 0 or group_size % b == 0):
            best = b
    if best is not None:
        return best
    if k <= 2 * cap:
        return k
    unit = 128 if per_column else math.lcm(128, group_size)
    return largest_divisor(round_up(k, unit), max(cap, unit), unit)


def pick_blocks(
    backend: str, m: int, k: int, n: int, x_dtype, group_size: int, block_m=None, block_n=None, block_k=None
) -> tuple[int, int, int]:
    """(block_m, block_n, block_k) from the table, fitted to the problem and group size, user overrides kept.

    group_size = k means per-column scales. Every chosen block_k is a multiple of group_size or divides it."""
    for max_m, bm, bn, bk in TABLE[backend]:
        if max_m is None or m <= max_m:
            break
    if backend == "tpu":
        bm = min(bm, round_up(m, tpu_sublane_tile(x_dtype)))
        if n <= bn:
            bn = n  # whole n: a full-dimension block needs no lane alignment
        else:
            bn = largest_divisor(n, bn, 128) or largest_divisor(round_up(n, 128), bn, 128)
        bk = _tpu_block_k(k, group_size, bk)
    else:
        # Powers of two nest with any power-of-two group size, so only the padding of k matters here.
        bm = min(bm, max(16, next_pow2(m)))
        bn = largest_divisor(n, bn, 16, pow2=True) or min(bn, max(16, next_pow2(n)))
        bk = largest_divisor(k, bk, 16, pow2=True) or min(bk, max(16, next_pow2(k)))
    return block_m or bm, block_n or bn, block_k or bk


def pad_to_blocks(
    x,  # [m, k]
    w_q,  # i8[k, n]
    scales,  # f32[k // G, n] (f32[1, n] per column)
    group_size: int,
    blocks: tuple[int, int, int],
):
    """Zero-pads x, w_q and the scales up to whole blocks (both backends' kernels).

    Returns (x [mp, kp], w_q [kp, np], scales [kp // G, np] or [1, np] per column, (mp, np, kp)). Padded k is
    whole zero groups (a block that does not divide k is a multiple of G): it adds 0 * 0. Padded output rows
    and columns are sliced off by the caller.
    """
    m, k = x.shape
    n = w_q.shape[1]
    bm, bn, bk = blocks
    mp, np_, kp = round_up(m, bm), round_up(n, bn), round_up(k, bk)
    xp = pad_axis(pad_axis(x, 0, mp), 1, kp)
    wp = pad_axis(pad_axis(w_q, 0, kp), 1, np_)
    scale_rows = 1 if group_size == k else kp // group_size
    sp = pad_axis(pad_axis(scales, 0, scale_rows), 1, np_)
    return xp, wp, sp, (mp, np_, kp)
