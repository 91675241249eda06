# mypy: disable-error-code="assignment,return-value"
# (numba kernels: numpy scalars stand for machine ints inside @njit; numba types them, not mypy)
"""The LSB-first bit writer the codec's kernels share (frequency tables, gap extra bits).

A writer is three machine values the caller keeps in registers: ``acc`` (uint64
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
