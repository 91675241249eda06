# mypy: disable-error-code="assignment,return-value"
# (numba kernels: numpy scalars stand for machine ints inside @njit; numba types them, not mypy)
"""LSB-first bit I/O shared by the codec's kernels (frequency tables, gap extra bits, bit-packing).

A writer (or reader) is three machine values the caller keeps in registers: ``acc`` (uint64
of pending bits), ``nacc`` (how many, < 8 between calls) and ``pos`` (the next byte). The
helpers are inlined into their callers at numba's IR level (``inline="always"``), so a kernel
that writes bits compiles to the same loop it did when every kernel spelled the flush out.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, inline="always")
def put_bits(acc, nacc, value, nbits, out, pos):  # type: ignore[no-untyped-def]  # pragma: no cover - jit
    """Append the low ``nbits`` of ``value`` (< 2**nbits, nbits <= 56) and write every whole
    byte to ``out[pos:]``; return the new (acc, nacc, pos)."""
    acc |= np.uint64(value) << np.uint64(nacc)
    nacc += nbits
    while nacc >= 8:
        out[pos] = np.uint8(acc & np.uint64(0xFF))
        acc >>= np.uint64(8)
        nacc -= 8
        pos += 1
    return acc, nacc, pos


@njit(cache=True, nogil=True, inline="always")
def flush_bits(acc, nacc, out, pos):  # type: ignore[no-untyped-def]  # pragma: no cover - jit
    """Write the pending bits (< 8) as one zero-padded byte, if any; return the end position."""
    if nacc > 0:
        out[pos] = np.uint8(acc & np.uint64(0xFF))
        pos += 1
    return pos


@njit(cache=True, nogil=True, inline="always")
def get_bit(data, pos, acc, nacc):  # type: ignore[no-untyped-def]  # pragma: no cover - jit
    """The next bit of an LSB-first stream at ``data[pos:]`` (``acc`` / ``nacc``: the bits of
    the current byte not read yet); return (bit, acc, nacc, pos), bit = -1 past the end."""
    if nacc == 0:
        if pos >= data.size:
            return -1, acc, nacc, pos
        acc = np.uint64(data[pos])
        pos += 1
        nacc = 8
    return np.int64(acc & np.uint64(1)), acc >> np.uint64(1), nacc - 1, pos
