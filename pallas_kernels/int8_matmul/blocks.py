"""Block-size table of the int8 matmul kernels (initial guesses, to be tuned on hardware)."""

# The values are INITIAL GUESSES, not measurements: they follow the usual shape
# of such tables (small-m decode rows vs large-m prefill tiles, lane-dense n) and
# must be replaced by numbers tuned on real TPUs/GPUs.

from __future__ import annotations

from pallas_kernels._common import next_pow2, pad_axis, round_up, tpu_sublane_tile

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


def pick_blocks(backend: str, m: int, k: int, n: int, x_dtype, block_m=None, block_n=None, block_k=None):
    """(block_m, block_n, block_k) from the table, shrunk to the problem, user overrides kept."""
    for max_m, bm, bn, bk in TABLE[backend]:
        if max_m is None or m <= max_m:
            break
    if backend == "tpu":
        sub = tpu_sublane_tile(x_dtype)  # rows of one native tile of x
        bm = min(bm, round_up(m, sub))
        bn = min(bn, round_up(n, 128))
        bk = min(bk, round_up(k, 128))
    else:
        bm = min(bm, max(16, next_pow2(m)))
        bn = min(bn, max(16, next_pow2(n)))
        bk = min(bk, max(16, next_pow2(k)))
    return block_m or bm, block_n or bn, block_k or bk


def pad_to_blocks(x, w_q, w_scale, blocks: tuple[int, int, int]):
    """Zero-pad x [m, k], w_q [k, n] and w_scale [n] up to whole blocks (both backends' kernels).

    Zero padding of k is exact (adds 0 * 0); padded output rows and columns are sliced off by the
    caller. Returns the padded operands and the padded (m, n, k).
    """
    m, k = x.shape
    n = w_q.shape[1]
    bm, bn, bk = blocks
    mp, np_, kp = round_up(m, bm), round_up(n, bn), round_up(k, bk)
    xp = pad_axis(pad_axis(x, 0, mp), 1, kp)
    wp = pad_axis(pad_axis(w_q, 0, kp), 1, np_)
    sp = pad_axis(w_scale, 0, np_)
    return xp, wp, sp, (mp, np_, kp)
