# mypy: disable-error-code="assignment,return-value"
# (numba kernels: numpy scalars stand for machine ints inside @njit; numba types them, not mypy)
"""Fixed-width bit-packing of small unsigned symbols (the ``bitpack`` code).

Bits are written LSB-first into little-endian bytes. Every reader checks the bytes really
present before it reads (numba does no bounds checks), and reports problems as a negative
status instead of raising, so callers can name the layer and field in a ``CodecError``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# Status codes returned by the readers (>= 0 means success).
ERR_TRUNCATED = -1  # the stream ended before every symbol was read
ERR_RANGE = -2  # a symbol lies outside the alphabet the header announced


def packed_bytes(count: int, width_bits: int) -> int:
    """Exact size in bytes of ``count`` symbols packed at ``width_bits`` each."""
    return (count * width_bits + 7) // 8


@njit(cache=True, nogil=True)
def pack_fixed(symbols: np.ndarray, offset: int, width: int, out: np.ndarray) -> None:  # pragma: no cover
    """Pack ``symbols + offset`` (each in [0, 2**width)) at ``width`` (1..8) bits into ``out``."""
    n = symbols.size
    acc = np.uint64(0)
    nacc = 0
    pos = 0
    i = 0
    # Eight symbols at a time fill exactly ``width`` bytes: no partial-byte bookkeeping inside.
    n8 = n - (n & 7)
    while i < n8:
        acc = np.uint64(0)
        for k in range(8):
            acc |= np.uint64(np.int64(symbols[i + k]) + offset) << np.uint64(k * width)
        for k in range(width):
            out[pos + k] = np.uint8((acc >> np.uint64(8 * k)) & np.uint64(0xFF))
        pos += width
        i += 8
    acc = np.uint64(0)
    nacc = 0
    while i < n:
        acc |= np.uint64(np.int64(symbols[i]) + offset) << np.uint64(nacc)
        nacc += width
        i += 1
    while nacc > 0:
        out[pos] = np.uint8(acc & np.uint64(0xFF))
        acc >>= np.uint64(8)
        nacc -= 8
        pos += 1


@njit(cache=True, nogil=True)
def unpack_fixed(
    data: np.ndarray, width: int, max_symbol: int, out: np.ndarray
) -> int:  # pragma: no cover - jit
    """Inverse of ``pack_fixed`` into uint8 ``out``; ERR_* when short or a symbol > max_symbol."""
    n = out.size
    if data.size < (n * width + 7) // 8:
        return ERR_TRUNCATED
    mask = np.uint64((1 << width) - 1)
    bad = 0
    i = 0
    pos = 0
    n8 = n - (n & 7)
    while i < n8:
        acc = np.uint64(0)
        for k in range(width):
            acc |= np.uint64(data[pos + k]) << np.uint64(8 * k)
        for k in range(8):
            s = (acc >> np.uint64(k * width)) & mask
            bad |= s > np.uint64(max_symbol)
            out[i + k] = np.uint8(s)
        pos += width
        i += 8
    acc = np.uint64(0)
    nacc = 0
    while i < n:
        if nacc < width:
            acc |= np.uint64(data[pos]) << np.uint64(nacc)
            pos += 1
            nacc += 8
        s = acc & mask
        bad |= s > np.uint64(max_symbol)
        out[i] = np.uint8(s)
        acc >>= np.uint64(width)
        nacc -= width
        i += 1
    if bad:
        return ERR_RANGE
    return 0
