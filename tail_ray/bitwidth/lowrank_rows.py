"""Low-rank's rows left behind: would the typical row of P get its own gradient?

The low-rank chooser holds a layer's residual ratio ||e||^2 / ||g||^2 to the quantizer's
(lowrank_choice.py). That ratio is the whole layer's, so the rows with the largest gradients
rule it. A matrix whose rows differ by orders of magnitude (an LM's output layer: a row per
vocabulary entry, the rare ones' gradients ~1000x smaller) meets it while its small rows are
not sent at all: P, the factor with a row per row, is quantized at 8 bits with one max-abs
scale per 512 values, and a small row's entries fall below half a step of that grid. They
get stochastic rounding's noise instead of their gradient, and the gradient piles up in e
(the LM's head.weight at rank 16: the median row's ||e_row||^2 / ||g_row||^2 was 1 after one
step, 14 after two, 35 after five; with unquantized factors it stays under 0.8). Rows
outside the rank's subspace look the same in P: entries near zero.

SGD with momentum averages such noise and bursts into the same steps. Adam does not: their
squares inflate its second moment v, and the row's steps shrink for ~1/(1 - beta2) steps.
``jobs.optimizer_study`` on the LM: head.weight's v 44x the true one's for the median
coordinate, its step along the true step 0.45 (quantized: 0.93); docs/engine.md "Low-rank
and the rows it leaves behind".

So a trial that passes on the layer's ratio also computes the P its rank would send, and
fails when more than half of P's rows (``rows_lost_share``) would get more rounding noise
than signal (at step 60 of the captured gradients: head.weight's median row 4.9x, every
other LM and digits matrix's under 0.001x). Only at a trial: checked during a stint as well
(an earlier version), it also took digits' fc1 out of low-rank once most of its units had
gone quiet, which SGD does not mind (2 of 5 seeds at 17x instead of 33-40x).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _rows_lost_count(pt, rows, rank, bucket_size, lmax):  # type: ignore[no-untyped-def]  # pragma: no cover - jit
    """Rows of P (``pt``: P^T flat, rank x rows, as the record stores it) whose expected
    squared error of stochastic rounding to the factor's grid (one max-abs step per bucket of
    ``bucket_size``) exceeds their energy. Sequential float64 sums: the same on every CPU."""
    n = pt.size
    n_buckets = (n + bucket_size - 1) // bucket_size
    step = np.empty(n_buckets, np.float64)
    for b in range(n_buckets):
        top = 0.0
        for i in range(b * bucket_size, min(n, (b + 1) * bucket_size)):
            top = max(top, abs(np.float64(pt[i])))
        step[b] = top / lmax
    noise = np.zeros(rows, np.float64)
    energy = np.zeros(rows, np.float64)
    for c in range(rank):
        for i in range(rows):
            k = c * rows + i
            x = abs(np.float64(pt[k]))
            d = step[k // bucket_size]
            energy[i] += x * x
            if d > 0:
                f = x / d
                f -= np.floor(f)
                noise[i] += d * d * f * (1.0 - f)  # stochastic rounding's variance
    count = 0
    for i in range(rows):
        # A row with no energy has nothing to lose (0 > 0 is False); a NaN row counts as lost.
        if noise[i] > energy[i] or energy[i] != energy[i]:
            count += 1
    return count


def rows_lost_share(p: np.ndarray, bits: int, bucket_size: int) -> float:
    """The share of P's rows (rows x rank) that its ``bits``-bit grid would give more rounding
    noise than signal."""
    rows, rank = p.shape
    pt = np.ascontiguousarray(p.T, dtype=np.float32).reshape(-1)
    return _rows_lost_count(pt, rows, rank, bucket_size, float(2 ** (bits - 1) - 1)) / rows


def warm_rows() -> None:
    """The kernel once on a tiny input, at hook set-up: its first call loads it from numba's
    cache (or compiles it, ~0.5 s), which would otherwise land in a trial."""
    rows_lost_share(np.ones((4, 2), np.float32), 8, 4)
