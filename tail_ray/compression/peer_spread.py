"""How far apart the workers' decoded gradients of one layer are: the SGD-noise reading Tail's
budget follows (``TailCompressor.observe_peers``), on a strided sample of the layer.

For the sampled elements i and the W ranks' decoded values d_r(i), three float64 sums:

    spread   sum_i sum_r (d_r(i) - m(i))^2,  m(i) = (sum_r d_r(i)) / W
    power    sum_i sum_r d_r(i)^2
    mean     sum_i m(i)^2

In training the sums come from the decode-average itself: ``aggregate.mean_records_into`` asks
the fused rank means (``rank_mean.mean_dequantized_into``, ``dither.mean_undithered_into``) for
them at the sample's stride, and they read the sampled values the mean already holds, in the
same order (``fixedsum.add_spread_sample``): the same bits as below, with no second decode.
Otherwise (``peer_sums``: a CUDA layer, a mix of codes) the sample is
``record_tensors.sample_stack``'s (W, n) float64 matrix (numba decodes only the sampled levels
when every rank sent the layer quantized); the sums are one numba pass over it in the fixed
lanes of ``fixedsum`` (lane i % LANES, then a fixed pairwise tree), so the same bits on every
CPU. They were torch reductions over the matrix, whose summation order follows the CPU's
vector width, and which took a third of observe_peers' time.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch
from numba import njit

from tail_ray.compression.fixedsum import LANES, add_spread_sample, lanes_total
from tail_ray.compression.record_tensors import sample_stack
from tail_ray.compression.records import LayerRecord

__all__ = ["PeerSums", "peer_sums", "sampled_sums"]

log = logging.getLogger(__name__)


class PeerSums(NamedTuple):
    """The three sums over ``n`` sampled elements of ``world`` ranks (module doc)."""

    spread: float
    power: float
    mean: float
    n: int
    world: int


@njit(cache=True, nogil=True)
def _sums_core(stack, out):  # type: ignore[no-untyped-def]
    """out[0:3] = (spread, power, mean) sums of a (W, n) float64 sample, in fixed lanes."""
    world, n = stack.shape
    lanes = np.zeros((3, LANES), np.float64)
    for j in range(n):
        total = np.float64(0.0)
        for r in range(world):  # the rank sum, in rank order
            total += stack[r, j]
        add_spread_sample(lanes, j, stack, j, total)
    for t in range(3):
        out[t] = lanes_total(lanes[t])


def peer_sums(records: Sequence[LayerRecord], stride: int) -> PeerSums:
    """The three sums of one layer over every rank's decoded record (in rank order), at the
    elements 0, stride, 2 * stride, ... A RuntimeError for records of different sizes (the
    caller skips the layer); a ValueError for a record dithered in slices (``decodable_seed``)."""
    stack = sample_stack(records, stride)
    if stack.dtype != torch.float64 or not stack.is_contiguous():
        stack = stack.double().contiguous()
    out = np.empty(3, np.float64)
    _sums_core(stack.numpy(), out)
    return PeerSums(float(out[0]), float(out[1]), float(out[2]), int(stack.shape[1]), len(records))


def sampled_sums(records: Sequence[LayerRecord], stride: int) -> PeerSums | None:
    """``peer_sums``, or None where the records cannot be sampled together (of different sizes,
    or dithered in slices): that layer gets no reading this step."""
    try:
        return peer_sums(records, stride)
    except (RuntimeError, ValueError) as exc:
        log.debug("no peer-spread sample of layer %r: %s", records[0].name if records else "?", exc)
        return None


def sampled_layers(
    records_by_rank: Sequence[Mapping[str, LayerRecord]], strides: Mapping[str, int]
) -> dict[str, PeerSums]:
    """``sampled_sums`` of each layer of ``strides`` that every rank sent."""
    out = {}
    for name, stride in strides.items():
        recs = [d.get(name) for d in records_by_rank]
        got = sampled_sums([r for r in recs if r is not None], stride) if None not in recs else None
        if got is not None:
            out[name] = got
    return out
