"""Bucket size per layer (``TailConfig(bucket_choice="auto")``): the same error, fewer bytes.

With one max-abs scale per bucket of 512, every bucket gets the full range of levels, however
small its values: a bucket of a unit whose gradient is 100x smaller than its neighbours' costs
as many bits as theirs and contributes almost nothing to the layer's error. The layer's
relative error ||x - Q(x)||^2 / ||x||^2 is one sum over the whole layer, and for a sum of
squared errors at a given entropy the best is one step size everywhere (reverse
water-filling), i.e. larger buckets: small buckets' levels then crowd at 0 and the entropy
coder sends them for far less. The price: the large buckets' values get a coarser step, so
the same error needs more bits there (measured: docs/engine.md, "Bucket size per layer").

When the controller has picked bits b at the base bucket (512) it calls ``choose_bucket``,
which, on one sample of the layer's g + e (whole buckets of the largest candidate, so every
candidate's buckets are whole in it), estimates for every candidate bucket B and bits:
  error  the closed form of ``quant_error`` (the controller's own estimate);
  bytes  the order-0 entropy of the levels the kernel gives there (a fixed seed) plus 2 bytes
         of scale per bucket;
and takes the cheapest (B, b) whose error is at most the base's (B = 512 at b) on the same
sample, only when it saves at least ``MIN_GAIN`` of the base's estimated bytes (otherwise the
base): never more error, and a clear saving or the plain choice. Without that margin, picks
whose estimated saving was within a sample's noise made the char LM send ~1 % more (the winner's
curse of choosing by a noisy estimate; docs/engine.md). Only bits >= b are tried (fewer bits at
a larger bucket have ~4x the error), at buckets 4x apart (the decision's cost: measured there
too). Deterministic for a given sample (numba kernels with fixed summation order, integer
histograms, Python's log2 on exact counts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tail_ray.bitwidth.quant_error import bucket_errors
from tail_ray.compression.grid import SCALE_BYTES, levels_max, n_buckets
from tail_ray.compression.quantize import quantize

__all__ = ["AUTO_BUCKETS", "BUCKET_CHOICES", "MIN_GAIN", "BucketPick", "choose_bucket", "level_bytes"]

BUCKET_CHOICES = ("fixed", "auto")
# Candidate buckets: powers of two, so each divides the largest and every candidate's buckets
# are whole inside the sample's.
AUTO_BUCKETS = (512, 1024, 4096, 16384)
# A pick must save this share of the base's estimated bytes.
MIN_GAIN = 0.05
# At least this many elements (whole largest buckets) are sampled; the whole layer if smaller.
AUTO_SAMPLE_NUMEL = 16384
_SEED = 0x5EED  # the estimate's rounding: any fixed value (deterministic decisions)


@dataclass(frozen=True)
class BucketPick:
    bucket_size: int
    bits: int
    rel_error: float  # estimated nu of (bucket_size, bits) on the sample
    saving: float  # share of the base's estimated bytes it saves (>= MIN_GAIN)


def level_bytes(levels: np.ndarray, bits: int) -> float:
    """Order-0 entropy of ``levels`` in bytes (what a static entropy code approaches)."""
    lmax = levels_max(bits)
    counts = np.bincount(levels.astype(np.int64) + lmax, minlength=2 * lmax + 1).tolist()
    n = levels.size
    return sum(c * math.log2(n / c) for c in counts if c) / 8.0


def _sample(x: np.ndarray, top: int, sample_numel: int | None, rng: np.random.Generator) -> np.ndarray:
    """Whole buckets of ``top`` elements, evenly spaced from a random start, in layer order
    (a partial last bucket can only come last, so every candidate's buckets stay aligned)."""
    nb = n_buckets(x.size, top)
    want = nb if sample_numel is None else min(nb, max(1, -(-max(sample_numel, AUTO_SAMPLE_NUMEL) // top)))
    if want >= nb:
        return x
    start = int(rng.integers(nb))
    ids = np.sort((start + (np.arange(want, dtype=np.int64) * nb) // want) % nb)
    return np.concatenate([x[k * top : (k + 1) * top] for k in ids.tolist()])


def choose_bucket(
    x: np.ndarray,
    base_bucket: int,
    bits: int,
    candidate_bits: tuple[int, ...],
    *,
    sample_numel: int | None,
    rng: np.random.Generator,
    rounding: str = "stochastic",
    buckets: tuple[int, ...] = AUTO_BUCKETS,
    min_gain: float = MIN_GAIN,
) -> BucketPick | None:
    """The cheapest (bucket, bits) at no more estimated error than (``base_bucket``, ``bits``)
    on a sample of ``x`` (g + e, finite); None when nothing beats the base (or ``x`` is all
    zero). ``base_bucket`` must divide every candidate bucket."""
    cands = sorted({base_bucket, *(b for b in buckets if b % base_bucket == 0)})
    # Buckets past the layer's size are all "one bucket": keep the first that covers it.
    covering = [b for b in cands if b >= x.size]
    cands = [b for b in cands if b < x.size] + covering[:1]
    if len(cands) < 2:
        return None
    xs = _sample(x, cands[-1], sample_numel, rng)
    bits_list = tuple(b for b in sorted(candidate_bits) if b >= bits)
    errors = {}
    for b in cands:
        num, den, _ = bucket_errors(
            xs, None, b, np.arange(n_buckets(xs.size, b), dtype=np.int64), bits_list, rounding
        )
        if den <= 0.0:
            return None
        errors[b] = (num / den).tolist()
    limit = errors[base_bucket][bits_list.index(bits)]
    levels = np.empty(xs.size, dtype=np.int8)
    best: tuple[float, int, int, float] | None = None
    base_cost = math.inf
    for b in cands:
        # The fewest bits that keep the error: more bits at the same bucket only cost more.
        j = next((j for j, nu in enumerate(errors[b]) if nu <= limit), None)
        if j is None:
            continue
        scales = np.empty(n_buckets(xs.size, b), dtype=np.float32)
        quantize(xs, bits_list[j], b, _SEED, levels, scales, rounding=rounding)
        cost = level_bytes(levels, bits_list[j]) + float(SCALE_BYTES * scales.size)
        if b == base_bucket:
            base_cost = cost
        if best is None or cost < best[0]:
            best = (cost, b, bits_list[j], errors[b][j])
    assert best is not None  # the base itself fits
    if best[1] == base_bucket or not best[0] <= (1 - min_gain) * base_cost:
        return None
    return BucketPick(best[1], best[2], best[3], 1 - best[0] / base_cost)
