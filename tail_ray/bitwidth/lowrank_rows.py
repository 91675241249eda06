"""Low-rank's rows left behind: does the typical row get its own gradient?

The low-rank chooser holds a layer's residual ratio ||e||^2 / ||g||^2 to the quantizer's
(lowrank_choice.py). That ratio is the whole layer's, so the rows with the largest gradients
rule it. A matrix whose rows differ by orders of magnitude (an LM's output layer: a row per
vocabulary entry, the rare ones' gradients ~1000x smaller) meets it while its small rows are
not sent at all: P, the factor with a row per row, is quantized at 8 bits with one max-abs
scale per 512 values, and a small row's entries fall below a step of that grid. They get
stochastic rounding's noise instead of their gradient, and the gradient piles up in e (the
LM's head.weight at rank 16: the median row's ||e_row||^2 / ||g_row||^2 was 1 after one
step, 14 after two, 35 after five; with unquantized factors it stays under 0.8).

SGD with momentum averages such noise and bursts into the same steps. Adam does not: their
squares inflate its second moment v, and the row's steps shrink for ~1/(1 - beta2) steps.
``jobs.optimizer_study`` on the LM: head.weight's v 44x the true one's for the median
coordinate, its step along the true step 0.45 (quantized: 0.93); docs/engine.md "Low-rank
and the rows it leaves behind".

So the chooser looks at rows twice; "the typical row" is more than half of the rows:

- at a trial, ``rows_lost_share``: the rows whose expected rounding error in P's grid exceeds
  their own energy in P. Over half: the trial fails (at step 60 of the captured gradients:
  head.weight's median row 4.9x, every other LM and digits matrix's under 0.001x). A
  failed trial costs nothing; a stint of two steps left Adam's v of those rows inflated for
  the rest of a 300-step run.
- while low-rank, ``rows_behind_share``: the rows holding back more than ``ROWS_BEHIND_LIMIT``
  times their squared gradient of the step, for what the trial cannot see (rows the rank
  itself drops). Over half, from a stint's ``ROWS_CHECK_STEPS``-th step on and every
  ``ROWS_CHECK_EVERY`` steps after, counts as the layer's ratio past its limit does.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tail_ray.compression.fixedsum import LANES, add_squares, lanes_total

# A row is behind when it holds back more than its whole gradient of the step (squared ratio
# 1). Per-step traces of the median row (docs/engine.md): the layers that stay low-rank
# 0.01-0.7 at every step (digits' fc1 at ranks 8-16, the LM's attention matrices); the
# starved head.weight 14 after two steps and 35 after five; digits' fc1 at rank 2, which then
# needs a higher rank, 1.4-5.5.
ROWS_BEHIND_LIMIT = 1.0
# From a stint's second step: a starved row is over the limit after two steps, and each
# starved step stays in Adam's second moment for ~1/(1 - beta2) steps. Then every 5 steps:
# each check reads the layer's e and g once more (~20 us per 65k elements).
ROWS_CHECK_STEPS = 2
ROWS_CHECK_EVERY = 5


def checks_rows_at(steps_in_mode: int) -> bool:
    """Whether the ``steps_in_mode``-th step of a low-rank stint checks its rows."""
    return steps_in_mode >= ROWS_CHECK_STEPS and (steps_in_mode - ROWS_CHECK_STEPS) % ROWS_CHECK_EVERY == 0


@njit(cache=True, nogil=True)
def _rows_behind_count(e, g, rows, cols, limit):  # type: ignore[no-untyped-def]  # pragma: no cover - jit
    """Rows with ||e_row||^2 > limit * ||g_row||^2 (a row with no gradient: behind if it holds
    anything back). Fixed-order sums (fixedsum.py): the same count on every CPU."""
    lanes_e = np.zeros(LANES, np.float64)
    lanes_g = np.zeros(LANES, np.float64)
    count = 0
    for r in range(rows):
        lanes_e[:] = 0.0
        lanes_g[:] = 0.0
        add_squares(e[r * cols : (r + 1) * cols], lanes_e)
        add_squares(g[r * cols : (r + 1) * cols], lanes_g)
        e_sq, g_sq = lanes_total(lanes_e), lanes_total(lanes_g)
        if e_sq > limit * g_sq or (g_sq == 0.0 and e_sq > 0.0) or e_sq != e_sq:
            count += 1
    return count


def rows_behind_share(residual: np.ndarray, grad: np.ndarray, rows: int, cols: int) -> float:
    """The share of rows (flat float32 arrays viewed as rows x cols) holding back more than
    ``ROWS_BEHIND_LIMIT`` times their squared gradient (a NaN row counts as behind)."""
    return _rows_behind_count(residual, grad, rows, cols, ROWS_BEHIND_LIMIT) / rows


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
        if noise[i] > energy[i] or energy[i] != energy[i]:  # no energy: nothing to lose
            count += 1
    return count


def rows_lost_share(p: np.ndarray, bits: int, bucket_size: int) -> float:
    """The share of P's rows (rows x rank) that its ``bits``-bit grid would give more rounding
    noise than signal."""
    rows, rank = p.shape
    pt = np.ascontiguousarray(p.T, dtype=np.float32).reshape(-1)
    return _rows_lost_count(pt, rows, rank, bucket_size, float(2 ** (bits - 1) - 1)) / rows


def warm_rows() -> None:
    """Both kernels once on tiny inputs, at hook set-up: their first call loads them from
    numba's cache (or compiles them, ~0.5 s), which would otherwise land in a trial."""
    x = np.ones(8, np.float32)
    rows_behind_share(x, x, 2, 4)
    rows_lost_share(x.reshape(4, 2), 8, 4)
