"""numba building blocks the quantizers share (quantize.py, dither.py): the integer max-abs and
the scale it rounds up to, the fixed table of uniforms and the hash that draws a window of it,
and the rank mean's tile.

Stochastic rounding and subtractive dither both read their uniforms from one fixed table of
65,536 distinct 16-bit values at a random offset per chunk of 1,024 elements, rotated by a
random fraction (quantize.py's module docstring says why this beats a per-element hash). A
receiver that subtracts the sender's uniforms (dither) draws them with these same functions,
so both sides compute the same bits: no function here is compiled with fastmath.
"""

from __future__ import annotations

import hashlib
import importlib.resources

import numpy as np
from numba import njit

from tail_ray.compression.grid import MAX_SCALE_BITS, SCALE_LOW_MASK

__all__ = [
    "CHUNK",
    "GOLDEN",
    "MEAN_TILE",
    "TABLE_SIZE",
    "UNIFORM_TABLE",
    "absmax",
    "bucket_scale_bits",
    "chunk_draw",
    "scale_bits_up",
    "splitmix",
    "uniform",
]

_U16 = 1.0 / (1 << 16)
TABLE_SIZE = 1 << 16
CHUNK = 1024  # elements per random table offset
# A random permutation of 0..65535 (numpy's default_rng(0x7A11).permutation, made once and
# shipped as package data: the receiver of a dithered layer must draw the sender's very
# uniforms, and numpy does not promise a Generator's stream across its versions), stored
# twice so any window of CHUNK elements starting below 65536 is contiguous; see
# quantize._round_bucket for how a window becomes uniforms.
_TABLE_FILE = "uniform_table.u16"
_TABLE_SHA256 = "8feef5d94da028aea06a66a954e93a70867a677cb408aeb89428ffbc79ace9b1"


def _load_table() -> np.ndarray:
    raw = (importlib.resources.files("tail_ray.compression") / _TABLE_FILE).read_bytes()
    if hashlib.sha256(raw).hexdigest() != _TABLE_SHA256:
        raise RuntimeError(
            f"tail_ray/compression/{_TABLE_FILE} is not the table every rank draws its uniforms "
            "from (checksum mismatch): reinstall tail-ray"
        )
    return np.frombuffer(raw, dtype="<u2").astype(np.uint16)


_TABLE = _load_table()
UNIFORM_TABLE = np.concatenate([_TABLE, _TABLE])
# The splitmix64 increment: a chunk's hash state is the previous one plus this.
GOLDEN = 0x9E3779B97F4A7C15
# Elements the fused rank means work on at a time: their float64 accumulator stays in L1.
MEAN_TILE = 2048


@njit(cache=True, nogil=True)
def absmax(x):  # type: ignore[no-untyped-def]
    # For non-negative floats the bit patterns order like the values, so the max-abs is an
    # integer max of (bits & 0x7FFFFFFF): LLVM vectorizes that, but not a float max.
    u = x.view(np.int32)
    m = np.int32(0)
    for i in range(u.size):
        m = max(m, u[i] & np.int32(0x7FFFFFFF))
    return m


@njit(cache=True, nogil=True, inline="always")
def scale_bits_up(m):  # type: ignore[no-untyped-def]
    """The bits of a finite max-abs (``absmax``'s int32) rounded up onto the 16-bit scale grid
    (grid.py), clamped to its largest finite value: a whole-integer round-up, the same on every
    CPU and in the Triton kernels."""
    b = min(np.int64(m), np.int64(MAX_SCALE_BITS))
    return np.int32((b + SCALE_LOW_MASK) & ~np.int64(SCALE_LOW_MASK))


@njit(cache=True, nogil=True)
def bucket_scale_bits(x):  # type: ignore[no-untyped-def]
    """The int32 bits of a bucket's scale: its max-abs, rounded up onto the scale grid."""
    return scale_bits_up(absmax(x))


@njit(cache=True, nogil=True, inline="always")
def splitmix(h):  # type: ignore[no-untyped-def]
    z = h
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(cache=True, nogil=True, inline="always")
def chunk_draw(h):  # type: ignore[no-untyped-def]
    """(table offset, rotation) of one chunk from the running hash state ``h``."""
    z = splitmix(h)
    off = np.int64(z & np.uint64(TABLE_SIZE - 1))
    # A random rotation of the whole window, u = frac(t / 65536 + r) with r uniform on
    # [0, 1) from the hash's top 24 bits (Cranley-Patterson): for any table entry t, u is
    # then uniform on [0, 1), so the rounding is unbiased whatever the table or offset.
    rot = np.float32(np.int64(z >> np.uint64(40))) * np.float32(1.0 / (1 << 24))
    return off, rot


@njit(cache=True, nogil=True, inline="always")
def uniform(t, rot):  # type: ignore[no-untyped-def]
    """u = frac(t / 65536 + rot) in float32, each operation rounded: the sender's and the
    receiver's u are the same bits."""
    u = np.float32(t) * np.float32(_U16) + rot
    return u - np.float32(1.0) if u >= np.float32(1.0) else u
