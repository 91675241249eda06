"""Bucketed max-abs stochastic quantization, fused with error feedback.

One layer's compensated gradient g' = g + e is split into buckets of ``bucket_size``
elements; bucket k gets the scale s_k = max |g'| over the bucket, and every element maps to
a signed integer level in [-L, L], L = 2^(bits-1) - 1, by stochastic rounding:

    level = sign(x) * floor(|x| * L / s + u),   u ~ U[0, 1)

which is unbiased (E[level * s / L] = x) and never leaves [-L, L]. Dequantization is
``level * s / L``.

Speed: per bucket, three short loops that LLVM vectorizes (e <- g + e; an integer max-abs;
the rounding, which also writes the new residual over e and counts non-zero levels), so the
buffer crosses memory once: read g and e, write the int8 levels and the residual. The
uniforms come from a fixed table of 65,536 distinct 16-bit values read at a random offset
(splitmix64 of the per-call seed) for every chunk of 1,024 elements: a contiguous vector load
instead of a per-element hash (64-bit multiplies do not vectorize well), 1.6x faster, and
still exactly unbiased thanks to a random rotation per chunk.

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

_U16 = 1.0 / (1 << 16)
_TABLE_SIZE = 1 << 16
_CHUNK = 1024  # elements per random table offset
# A random permutation of 0..65535, stored twice so any window of _CHUNK elements starting
# below 65536 is contiguous; see _round_bucket for how a window becomes uniforms.
_TABLE = np.random.default_rng(0x7A11).permutation(_TABLE_SIZE).astype(np.uint16)
UNIFORM_TABLE = np.concatenate([_TABLE, _TABLE])


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


@njit(cache=True, nogil=True, inline="always")
def _splitmix(h):  # type: ignore[no-untyped-def]
    z = h
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(cache=True, nogil=True, fastmath=True)
def _round_chunk(xb, lb, ub, rot, inv, step, lf, write_e):  # type: ignore[no-untyped-def]
    """Stochastically round xb into levels lb with uniforms from table window ub, rotated by rot.

    xb becomes the residual x - level * step when write_e. Returns the non-zero level count
    (accumulated in float32, exact for chunks below 2^24, because an integer select-count
    stops LLVM from vectorizing this loop) and the squared rounding error of the chunk.
    """
    cnt = np.float32(0.0)
    err = np.float32(0.0)
    for i in range(xb.size):
        x = xb[i]
        u = np.float32(ub[i]) * np.float32(_U16) + rot
        u = u - np.float32(1.0) if u >= np.float32(1.0) else u
        # Truncation equals floor here because the argument is >= 0.
        q = np.float32(np.int32(abs(x) * inv + u))
        q = min(q, lf)
        cnt += min(q, np.float32(1.0))
        lv = q if x >= 0 else -q
        lb[i] = np.int8(np.int32(lv))
        r = x - lv * step
        err += r * r
        if write_e:
            xb[i] = r
    return np.int64(cnt), np.float64(err)


@njit(cache=True, nogil=True)
def _round_bucket(xb, lb, tab, h, inv, step, lf, write_e):  # type: ignore[no-untyped-def]
    """Round one bucket chunk by chunk; each chunk reads the table at a fresh random offset.

    ``h`` is the running splitmix64 state; returns (nnz, squared rounding error, new state).
    """
    cnt = 0
    err = 0.0
    for lo in range(0, xb.size, _CHUNK):
        hi = min(xb.size, lo + _CHUNK)
        h = h + np.uint64(0x9E3779B97F4A7C15)
        z = _splitmix(h)
        off = np.int64(z & np.uint64(_TABLE_SIZE - 1))
        # A random rotation of the whole window, u = frac(t / 65536 + r) with r uniform on
        # [0, 1) from the hash's top 24 bits (Cranley-Patterson): for any table entry t, u is
        # then uniform on [0, 1), so the rounding is unbiased whatever the table or offset.
        rot = np.float32(np.int64(z >> np.uint64(40))) * np.float32(1.0 / (1 << 24))
        c, e2 = _round_chunk(xb[lo:hi], lb[lo:hi], tab[off : off + (hi - lo)], rot, inv, step, lf, write_e)
        cnt += c
        err += e2
    return cnt, err, h


@njit(cache=True, nogil=True, fastmath=True)
def _quantize_ef_core(g, e, bucket_size, lmax, seed, levels, scales, tab):  # type: ignore[no-untyped-def]
    """e <- g + e, quantized bucket by bucket; e ends as the new residual.

    Returns (nnz, ||new residual||^2).

    The caller guarantees g is finite (fastmath assumes it).
    """
    n = g.size
    nb = (n + bucket_size - 1) // bucket_size
    lf = np.float32(lmax)
    h = np.uint64(seed)
    nnz = 0
    err = 0.0
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
        cnt, e2, h = _round_bucket(eb, lb, tab, h, lf / m, m / lf, lf, True)
        nnz += cnt
        err += e2
    return nnz, err


@njit(cache=True, nogil=True, fastmath=True)
def _quantize_core(x, bucket_size, lmax, seed, levels, scales, tab):  # type: ignore[no-untyped-def]
    """Quantize x (left unchanged) into levels and scales. Returns (nnz, squared error)."""
    n = x.size
    nb = (n + bucket_size - 1) // bucket_size
    lf = np.float32(lmax)
    h = np.uint64(seed)
    nnz = 0
    err = 0.0
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
        cnt, e2, h = _round_bucket(xb, lb, tab, h, lf / m, m / lf, lf, False)
        nnz += cnt
        err += e2
    return nnz, err


def quantize_finite(
    g: np.ndarray,
    residual: np.ndarray | None,
    bits: int,
    bucket_size: int,
    seed: int,
    levels: np.ndarray,
    scales: np.ndarray,
) -> tuple[int, float]:
    """The kernel without the finiteness check, for callers that already ran ``sum_squares(g)``.

    Quantizes g (+ residual, which then becomes the new residual) into ``levels``/``scales``
    and returns (non-zero level count, squared rounding error = ||new residual||^2 with error
    feedback). g MUST be finite: the kernel assumes it.
    """
    lmax = levels_max(bits)
    if residual is None:
        nnz, err = _quantize_core(g, bucket_size, lmax, seed, levels, scales, UNIFORM_TABLE)
    else:
        nnz, err = _quantize_ef_core(g, residual, bucket_size, lmax, seed, levels, scales, UNIFORM_TABLE)
    return int(nnz), float(err)


def quantize(
    x: np.ndarray, bits: int, bucket_size: int, seed: int, levels: np.ndarray, scales: np.ndarray
) -> int:
    """Stochastically quantize ``x`` (no error feedback); fill ``levels``/``scales``; return nnz."""
    if not math.isfinite(float(sum_squares(x))):
        raise ValueError("quantize() needs finite input; send non-finite layers raw")
    return int(_quantize_core(x, bucket_size, levels_max(bits), seed, levels, scales, UNIFORM_TABLE)[0])


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
    nnz, _ = _quantize_ef_core(
        g, residual, bucket_size, levels_max(bits), seed, levels, scales, UNIFORM_TABLE
    )
    return int(nnz), ss


@njit(cache=True, nogil=True, fastmath=True)
def _dequantize_core(levels, scales, bucket_size, lmax, out):  # type: ignore[no-untyped-def]
    n = levels.size
    nb = (n + bucket_size - 1) // bucket_size
    inv = np.float32(1.0) / np.float32(lmax)
    for k in range(nb):
        lo = k * bucket_size
        hi = min(n, lo + bucket_size)
        # scale * (1 / L), written out: it is what fastmath made of the former scale / L (so
        # decoded values are unchanged), and ``mean_dequantized_into`` must reproduce it exactly.
        step = scales[k] * inv
        lb = levels[lo:hi]
        ob = out[lo:hi]
        for i in range(lb.size):
            ob[i] = np.float32(lb[i]) * step


def dequantize(levels: np.ndarray, scales: np.ndarray, bits: int, bucket_size: int) -> np.ndarray:
    """``level * scale / L`` as a new flat float32 array."""
    out = np.empty(levels.size, np.float32)
    _dequantize_core(levels, scales.astype(np.float32, copy=False), bucket_size, levels_max(bits), out)
    return out


# Elements the fused mean works on at a time: its float32 accumulator stays in L1.
_MEAN_TILE = 4096


@njit(cache=True, nogil=True)
def _mean_dequantized_core(levels_t, steps_t, bucket_sizes, out):  # type: ignore[no-untyped-def]
    """out[i] = (sum over ranks r, in rank order, of levels_r[i] * steps_r[i // bucket_r]) / R.

    No fastmath on purpose: each product is rounded to float32 and added in rank order, then
    divided by R, exactly as dequantize -> clone -> add_ -> div_ did (no FMA contraction, no
    reciprocal for the division), so the mean is bit-identical to the unfused path.
    ``levels_t`` / ``steps_t`` are tuples (one array per rank, no stacking copy).
    """
    n = out.size
    world = len(levels_t)
    wf = np.float32(world)
    buf = np.empty(_MEAN_TILE, np.float32)
    lo = 0
    while lo < n:
        # The segment ends at the first bucket boundary of any rank (ranks may differ in
        # bucket size), so each rank has one step per segment.
        hi = min(n, lo + _MEAN_TILE)
        for r in range(world):
            bs = bucket_sizes[r]
            hi = min(hi, (lo // bs + 1) * bs)
        m = hi - lo
        for r in range(world):
            st = steps_t[r][lo // bucket_sizes[r]]
            lv = levels_t[r][lo:hi]
            if r == 0:
                for i in range(m):
                    buf[i] = np.float32(lv[i]) * st
            else:
                for i in range(m):
                    buf[i] = buf[i] + np.float32(lv[i]) * st
        ob = out[lo:hi]
        for i in range(m):
            ob[i] = buf[i] / wf
        lo = hi


def bucket_steps(scales: np.ndarray, bits: int) -> np.ndarray:
    """Per-bucket dequantization step ``scale * (1 / L)`` in float32, as ``dequantize`` uses."""
    inv = np.float32(1.0) / np.float32(levels_max(bits))
    return np.ascontiguousarray(scales, dtype=np.float32) * inv


def mean_dequantized_into(
    levels: list[np.ndarray],
    scales: list[np.ndarray],
    bits: list[int],
    bucket_sizes: list[int],
    out: np.ndarray,
) -> None:
    """Write the mean over ranks of ``dequantize(levels_r, scales_r, bits_r, bucket_r)`` into
    ``out`` (float32, numel long) in one pass, with no per-rank float32 array: bit-identical to
    dequantizing each rank, summing in rank order and dividing by the number of ranks.

    Sizes are checked here (the kernel does no bounds checks): every ``levels_r`` must have
    ``out.size`` elements and ``scales_r`` one scale per bucket; a ValueError otherwise.
    """
    lv = tuple(np.ascontiguousarray(x, dtype=np.int8).reshape(-1) for x in levels)
    st = tuple(bucket_steps(s, b) for s, b in zip(scales, bits, strict=True))
    for x, s, bs in zip(lv, st, bucket_sizes, strict=True):
        if x.size != out.size or bs < 1 or s.size != n_buckets(out.size, bs):
            raise ValueError(f"{x.size} levels / {s.size} scales of bucket {bs} for {out.size} elements")
    _mean_dequantized_core(lv, st, np.asarray(bucket_sizes, dtype=np.int64), out)
