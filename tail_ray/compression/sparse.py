# mypy: disable-error-code="assignment,return-value,arg-type"
# (numba kernels: numpy scalars stand for machine ints inside @njit; numba types them, not mypy)
"""The gap code of sparse positions: a small slot alphabet (entropy coded) + raw extra bits.

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

from tail_ray.compression.bitio import flush_bits, put_bits

N_SLOTS = 123
DIRECT_SLOTS = 7

OK = 0
ERR_EXTRA_TRUNCATED = -1  # the raw extra-bit stream ends early
ERR_POSITION = -2  # a gap runs past numel (or indices are not strictly increasing)
ERR_SLOT = -3  # a slot symbol outside the alphabet


@njit(cache=True, nogil=True, inline="always")
def gap_slot(u: int) -> tuple[int, int, int]:  # pragma: no cover - jit
    """(slot, n_extra_bits, extra_value) for u >= 1."""
    if u < 8:
        return u - 1, 0, 0
    b = 3
    while (u >> (b + 1)) != 0:
        b += 1
    nx = b - 2
    return DIRECT_SLOTS + 4 * (b - 3) + ((u >> nx) & 3), nx, u & ((1 << nx) - 1)


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
            sl, nx, xv = gap_slot(u)
            slots[ku] = sl
            acc, nacc, epos = put_bits(acc, nacc, xv, nx, extra, epos)
        else:
            slots[ku] = u - 1
        k += nz
        last = i if nz else last
    epos = flush_bits(acc, nacc, extra, epos)
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
        sl, nx, xv = gap_slot(i - last)
        last = i
        slots[k] = sl
        if nx:
            acc, nacc, epos = put_bits(acc, nacc, xv, nx, extra, epos)
    epos = flush_bits(acc, nacc, extra, epos)
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
        out[np.uint64(idx[k])] = s - half + (s >= half)  # unsigned index: no wraparound check
