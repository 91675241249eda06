# mypy: disable-error-code="assignment,return-value"
# (numba kernels: numpy scalars stand for machine ints inside @njit; numba types them, not mypy)
"""Two levels per rANS symbol (bits 2..4): the pair symbols and what they decode to.

A pair of symbols (x, y) of an alphabet of a <= 15 values is the one symbol x * a + y
(< 225: it fits a byte); an odd last symbol pairs with itself. Coding pairs halves the number
of serial rANS steps at the same order-0 size; the pair model is derived from the sent
single-symbol table (``EntropyModel.paired``), never sent. Decoding writes a pair as one
uint16 (first symbol in the low byte) into a little-endian view of the output.
"""

from __future__ import annotations

import functools
import sys

import numpy as np
from numba import njit

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("tail_ray's level coder views int8 pairs as uint16: it needs a little-endian host")

PAIR_MAX_BITS = 4  # (2L + 1)**2 <= 225 pair symbols fit a byte


@functools.cache
def level_pair_values(half: int) -> np.ndarray:
    """uint16 output of each pair symbol of levels in [-half, half]: first level in the low byte."""
    a = 2 * half + 1
    lv = (np.arange(a) - half).astype(np.int8).view(np.uint8).astype(np.uint16)
    return (lv[:, None] | (lv[None, :] << 8)).reshape(-1).astype(np.uint16)


@functools.cache
def symbol_pair_values(alphabet: int) -> np.ndarray:
    """uint16 output of each pair symbol when the pair stands for two raw uint8 symbols."""
    a = np.arange(alphabet, dtype=np.uint16)
    return (a[:, None] | (a[None, :] << 8)).reshape(-1).astype(np.uint16)


@njit(cache=True, nogil=True)
def pair_symbols(levels, half, syms):  # type: ignore[no-untyped-def]  # pragma: no cover - jit
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
