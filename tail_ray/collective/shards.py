"""Which rank owns which elements of which layer: the shard layout of the sharded collectives.

The model's parameters, in ``named_parameters`` order, are laid end to end and the whole is
cut into W ranges of equal size (as ZeRO partitions a flat gradient); rank r owns range r.
A layer that straddles a boundary is cut there, into slices of the layer, every cut a
multiple of the compressor's ``shard_alignment`` (its quantizer bucket, so a slice holds
whole buckets). A cut that would leave a slice smaller than ``min_slice_numel`` is not made
(the piece stays with its neighbour), so slices are large enough to be worth a record of
their own: a header, scales, and for the second stage the compressor's raw threshold (a
slice below it would be re-sent raw). A slice belongs to the rank whose range holds its
middle: no rank owns two slices of one layer, and every rank owns W-th of the elements up
to a few slices.

Why from the whole model and not per DDP bucket: DDP rebuilds its buckets after the first
step, and a resized job has other buckets again; the second stage keeps its residuals per
layer and per slice, so a layer's slices must stay put for as long as W does. Only the
model's parameter list, W, the alignment and the minimum decide them: every rank computes
the same layout with no communication, and a bucket's shards are that layout restricted to
the bucket's layers.

Balance, simulated on GPT-2 small's 148 tensors (``python -m jobs.collective_cost simulate``):
the busiest rank sends 2.13 payloads a step at W = 1024 against a mean of 2.00 (placing each
layer's slices from a hash of its name instead, tried first, gave 2.94).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

MIN_SLICE_NUMEL = 16384  # 64 KiB of fp32: 4x the record compressors' raw threshold

Shard = dict[str, slice]  # layer name -> element range of its flat gradient


@dataclass(frozen=True, slots=True)
class LayerSlice:
    owner: int
    start: int
    stop: int


def model_layout(
    layers: Sequence[tuple[str, int]],
    world_size: int,
    *,
    alignment: int,
    min_slice_numel: int = MIN_SLICE_NUMEL,
) -> dict[str, list[LayerSlice]]:
    """Every layer's slices, in element order, with their owners (see the module docstring)."""
    if world_size < 1 or alignment < 1 or min_slice_numel < 1:
        raise ValueError(f"bad layout arguments: W={world_size} alignment={alignment} min={min_slice_numel}")
    total = sum(numel for _, numel in layers)
    per_rank = max(total, 1) / world_size
    out: dict[str, list[LayerSlice]] = {}
    at = 0  # where this layer starts in the model's flat space
    for name, numel in layers:
        if numel < 0:
            raise ValueError(f"layer {name!r} has {numel} elements")
        cuts = [0]
        first = int(at // per_rank) + 1
        for k in range(first, world_size):
            boundary = k * per_rank - at
            if boundary >= numel:
                break
            cut = round(boundary / alignment) * alignment
            # Cut only where both sides keep at least min_slice_numel (the rest stays together).
            if cut - cuts[-1] >= min_slice_numel and numel - cut >= min_slice_numel:
                cuts.append(cut)
        cuts.append(numel)
        pieces = []
        for start, stop in itertools.pairwise(cuts):
            middle = at + (start + stop) / 2
            owner = min(world_size - 1, int(middle // per_rank))
            pieces.append(LayerSlice(owner, start, stop))
        out[name] = pieces
        at += numel
    return out


def shard_layout(
    layers: Sequence[tuple[str, int]],
    world_size: int,
    *,
    alignment: int,
    min_slice_numel: int = MIN_SLICE_NUMEL,
) -> list[Shard]:
    """``shards[r]``: the slices rank r owns, layer name -> element range, in ``layers`` order."""
    shards: list[Shard] = [{} for _ in range(world_size)]
    for name, pieces in model_layout(
        layers, world_size, alignment=alignment, min_slice_numel=min_slice_numel
    ).items():
        for piece in pieces:
            shards[piece.owner][name] = slice(piece.start, piece.stop)
    return shards


def restrict(shards: Sequence[Shard], names: Sequence[str]) -> list[Shard]:
    """The model's shards cut down to the layers ``names`` (one bucket's), in ``names`` order."""
    return [{name: shard[name] for name in names if name in shard} for shard in shards]


def shard_views(flat: Mapping[str, torch.Tensor], shard: Shard) -> dict[str, torch.Tensor]:
    """``{name: flat[name][range]}``: views of flat gradients (writing them writes the bucket)."""
    return {name: flat[name][part] for name, part in shard.items()}
