"""The quantization grid, defined once: L, the step, the reference dequantizer, the rank mean.

A layer quantized at ``bits`` has integer levels in [-L, L], L = 2^(bits-1) - 1, and one
scale s per bucket (the bucket's max |x|, rounded UP onto the 16-bit scale grid below). Its
decoded value is, in float32 with every operation rounded on its own (IEEE round-to-nearest,
no fused multiply-add):

    step  = s * (1 / L)          the bucket's grid step; 1 / L is itself rounded to float32
    value = float32(level) * step

and the mean over R ranks of a layer is their values added in rank order in float64, then
divided by R in float64, then rounded to float32:

    mean  = float32((v_0 + v_1 + ... + v_{R-1}) / R)

These are the only definitions. The numba kernels (``quantize.dequantize``, the fused
decode-average ``rank_mean.mean_dequantized_into``, the controller's sampled view
``record_tensors.sample_stack``, the quantizer's error-feedback residual x - value) compute exactly
these operations, none of them compiled with fastmath, so LLVM may neither reassociate nor
contract them and the bits are the same on every CPU (AVX-512, AVX2, plain x86-64, aarch64);
tests/compression/test_grid.py checks each kernel against the numpy functions below, also
with numba compiling for other CPUs.

Why this form: ``s * (1 / L)`` (not ``s / L``) never overflows: L * step stays finite for
every finite s, up to float32's max (``s / L`` rounds up past it for L = 31 and 127), so a
huge finite gradient decodes to a finite value. The mean in float64 cannot overflow either
(R values of up to 3.4e38 each), and its rounded result is at most the largest |value|.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MIN_BITS = 2
MAX_BITS = 8

F32_MAX = np.float32(np.finfo(np.float32).max)
# Below this scale L / s could overflow float32 (s < L / 3.4e38 ~ 2^-121): the quantizer and
# the controller's estimate multiply such a bucket by 2^64 first (exact: a power of two, far
# from overflow). Decoding does not care: step = s * (1 / L) is just small.
TINY_SCALE = np.float32(2.0**-64)
TINY_PRESCALE = np.float32(2.0**64)

# A scale goes on the wire in 16 bits: bits 30..15 of its float32 (8 exponent and 8 mantissa
# bits; the sign of a max-abs is always 0). Every quantizer rounds its bucket's max-abs UP onto
# that grid before it quantizes, so levels still fit in [-L, L] and the receiver rebuilds the
# very float32 the sender quantized with. The cost: a step at most 2^-8 (0.4 %) wider; the gain:
# half of every scale's bytes (at 3 bits a fp32 scale was ~3 % of a bucket's payload).
SCALE_SHIFT = 15
SCALE_BYTES = 2
SCALE_LOW_MASK = (1 << SCALE_SHIFT) - 1
MAX_SCALE_BITS = 0x7F7F8000  # the largest finite float32 on the grid, ~3.3961e38
MAX_SCALE = np.float32(np.array([MAX_SCALE_BITS], np.int32).view(np.float32)[0])


def scales_up_reference(max_abs: np.ndarray) -> np.ndarray:
    """Finite, non-negative float32 values rounded up onto the scale grid (clamped to its largest
    finite value): the scales every quantizing kernel must produce, in plain numpy."""
    bits = np.ascontiguousarray(max_abs, dtype=np.float32).view(np.int32).astype(np.int64)
    up = np.minimum((bits + SCALE_LOW_MASK) & ~SCALE_LOW_MASK, MAX_SCALE_BITS)
    return up.astype(np.int32).view(np.float32)


def on_scale_grid(scales: np.ndarray) -> bool:
    """Whether every scale is a non-negative float32 that 16 bits carry exactly."""
    bits = np.ascontiguousarray(scales, dtype=np.float32).reshape(-1).view(np.uint32)
    # One OR over the bits, then one test: every payload's encoder asks (~1 us a layer, where
    # an elementwise test and np.all took ~3).
    return bits.size == 0 or int(np.bitwise_or.reduce(bits)) & (0x80000000 | SCALE_LOW_MASK) == 0


def levels_max(bits: int) -> int:
    """L = 2^(bits-1) - 1 for 2 <= bits <= 8: levels lie in [-L, L]."""
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits must be in {MIN_BITS}..{MAX_BITS}, got {bits}")
    return (1 << (bits - 1)) - 1


def inverse_levels_max(bits: int) -> np.float32:
    """1 / L rounded to float32: the factor every step is made with."""
    return np.float32(1.0) / np.float32(levels_max(bits))


def n_buckets(numel: int, bucket_size: int) -> int:
    return -(-numel // bucket_size)


def bucket_steps(scales: np.ndarray, bits: int) -> np.ndarray:
    """Per-bucket grid step ``scale * (1 / L)`` in float32."""
    return np.ascontiguousarray(scales, dtype=np.float32).reshape(-1) * inverse_levels_max(bits)


def rank_steps(
    levels: Sequence[np.ndarray],
    scales: Sequence[np.ndarray],
    bits: Sequence[int],
    bucket_sizes: Sequence[int],
    numel: int,
) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """Every rank's flat int8 levels and bucket steps for a fused rank mean of ``numel``
    elements, checked (the kernels do no bounds checks): each rank's levels must have ``numel``
    elements and one scale per bucket; a ValueError otherwise."""
    lv = tuple(np.ascontiguousarray(x, dtype=np.int8).reshape(-1) for x in levels)
    st = tuple(bucket_steps(s, b) for s, b in zip(scales, bits, strict=True))
    for x, s, bs in zip(lv, st, bucket_sizes, strict=True):
        if x.size != numel or bs < 1 or s.size != n_buckets(numel, bs):
            raise ValueError(f"{x.size} levels / {s.size} scales of bucket {bs} for {numel} elements")
    return lv, st


def dequantize_reference(levels: np.ndarray, scales: np.ndarray, bits: int, bucket_size: int) -> np.ndarray:
    """``float32(level) * step`` per element, in plain numpy (one IEEE multiply per element,
    whatever SIMD path numpy takes): the values every dequantizing kernel must reproduce."""
    lv = np.asarray(levels).reshape(-1)
    per_elem = np.repeat(bucket_steps(scales, bits), bucket_size)[: lv.size]
    return lv.astype(np.float32) * per_elem


def mean_reference(values_by_rank: Sequence[np.ndarray]) -> np.ndarray:
    """The rank mean: float64 sum in rank order (starting from rank 0's value), / R, to float32."""
    if not values_by_rank:
        raise ValueError("the mean needs at least one rank")
    acc = np.asarray(values_by_rank[0], dtype=np.float64).reshape(-1).copy()
    for v in values_by_rank[1:]:
        acc += np.asarray(v, dtype=np.float32).reshape(-1)
    return (acc / np.float64(len(values_by_rank))).astype(np.float32)
