"""Closed-form quantization error, estimated without quantizing anything.

For stochastic rounding onto the grid {k * s / L} an element x (f = frac(|x| * L / s)) is
rounded up with probability f, so its expected squared error is (s / L)^2 * f * (1 - f). Rounded
to the nearest level (``rounding="nearest"``) its error is exactly (s / L)^2 * min(f, 1 - f)^2, and
under subtractive dither (``rounding="dither"``) (s / L)^2 / 12 whatever x. Summed
over a layer and divided by ||x||^2 this is nu_b, the expected relative quantization error
E||Q_b(x) - x||^2 / ||x||^2 at b bits.

Approximate computing: instead of all buckets, a random handful of whole buckets (a few
thousand elements) gives an unbiased estimate of both sums (each sampled bucket has its exact
scale), so the decision costs microseconds. ``bucket_errors`` computes the same sums over any
set of buckets, so the exact value is the same call with every bucket.

A layer held on the device (``DeviceFlat``: the Triton backend) is estimated there, by a kernel
that sums in exactly this module's order (device_codec.bucket_errors): the same bits, so the
same sampled buckets give the same decision on either backend.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import njit

from tail_ray.compression.device import DeviceFlat, LayerArray
from tail_ray.compression.feedback import Residual
from tail_ray.compression.fixedsum import LANES, add_squares, lanes_total
from tail_ray.compression.grid import F32_MAX, TINY_PRESCALE, TINY_SCALE, levels_max
from tail_ray.compression.kernel_parts import bucket_scale_bits
from tail_ray.compression.quantize import is_dither, is_nearest

# The kernels' ``mode``: which rounding's error is summed (an int, so one compiled kernel each).
_STOCHASTIC, _NEAREST, _DITHER = 0, 1, 2
_TWELFTH = np.float32(1.0 / 12.0)


def _mode(rounding: str) -> int:
    if is_dither(rounding):
        return _DITHER
    return _NEAREST if is_nearest(rounding) else _STOCHASTIC


@njit(cache=True, nogil=True, inline="always")
def _frac_term(x, pre, inv, mode):  # type: ignore[no-untyped-def]
    if mode == 2:  # subtractive dither: U(-1/2, 1/2] steps whatever x, variance 1/12
        return _TWELFTH
    y = (abs(x) * pre) * inv
    f = y - np.float32(np.int32(y))  # truncation is floor since y >= 0; y <= L + 1
    if mode == 1:
        d = min(f, np.float32(1.0) - f)
        return d * d
    return f * (np.float32(1.0) - f)


@njit(cache=True, nogil=True)
def _frac_sum(xb, pre, inv, lanes, mode):  # type: ignore[no-untyped-def]
    """sum f (1 - f) (stochastic), min(f, 1 - f)^2 (nearest) or 1/12 (dither), f = frac(|x| * pre * inv), each
    operation rounded (no fastmath), summed in the fixed lane layout of ``fixedsum``: the same
    bits on every CPU."""
    lanes[:] = 0
    n = xb.size
    n_full = n - n % LANES
    for lo in range(0, n_full, LANES):
        blk = xb[lo : lo + LANES]
        for j in range(LANES):
            lanes[j] += _frac_term(blk[j], pre, inv, mode)
    for i in range(n_full, n):
        lanes[i - n_full] += _frac_term(xb[i], pre, inv, mode)
    return lanes_total(lanes)


@njit(cache=True, nogil=True)
def _bucket_error_sums(g, e, use_e, bucket_size, bucket_ids, lmaxes, num, mode):  # type: ignore[no-untyped-def]
    """num[j] += sum over chosen buckets of (s/L_j)^2 f(1-f) (min(f, 1-f)^2 when nearest, 1/12
    when dithered; ``mode`` 0, 1, 2);
    returns (sum of x^2, non-zero buckets).

    Written as short loops over a bucket-sized scratch (slices, integer max-abs) so that LLVM
    vectorizes each of them; the bucket stays in L1 across the candidates. No fastmath: the
    sums use fixed lanes, so the estimate (and the bits it picks) is the same on every CPU;
    squares are summed in float64, so a huge finite layer gives a finite estimate.
    """
    n = g.size
    scratch = np.empty(bucket_size, np.float32)
    sq_lanes = np.zeros(LANES, np.float64)
    frac_lanes = np.zeros(LANES, np.float32)  # terms are <= 1/4: float32 lanes lose nothing that matters
    nonzero = 0
    box = np.empty(1, np.int32)
    fbox = box.view(np.float32)
    for t in range(bucket_ids.size):
        k = bucket_ids[t]
        lo = k * bucket_size
        hi = min(n, lo + bucket_size)
        xb = scratch[: hi - lo]
        gb = g[lo:hi]
        if use_e:
            eb = e[lo:hi]
            for i in range(xb.size):  # saturated as the quantizer does it
                xb[i] = min(max(gb[i] + eb[i], -F32_MAX), F32_MAX)
        else:
            for i in range(xb.size):
                xb[i] = gb[i]
        add_squares(xb, sq_lanes)
        box[0] = bucket_scale_bits(xb)  # the scale the quantizer will send, by its own kernel
        m = fbox[0]
        if m == 0:
            continue
        nonzero += 1
        # As in the quantizer: L / s must not overflow (every fraction would be inf - inf = NaN).
        pre = TINY_PRESCALE if m < TINY_SCALE else np.float32(1.0)
        # Dither's term is 1/12 whatever x: its lane sum depends on the bucket's length alone,
        # so it is summed once per bucket, not once per candidate (the same bits: the same sum).
        twelfths = _frac_sum(xb, pre, np.float32(1.0), frac_lanes, mode) if mode == 2 else np.float32(0.0)
        for j in range(lmaxes.size):
            lf = np.float32(lmaxes[j])
            step = np.float64(m) / np.float64(lf)
            fsum = twelfths if mode == 2 else _frac_sum(xb, pre, lf / (m * pre), frac_lanes, mode)
            num[j] += step * step * np.float64(fsum)
    return lanes_total(sq_lanes), nonzero


@njit(cache=True, nogil=True)
def _sampled_error_sums(g, e, use_e, bucket_size, start, k, nb, lmaxes, num, mode):  # type: ignore[no-untyped-def]
    """``_bucket_error_sums`` over the systematic sample (start + i * nb // k) % nb, i < k: the
    ids are made here, in the integer arithmetic numpy used for them (exact), so a decision
    is one compiled call instead of a handful of small numpy ones."""
    ids = np.empty(k, np.int64)
    for i in range(k):
        ids[i] = (start + (i * nb) // k) % nb
    return _bucket_error_sums(g, e, use_e, bucket_size, ids, lmaxes, num, mode)


@functools.cache
def _levels_max_array(candidate_bits: tuple[int, ...]) -> np.ndarray:
    """L per candidate as the kernels take it (kept: building it was a tenth of a decision)."""
    return np.array([levels_max(b) for b in candidate_bits], dtype=np.int64)


def bucket_errors(
    g: LayerArray,
    residual: Residual | None,
    bucket_size: int,
    bucket_ids: np.ndarray,
    candidate_bits: tuple[int, ...],
    rounding: str = "stochastic",
) -> tuple[np.ndarray, float, int]:
    """(sum of expected squared errors per candidate bits, sum of squares, non-zero buckets)
    over ``bucket_ids``. The values are those of g + residual (or g alone when residual is None).
    """
    mode = _mode(rounding)
    if isinstance(g, DeviceFlat):
        from tail_ray.compression import device_codec

        assert residual is None or isinstance(residual, torch.Tensor)
        return device_codec.bucket_errors(g, residual, bucket_size, bucket_ids, candidate_bits, rounding)
    assert residual is None or isinstance(residual, np.ndarray)
    num = np.zeros(len(candidate_bits), dtype=np.float64)
    e = residual if residual is not None else g
    den, nonzero = _bucket_error_sums(
        g, e, residual is not None, bucket_size, bucket_ids, _levels_max_array(candidate_bits), num, mode
    )
    return num, float(den), int(nonzero)


def _sampled_errors(
    g: LayerArray,
    residual: Residual | None,
    bucket_size: int,
    start: int,
    k: int,
    nb: int,
    candidate_bits: tuple[int, ...],
    rounding: str,
) -> tuple[np.ndarray, float, int]:
    """``bucket_errors`` over the systematic sample of k buckets from ``start``."""
    if isinstance(g, DeviceFlat):
        ids = (start + (np.arange(k, dtype=np.int64) * nb) // k) % nb
        return bucket_errors(g, residual, bucket_size, ids, candidate_bits, rounding)
    assert residual is None or isinstance(residual, np.ndarray)
    num = np.zeros(len(candidate_bits), dtype=np.float64)
    e = residual if residual is not None else g
    lmaxes = _levels_max_array(candidate_bits)
    den, nonzero = _sampled_error_sums(
        g, e, residual is not None, bucket_size, start, k, nb, lmaxes, num, _mode(rounding)
    )
    return num, float(den), int(nonzero)


# A sample whose buckets are mostly all-zero (dead units: whole rows of zeros) rests on a
# couple of buckets; draw more, up to this many times the requested sample.
_MAX_SAMPLE_GROWTH = 4


def relative_errors(
    g: LayerArray,
    residual: Residual | None,
    bucket_size: int,
    candidate_bits: tuple[int, ...],
    *,
    sample_numel: int | None,
    rng: np.random.Generator,
    rounding: str = "stochastic",
) -> np.ndarray:
    """Estimated nu_b for each candidate b: exact when ``sample_numel`` is None or covers the
    layer, otherwise from ``ceil(sample_numel / bucket_size)`` whole buckets, evenly spaced from a
    random start (more when most of those are all-zero). ``rounding`` is the quantizer's
    (quantize.ROUNDINGS): the error model follows it."""
    nb = -(-g.size // bucket_size)
    if sample_numel is None or sample_numel >= g.size:
        ids = np.arange(nb, dtype=np.int64)
        num, den, _ = bucket_errors(g, residual, bucket_size, ids, candidate_bits, rounding)
    else:
        # Systematic sample: k buckets evenly spaced from a random start. Every bucket is equally
        # likely to be drawn (so both sums stay unbiased), spread covers the whole layer, and
        # it costs far less than rng.choice(replace=False).
        k0 = min(nb, max(1, -(-sample_numel // bucket_size)))
        k = k0
        while True:
            start = int(rng.integers(nb))
            num, den, nonzero = _sampled_errors(
                g, residual, bucket_size, start, k, nb, candidate_bits, rounding
            )
            if 2 * nonzero >= k0 or k >= nb or k >= _MAX_SAMPLE_GROWTH * k0:
                break
            k = min(nb, 2 * k)
    if den <= 0.0:
        return np.zeros(len(candidate_bits), dtype=np.float64)
    return num / den


_estimates_warm = False  # warm_estimates ran in this process


def warm_estimates() -> None:
    """Both estimate kernels once on a tiny fixed input, at controller set-up (as the low-rank
    chooser's warm_linalg): a process's first call loads them from numba's cache (~0.3 s in a
    fresh process, ~10 ms in the benchmark's workers, whose other kernels share the loading),
    which otherwise lands in the first step's decisions, every layer waiting on it. No
    generator is drawn from: no sample, bit or choice changes."""
    global _estimates_warm
    if _estimates_warm:
        return
    g = np.linspace(-1.0, 1.0, 2048, dtype=np.float32)
    for residual in (None, g * np.float32(0.5)):
        bucket_errors(g, residual, 512, np.arange(4, dtype=np.int64), (2, 8))
        _sampled_errors(g, residual, 512, 1, 2, 4, (2, 8), "stochastic")
    _estimates_warm = True
