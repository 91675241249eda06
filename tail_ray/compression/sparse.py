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

N_SLOTS = 123
DIRECT_SLOTS = 7

OK = 0
ERR_EXTRA_TRUNCATED = -1  # the raw extra-bit stream ends early
ERR_POSITION = -2  # a gap runs past numel (or indices are not strictly increasing)
ERR_SLOT = -3  # a slot symbol outside the alphabet


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
) -> tuple[int, int]:  # pragma: no cover
    """One pass: histogram of ``levels + half`` into ``counts`` and of gap slots into ``slot_counts``.

    Returns (nnz, extra_bits). Four sub-histograms break the store-to-load dependency that a
    peaked histogram (most levels equal) would otherwise serialise on.
    """
    n = levels.size
    a = counts.size
    h = np.zeros((4, a), dtype=np.int64)
    n4 = n - (n & 3)
    for i in range(0, n4, 4):
        h[0, np.int64(levels[i]) + half] += 1
        h[1, np.int64(levels[i + 1]) + half] += 1
        h[2, np.int64(levels[i + 2]) + half] += 1
        h[3, np.int64(levels[i + 3]) + half] += 1
    for i in range(n4, n):
        h[0, np.int64(levels[i]) + half] += 1
    for s in range(a):
        counts[s] = h[0, s] + h[1, s] + h[2, s] + h[3, s]
    for s in range(slot_counts.size):
        slot_counts[s] = 0
    nnz = n - counts[half]
    extra_bits = 0
    if nnz == 0:
        return 0, 0
    last = -1
    for i in range(n):
        if levels[i] != 0:
            u = i - last
            last = i
            if u < 8:
                slot_counts[u - 1] += 1
            else:
                sl, nx, _ = _slot(u)
                slot_counts[sl] += 1
                extra_bits += nx
    return nnz, extra_bits


@njit(cache=True, nogil=True)
def split_levels(
    levels: np.ndarray, half: int, nnz: int, extra_bits: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - jit
    """Return (slots u8[nnz], non-zero symbols u8[nnz], extra bits as bytes)."""
    slots = np.empty(nnz, dtype=np.uint8)
    syms = np.empty(nnz, dtype=np.uint8)
    extra = np.zeros((extra_bits + 7) // 8 + 8, dtype=np.uint8)
    acc = np.uint64(0)
    nacc = 0
    epos = 0
    k = 0
    last = -1
    for i in range(levels.size):
        lv = np.int64(levels[i])
        if lv != 0:
            sl, nx, xv = _slot(i - last)
            last = i
            slots[k] = sl
            syms[k] = lv + half if lv < 0 else lv + half - 1
            k += 1
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
    return slots, syms, extra[:epos]


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
