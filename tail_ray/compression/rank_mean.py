"""The grid's rank mean: every rank's decoded layer summed in float64 in rank order, divided
by the number of ranks, rounded once to float32 (tail_ray/compression/grid.py), on the host.

``mean_into`` averages decoded float32 layers (raw, sparse, or a mix of codes);
``mean_dequantized_into`` averages quantized layers straight from their levels and scales in one
pass (the decode-average of ``aggregate``), and can read the controller's peer-spread sample
on the way (``sample_stride``: the sums ``peer_spread.peer_sums`` computes, bit for bit, from
the values the mean already holds). The dithered twin is ``dither.mean_undithered_into``; the
device's, ``device_codec.mean_into``. No kernel here is compiled with fastmath.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tail_ray.compression.fixedsum import LANES, add_spread_segment, first_sample, spread_totals_into
from tail_ray.compression.grid import rank_steps
from tail_ray.compression.kernel_parts import MEAN_TILE

__all__ = ["mean_dequantized_into", "mean_into"]


@njit(cache=True, nogil=True)
def _mean_dequantized_core(levels_t, steps_t, bucket_sizes, out, stride, sums):  # type: ignore[no-untyped-def]
    """out[i] = float32((sum over ranks r, in rank order, of levels_r[i] * steps_r[i // bucket_r]) / R).

    The grid's arithmetic exactly: each product rounded to float32, widened to float64, added
    in rank order, divided by R in float64, rounded to float32 (no fastmath: no FMA, no
    reciprocal for the division). ``levels_t`` / ``steps_t`` are tuples (one array per rank,
    no stacking copy). With ``stride`` > 0, sums[0:3] are also the peer-spread sums of every
    ``stride``-th element (peer_spread.py's, bit for bit), from the values the mean reads.
    """
    n = out.size
    world = len(levels_t)
    wf = np.float64(world)
    buf = np.empty(MEAN_TILE, np.float64)
    samp = np.empty((world, MEAN_TILE // max(stride, 1) + 1), np.float64)
    lanes = np.zeros((3, LANES), np.float64)
    lo = 0
    while lo < n:
        # The segment ends at the first bucket boundary of any rank (ranks may differ in
        # bucket size), so each rank has one step per segment.
        hi = min(n, lo + MEAN_TILE)
        for r in range(world):
            bs = bucket_sizes[r]
            hi = min(hi, (lo // bs + 1) * bs)
        m = hi - lo
        for r in range(world):
            st = steps_t[r][lo // bucket_sizes[r]]
            lv = levels_t[r][lo:hi]
            if r == 0:
                for i in range(m):
                    buf[i] = np.float64(np.float32(lv[i]) * st)
            else:
                for i in range(m):
                    buf[i] = buf[i] + np.float64(np.float32(lv[i]) * st)
            if stride > 0:
                for t, p in enumerate(range(first_sample(lo, stride), hi, stride)):
                    samp[r, t] = np.float64(np.float32(lv[p - lo]) * st)
        if stride > 0:
            add_spread_segment(lanes, samp, buf, lo, hi, stride)
        ob = out[lo:hi]
        for i in range(m):
            ob[i] = np.float32(buf[i] / wf)
        lo = hi
    if stride > 0:
        spread_totals_into(lanes, sums)


def mean_dequantized_into(
    levels: list[np.ndarray],
    scales: list[np.ndarray],
    bits: list[int],
    bucket_sizes: list[int],
    out: np.ndarray,
    *,
    sample_stride: int = 0,
) -> np.ndarray | None:
    """Write the mean over ranks of ``dequantize(levels_r, scales_r, bits_r, bucket_r)`` into
    ``out`` (float32, numel long) in one pass, with no per-rank float32 array: bit-identical to
    ``grid.mean_reference`` of the dequantized ranks. With ``sample_stride`` > 0 it also returns
    the (spread, power, mean) sums ``peer_spread.peer_sums`` gives at that stride, same bits.

    Sizes are checked here (the kernel does no bounds checks): every ``levels_r`` must have
    ``out.size`` elements and ``scales_r`` one scale per bucket; a ValueError otherwise.
    """
    lv, st = rank_steps(levels, scales, bits, bucket_sizes, out.size)
    sums = np.zeros(3, np.float64)
    _mean_dequantized_core(lv, st, np.asarray(bucket_sizes, dtype=np.int64), out, max(sample_stride, 0), sums)
    return sums if sample_stride > 0 else None


@njit(cache=True, nogil=True)
def _mean_core(values_t, out):  # type: ignore[no-untyped-def]
    """out[i] = float32((sum over ranks, in rank order, of float64(values_r[i])) / R)."""
    n = out.size
    world = len(values_t)
    wf = np.float64(world)
    buf = np.empty(MEAN_TILE, np.float64)
    for lo in range(0, n, MEAN_TILE):
        hi = min(n, lo + MEAN_TILE)
        m = hi - lo
        for r in range(world):
            v = values_t[r][lo:hi]
            if r == 0:
                for i in range(m):
                    buf[i] = np.float64(v[i])
            else:
                for i in range(m):
                    buf[i] = buf[i] + np.float64(v[i])
        ob = out[lo:hi]
        for i in range(m):
            ob[i] = np.float32(buf[i] / wf)


def mean_into(values: list[np.ndarray], out: np.ndarray) -> None:
    """The rank mean of float32 layers (raw, sparse or a mix of codes, already decoded) into
    ``out``: the same arithmetic as the fused quantized mean (``grid.mean_reference``), so a
    layer averages to the same bits whichever path it takes."""
    vals = tuple(np.ascontiguousarray(v, dtype=np.float32).reshape(-1) for v in values)
    if not vals:
        raise ValueError("the mean needs at least one rank")
    for v in vals:
        if v.size != out.size:
            raise ValueError(f"{v.size} values for {out.size} elements")
    _mean_core(vals, out)
