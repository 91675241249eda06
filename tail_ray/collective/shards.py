"""Which rank owns which elements of which layer: the shard layout of the sharded collectives.

A layer of n elements is cut into k = clamp(n // min_slice_numel, 1, W) slices of near-equal
size, every inner boundary a multiple of the compressor's ``shard_alignment`` (its quantizer
bucket, so a slice holds whole buckets). Slice s of layer L goes to rank (base(L) + s) mod W,
with base(L) = crc32(L) mod W: a large layer is spread over every rank, small layers land on
ranks scattered by name, and no rank owns two slices of one layer (k <= W).

Why per layer and by name, not by cutting the DDP bucket's flat buffer into W equal ranges
(which balances a little better): the layout of a layer must not depend on which bucket it
is in. DDP rebuilds its buckets after the first step, and a resized job has other buckets
again; the second stage's residuals are kept per layer and per slice, so a layer's slices
must stay put for as long as the world size does. Only W, the layer's name and size and the
alignment decide them: every rank computes the same layout with no communication.

``min_slice_numel`` keeps slices large enough to be worth a record of their own (a header,
scales, and for the second stage the compressor's raw threshold: a slice below it would be
re-sent raw).
"""

from __future__ import annotations

import itertools
import zlib
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


def layer_slices(
    name: str, numel: int, world_size: int, *, alignment: int, min_slice_numel: int = MIN_SLICE_NUMEL
) -> list[LayerSlice]:
    """The slices of one layer, in element order, with their owners (see the module docstring)."""
    if world_size < 1 or alignment < 1 or min_slice_numel < 1 or numel < 0:
        raise ValueError(
            f"bad layout arguments: numel={numel} W={world_size} alignment={alignment} min={min_slice_numel}"
        )
    base = zlib.crc32(name.encode()) % world_size
    k = max(1, min(world_size, numel // min_slice_numel))
    per = -(-max(numel, 1) // k)  # ceil(numel / k) ...
    per = -(-per // alignment) * alignment  # ... rounded up to whole buckets
    bounds = [*range(0, numel, per), numel] if numel else [0, 0]
    return [
        LayerSlice((base + s) % world_size, start, stop)
        for s, (start, stop) in enumerate(itertools.pairwise(bounds))
    ]


def shard_layout(
    layers: Sequence[tuple[str, int]],
    world_size: int,
    *,
    alignment: int,
    min_slice_numel: int = MIN_SLICE_NUMEL,
) -> list[Shard]:
    """``shards[r]``: the slices rank r owns, layer name -> element range, in ``layers`` order."""
    shards: list[Shard] = [{} for _ in range(world_size)]
    for name, numel in layers:
        for piece in layer_slices(
            name, numel, world_size, alignment=alignment, min_slice_numel=min_slice_numel
        ):
            shards[piece.owner][name] = slice(piece.start, piece.stop)
    return shards


def shard_views(flat: Mapping[str, torch.Tensor], shard: Shard) -> dict[str, torch.Tensor]:
    """``{name: flat[name][range]}``: views of flat gradients (writing them writes the bucket)."""
    return {name: flat[name][part] for name, part in shard.items()}
