"""Per-layer plumbing of the record compressors: raw records, layer stats, records to tensors."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from tail_ray.compression.quantize import bucket_steps, dequantize, n_buckets
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
    """One LayerStats from what was sent and its cost.

    Density is the share of elements the payload carries as non-zero: the wire's own count
    (``cost.nnz``: non-zero levels of a quantized layer whatever its code, kept values of a
    sparse one), so it is in [0, 1] for every code; 1 for a raw layer (every value is sent).
    ``nnz``, the compressor's count of the same thing, is no longer needed for it (a kernel
    that miscounted once put -1.3e8 on the dashboard) and is kept only for the callers.
    """
    bits = {Kind.QUANT: rec.bits, Kind.RAW_F16: 16}.get(rec.kind, 32)
    if rec.kind in (Kind.QUANT, Kind.SPARSE_F32):
        density = cost.nnz / rec.numel if rec.numel else 0.0
    else:
        density = 1.0
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
def _sample_dequantized(levels, steps, bucket_size, stride, out):  # type: ignore[no-untyped-def]
    """out[j] = float64(float32(levels[i]) * steps[i // bucket]), i = j * stride: the grid's
    float32 product (no fastmath here), widened as ``.double()`` does."""
    for j in range(out.size):
        i = j * stride
        out[j] = np.float64(np.float32(levels[i]) * steps[i // bucket_size])


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
            steps = bucket_steps(r.scales, r.bits)
            _sample_dequantized(r.levels.reshape(-1), steps, r.bucket_size, stride, row)
        return torch.from_numpy(out)
    return torch.stack([sample_flat(r, stride) for r in records]).double()


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
