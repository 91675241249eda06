"""Closed-form quantization error, estimated without quantizing anything.

For stochastic rounding onto the grid {k * s / L} an element x (f = frac(|x| * L / s)) is
rounded up with probability f, so its expected squared error is (s / L)^2 * f * (1 - f). Summed
over a layer and divided by ||x||^2 this is nu_b, the expected relative quantization error
E||Q_b(x) - x||^2 / ||x||^2 at b bits.

Approximate computing: instead of all buckets, a random handful of whole buckets (a few
thousand elements) gives an unbiased estimate of both sums (each sampled bucket has its exact
scale), so the decision costs microseconds. ``bucket_errors`` computes the same sums over any
set of buckets, so the exact value is the same call with every bucket.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, fastmath=True)
def _bucket_error_sums(g, e, use_e, bucket_size, bucket_ids, lmaxes, num):  # type: ignore[no-untyped-def]
    """num[j] += sum over chosen buckets of (s/L_j)^2 f(1-f); returns sum of x^2 over them."""
    n = g.size
    den = 0.0
    for t in range(bucket_ids.size):
        k = bucket_ids[t]
        lo = k * bucket_size
        hi = min(n, lo + bucket_size)
        m = np.float32(0.0)
        sq = 0.0
        for i in range(lo, hi):
            x = g[i] + e[i] if use_e else g[i]
            a = abs(x)
            m = max(m, a)
            sq += np.float64(x) * np.float64(x)
        den += sq
        if m == 0:
            continue
        for j in range(lmaxes.size):
            lf = np.float32(lmaxes[j])
            inv = lf / m
            acc = 0.0
            for i in range(lo, hi):
                x = g[i] + e[i] if use_e else g[i]
                y = abs(x) * inv
                f = y - np.floor(y)
                acc += np.float64(f * (1 - f))
            step = np.float64(m) / np.float64(lf)
            num[j] += step * step * acc
    return den


def bucket_errors(
    g: np.ndarray,
    residual: np.ndarray | None,
    bucket_size: int,
    bucket_ids: np.ndarray,
    candidate_bits: tuple[int, ...],
) -> tuple[np.ndarray, float]:
    """(sum of expected squared errors per candidate bits, sum of squares) over ``bucket_ids``.

    The values are those of g + residual (or g alone when residual is None).
    """
    lmaxes = np.array([(1 << (b - 1)) - 1 if b > 1 else 1 for b in candidate_bits], dtype=np.int64)
    num = np.zeros(len(candidate_bits), dtype=np.float64)
    e = residual if residual is not None else g
    den = _bucket_error_sums(g, e, residual is not None, bucket_size, bucket_ids, lmaxes, num)
    return num, float(den)


def relative_errors(
    g: np.ndarray,
    residual: np.ndarray | None,
    bucket_size: int,
    candidate_bits: tuple[int, ...],
    *,
    sample_numel: int | None,
    rng: np.random.Generator,
) -> np.ndarray:
    """Estimated nu_b for each candidate b: exact when ``sample_numel`` is None or covers the
    layer, otherwise from ``ceil(sample_numel / bucket_size)`` whole buckets drawn at random."""
    nb = -(-g.size // bucket_size)
    if sample_numel is None or sample_numel >= g.size:
        ids = np.arange(nb, dtype=np.int64)
    else:
        k = max(1, -(-sample_numel // bucket_size))
        ids = np.sort(rng.choice(nb, size=min(k, nb), replace=False)).astype(np.int64)
    num, den = bucket_errors(g, residual, bucket_size, ids, candidate_bits)
    if den <= 0.0:
        return np.zeros(len(candidate_bits), dtype=np.float64)
    return num / den
