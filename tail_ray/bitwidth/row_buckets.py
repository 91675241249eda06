"""Buckets cut on row edges for layers with all-zero rows (dithered layers only).

Subtractive dither decodes every element of a bucket with a non-zero max as (level + 1/2 - u)
x step: an element whose gradient is exactly zero receives up to half a step of noise. Where a
whole row of a matrix has no gradient (an embedding's tokens absent from the batch, a dead
unit) and shares its bucket with a row that has one, the receiver's optimizer sees noise for
parameters nothing asked to move, and Adam turns it into full-size steps. A bucket that holds
only such rows has a zero max and decodes to exactly zero, so these layers' buckets are cut on
row edges: the largest divisor of the row length not above the base bucket. Only where at
least MIN_ZERO_ROW_SHARE of the rows are zero: a few dead units in a dense layer (3-7 of the
char LM's 512 in one block) would make every bucket of the layer smaller, and at the same bits
a smaller bucket codes more bytes (4 % more of the LM's payload, measured), to spare 1 % of
its rows some noise. Nearest rounding decodes a zero as zero and needs none of this.
"""

from __future__ import annotations

import numpy as np

from tail_ray.compression.lowrank import matrix_shape

# Below this many elements a bucket's 2-byte scale costs over a quarter of a bit per element.
MIN_ROW_BUCKET = 64
# Row buckets where at least this share of a layer's rows is zero: an embedding's absent
# tokens (the char LM: 75-80 % of its rows in a batch), not a dense layer's dead units.
MIN_ZERO_ROW_SHARE = 0.125
SAMPLE_ROWS = 32  # rows read to judge the share (zero_row_share)
_PREFIX = 8  # elements of a row read before the whole row
_GOLDEN = np.uint64(0x9E3779B1)  # 2^32 / golden ratio: consecutive multiples spread over any range


def row_length(shape: tuple[int, ...] | None) -> int | None:
    """Elements per row of a parameter of ``shape`` seen as low-rank sees it as a matrix
    (``matrix_shape``: an embedding's width, a linear layer's inputs, a conv filter's
    in x kh x kw); None for vectors, scalars and one-row matrices."""
    matrix = matrix_shape(shape) if shape is not None else None
    if matrix is None or matrix[0] < 2 or matrix[1] == 0:
        return None
    return matrix[1]


def row_bucket(row_len: int | None, bucket_size: int) -> int | None:
    """The bucket cut on row edges for rows of ``row_len``: the largest divisor of it not above
    ``bucket_size`` and not below MIN_ROW_BUCKET. None where the base bucket already never
    straddles rows (it divides the row length) or no such divisor exists."""
    if row_len is None or row_len % bucket_size == 0:
        return None
    for size in range(min(row_len, bucket_size), MIN_ROW_BUCKET - 1, -1):
        if row_len % size == 0:
            return size
    return None


def zero_row_share(g: np.ndarray, row_len: int) -> float:
    """The share of the flat gradient ``g``'s rows that are all zeros (-0.0 counts as zero),
    read on at most SAMPLE_ROWS rows picked by Fibonacci hashing of their index (the same rows
    on every CPU and run, and no period for a layout to line up with, as a plain stride has:
    every 8th token of an embedding may well be the 8th of a pattern); 0 where ``g`` is not a
    whole number of rows.

    Reading the whole layer at every decision cost the char LM ~17 us a step of deciding
    (+0.46 points of its share of compress time); the threshold it is held to
    (MIN_ZERO_ROW_SHARE) is far from both kinds of layer it separates, so a sample tells them
    apart. A row's first elements are read first: a row with a gradient almost always has one
    there, so only the rest are read in full."""
    if g.size % row_len or g.size == 0:
        return 0.0
    rows = g.reshape(-1, row_len)
    if rows.shape[0] > SAMPLE_ROWS:
        rows = rows[(np.arange(SAMPLE_ROWS, dtype=np.uint64) * _GOLDEN) % np.uint64(rows.shape[0])]
    maybe_zero = ~rows[:, :_PREFIX].any(axis=1)
    if not maybe_zero.any():
        return 0.0
    return float(np.count_nonzero(~rows[maybe_zero].any(axis=1))) / rows.shape[0]
