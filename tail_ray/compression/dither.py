"""Subtractive dither (rounding="dither", issue 15): the kernel, its decoders, and its error.

A value x of a bucket with scale s at ``bits`` (L = 2^(bits-1) - 1, step = s * (1 / L)) is
sent as level = clamp(floor(x * L / s + u), -L, L) with u ~ U[0, 1) drawn from a seed the
payload carries, and decoded as (float32(level) + (1/2 - u)) * step with the very same u:
the error is uniform on (-step/2, step/2] whatever x, unbiased, independent of the gradient
and of every other element, with variance step^2 / 12 known from the scales alone
(``dither_error_sq``; the controller's model in bitwidth/quant_error.py). docs/engine.md,
"Subtractive dither by default", has the measurements behind it.

Same bits on every CPU, as the rest of the grid (grid.py): no fastmath, every float operation
rounded on its own. ``quantize.quantize_finite`` / ``dequantize`` dispatch here for
rounding "dither"; the rank mean and the controller's strided sample of dithered layers are
``mean_undithered_into`` and ``sample_undithered``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tail_ray.compression.fixedsum import LANES, add_spread_segment, first_sample, spread_totals_into
from tail_ray.compression.grid import F32_MAX, TINY_PRESCALE, TINY_SCALE, bucket_steps, rank_steps
from tail_ray.compression.kernel_parts import (
    CHUNK,
    GOLDEN,
    MEAN_TILE,
    UNIFORM_TABLE,
    bucket_scale_bits,
    chunk_draw,
    splitmix,
    uniform,
)

__all__ = [
    "dither_core",
    "dither_core_ef",
    "dither_error_sq",
    "mean_undithered_into",
    "sample_undithered",
    "undither_core",
    "undithered_at",
]

# Subtractive dither (rounding="dither", issue 15): t = x * L / s in two's complement (a
# sign-magnitude level 0 would lose the sign that subtracting u needs), level = floor(t + u)
# clamped to [-L, L], and the receiver decodes (level + (1/2 - u)) * step with the very same
# u. The error is then uniform on (-step/2, step/2], whatever x: unbiased, independent of the
# gradient and of every other element, with variance step^2 / 12 known from the scales alone.
# There is no error feedback: what the rounding dropped is not resent (nothing to resend: the
# error is zero-mean noise, not a bias).
#
# The uniforms are keyed by position, not by a walk over the layer: bucket k's state is a hash
# of (seed, k), and its chunks of 1,024 read the table as the stochastic kernel does. A bucket
# decodes without the buckets before it, and an all-zero bucket costs no draw.


@njit(cache=True, nogil=True, inline="always")
def bucket_state(seed, k):  # type: ignore[no-untyped-def]
    return splitmix(np.uint64(seed) ^ (np.uint64(k + 1) * np.uint64(0xD1B54A32D192ED03)))


@njit(cache=True, nogil=True)
def _dither_chunk(xb, lb, ub, rot, pre, inv, lmax):  # type: ignore[no-untyped-def]
    """lb = clamp(floor((x * pre) * inv + u), -L, L), each operation rounded. Returns nnz."""
    cnt = 0
    for i in range(xb.size):
        y = (xb[i] * pre) * inv + uniform(ub[i], rot)
        q = min(max(np.int32(np.floor(y)), -lmax), lmax)  # |y| < L + 2: no overflow
        cnt += min(abs(q), np.int32(1))
        lb[i] = np.int8(q)
    return cnt


@njit(cache=True, nogil=True)
def _dither_bucket(xb, lb, tab, seed, k, m, lmax):  # type: ignore[no-untyped-def]
    """Dither bucket k (scale m > 0) of a layer; returns its non-zero level count."""
    pre = TINY_PRESCALE if m < TINY_SCALE else np.float32(1.0)
    inv = np.float32(lmax) / (m * pre)
    h = bucket_state(seed, k)
    cnt = 0
    for lo in range(0, xb.size, CHUNK):
        hi = min(xb.size, lo + CHUNK)
        h = h + np.uint64(GOLDEN)
        off, rot = chunk_draw(h)
        cnt += _dither_chunk(xb[lo:hi], lb[lo:hi], tab[off : off + (hi - lo)], rot, pre, inv, lmax)
    return cnt


@njit(cache=True, nogil=True)
def _dither_into(xb, lb, scales, tab, seed, k, lmax):  # type: ignore[no-untyped-def]
    """Bucket k of x: its scale into scales[k], its levels into lb. Returns nnz."""
    box = np.empty(1, np.int32)
    box[0] = bucket_scale_bits(xb)
    m = box.view(np.float32)[0]
    scales[k] = m
    if m == 0:
        lb[:] = 0
        return 0
    return _dither_bucket(xb, lb, tab, seed, k, m, lmax)


@njit(cache=True, nogil=True)
def dither_core(g, bucket_size, lmax, seed, levels, scales, tab):  # type: ignore[no-untyped-def]
    """Dither g (read only) into levels and scales. Returns nnz."""
    n = g.size
    nnz = 0
    for k in range((n + bucket_size - 1) // bucket_size):
        lo = k * bucket_size
        hi = min(n, lo + bucket_size)
        nnz += _dither_into(g[lo:hi], levels[lo:hi], scales, tab, seed, k, np.int32(lmax))
    return nnz


@njit(cache=True, nogil=True)
def dither_core_ef(g, e, bucket_size, lmax, seed, levels, scales, tab):  # type: ignore[no-untyped-def]
    """Dither g + e (saturated, written into e first: a residual left by another code is sent
    once), then empty e. Returns nnz."""
    n = g.size
    nnz = 0
    for k in range((n + bucket_size - 1) // bucket_size):
        lo = k * bucket_size
        hi = min(n, lo + bucket_size)
        eb = e[lo:hi]
        gb = g[lo:hi]
        for i in range(eb.size):
            eb[i] = min(max(gb[i] + eb[i], -F32_MAX), F32_MAX)
        nnz += _dither_into(eb, levels[lo:hi], scales, tab, seed, k, np.int32(lmax))
        eb[:] = 0
    return nnz


@njit(cache=True, nogil=True, inline="always")
def _chunk_window(seed, k, c):  # type: ignore[no-untyped-def]
    """(table offset, rotation) of chunk c of bucket k: the draw the walk in ``_dither_bucket``
    makes for it, computed directly (a decoder that starts mid-bucket, or samples)."""
    return chunk_draw(bucket_state(seed, k) + np.uint64(c + 1) * np.uint64(GOLDEN))


@njit(cache=True, nogil=True, inline="always")
def _undithered(level, u, step):  # type: ignore[no-untyped-def]
    """The decoded value (float32(level) + (1/2 - u)) * step, each operation rounded,
    saturated: at the top level the value may pass the scale by half a step, which past
    ~F32_MAX / (1 + 1 / 2L) would round to inf."""
    return min(max((np.float32(level) + (np.float32(0.5) - u)) * step, -F32_MAX), F32_MAX)


@njit(cache=True, nogil=True)
def undither_core(levels, steps, bucket_size, seed, tab, out):  # type: ignore[no-untyped-def]
    """out[i] = (float32(level) + (1/2 - u)) * step, each operation rounded (no FMA: the same
    bits on every CPU), with the sender's u, saturated at float32's max; a bucket of step 0
    (all-zero) decodes to 0."""
    n = levels.size
    nb = (n + bucket_size - 1) // bucket_size
    for k in range(nb):
        lo = k * bucket_size
        hi = min(n, lo + bucket_size)
        step = steps[k]
        ob = out[lo:hi]
        if step == 0:
            ob[:] = 0
            continue
        lb = levels[lo:hi]
        h = bucket_state(seed, k)
        for c in range(0, hi - lo, CHUNK):
            d = min(hi - lo, c + CHUNK)
            h = h + np.uint64(GOLDEN)
            off, rot = chunk_draw(h)
            _undither_chunk(lb[c:d], tab[off : off + (d - c)], rot, step, ob[c:d])


@njit(cache=True, nogil=True)
def _undither_chunk(lb, tb, rot, step, ob):  # type: ignore[no-untyped-def]
    """One chunk of ``undither_core`` over its own table window: a loop numba vectorizes
    (indexing the whole layer and table inline in the bucket loop ran ~10x slower)."""
    for i in range(lb.size):
        ob[i] = _undithered(lb[i], uniform(tb[i], rot), step)


def dither_error_sq(scales: np.ndarray, bits: int, bucket_size: int, numel: int) -> float:
    """The dither error's expected ||decoded - x||^2, known from the scales alone: every element
    of bucket k is off by U(-1/2, 1/2] steps, so sum over buckets of n_k step_k^2 / 12."""
    steps = bucket_steps(scales, bits).astype(np.float64)
    counts = np.full(steps.size, float(bucket_size))
    if steps.size:
        counts[-1] = numel - bucket_size * (steps.size - 1)
    return float(np.dot(counts, steps * steps)) / 12.0


@njit(cache=True, nogil=True)
def _mean_undithered_core(levels_t, steps_t, bucket_sizes, seeds, tab, out, stride, sums):  # type: ignore[no-untyped-def]
    """``_mean_dequantized_core`` (rank_mean.py) for ranks that all dithered the layer: each
    rank's value is ``_undithered`` with its own seed's uniforms, then the grid's float64 rank
    mean. Segments end at every rank's bucket and uniform-chunk boundaries, so each rank draws
    once per segment. ``stride`` > 0: the peer-spread sums too, as there."""
    n = out.size
    world = len(levels_t)
    wf = np.float64(world)
    buf = np.empty(MEAN_TILE, np.float64)
    samp = np.empty((world, MEAN_TILE // max(stride, 1) + 1), np.float64)
    lanes = np.zeros((3, LANES), np.float64)
    lo = 0
    while lo < n:
        hi = min(n, lo + MEAN_TILE)
        for r in range(world):
            bs = bucket_sizes[r]
            k = lo // bs
            hi = min(hi, k * bs + min(bs, ((lo - k * bs) // CHUNK + 1) * CHUNK))
        m = hi - lo
        for r in range(world):
            bs = bucket_sizes[r]
            k = lo // bs
            j = lo - k * bs
            st = steps_t[r][k]
            lv = levels_t[r][lo:hi]
            off, rot = _chunk_window(seeds[r], k, j // CHUNK)
            t0 = off + j % CHUNK
            for i in range(m):
                v = np.float32(0.0) if st == 0 else _undithered(lv[i], uniform(tab[t0 + i], rot), st)
                buf[i] = np.float64(v) if r == 0 else buf[i] + np.float64(v)
            if stride > 0:
                for t, p in enumerate(range(first_sample(lo, stride), hi, stride)):
                    i = p - lo
                    v = np.float32(0.0) if st == 0 else _undithered(lv[i], uniform(tab[t0 + i], rot), st)
                    samp[r, t] = np.float64(v)
        if stride > 0:
            add_spread_segment(lanes, samp, buf, lo, hi, stride)
        ob = out[lo:hi]
        for i in range(m):
            ob[i] = np.float32(buf[i] / wf)
        lo = hi
    if stride > 0:
        spread_totals_into(lanes, sums)


def mean_undithered_into(
    levels: list[np.ndarray],
    scales: list[np.ndarray],
    bits: list[int],
    bucket_sizes: list[int],
    seeds: list[int],
    out: np.ndarray,
    *,
    sample_stride: int = 0,
) -> np.ndarray | None:
    """``mean_dequantized_into`` for ranks that all sent the layer dithered (``seeds``: each
    rank's dither seed): bit-identical to ``mean_into`` of their ``dequantize(...,
    dither_seed=)``, in one pass with no per-rank float32 array. Sizes checked as there; the
    peer-spread sums at ``sample_stride`` returned as there."""
    lv, st = rank_steps(levels, scales, bits, bucket_sizes, out.size)
    seed_arr = np.asarray([int(x) & 0xFFFFFFFF for x in seeds], dtype=np.int64)
    if seed_arr.size != len(lv):
        raise ValueError(f"{seed_arr.size} seeds for {len(lv)} ranks")
    sums = np.zeros(3, np.float64)
    buckets = np.asarray(bucket_sizes, dtype=np.int64)
    _mean_undithered_core(lv, st, buckets, seed_arr, UNIFORM_TABLE, out, max(sample_stride, 0), sums)
    return sums if sample_stride > 0 else None


@njit(cache=True, nogil=True, inline="always")
def undithered_at(levels, steps, bucket_size, seed, tab, i):  # type: ignore[no-untyped-def]
    """float64 of the dithered layer's decoded value at element i (the bits ``dequantize(...,
    dither_seed=seed)`` gives there), drawing only its own uniform; 0 in an all-zero bucket."""
    k = i // bucket_size
    j = i - k * bucket_size
    st = steps[k]
    if st == 0:
        return np.float64(0.0)
    off, rot = _chunk_window(seed, k, j // CHUNK)
    return np.float64(_undithered(levels[i], uniform(tab[off + j % CHUNK], rot), st))


@njit(cache=True, nogil=True)
def sample_undithered(levels, steps, bucket_size, seed, tab, stride, out):  # type: ignore[no-untyped-def]
    """out[j] = ``undithered_at`` i = j * stride: the controller's strided sample without
    decoding the rest. A chunk's draw is made once for all its sampled elements (the same
    uniforms: most samples share their chunk with the one before)."""
    k_at = c_at = -1
    off = np.int64(0)
    rot = np.float32(0.0)
    for jj in range(out.size):
        i = jj * stride
        k = i // bucket_size
        j = i - k * bucket_size
        st = steps[k]
        if st == 0:
            out[jj] = 0.0
            continue
        c = j // CHUNK
        if k != k_at or c != c_at:
            off, rot = _chunk_window(seed, k, c)
            k_at, c_at = k, c
        out[jj] = np.float64(_undithered(levels[i], uniform(tab[off + j % CHUNK], rot), st))
