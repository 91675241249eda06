"""Bucketed max-abs stochastic quantization, fused with error feedback.

One layer's compensated gradient g' = g + e is split into buckets of ``bucket_size``
elements; bucket k gets the scale s_k = max |g'| over the bucket, and every element maps to
a signed integer level in [-L, L], L = 2^(bits-1) - 1, by stochastic rounding:

    level = sign(x) * floor(|x| * L / s + u),   u ~ U[0, 1)

which is unbiased (E[level * s / L] = x) and never leaves [-L, L]. Dequantization is
``level * s / L``.

Speed: the whole thing is one numba pass per bucket pair of loops (the bucket is still in
L1 when the second loop runs), so the buffer crosses memory once: read g and e, write the
int8 levels and the new residual in place of e. The random numbers come from a counter-based
hash (murmur3's finalizer of seed + element index), so every element is independent and the
loop vectorizes; there is no RNG state to carry between elements or calls.

Non-finite input: ``quantize_ef`` first checks the layer (one read of g, a float64 sum of
squares that also gives the norm) and, when any element is NaN/Inf, returns without touching
anything, so the caller can send that layer raw and keep the residual clean.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
from numba import njit

# Flags that let LLVM reorder float reductions (so they vectorize) while keeping NaN/Inf
# semantics, which the non-finite check relies on.
_REDUCE_FLAGS = {"reassoc", "nsz", "arcp", "contract"}

_U24 = 1.0 / (1 << 24)


def levels_max(bits: int) -> int:
    """L for ``bits``: the largest level magnitude (1 for 1 and 2 bits)."""
    return (1 << (bits - 1)) - 1 if bits > 1 else 1


def n_buckets(numel: int, bucket_size: int) -> int:
    return -(-numel // bucket_size)


def layer_seed(base_seed: int, step: int, name: str) -> int:
    """A 32-bit seed that differs per worker (base_seed), per call (step) and per layer."""
    h = (base_seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + zlib.crc32(name.encode())) & (
        (1 << 64) - 1
    )
    h ^= h >> 31
    return h & 0xFFFFFFFF


@njit(cache=True, nogil=True, fastmath=_REDUCE_FLAGS)
def sum_squares(x: np.ndarray) -> float:
    """Sum of squares in float64: NaN/Inf when any element is non-finite."""
    acc = 0.0
    for i in range(x.size):
        v = np.float64(x[i])
        acc += v * v
    return acc


@njit(cache=True, nogil=True, fastmath=True)
def _absmax(x):  # type: ignore[no-untyped-def]
    # For non-negative floats the bit patterns order like the values, so the max-abs is an
    # integer max of (bits & 0x7FFFFFFF): LLVM vectorizes that, but not a float max.
    u = x.view(np.int32)
    m = np.int32(0)
    for i in range(u.size):
        m = max(m, u[i] & np.int32(0x7FFFFFFF))
    return m


@njit(cache=True, nogil=True, fastmath=True)
def _round_bucket(xb, lb, base, seed, inv, step, lf, write_e):  # type: ignore[no-untyped-def]
    """Stochastically round one bucket xb into levels lb; xb becomes the residual when write_e."""
    cnt = 0
    for i in range(xb.size):
        x = xb[i]
        # Counter-based uniform in [0, 1): a 32-bit integer hash of (seed, element index),
        # independent per element, so this loop has no carried state and vectorizes.
        h = np.uint32(base + i) * np.uint32(0x9E3779B1) + seed
        h = np.uint32(h ^ (h >> np.uint32(15)))
        h = np.uint32(h * np.uint32(0x2C1B3C6D))
        h = np.uint32(h ^ (h >> np.uint32(12)))
        h = np.uint32(h * np.uint32(0x297A2D39))
        h = np.uint32(h ^ (h >> np.uint32(15)))
        u = np.float32(np.int32(h >> np.uint32(8))) * np.float32(_U24)
        # Truncation equals floor here because the argument is >= 0.
        q = np.float32(np.int32(abs(x) * inv + u))
        q = min(q, lf)
        lv = q if x >= 0 else -q
        lb[i] = np.int8(np.int32(lv))
        cnt += np.int32(1) if q != 0 else np.int32(0)
        if write_e:
            xb[i] = x - lv * step
    return cnt


@njit(cache=True, nogil=True, fastmath=True)
def _quantize_ef_core(g, e, bucket_size, lmax, seed, levels, scales):  # type: ignore[no-untyped-def]
    """e <- g + e, quantized bucket by bucket; e ends as the new residual. Returns nnz.

    The caller guarantees g is finite (fastmath assumes it).
    """
    n = g.size
    nb = (n + bucket_size - 1) // bucket_size
    lf = np.float32(lmax)
    s32 = np.uint32(seed)
    nnz = 0
    box = np.empty(1, np.int32)  # reinterprets the integer max as the float scale
    fbox = box.view(np.float32)
    for k in range(nb):
        lo = k * bucket_size
        hi = min(n, lo + bucket_size)
        gb = g[lo:hi]
        eb = e[lo:hi]
        for i in range(gb.size):
            eb[i] = gb[i] + eb[i]
        box[0] = _absmax(eb)
        m = fbox[0]
        scales[k] = m
        lb = levels[lo:hi]
        if m == 0:
            lb[:] = 0
            continue
        nnz += _round_bucket(eb, lb, lo, s32, lf / m, m / lf, lf, True)
    return nnz


@njit(cache=True, nogil=True, fastmath=True)
def _quantize_core(x, bucket_size, lmax, seed, levels, scales):  # type: ignore[no-untyped-def]
    """Quantize x (left unchanged) into levels and scales. Returns nnz."""
    n = x.size
    nb = (n + bucket_size - 1) // bucket_size
    lf = np.float32(lmax)
    s32 = np.uint32(seed)
    nnz = 0
    box = np.empty(1, np.int32)
    fbox = box.view(np.float32)
    for k in range(nb):
        lo = k * bucket_size
        hi = min(n, lo + bucket_size)
        xb = x[lo:hi]
        box[0] = _absmax(xb)
        m = fbox[0]
        scales[k] = m
        lb = levels[lo:hi]
        if m == 0:
            lb[:] = 0
            continue
        nnz += _round_bucket(xb, lb, lo, s32, lf / m, m / lf, lf, False)
    return nnz


def quantize(
    x: np.ndarray, bits: int, bucket_size: int, seed: int, levels: np.ndarray, scales: np.ndarray
) -> int:
    """Stochastically quantize ``x`` (no error feedback); fill ``levels``/``scales``; return nnz."""
    if not math.isfinite(float(sum_squares(x))):
        raise ValueError("quantize() needs finite input; send non-finite layers raw")
    return int(_quantize_core(x, bucket_size, levels_max(bits), seed, levels, scales))


def quantize_ef(
    g: np.ndarray,
    residual: np.ndarray,
    bits: int,
    bucket_size: int,
    seed: int,
    levels: np.ndarray,
    scales: np.ndarray,
) -> tuple[int, float]:
    """Quantize g + residual, writing the new residual (g + residual - decoded) in place.

    Returns (nnz, sum of squares of g). When g holds NaN/Inf, returns (-1, nan) and writes
    nothing: neither levels nor the residual are touched.
    """
    ss = float(sum_squares(g))
    if not math.isfinite(ss):
        return -1, ss
    nnz = _quantize_ef_core(g, residual, bucket_size, levels_max(bits), seed, levels, scales)
    return int(nnz), ss


@njit(cache=True, nogil=True, fastmath=True)
def _dequantize_core(levels, scales, bucket_size, lmax, out):  # type: ignore[no-untyped-def]
    n = levels.size
    nb = (n + bucket_size - 1) // bucket_size
    lf = np.float32(lmax)
    for k in range(nb):
        lo = k * bucket_size
        hi = min(n, lo + bucket_size)
        # Same float32 expression as the quantizer's residual update, so decoded + residual
        # reproduces the compensated gradient to one rounding.
        step = scales[k] / lf
        lb = levels[lo:hi]
        ob = out[lo:hi]
        for i in range(lb.size):
            ob[i] = np.float32(lb[i]) * step


def dequantize(levels: np.ndarray, scales: np.ndarray, bits: int, bucket_size: int) -> np.ndarray:
    """``level * scale / L`` as a new flat float32 array."""
    out = np.empty(levels.size, np.float32)
    _dequantize_core(levels, scales.astype(np.float32, copy=False), bucket_size, levels_max(bits), out)
    return out
