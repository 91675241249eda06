"""Entropy bounds a lossless code is measured against (order-0, empirical, in bytes)."""

from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def byte_histogram(symbols: np.ndarray) -> np.ndarray:  # pragma: no cover - jit
    """Counts of each byte value of an int8/uint8 array (index = value & 0xFF)."""
    h = np.zeros((4, 256), dtype=np.int64)
    n = symbols.size
    n4 = n - (n & 3)
    for i in range(0, n4, 4):
        h[0, np.int64(symbols[i]) & 0xFF] += 1
        h[1, np.int64(symbols[i + 1]) & 0xFF] += 1
        h[2, np.int64(symbols[i + 2]) & 0xFF] += 1
        h[3, np.int64(symbols[i + 3]) & 0xFF] += 1
    for i in range(n4, n):
        h[0, np.int64(symbols[i]) & 0xFF] += 1
    return h[0] + h[1] + h[2] + h[3]


def entropy_bits(counts: np.ndarray) -> float:
    """n * H0 in bits for a histogram ``counts``."""
    c = np.asarray(counts, dtype=np.float64)
    c = c[c > 0]
    n = c.sum()
    if n == 0:
        return 0.0
    return float(-(c * np.log2(c / n)).sum())


def entropy_bound_bytes(levels: np.ndarray) -> float:
    """Order-0 empirical entropy of the symbols as sent densely: n * H0 / 8 bytes.

    No real code can beat this with a static per-layer model; Tail's payload is compared
    against it (plus the scales and header, which the caller adds).
    """
    lv = np.ascontiguousarray(levels)
    if lv.dtype not in (np.int8, np.uint8):
        raise TypeError(f"levels must be int8 or uint8, got {lv.dtype}")
    return entropy_bits(byte_histogram(lv.reshape(-1))) / 8.0


def sparse_entropy_bound_bytes(levels: np.ndarray) -> float:
    """The same bound split the sparse way: positions log2 C(n, nnz) + nnz * H0(non-zero levels).

    log2 C(n, k) <= n * Hb(k / n), so this is never above ``entropy_bound_bytes`` by more than
    rounding: sending positions cannot legitimately cost more than the dense zero/non-zero flags.
    """
    lv = np.ascontiguousarray(levels).reshape(-1)
    counts = byte_histogram(lv)
    n = int(lv.size)
    k = n - int(counts[0])
    counts = counts.copy()
    counts[0] = 0
    log2_choose = (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)
    return (log2_choose + entropy_bits(counts)) / 8.0
