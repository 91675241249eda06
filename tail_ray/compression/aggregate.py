"""The mean over ranks of decoded payloads, written into the gradients a collective hands over.

Two entry points, bit-identical to each other on the same payloads:
- ``mean_tensors_into``: decoded tensors (any compressor's ``decompress``);
- ``mean_records_into``: decoded records (levels and scales, not yet dequantized). A layer
  quantized on every rank is dequantized, summed and divided in one numba pass
  (``rank_mean.mean_dequantized_into``) straight into the gradient when it is CPU fp32
  contiguous: no per-rank float32 copy; into a CUDA gradient (Triton backend,
  ``device.uses_triton``) the same arithmetic runs as one Triton kernel on the device
  (``device_codec.mean_into``: int8 levels up, nothing back). A layer dithered on every rank
  is averaged in one pass too, each rank's uniforms subtracted (``dither.mean_undithered_into``
  on the host, ``device_codec.mean_into`` with the ranks' seeds on the device). Any other
  layer (raw, sparse, or a mix, e.g. one rank sent a non-finite layer raw) is decoded to
  tensors and averaged as above; into a CUDA gradient, a layer sent low-rank is reconstructed
  and averaged on the device (``lowrank_device``: the same bits).

Both compute the grid's rank mean (tail_ray/compression/grid.py: float64 sum in rank order,
divided by the number of ranks in float64, rounded to float32), through ``rank_mean.mean_into``
or its fused form, so a layer averages to the same bits whichever path it takes and on any
CPU. Both check every layer of every rank before writing anything: a payload that lacks a
layer or sizes it differently is a ``CodecError`` naming the rank and the layer, and leaves
the gradients as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np
import torch

from tail_ray.compression.device import uses_triton
from tail_ray.compression.dither import mean_undithered_into
from tail_ray.compression.peer_spread import PeerSums, sampled_sums
from tail_ray.compression.rank_mean import mean_dequantized_into, mean_into
from tail_ray.compression.record_tensors import record_to_flat
from tail_ray.compression.records import LayerRecord, LowRankRecord, QuantRecord, decodable_seed
from tail_ray.errors import CodecError

T = TypeVar("T")


def _by_layer(
    by_rank: Sequence[Mapping[str, T]], into: Mapping[str, torch.Tensor], numel_of: Callable[[T], int]
) -> list[list[T]]:
    """Every rank's entry for each layer of ``into``, in rank order; a CodecError for a layer a
    rank lacks or sizes differently from its gradient."""
    layers: list[list[T]] = []
    for name, g in into.items():
        entries = []
        for rank, decoded in enumerate(by_rank):
            entry = decoded.get(name)
            if entry is None:
                raise CodecError(f"rank {rank}'s payload lacks this layer", layer=name, field="name")
            numel = numel_of(entry)
            if numel != g.numel():
                raise CodecError(
                    f"rank {rank}'s payload has {numel} elements, the gradient {g.numel()}",
                    layer=name,
                    field="numel",
                )
            entries.append(entry)
        layers.append(entries)
    return layers


def _copy_mean(g: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """g <- the grid's rank mean of decoded tensors (``mean_into``: the fused path's arithmetic)."""
    direct = g.device.type == "cpu" and g.dtype == torch.float32 and g.is_contiguous()
    out = g.detach().view(-1).numpy() if direct else np.empty(g.numel(), dtype=np.float32)
    # This rank's own raw record aliases the gradient (it is sent uncopied): then the mean is
    # made beside it and copied in, so no rank's values are overwritten while being read.
    values = [t.detach().to("cpu", torch.float32).reshape(-1).numpy() for t in tensors]
    if direct and any(np.shares_memory(v, out) for v in values):
        out = np.empty(g.numel(), dtype=np.float32)
        direct = False
    mean_into(values, out)
    if not direct:
        g.copy_(torch.from_numpy(out).view(g.shape))


def mean_tensors_into(
    decoded_by_rank: Sequence[Mapping[str, torch.Tensor]], into: Mapping[str, torch.Tensor]
) -> None:
    """Write the mean over ranks of each layer of ``into`` (flat decoded tensors) into it."""
    if not decoded_by_rank:
        raise ValueError("nothing to average: no payloads")
    layers = _by_layer(decoded_by_rank, into, lambda t: t.numel())
    for g, tensors in zip(into.values(), layers, strict=True):
        _copy_mean(g, tensors)


def _fused_mean(
    g: torch.Tensor, recs: list[QuantRecord], seeds: list[int] | None, stride: int
) -> PeerSums | None:
    """g <- the grid's rank mean of quantized layers in one pass, each rank's uniforms
    subtracted when ``seeds`` (every rank dithered): on the device for a Triton gradient,
    else on the host straight into g where it is CPU fp32 contiguous. With ``stride`` > 0 also
    the layer's peer-spread sums at that stride (peer_spread.py), read by the host's mean pass."""
    parts = (
        [r.levels for r in recs],
        [r.scales for r in recs],
        [r.bits for r in recs],
        [r.bucket_size for r in recs],
    )
    if uses_triton(g):
        from tail_ray.compression import device_codec

        sampled = _sampled(recs, stride)
        fits = g.dtype == torch.float32 and g.is_contiguous()
        dst = g.detach().view(-1) if fits else torch.empty(g.numel(), dtype=torch.float32, device=g.device)
        device_codec.mean_into(*parts, dst, dither_seeds=seeds)
        if not fits:
            g.copy_(dst.view(g.shape))
        return sampled
    direct = g.device.type == "cpu" and g.dtype == torch.float32 and g.is_contiguous()
    out = g.detach().view(-1).numpy() if direct else np.empty(g.numel(), dtype=np.float32)
    if seeds is not None:
        sums = mean_undithered_into(*parts, seeds, out, sample_stride=stride)
    else:
        sums = mean_dequantized_into(*parts, out, sample_stride=stride)
    if not direct:
        g.copy_(torch.from_numpy(out).view(g.shape))
    if sums is None:
        return None
    n_sample = (g.numel() + stride - 1) // stride
    return PeerSums(float(sums[0]), float(sums[1]), float(sums[2]), n_sample, len(recs))


def _sampled(recs: Sequence[LayerRecord], stride: int) -> PeerSums | None:
    return sampled_sums(recs, stride) if stride > 0 else None


def _device_mean(g: torch.Tensor, recs: list[LayerRecord]) -> None:
    """g <- the grid's rank mean, on g's device, of layers some rank sent low-rank: each
    product of factors is formed there (lowrank_device.py), any other record decoded on the
    host and copied up."""
    from tail_ray.compression import lowrank_device

    dev = g.device
    # One rank's layer at a time, added as it is made: W layers at once would not fit a big one.
    decoded = (
        lowrank_device.reconstruct_on(r, dev) if isinstance(r, LowRankRecord) else record_to_flat(r).to(dev)
        for r in recs
    )
    fits = g.dtype == torch.float32 and g.is_contiguous()
    dst = g.detach().view(-1) if fits else torch.empty(g.numel(), dtype=torch.float32, device=dev)
    lowrank_device.mean_tensors_on_device(decoded, dst)
    if not fits:
        g.copy_(dst.view(g.shape))


def mean_records_into(
    records_by_rank: Sequence[Mapping[str, LayerRecord]],
    into: Mapping[str, torch.Tensor],
    *,
    sample_strides: Mapping[str, int] | None = None,
) -> dict[str, PeerSums]:
    """Write the mean over ranks of each layer of ``into`` (decoded records) into it,
    bit-identical to ``mean_tensors_into`` on the same payloads decoded to tensors.

    ``sample_strides``: the layers whose peer-spread sums (peer_spread.py) the caller wants, at
    what stride; they are returned by layer name, the same bits as ``peer_sums`` of the records
    (read by the fused mean where it runs on the host; else sampled before the layer's mean is
    written, which a rank's own raw record may alias)."""
    if not records_by_rank:
        raise ValueError("nothing to average: no payloads")
    layers = _by_layer(records_by_rank, into, lambda rec: rec.numel)
    strides = sample_strides or {}
    sums: dict[str, PeerSums | None] = {}
    for (name, g), recs in zip(into.items(), layers, strict=True):
        stride = strides.get(name, 0)
        quant = [r for r in recs if isinstance(r, QuantRecord) and r.dither_seed is None]
        dithered = [r for r in recs if isinstance(r, QuantRecord) and r.dither_seed is not None]
        if len(dithered) == len(recs):  # every rank dithered it: the fused mean subtracts each u
            seeds = [decodable_seed(r) for r in dithered]
            sums[name] = _fused_mean(g, dithered, [int(s) for s in seeds if s is not None], stride)
        elif len(quant) == len(recs):
            sums[name] = _fused_mean(g, quant, None, stride)
        elif uses_triton(g) and any(isinstance(r, LowRankRecord) for r in recs):
            sums[name] = _sampled(recs, stride)
            _device_mean(g, recs)
        else:  # a mix: each decoded on its own (record_to_flat), then the mean
            sums[name] = _sampled(recs, stride)
            _copy_mean(g, [record_to_flat(rec) for rec in recs])
    return {name: got for name, got in sums.items() if got is not None}
