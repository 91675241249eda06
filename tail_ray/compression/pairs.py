# mypy: disable-error-code="assignment,return-value"
# (numba kernels: numpy scalars stand for machine ints inside @njit; numba types them, not mypy)
"""Two levels per rANS symbol for small alphabets (bits 2..4: at most 15 * 15 = 225 pairs).

Coding pairs halves the number of (serial) rANS steps. The pair model is NOT sent: encoder
and decoder both derive it from the single-level table with integer arithmetic only (product
of the two marginal frequencies, rescaled, every possible pair >= 1, the rounding remainder on
the most frequent pair), so it is bit-identical on every machine and costs no header bytes.
Its code length is the order-0 one of the levels, up to the pair table's rounding.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tail_ray.compression.entropy import byte_histogram
from tail_ray.compression.sparse import _slot, level_stats

MAX_PAIR_SCALE_BITS = 14
MIN_PAIR_SCALE_BITS = 12
ERR_PAIR_TABLE = -1


def pair_scale_bits(single_scale_bits: int, n_pairs: int) -> int:
    """Pair table precision: 2**14, less for small layers (building the decode table is O(2**s)).

    Depends only on what the decoder knows (the sent table's scale and numel).
    """
    size_bits = max(MIN_PAIR_SCALE_BITS, int(n_pairs).bit_length() + 2)
    return min(MAX_PAIR_SCALE_BITS, 2 * single_scale_bits, size_bits)


@njit(cache=True, nogil=True)
def product_freqs(f1: np.ndarray, scale1: int, scale2: int) -> tuple[int, np.ndarray]:  # pragma: no cover
    """Integer-only pair table summing to 2**scale2 from a single table summing to 2**scale1."""
    a = f1.size
    shift = 2 * scale1 - scale2
    pf = np.zeros(a * a, dtype=np.int64)
    if shift < 0:
        return ERR_PAIR_TABLE, pf
    total = 0
    best = 0
    for x in range(a):
        for y in range(a):
            if f1[x] > 0 and f1[y] > 0:
                v = (f1[x] * f1[y]) >> shift
                if v < 1:
                    v = 1
                pf[x * a + y] = v
                total += v
                if v > pf[best]:
                    best = x * a + y
    pf[best] += (1 << scale2) - total
    if pf[best] < 1:
        return ERR_PAIR_TABLE, pf
    return 0, pf


def pair_values(half: int) -> np.ndarray:
    """uint16 output value of each pair symbol: first level in the low byte (little-endian view)."""
    a = 2 * half + 1
    lv = (np.arange(a) - half).astype(np.int8).view(np.uint8).astype(np.uint16)
    return (lv[:, None] | (lv[None, :] << 8)).reshape(-1).astype(np.uint16)


@njit(cache=True, nogil=True)
def pair_level_stats(
    levels: np.ndarray, half: int, counts: np.ndarray, slot_counts: np.ndarray
) -> tuple[int, int, np.ndarray, np.ndarray]:  # pragma: no cover - jit
    """``sparse.level_stats`` plus the pair symbols and their histogram, in one pass.

    Returns (nnz or -1 for a level outside [-L, L], extra_bits, pair symbols, pair histogram)
    and fills the single-level ``counts`` (the pair histogram's marginals) and ``slot_counts``.
    """
    n = levels.size
    a = 2 * half + 1
    n2 = (n + 1) // 2
    syms = np.empty(n2, dtype=np.uint8)
    h = np.zeros((2, a * a), dtype=np.int64)
    g = np.zeros((4, 8), dtype=np.int64)  # small-gap slots 0..6; 7 = zero or large gap (ignored)
    for s in range(slot_counts.size):
        slot_counts[s] = 0
    last = -1
    extra_bits = 0
    bad = False
    n4 = n - (n & 3)
    for i in range(0, n4, 4):
        last_in = last
        big = False
        for p in range(2):
            j = i + 2 * p
            x = np.int64(levels[j]) + half
            y = np.int64(levels[j + 1]) + half
            bad |= (x < 0) | (x >= a) | (y < 0) | (y >= a)
            s = x * a + y
            s = s if 0 <= s < a * a else 0
            syms[j >> 1] = s
            h[p, s] += 1
        for k in range(4):
            j = i + k
            nz = levels[j] != 0
            u = j - last
            t = u - 1 if u < 8 else 7
            g[k, t if nz else 7] += 1
            big |= nz & (u >= 8)
            last = j if nz else last
        if big:  # rare for dense layers: count this group's large gaps exactly, off the hot path
            last = last_in
            for j in range(i, i + 4):
                if levels[j] != 0:
                    if j - last >= 8:
                        sl, nx, _ = _slot(j - last)
                        slot_counts[sl] += 1
                        extra_bits += nx
                    last = j
    for j in range(n4, n):
        if levels[j] != 0:
            sl, nx, _ = _slot(j - last)
            slot_counts[sl] += 1
            extra_bits += nx
            last = j
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
    for v in range(a):
        counts[v] = 0
    for x in range(a):
        for y in range(a):
            counts[x] += pc[x * a + y]
            counts[y] += pc[x * a + y]
    if n & 1:
        counts[np.int64(levels[n - 1]) + half] -= 1  # the padding copy is not a level
    for t in range(7):
        slot_counts[t] += g[0, t] + g[1, t] + g[2, t] + g[3, t]
    return n - counts[half], extra_bits, syms, pc


@njit(cache=True, nogil=True)
def pair_up(symbols: np.ndarray, alphabet: int) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover
    """Pair uint8 symbols (< alphabet, alphabet**2 <= 256): s0 * alphabet + s1, plus the histogram.

    An odd last symbol pairs with itself. Symbols >= alphabet are clamped (callers pass valid
    symbols; the clamp only keeps the histogram write in bounds).
    """
    n = symbols.size
    n2 = (n + 1) // 2
    out = np.empty(n2, dtype=np.uint8)
    h = np.zeros(alphabet * alphabet, dtype=np.int64)
    top = alphabet - 1
    for k in range(n2):
        x = np.int64(symbols[2 * k])
        x = x if x < top else top
        y = np.int64(symbols[2 * k + 1]) if 2 * k + 1 < n else x
        y = y if y < top else top
        s = x * alphabet + y
        out[k] = s
        h[np.uint64(s)] += 1
    return out, h


def symbol_pair_values(alphabet: int) -> np.ndarray:
    """uint16 output of each pair symbol when the pair stands for two raw uint8 symbols."""
    a = np.arange(alphabet, dtype=np.uint16)
    return (a[:, None] | (a[None, :] << 8)).reshape(-1).astype(np.uint16)


# Gap statistics (for the sparse code's size estimate) are counted exactly on layers up to
# this size; above it, on evenly spaced windows covering about 1/GAP_SAMPLE_EVERY of the
# layer. The loop-carried "last non-zero" chain makes the gap pass the slowest part of the
# counting; the estimate only ranks the codes, and the sparse code, when chosen, is built
# from an exact count (``sparse.level_stats``).
GAP_EXACT_NUMEL = 1 << 15
GAP_WINDOW = 4096
GAP_SAMPLE_EVERY = 8


@njit(cache=True, nogil=True)
def _first_nonzero(levels, lo, hi):  # type: ignore[no-untyped-def]  # pragma: no cover - jit
    """Index of the first non-zero level in levels[lo:hi], or hi."""
    j = lo
    while j < hi and levels[j] == 0:
        j += 1
    return j


@njit(cache=True, nogil=True)
def _count_gaps(levels, last, lo, hi, slot_counts, g):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Gap slots of the non-zeros in levels[lo:hi], the previous non-zero at ``last``: gaps
    1..7 into ``g``, longer ones into ``slot_counts``. Returns (non-zeros counted, extra bits)."""
    counted = 0
    extra = 0
    for j in range(lo, hi):
        if levels[j] != 0:
            u = j - last
            if u < 8:
                g[u - 1] += 1
            else:
                sl, nx, _ = _slot(u)
                slot_counts[sl] += 1
                extra += nx
            counted += 1
            last = j
    return counted, extra


@njit(cache=True, nogil=True)
def _gap_window(levels, lo, hi, slot_counts, g):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Gap slots of the non-zeros in levels[lo:hi], the first one skipped (its gap starts
    before the window). Returns (non-zeros counted, extra bits)."""
    first = _first_nonzero(levels, lo, hi)
    if first >= hi:
        return 0, 0
    return _count_gaps(levels, first, first + 1, hi, slot_counts, g)


@njit(cache=True, nogil=True)
def _pair_symbols(levels, half, syms):  # type: ignore[no-untyped-def]  # pragma: no cover - jit
    """syms[k] = (l[2k] + L) * a + l[2k+1] + L in uint8 arithmetic (vectorizes); an odd last
    level pairs with itself. Returns the largest shifted level seen (> 2L: out of range)."""
    n = levels.size
    a = np.int32(2 * half + 1)
    hh = np.int32(half)
    top = np.int32(0)
    for k in range(n // 2):
        x = (np.int32(levels[2 * k]) + hh) & 0xFF
        y = (np.int32(levels[2 * k + 1]) + hh) & 0xFF
        top = max(top, max(x, y))
        syms[k] = np.uint8((x * a + y) & 0xFF)
    if n & 1:
        x = (np.int32(levels[n - 1]) + hh) & 0xFF
        top = max(top, x)
        syms[n // 2] = np.uint8((x * a + x) & 0xFF)
    return top


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
    top = _pair_symbols(levels, half, syms)
    pc = byte_histogram(syms)[: a * a].copy()
    if top >= a:  # a level outside [-L, L] (int8 values below -L wrap to large uint8)
        return -1, 0, syms, pc, True
    for v in range(a):
        counts[v] = 0
    for x in range(a):
        for y in range(a):
            counts[x] += pc[x * a + y]
            counts[y] += pc[x * a + y]
    if n & 1:
        counts[np.int64(levels[n - 1]) + half] -= 1  # the padding copy is not a level
    nnz = n - counts[half]
    extra = sampled_gaps(levels, nnz, slot_counts)
    if extra < 0:  # no gap in the sample (very sparse layer): count them all
        nnz, extra, syms, pc = pair_level_stats(levels, half, counts, slot_counts)
        return nnz, extra, syms, pc, True
    return nnz, extra, syms, pc, False


# Above this share of non-zero levels (about where the two cost the same, measured) the gap
# windows are counted without a branch per level (``_gap_window_dense``): at 30-70 % density
# the branch on "non-zero?" mispredicts about every other level, which made the sampled gap
# count the slowest part of encoding (0.5 -> 0.18 ms per 1M levels at 3 bits).
DENSE_GAP_SHARE = 0.18


@njit(cache=True, nogil=True)
def _gap_window_dense(levels, lo, hi, slot_counts, g):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``_gap_window`` (same counts, same result) for dense layers: small gaps counted branch-free
    in four sub-histograms (lane k of each group of four; slot 7 takes zeros and large gaps, and
    is ignored), large gaps re-counted exactly in the rare group that has one."""
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
        big = False
        for k in range(4):
            jj = i + k
            nz = levels[jj] != 0
            u = jj - last
            t = u - 1 if u < 8 else 7
            gg[k, t if nz else 7] += 1
            big |= nz & (u >= 8)
            last = jj if nz else last
        if big:
            last = last_in
            for jj in range(i, i + 4):
                if levels[jj] != 0:
                    if jj - last >= 8:
                        sl, nx, _ = _slot(jj - last)
                        slot_counts[sl] += 1
                        extra += nx
                        counted += 1
                    last = jj
    c, e = _count_gaps(levels, last, end4, hi, slot_counts, g)  # the last < 4 levels
    counted += c
    extra += e
    for t in range(7):
        small = gg[0, t] + gg[1, t] + gg[2, t] + gg[3, t]
        g[t] += small
        counted += small
    return counted, extra


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


@njit(cache=True, nogil=True)
def level_stats_fast(
    levels: np.ndarray, half: int, counts: np.ndarray, slot_counts: np.ndarray
) -> tuple[int, int, bool]:  # pragma: no cover - jit
    """``sparse.level_stats`` for large layers: level counts exact (``byte_histogram``), gap
    slots estimated by ``sampled_gaps``. Returns (nnz or -1, extra_bits, exact)."""
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
