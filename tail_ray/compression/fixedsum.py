"""Float sums whose bits do not depend on the CPU that runs them.

A reduction compiled with ``fastmath`` (``reassoc``) is vectorized at the target's width:
16 float32 lanes with AVX-512, 8 with AVX2, 4 with SSE2 or NEON, and LLVM picks the unroll
factor per CPU too. Each of those adds the elements in a different order, so the same input
gives a different last bit on different machines; through the controller's thresholds such
a bit can change a decision, and so the payload. A strict left-to-right sum is the same
everywhere but does not vectorize at all.

The sums here use a fixed layout instead: element i goes to lane ``i % LANES`` (the tail of
a slice starts again at lane 0), each lane adds in index order, and the lanes are combined by
a fixed pairwise tree. Each lane's chain is independent, so LLVM vectorizes the lane loop
without any reassociation (and without ``contract``: a product is rounded before it is
added, never fused), at whatever width the CPU has: same bits, near-fastmath speed.

Squares are summed in float64: |x| up to 3.4e38 (float32's max) squares to 1.2e77, far from
float64's limit, so a huge but finite layer gives a finite norm.
"""

# numba kernels: numpy scalars stand for machine ints inside @njit; numba types them, not mypy.
# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

import numpy as np
from numba import njit

# 64 float64 lanes: eight 512-bit or sixteen 256-bit registers, so every ISA fills whole
# vectors; measured here, as fast as the fastmath loop on 1M elements.
LANES = 64


def new_lanes() -> np.ndarray:
    """A zeroed lane accumulator for ``add_squares`` / ``lanes_total``."""
    return np.zeros(LANES, np.float64)


@njit(cache=True, nogil=True, inline="always")
def add_squares(x, lanes):  # pragma: no cover - jit
    """lanes[i % LANES] += float64(x[i])^2 over x in index order (the tail restarts at lane 0)."""
    n = x.size
    n_full = n - n % LANES
    for lo in range(0, n_full, LANES):
        xb = x[lo : lo + LANES]
        for j in range(LANES):
            v = np.float64(xb[j])
            lanes[j] += v * v
    for i in range(n_full, n):
        v = np.float64(x[i])
        lanes[i - n_full] += v * v


@njit(cache=True, nogil=True)
def lanes_total(lanes):  # pragma: no cover - jit
    """The lanes combined by a fixed pairwise tree (lanes.size is a power of two)."""
    t = lanes.copy()
    w = t.size
    while w > 1:
        w //= 2
        for j in range(w):
            t[j] = t[j] + t[j + w]
    return t[0]


@njit(cache=True, nogil=True)
def sum_squares(x) -> float:  # pragma: no cover - jit
    """Sum of squares in float64, the same bits on every CPU: NaN/Inf when any element is."""
    lanes = np.zeros(LANES, np.float64)
    add_squares(x, lanes)
    return lanes_total(lanes)


def sum_squares_reference(x: np.ndarray) -> float:
    """``sum_squares`` in plain numpy (elementwise IEEE operations only), for tests."""
    v = np.asarray(x, dtype=np.float64).reshape(-1)
    lanes = np.zeros(LANES, np.float64)
    n_full = v.size - v.size % LANES
    for lo in range(0, n_full, LANES):
        lanes += v[lo : lo + LANES] * v[lo : lo + LANES]
    tail = v[n_full:]
    lanes[: tail.size] += tail * tail
    w = LANES
    while w > 1:
        w //= 2
        lanes[:w] = lanes[:w] + lanes[w : 2 * w]
    return float(lanes[0])


@njit(cache=True, nogil=True, inline="always")
def add_spread_sample(lanes, j, values, t, total):  # pragma: no cover - jit
    """One sampled element j of W ranks' decoded values (``values[:, t]``, float64, rank order),
    whose rank-order sum is ``total``, into lane j % LANES of the three peer-spread sums
    (peer_spread.py): lanes[0] += sum_r (v_r - m)^2, lanes[1] += sum_r v_r^2, lanes[2] += m^2,
    m = total / W."""
    world = values.shape[0]
    m = total / np.float64(world)
    dev = np.float64(0.0)
    sq = np.float64(0.0)
    for r in range(world):
        v = values[r, t]
        d = v - m
        dev += d * d
        sq += v * v
    lane = j % LANES
    lanes[0, lane] += dev
    lanes[1, lane] += sq
    lanes[2, lane] += m * m


@njit(cache=True, nogil=True, inline="always")
def first_sample(lo, stride):  # pragma: no cover - jit
    """The first element at or after ``lo`` that a sample of every ``stride``-th element takes."""
    return (lo + stride - 1) // stride * stride


@njit(cache=True, nogil=True, inline="always")
def add_spread_segment(lanes, samp, buf, lo, hi, stride):  # pragma: no cover - jit
    """The sampled elements of one segment [lo, hi) of a fused rank mean: ``samp[r, t]`` holds rank
    r's value at the segment's t-th sampled element, ``buf`` the rank-order sums of the segment."""
    first = first_sample(lo, stride)
    j0 = first // stride  # the sample index of the segment's first sampled element
    for t, p in enumerate(range(first, hi, stride)):
        add_spread_sample(lanes, j0 + t, samp, t, buf[p - lo])


@njit(cache=True, nogil=True, inline="always")
def spread_totals_into(lanes, sums):  # pragma: no cover - jit
    """sums[k] = lanes_total(lanes[k]) for the three peer-spread sums."""
    for k in range(3):
        sums[k] = lanes_total(lanes[k])
