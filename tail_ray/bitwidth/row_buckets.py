"""Buckets cut on row edges for layers with all-zero rows (dithered layers only).

Subtractive dither decodes every element of a bucket with a non-zero max as (level + 1/2 - u)
x step: an element whose gradient is exactly zero receives up to half a step of noise. Where a
whole row of a matrix has no gradient (an embedding's tokens absent from the batch, a dead
unit) and shares its bucket with a row that has one, the receiver's optimizer sees noise for
parameters nothing asked to move, and Adam turns it into full-size steps. A bucket that holds
only such rows has a zero max and decodes to exactly zero, so these layers' buckets are cut on
row edges: the largest divisor of the row length not above the base bucket. Nearest rounding
decodes a zero as zero and needs none of this.
"""

from __future__ import annotations

import math

import numpy as np

# Below this many elements a bucket's 2-byte scale costs over a quarter of a bit per element.
MIN_ROW_BUCKET = 64


def row_length(shape: tuple[int, ...] | None) -> int | None:
    """Elements per row of a parameter of ``shape``: everything after its first dimension
    (an embedding's width, a linear layer's inputs, a conv filter's in x kh x kw); None for
    vectors and scalars."""
    if shape is None or len(shape) < 2 or shape[0] < 2:
        return None
    return math.prod(shape[1:]) or None


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


def has_zero_row(g: np.ndarray, row_len: int) -> bool:
    """Whether some row of the flat gradient ``g`` is all zeros (-0.0 counts as zero)."""
    if g.size % row_len:
        return False
    return bool((~g.reshape(-1, row_len).any(axis=1)).any())
