# mypy: disable-error-code="assignment,return-value,arg-type"
# (numba kernels: numpy scalars stand for machine ints inside @njit; numba types them, not mypy)
"""Positions of non-zero levels as gaps: a small slot alphabet (entropy coded) + raw extra bits.

A gap g (zeros before the next non-zero) is sent as u = g + 1 >= 1. Values 1..7 are slots 0..6
with no extra bits; larger u with bit length b+1 (b >= 3) go to slot 7 + 4*(b-3) + the two
bits under the leading one, followed by the b - 2 remaining low bits raw (LSB-first). Two
mantissa bits keep the within-slot distribution nearly uniform for geometric gaps, so the
raw bits cost within a fraction of a percent of their entropy. u < 2**32 needs 123 slots.

Non-zero levels l in [-L, L] \\ {0} map to symbols 0..2L-1 (l + L for l < 0, l + L - 1 above).
All kernels bounds-check explicitly and return a negative status instead of raising.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tail_ray.compression.entropy import byte_histogram

N_SLOTS = 123
DIRECT_SLOTS = 7

OK = 0
ERR_EXTRA_TRUNCATED = -1  # the raw extra-bit stream ends early
ERR_POSITION = -2  # a gap runs past numel (or indices are not strictly increasing)
ERR_SLOT = -3  # a slot symbol outside the alphabet
ERR_LEVEL = -4  # a level outside [-L, L] given to the encoder


@njit(cache=True, nogil=True, inline="always")
def _slot(u: int) -> tuple[int, int, int]:  # pragma: no cover - jit
    """(slot, n_extra_bits, extra_value) for u >= 1."""
    if u < 8:
        return u - 1, 0, 0
    b = 3
    while (u >> (b + 1)) != 0:
        b += 1
    nx = b - 2
    return DIRECT_SLOTS + 4 * (b - 3) + ((u >> nx) & 3), nx, u & ((1 << nx) - 1)


@njit(cache=True, nogil=True)
def level_stats(
    levels: np.ndarray, half: int, counts: np.ndarray, slot_counts: np.ndarray
) -> tuple[int, int]:  # pragma: no cover - jit
    """One fused pass: histogram of ``levels + half`` and of the gap slots of the non-zeros.

    Returns (nnz, extra_bits), or (ERR_LEVEL, 0) when a level lies outside [-half, half]
    (checked on the byte histogram, so any int8 input is safe). Four sub-histograms (one per
    lane) break the store-to-load chains a peaked histogram would serialise on; small gaps
    (u < 8, the common case for dense layers) are counted without a branch.
    """
    n = levels.size
    h = byte_histogram(levels)
    g = np.zeros((4, 8), dtype=np.int64)  # small-gap slots 0..6; 7 = zero or large gap (ignored)
    for s in range(slot_counts.size):
        slot_counts[s] = 0
    last = -1
    extra_bits = 0
    n4 = n - (n & 3)
    for i in range(0, n4, 4):
        last_in = last
        big = False
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
    total = 0
    for s in range(counts.size):
        b = (s - half) & 0xFF
        counts[s] = h[b]
        total += counts[s]
    if total != n:
        return ERR_LEVEL, 0
    for t in range(DIRECT_SLOTS):
        slot_counts[t] += g[0, t] + g[1, t] + g[2, t] + g[3, t]
    return n - counts[half], extra_bits


@njit(cache=True, nogil=True)
def split_levels(
    levels: np.ndarray, half: int, nnz: int, extra_bits: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - jit
    """Return (slots u8[nnz], non-zero symbols u8[nnz], extra bits as bytes).

    Branch-free compaction: every element writes its candidate slot/symbol at index k and k
    advances only on a non-zero (one spare entry absorbs the writes after the last one).
    Only large gaps (u >= 8, rare inside dense regions) take a branch.
    """
    slots = np.empty(nnz + 1, dtype=np.uint8)
    syms = np.empty(nnz + 1, dtype=np.uint8)
    extra = np.zeros((extra_bits + 7) // 8 + 8, dtype=np.uint8)
    acc = np.uint64(0)
    nacc = 0
    epos = 0
    k = 0
    last = -1
    for i in range(levels.size):
        lv = np.int64(levels[i])
        nz = lv != 0
        u = i - last
        ku = np.uint64(k)
        syms[ku] = lv + half - (lv > 0)
        if nz & (u >= 8):
            sl, nx, xv = _slot(u)
            slots[ku] = sl
            acc |= np.uint64(xv) << np.uint64(nacc)
            nacc += nx
            while nacc >= 8:
                extra[epos] = np.uint8(acc & np.uint64(0xFF))
                acc >>= np.uint64(8)
                nacc -= 8
                epos += 1
        else:
            slots[ku] = u - 1
        k += nz
        last = i if nz else last
    if nacc > 0:
        extra[epos] = np.uint8(acc & np.uint64(0xFF))
        epos += 1
    return slots[:nnz], syms[:nnz], extra[:epos]


@njit(cache=True, nogil=True)
def index_slots(indices: np.ndarray, numel: int) -> tuple[int, np.ndarray, np.ndarray]:  # pragma: no cover
    """Slots and extra bytes for strictly increasing ``indices`` in [0, numel); status first."""
    n = indices.size
    slots = np.empty(n, dtype=np.uint8)
    extra = np.zeros(5 * n + 8, dtype=np.uint8)
    acc = np.uint64(0)
    nacc = 0
    epos = 0
    last = -1
    for k in range(n):
        i = np.int64(indices[k])
        if i <= last or i >= numel:
            return ERR_POSITION, slots, extra[:0]
        sl, nx, xv = _slot(i - last)
        last = i
        slots[k] = sl
        if nx:
            acc |= np.uint64(xv) << np.uint64(nacc)
            nacc += nx
            while nacc >= 8:
                extra[epos] = np.uint8(acc & np.uint64(0xFF))
                acc >>= np.uint64(8)
                nacc -= 8
                epos += 1
    if nacc > 0:
        extra[epos] = np.uint8(acc & np.uint64(0xFF))
        epos += 1
    return OK, slots, extra[:epos]


@njit(cache=True, nogil=True)
def positions(
    slots: np.ndarray, extra: np.ndarray, estart: int, eend: int, numel: int, out_idx: np.ndarray
) -> int:  # pragma: no cover - jit
    """Rebuild positions from slots + extra bits at ``extra[estart:eend]``; each checked < numel.

    Returns the number of extra bytes consumed, or ERR_*.
    """
    acc = np.uint64(0)
    nacc = 0
    epos = estart
    last = -1
    for k in range(slots.size):
        sl = np.int64(slots[k])
        if sl < DIRECT_SLOTS:
            u = sl + 1
        else:
            if sl >= N_SLOTS:
                return ERR_SLOT
            t = sl - DIRECT_SLOTS
            b = 3 + (t >> 2)
            nx = b - 2
            while nacc < nx:
                if epos >= eend:
                    return ERR_EXTRA_TRUNCATED
                acc |= np.uint64(extra[epos]) << np.uint64(nacc)
                epos += 1
                nacc += 8
            u = ((4 | (t & 3)) << nx) | np.int64(acc & np.uint64((1 << nx) - 1))
            acc >>= np.uint64(nx)
            nacc -= nx
        last += u
        if last >= numel:
            return ERR_POSITION
        out_idx[k] = last
    return epos - estart


@njit(cache=True, nogil=True)
def scatter_levels(idx: np.ndarray, syms: np.ndarray, half: int, out: np.ndarray) -> None:  # pragma: no cover
    """out[idx[k]] = level of non-zero symbol syms[k]; ``idx`` already validated < out.size."""
    for k in range(idx.size):
        s = np.int64(syms[k])
        out[idx[k]] = s - half if s < half else s - half + 1
