"""A layer quantized by subtractive dither into one record, slice by slice where the sharded
exchanges cut it, on the host (numba) or on the device (Triton).

The sharded exchanges send each shard's slice of a layer as a whole record of its own
(``records.slice_record``), and a dithered slice must decode alone: its uniforms are keyed by
bucket from its own start, so each slice is dithered from its own seed
(``quantize.slice_seed(seed, start)``), and the record keeps every slice's seed
(``QuantRecord.slice_seeds``). Cuts sit on bucket edges, so the buckets, and with them the
scales, are the ones a single pass makes. Both backends give the same levels and scales, bit
for bit (the Triton kernel draws the numba kernel's uniforms).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tail_ray.compression.device import DeviceFlat
from tail_ray.compression.quantize import n_buckets, quantize_finite, slice_seed
from tail_ray.compression.records import QuantRecord

__all__ = ["dither_in_slices", "dither_on_device", "slice_starts"]


def slice_starts(cuts: Sequence[int] | None, numel: int, bucket_size: int) -> list[int]:
    """The sorted element starts of a layer's slices ([0] when ``cuts`` is None: one slice),
    checked: at 0 and at multiples of the bucket inside the layer (a ValueError otherwise)."""
    starts = sorted(set(cuts)) if cuts is not None else [0]
    if starts[0] != 0 or starts[-1] >= numel or any(s % bucket_size for s in starts):
        raise ValueError(
            f"slices must start at 0 and at multiples of the bucket ({bucket_size}) inside"
            f" {numel} elements, got {starts}"
        )
    return starts


def _spans(starts: list[int], numel: int) -> list[tuple[int, int]]:
    return list(zip(starts, [*starts[1:], numel], strict=True))


def dither_in_slices(
    g: np.ndarray,
    residual: np.ndarray | None,
    bits: int,
    bucket_size: int,
    seed: int,
    cuts: Sequence[int],
    levels: np.ndarray,
    scales: np.ndarray,
) -> tuple[QuantRecord, int]:
    """g (+ a residual sent once) dithered slice by slice into ``levels`` / ``scales``: the
    same buckets as one pass (the cuts sit on bucket edges), each slice's uniforms from
    ``slice_seed(seed, start)``. The record (named "") holds every slice's seed."""
    seeds, nnz = [], 0
    for lo, hi in _spans(slice_starts(cuts, g.size, bucket_size), g.size):
        s32 = slice_seed(seed, lo)
        first = lo // bucket_size
        part_scales = scales[first : first + n_buckets(hi - lo, bucket_size)]
        part_res = None if residual is None else residual[lo:hi]
        n, _ = quantize_finite(
            g[lo:hi], part_res, bits, bucket_size, s32, levels[lo:hi], part_scales, rounding="dither"
        )
        nnz += n
        seeds.append((lo, s32))
    record = QuantRecord(
        "", bits, bucket_size, scales, levels, dither_seed=seeds[0][1], slice_seeds=tuple(seeds)
    )
    return record, nnz


def dither_on_device(
    g: DeviceFlat,
    residual: torch.Tensor | None,
    bits: int,
    bucket_size: int,
    seed: int,
    cuts: Sequence[int] | None,
) -> tuple[QuantRecord, int]:
    """g (+ a residual sent once, emptied on the device) dithered by the Triton kernel: whole
    from ``seed`` (its low 32 bits), or slice by slice as ``dither_in_slices`` when ``cuts``
    cut the layer. The record is named "" (the caller names it)."""
    from tail_ray.compression import device_codec

    starts = slice_starts(cuts, g.size, bucket_size)
    sliced = len(starts) > 1
    parts, seeds = [], []
    for lo, hi in _spans(starts, g.size):
        s32 = slice_seed(seed, lo) if sliced else seed & 0xFFFFFFFF
        part_res = None if residual is None else residual[lo:hi]
        parts.append(
            device_codec.quantize(DeviceFlat(g.tensor[lo:hi]), part_res, bits, bucket_size, s32, "dither")
        )
        seeds.append((lo, s32))
    record = QuantRecord(
        "",
        bits,
        bucket_size,
        np.concatenate([p.scales for p in parts]),
        np.concatenate([p.levels for p in parts]),
        dither_seed=seeds[0][1],
        slice_seeds=tuple(seeds) if sliced else None,
    )
    return record, sum(p.nnz for p in parts)
