# mypy: disable-error-code="assignment,return-value"
# (numba kernels: numpy scalars stand for machine ints inside @njit; numba types them, not mypy)
"""The counting pass behind the code choice: level, pair and gap-slot histograms of a layer.

One pass over a layer's int8 levels gives what every candidate code's size estimate needs:
the level histogram (dense codes), the pair symbols and their histogram (pair rANS, bits
2..4), the gap-slot histogram and the raw extra bits of the non-zeros' positions (sparse
rANS). Layers up to ``GAP_EXACT_NUMEL`` are counted exactly in one fused pass; larger ones in
three cheap passes (vectorised pair symbols, a 4-way byte histogram, both exact) with the gap
slots ESTIMATED from evenly spaced windows scaled to the exact nnz. The estimate only ranks
the codes: the sparse code, when chosen, is built from an exact count (``level_stats``).

The gap counter of a group of four levels (``_small_gaps``, and ``_large_gaps`` on its rare
path) and of a short run (``_count_gaps``) are inline helpers shared by every pass. Every
kernel range-checks the levels it counts and reports a level outside [-L, L] as a negative
nnz.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tail_ray.compression.entropy import byte_histogram
from tail_ray.compression.pair_symbols import pair_symbols
from tail_ray.compression.sparse import DIRECT_SLOTS, gap_slot

ERR_LEVEL = -4  # a level outside [-L, L]

# Gap statistics are counted exactly on layers up to this size; above it, on evenly spaced
# windows covering about 1/GAP_SAMPLE_EVERY of the layer. The loop-carried "last non-zero"
# chain makes the gap pass the slowest part of the counting.
GAP_EXACT_NUMEL = 1 << 15
GAP_WINDOW = 4096
GAP_SAMPLE_EVERY = 8
# Above this share of non-zero levels (about where the two cost the same, measured) the gap
# windows are counted without a branch per level (``_gap_window_dense``): at 30-70 % density
# the branch on "non-zero?" mispredicts about every other level, which made the sampled gap
# count the slowest part of encoding (0.5 -> 0.18 ms per 1M levels at 3 bits).
DENSE_GAP_SHARE = 0.18


# --------------------------------------------------------------------------- gap counters


@njit(cache=True, nogil=True, inline="always")
def _small_gaps(levels, i, last, g):  # type: ignore[no-untyped-def]  # pragma: no cover - jit
    """Gap slots of the non-zeros in levels[i:i + 4], the previous non-zero at ``last``, for
    the common case of small gaps (u < 8): counted without a branch in lane k's row ``g[k]``
    (column 7 takes zeros and large gaps, and is ignored). Returns (last, whether a large gap
    occurred: then ``_large_gaps`` counts this group's large gaps exactly)."""
    big = False
    for k in range(4):
        j = i + k
        nz = levels[j] != 0
        u = j - last
        t = u - 1 if u < 8 else 7
        g[k, t if nz else 7] += 1
        big |= nz & (u >= 8)
        last = j if nz else last
    return last, big


@njit(cache=True, nogil=True, inline="always")
def _large_gaps(levels, i, last, slot_counts):  # type: ignore[no-untyped-def]  # pragma: no cover - jit
    """The large gaps (u >= 8) in levels[i:i + 4] into ``slot_counts``, the previous non-zero at
    ``last`` (the rare path of a dense layer). Returns (last, extra bits, large gaps)."""
    extra = 0
    n_big = 0
    for j in range(i, i + 4):
        if levels[j] != 0:
            if j - last >= 8:
                sl, nx, _ = gap_slot(j - last)
                slot_counts[sl] += 1
                extra += nx
                n_big += 1
            last = j
    return last, extra, n_big


@njit(cache=True, nogil=True)
def _count_gaps(levels, last, lo, hi, slot_counts, g):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Gap slots of the non-zeros in levels[lo:hi], the previous non-zero at ``last``: gaps
    1..7 into ``g`` (1-D), longer ones into ``slot_counts``. Returns (non-zeros counted, extra bits)."""
    counted = 0
    extra = 0
    for j in range(lo, hi):
        if levels[j] != 0:
            u = j - last
            if u < 8:
                g[u - 1] += 1
            else:
                sl, nx, _ = gap_slot(u)
                slot_counts[sl] += 1
                extra += nx
            counted += 1
            last = j
    return counted, extra


@njit(cache=True, nogil=True, inline="always")
def _add_lanes(g, slot_counts):  # type: ignore[no-untyped-def]  # pragma: no cover - jit
    """slot_counts[t] += the four lanes' small-gap counts of slot t; return their total."""
    total = 0
    for t in range(DIRECT_SLOTS):
        small = g[0, t] + g[1, t] + g[2, t] + g[3, t]
        slot_counts[t] += small
        total += small
    return total


@njit(cache=True, nogil=True)
def _first_nonzero(levels, lo, hi):  # type: ignore[no-untyped-def]  # pragma: no cover - jit
    """Index of the first non-zero level in levels[lo:hi], or hi."""
    j = lo
    while j < hi and levels[j] == 0:
        j += 1
    return j


@njit(cache=True, nogil=True)
def _gap_window(levels, lo, hi, slot_counts, g):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Gap slots of the non-zeros in levels[lo:hi], the first one skipped (its gap starts
    before the window). Returns (non-zeros counted, extra bits)."""
    first = _first_nonzero(levels, lo, hi)
    if first >= hi:
        return 0, 0
    return _count_gaps(levels, first, first + 1, hi, slot_counts, g)


@njit(cache=True, nogil=True)
def _gap_window_dense(levels, lo, hi, slot_counts, g):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``_gap_window`` (same counts, same result) for dense layers: four lanes branch-free."""
    last = _first_nonzero(levels, lo, hi)
    if last >= hi:
        return 0, 0
    counted = 0
    extra = 0
    gg = np.zeros((4, 8), dtype=np.int64)
    start = last + 1
    end4 = start + ((hi - start) & ~3)
    for i in range(start, end4, 4):
        last_in = last
        last, big = _small_gaps(levels, i, last, gg)
        if big:
            last, e, n_big = _large_gaps(levels, i, last_in, slot_counts)
            extra += e
            counted += n_big
    c, e = _count_gaps(levels, last, end4, hi, slot_counts, g)  # the last < 4 levels
    counted += c + _add_lanes(gg, g)
    return counted, extra + e


@njit(cache=True, nogil=True)
def sampled_gaps(levels: np.ndarray, nnz: int, slot_counts: np.ndarray) -> int:  # pragma: no cover - jit
    """Fill ``slot_counts`` with the gap-slot histogram of the non-zeros estimated from evenly
    spaced windows and scaled to ``nnz`` gaps (a slot seen keeps >= 1); return the estimated
    extra bits, or -1 when the sample held no gap (the caller then counts exactly)."""
    n = levels.size
    for s in range(slot_counts.size):
        slot_counts[s] = 0
    g = np.zeros(8, dtype=np.int64)
    counted = 0
    extra = 0
    step = GAP_WINDOW * GAP_SAMPLE_EVERY
    dense = nnz > DENSE_GAP_SHARE * n  # which counter is faster; both count the same
    for lo in range((n % step) // 2, n, step):  # evenly spaced windows
        if dense:
            c, e = _gap_window_dense(levels, lo, min(n, lo + GAP_WINDOW), slot_counts, g)
        else:
            c, e = _gap_window(levels, lo, min(n, lo + GAP_WINDOW), slot_counts, g)
        counted += c
        extra += e
    for t in range(7):
        slot_counts[t] += g[t]
    if counted == 0:
        return -1
    for s in range(slot_counts.size):
        if slot_counts[s] > 0:
            v = (slot_counts[s] * nnz) // counted
            slot_counts[s] = v if v > 0 else 1
    return (extra * nnz) // counted


# --------------------------------------------------------------------------- exact passes


@njit(cache=True, nogil=True)
def level_stats(
    levels: np.ndarray, half: int, counts: np.ndarray, slot_counts: np.ndarray
) -> tuple[int, int]:  # pragma: no cover - jit
    """One fused pass: histogram of ``levels + half`` and of the gap slots of the non-zeros.

    Returns (nnz, extra_bits), or (ERR_LEVEL, 0) when a level lies outside [-half, half]
    (checked on the byte histogram, so any int8 input is safe). Four sub-histograms (one per
    lane) break the store-to-load chains a peaked histogram would serialise on.
    """
    n = levels.size
    h = byte_histogram(levels)
    g = np.zeros((4, 8), dtype=np.int64)
    for s in range(slot_counts.size):
        slot_counts[s] = 0
    last = -1
    extra_bits = 0
    n4 = n - (n & 3)
    for i in range(0, n4, 4):
        last_in = last
        last, big = _small_gaps(levels, i, last, g)
        if big:  # rare for dense layers: off the hot path
            last, e, _ = _large_gaps(levels, i, last_in, slot_counts)
            extra_bits += e
    extra_bits += _count_gaps(levels, last, n4, n, slot_counts, g[0])[1]
    total = 0
    for s in range(counts.size):
        b = (s - half) & 0xFF
        counts[s] = h[b]
        total += counts[s]
    if total != n:
        return ERR_LEVEL, 0
    _add_lanes(g, slot_counts)
    return n - counts[half], extra_bits


@njit(cache=True, nogil=True, inline="always")
def _pair_marginals(pc, a, levels, half, counts):  # type: ignore[no-untyped-def]  # pragma: no cover
    """counts[v] = how often level v - half occurs, from the pair histogram (an odd last level
    was paired with itself: its padding copy is not a level)."""
    n = levels.size
    for v in range(a):
        counts[v] = 0
    for x in range(a):
        for y in range(a):
            counts[x] += pc[x * a + y]
            counts[y] += pc[x * a + y]
    if n & 1:
        counts[np.int64(levels[n - 1]) + half] -= 1


@njit(cache=True, nogil=True)
def pair_level_stats(
    levels: np.ndarray, half: int, counts: np.ndarray, slot_counts: np.ndarray
) -> tuple[int, int, np.ndarray, np.ndarray]:  # pragma: no cover - jit
    """``level_stats`` plus the pair symbols and their histogram, in one pass.

    Returns (nnz or -1 for a level outside [-L, L], extra_bits, pair symbols, pair histogram)
    and fills the single-level ``counts`` (the pair histogram's marginals) and ``slot_counts``.
    """
    n = levels.size
    a = 2 * half + 1
    syms = np.empty((n + 1) // 2, dtype=np.uint8)
    h = np.zeros((2, a * a), dtype=np.int64)
    g = np.zeros((4, 8), dtype=np.int64)
    for s in range(slot_counts.size):
        slot_counts[s] = 0
    last = -1
    extra_bits = 0
    bad = False
    n4 = n - (n & 3)
    for i in range(0, n4, 4):
        for p in range(2):
            j = i + 2 * p
            x = np.int64(levels[j]) + half
            y = np.int64(levels[j + 1]) + half
            bad |= (x < 0) | (x >= a) | (y < 0) | (y >= a)
            s = x * a + y
            s = s if 0 <= s < a * a else 0
            syms[j >> 1] = s
            h[p, s] += 1
        last_in = last
        last, big = _small_gaps(levels, i, last, g)
        if big:
            last, e, _ = _large_gaps(levels, i, last_in, slot_counts)
            extra_bits += e
    extra_bits += _count_gaps(levels, last, n4, n, slot_counts, g[0])[1]
    for j in range(n4, n, 2):  # the last one or two pairs; an odd last level pairs with itself
        x = np.int64(levels[j]) + half
        y = np.int64(levels[j + 1]) + half if j + 1 < n else x
        bad |= (x < 0) | (x >= a) | (y < 0) | (y >= a)
        s = x * a + y
        s = s if 0 <= s < a * a else 0
        syms[j >> 1] = s
        h[0, s] += 1
    if bad:
        return -1, 0, syms, h[0]
    pc = h[0] + h[1]
    _pair_marginals(pc, a, levels, half, counts)
    _add_lanes(g, slot_counts)
    return n - counts[half], extra_bits, syms, pc


# --------------------------------------------------------------------------- large layers


@njit(cache=True, nogil=True)
def pair_level_stats_fast(
    levels: np.ndarray, half: int, counts: np.ndarray, slot_counts: np.ndarray
) -> tuple[int, int, np.ndarray, np.ndarray, bool]:  # pragma: no cover - jit
    """``pair_level_stats`` for large layers, in three cheap passes instead of one serial one:
    pair symbols (vectorized, uint8 arithmetic), their histogram (``byte_histogram``: four
    sub-histograms), and the gap slots estimated from windows (scaled to the exact nnz).

    Returns (nnz or -1, extra_bits estimate, pair symbols, pair histogram, exact): ``exact``
    is True when the layer was small enough to count every gap (then this IS
    ``pair_level_stats``). Level and pair counts are always exact.
    """
    n = levels.size
    if n <= GAP_EXACT_NUMEL:
        nnz, extra, syms, pc = pair_level_stats(levels, half, counts, slot_counts)
        return nnz, extra, syms, pc, True
    a = 2 * half + 1
    syms = np.empty((n + 1) // 2, dtype=np.uint8)
    top = pair_symbols(levels, half, syms)
    pc = byte_histogram(syms)[: a * a].copy()
    if top >= a:  # a level outside [-L, L] (int8 values below -L wrap to large uint8)
        return -1, 0, syms, pc, True
    _pair_marginals(pc, a, levels, half, counts)
    nnz = n - counts[half]
    extra = sampled_gaps(levels, nnz, slot_counts)
    if extra < 0:  # no gap in the sample (very sparse layer): count them all
        nnz, extra, syms, pc = pair_level_stats(levels, half, counts, slot_counts)
        return nnz, extra, syms, pc, True
    return nnz, extra, syms, pc, False


@njit(cache=True, nogil=True)
def level_stats_fast(
    levels: np.ndarray, half: int, counts: np.ndarray, slot_counts: np.ndarray
) -> tuple[int, int, bool]:  # pragma: no cover - jit
    """``level_stats`` for large layers: level counts exact (``byte_histogram``), gap slots
    estimated by ``sampled_gaps``. Returns (nnz or -1, extra_bits, exact)."""
    n = levels.size
    if n <= GAP_EXACT_NUMEL:
        nnz, extra = level_stats(levels, half, counts, slot_counts)
        return nnz, extra, True
    h = byte_histogram(levels)
    total = 0
    for v in range(counts.size):
        counts[v] = h[(v - half) & 0xFF]
        total += counts[v]
    if total != n:  # a level outside [-L, L]
        return -1, 0, True
    nnz = n - counts[half]
    extra = sampled_gaps(levels, nnz, slot_counts)
    if extra < 0:
        nnz, extra = level_stats(levels, half, counts, slot_counts)
        return nnz, extra, True
    return nnz, extra, False
