"""Per-layer plumbing of the record compressors: raw records, layer stats, records to tensors."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from tail_ray.compression.quantize import bucket_steps, dequantize, levels_max, n_buckets
from tail_ray.compression.stats import LayerStats
from tail_ray.compression.wire import EncodedLayer, Kind, LayerRecord, encode_payload
from tail_ray.errors import CodecError

log = logging.getLogger(__name__)

# Warn about non-finite layers at most this many times per process: a diverging run would
# otherwise flood the log every step.
_NONFINITE_WARNINGS = 5
_nonfinite_warned = 0


def as_flat_f32(t: torch.Tensor) -> np.ndarray:
    """A flat float32 numpy view of the gradient (a copy only if it is not CPU fp32 contiguous).

    Read-only use: compressors never write into the caller's gradient.
    """
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu" or flat.dtype != torch.float32:
        flat = flat.to("cpu", torch.float32)
    return flat.numpy()


def raw_record(name: str, g: np.ndarray) -> LayerRecord:
    return LayerRecord(name=name, numel=int(g.size), kind=Kind.RAW_F32, values=g)


def warn_nonfinite(name: str) -> None:
    global _nonfinite_warned
    if _nonfinite_warned < _NONFINITE_WARNINGS:
        _nonfinite_warned += 1
        log.warning(
            "layer %r has NaN/Inf gradients: sent raw fp32 unchanged (as plain DDP would), "
            "its error-feedback residual is left as it was",
            name,
        )


def layer_stats(rec: LayerRecord, cost: EncodedLayer, rel_error: float, nnz: int | None = None) -> LayerStats:
    """One LayerStats from what was sent (``nnz``: non-zero levels / kept values) and its cost."""
    bits = {Kind.QUANT: rec.bits, Kind.RAW_F16: 16}.get(rec.kind, 32)
    density = 1.0 if nnz is None else nnz / rec.numel if rec.numel else 0.0
    return LayerStats(
        layer=rec.name,
        numel=rec.numel,
        bits=bits,
        density=float(density),
        raw_bytes=4 * rec.numel,
        encoded_bytes=cost.encoded_bytes,
        rel_error=float(rel_error),
        code=cost.code,
    )


def record_to_flat(rec: LayerRecord) -> torch.Tensor:
    """One decoded record as a flat fp32 tensor (raw values are not copied); quantized layers
    through the fast numba kernel."""
    if rec.kind == Kind.QUANT and rec.levels is not None and rec.scales is not None:
        return torch.from_numpy(dequantize(rec.levels, rec.scales, rec.bits, rec.bucket_size))
    if rec.kind in (Kind.RAW_F32, Kind.RAW_F16) and rec.values is not None:
        return torch.from_numpy(rec.values)
    if rec.kind == Kind.SPARSE_F32 and rec.indices is not None and rec.values is not None:
        dense = np.zeros(rec.numel, dtype=np.float32)
        dense[rec.indices] = rec.values
        return torch.from_numpy(dense)
    raise CodecError(f"record of kind {rec.kind} lacks its arrays", layer=rec.name, field="kind")


def records_to_flat(records: Sequence[LayerRecord]) -> dict[str, torch.Tensor]:
    """Decoded records to flat fp32 tensors keyed by layer name, in record order."""
    return {rec.name: record_to_flat(rec) for rec in records}


def sample_flat(rec: LayerRecord, stride: int) -> torch.Tensor:
    """``records_to_flat([rec])[rec.name][::stride]`` without decoding the other elements:
    a quantized layer dequantizes only the sampled levels (same float32 products)."""
    if rec.kind == Kind.QUANT and rec.levels is not None and rec.scales is not None:
        at = np.arange(0, rec.numel, stride)
        steps = bucket_steps(rec.scales, rec.bits)[at // rec.bucket_size]
        return torch.from_numpy(rec.levels.reshape(-1)[::stride].astype(np.float32) * steps)
    if rec.kind in (Kind.RAW_F32, Kind.RAW_F16) and rec.values is not None:
        return torch.from_numpy(np.ascontiguousarray(rec.values.reshape(-1)[::stride], dtype=np.float32))
    return record_to_flat(rec)[::stride]


@njit(cache=True, nogil=True)
def _sample_dequantized(levels, scales, inv_lmax, bucket_size, stride, out):  # type: ignore[no-untyped-def]
    """out[j] = float64(float32(levels[i]) * (scales[b] * inv_lmax)), i = j * stride, b = i // bucket:
    the float32 product ``dequantize`` makes (no fastmath here), widened as ``.double()`` does."""
    for j in range(out.size):
        i = j * stride
        out[j] = np.float64(np.float32(levels[i]) * (scales[i // bucket_size] * inv_lmax))


def sample_stack(records: list[LayerRecord], stride: int) -> torch.Tensor:
    """``torch.stack([sample_flat(r, stride) for r in records]).double()``: observe_peers' sample.

    One numba call per rank, straight into the float64 matrix, when every record is quantized
    and of one size (the hot path); otherwise exactly that expression, which raises
    RuntimeError for records of different sizes (the caller skips such a layer).
    """
    if len({r.numel for r in records}) == 1 and all(
        r.kind == Kind.QUANT
        and r.levels is not None
        and r.scales is not None
        and r.bucket_size >= 1
        and r.levels.size == r.numel  # the kernel does no bounds checks
        and r.scales.size == n_buckets(r.numel, r.bucket_size)
        for r in records
    ):
        out = np.empty((len(records), len(range(0, records[0].numel, stride))), dtype=np.float64)
        for row, r in zip(out, records, strict=True):
            assert r.levels is not None and r.scales is not None
            inv = np.float32(1.0) / np.float32(levels_max(r.bits))
            _sample_dequantized(r.levels.reshape(-1), r.scales, inv, r.bucket_size, stride, row)
        return torch.from_numpy(out)
    return torch.stack([sample_flat(r, stride) for r in records]).double()


def slice_record(rec: LayerRecord, start: int, stop: int) -> LayerRecord:
    """Elements [start, stop) of a record, as a record of the same kind under the same name
    (views, no copies): what a sharded collective sends one slice's owner. A quantized record
    is cut between its buckets, so ``start`` must be a multiple of its bucket size; levels and
    scales are then exactly what the whole record holds there."""
    if not 0 <= start <= stop <= rec.numel:
        raise ValueError(f"slice [{start}, {stop}) outside layer {rec.name!r} of {rec.numel} elements")
    if start == 0 and stop == rec.numel:
        return rec
    n = stop - start
    if rec.kind == Kind.QUANT and rec.levels is not None and rec.scales is not None:
        if start % rec.bucket_size:
            raise ValueError(
                f"slice of layer {rec.name!r} starts at {start}, inside a bucket of {rec.bucket_size}"
            )
        first = start // rec.bucket_size
        return dataclasses.replace(
            rec,
            numel=n,
            levels=rec.levels.reshape(-1)[start:stop],
            scales=rec.scales[first : first + n_buckets(n, rec.bucket_size)],
        )
    if rec.kind in (Kind.RAW_F32, Kind.RAW_F16) and rec.values is not None:
        return dataclasses.replace(rec, numel=n, values=rec.values.reshape(-1)[start:stop])
    if rec.kind == Kind.SPARSE_F32 and rec.indices is not None and rec.values is not None:
        lo, hi = np.searchsorted(rec.indices, [start, stop])
        return dataclasses.replace(rec, numel=n, indices=rec.indices[lo:hi] - start, values=rec.values[lo:hi])
    raise CodecError(f"record of kind {rec.kind} lacks its arrays", layer=rec.name, field="kind")


@dataclass(frozen=True, slots=True)
class CompressedLayer:
    """What compressing one layer gave: its record, the engine's estimate of the relative
    error it adds, and its non-zero levels / kept values (None: dense, every value sent)."""

    record: LayerRecord
    rel_error: float = 0.0
    nnz: int | None = None


def encode_with_stats(layers: Sequence[CompressedLayer]) -> tuple[bytes, list[LayerStats]]:
    """Encode one call's records into one payload and pair each layer's wire cost with its
    error and density, so ``last_stats`` means the same for every record compressor."""
    payload, costs = encode_payload([layer.record for layer in layers])
    stats = [
        layer_stats(layer.record, cost, layer.rel_error, layer.nnz)
        for layer, cost in zip(layers, costs, strict=True)
    ]
    return payload, stats


def sliced_layer_stats(layer: CompressedLayer, slices: Sequence[LayerStats]) -> LayerStats:
    """One layer's stats when it was sent as slices (a sharded collective): the whole layer's
    bits, density and error, the bytes of all its slices, and the code that carried most."""
    biggest = max(slices, key=lambda s: s.encoded_bytes)
    cost = EncodedLayer(layer.record.name, sum(s.encoded_bytes for s in slices), biggest.code)
    return layer_stats(layer.record, cost, layer.rel_error, layer.nnz)
