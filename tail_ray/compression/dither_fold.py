"""The wire's sign fold of dithered levels: each level negated where its uniform is >= 1/2.

Why: a dithered level is floor(t + u), t = x L / s (dither.py). Most values of a gradient's
bucket are far below a step, and for those a non-zero level is +1 when u is near 1 and -1 when
u is near 0: its sign is all but fixed by u, which the receiver draws too. Coded as they are,
those signs cost about a bit each. Negated where u >= 1/2, the same levels mostly fall on one
side, and the entropy coder no longer pays for a sign the receiver could have guessed. The fold
is its own inverse and needs nothing but the seed the layer already carries: the receiver
unfolds with the same uniforms before anything else reads the levels.

It only reorders which symbol stands for which level, so the quantizer, its error, the rank
means and the controller see the levels exactly as before; only their entropy changes
(docs/engine.md, "The dither's sign fold on the wire").
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tail_ray.compression.dither import bucket_state
from tail_ray.compression.kernel_parts import CHUNK, GOLDEN, UNIFORM_TABLE, chunk_draw, uniform

__all__ = ["fold_levels"]


@njit(cache=True, nogil=True)
def _fold_chunk(lb, ob, tb, rot):  # type: ignore[no-untyped-def]
    """ob = -lb where the chunk's uniform is >= 1/2, else lb: branch-free (u is a coin flip)."""
    half = np.float32(0.5)
    for i in range(lb.size):
        flip = np.int32(uniform(tb[i], rot) >= half)
        ob[i] = np.int8(np.int32(lb[i]) * (np.int32(1) - np.int32(2) * flip))


@njit(cache=True, nogil=True)
def _fold_core(levels, out, bucket_size, seed, tab):  # type: ignore[no-untyped-def]
    """out = levels folded by the dither kernel's uniforms (bucket k's hash state, its chunks'
    table windows: dither.py)."""
    n = levels.size
    for k in range((n + bucket_size - 1) // bucket_size):
        lo = k * bucket_size
        hi = min(n, lo + bucket_size)
        h = bucket_state(seed, k)
        for c in range(lo, hi, CHUNK):
            d = min(hi, c + CHUNK)
            h = h + np.uint64(GOLDEN)
            off, rot = chunk_draw(h)
            _fold_chunk(levels[c:d], out[c:d], tab[off : off + (d - c)], rot)


def fold_levels(levels: np.ndarray, bucket_size: int, seed: int) -> np.ndarray:
    """The levels of a dithered layer (int8, two's complement in [-L, L]) folded by their
    uniforms: a new array. Applied twice it gives the levels back (folding and unfolding are
    the same map)."""
    src = np.ascontiguousarray(levels, dtype=np.int8).reshape(-1)
    out = np.empty_like(src)
    _fold_core(src, out, bucket_size, int(seed) & 0xFFFFFFFF, UNIFORM_TABLE)
    return out
