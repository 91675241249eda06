"""Records as tensors: decoded layer records to flat fp32 tensors, and the controller's samples."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numba import njit

from tail_ray.compression.dither import sample_undithered
from tail_ray.compression.kernel_parts import UNIFORM_TABLE
from tail_ray.compression.lowrank import reconstruct
from tail_ray.compression.quantize import bucket_steps, dequantize, n_buckets
from tail_ray.compression.records import (
    LayerRecord,
    LowRankRecord,
    QuantRecord,
    RawRecord,
    SparseRecord,
    decodable_seed,
)


def as_flat_f32(t: torch.Tensor) -> np.ndarray:
    """A flat float32 numpy view of the gradient (a copy only if it is not CPU fp32 contiguous).

    Read-only use: compressors never write into the caller's gradient.
    """
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu" or flat.dtype != torch.float32:
        flat = flat.to("cpu", torch.float32)
    return flat.numpy()


def record_to_flat(rec: LayerRecord) -> torch.Tensor:
    """One decoded record as a flat fp32 tensor (raw values are not copied); quantized layers
    through the fast numba kernel."""
    match rec:
        case QuantRecord():
            return torch.from_numpy(
                dequantize(rec.levels, rec.scales, rec.bits, rec.bucket_size, dither_seed=decodable_seed(rec))
            )
        case RawRecord():
            return torch.from_numpy(rec.values)
        case SparseRecord():
            dense = np.zeros(rec.numel, dtype=np.float32)
            dense[rec.indices] = rec.values
            return torch.from_numpy(dense)
        case LowRankRecord():
            return torch.from_numpy(reconstruct(rec))


def records_to_flat(records: Sequence[LayerRecord]) -> dict[str, torch.Tensor]:
    """Decoded records to flat fp32 tensors keyed by layer name, in record order."""
    return {rec.name: record_to_flat(rec) for rec in records}


def sample_flat(rec: LayerRecord, stride: int) -> torch.Tensor:
    """``records_to_flat([rec])[rec.name][::stride]`` without decoding the other elements:
    a quantized layer dequantizes only the sampled levels (same float32 products)."""
    seed = decodable_seed(rec) if isinstance(rec, QuantRecord) else None
    if isinstance(rec, QuantRecord) and seed is not None:
        out = np.empty(len(range(0, rec.numel, stride)), dtype=np.float64)
        steps = bucket_steps(rec.scales, rec.bits)
        sample_undithered(rec.levels.reshape(-1), steps, rec.bucket_size, seed, UNIFORM_TABLE, stride, out)
        return torch.from_numpy(out.astype(np.float32))
    if isinstance(rec, QuantRecord):
        at = np.arange(0, rec.numel, stride)
        steps = bucket_steps(rec.scales, rec.bits)[at // rec.bucket_size]
        return torch.from_numpy(rec.levels.reshape(-1)[::stride].astype(np.float32) * steps)
    if isinstance(rec, RawRecord):
        return torch.from_numpy(np.ascontiguousarray(rec.values.reshape(-1)[::stride], dtype=np.float32))
    return record_to_flat(rec)[::stride]


@njit(cache=True, nogil=True)
def _sample_dequantized(levels, steps, bucket_size, stride, out):  # type: ignore[no-untyped-def]
    """out[j] = float64(float32(levels[i]) * steps[i // bucket]), i = j * stride: the grid's
    float32 product (no fastmath here), widened as ``.double()`` does."""
    for j in range(out.size):
        i = j * stride
        out[j] = np.float64(np.float32(levels[i]) * steps[i // bucket_size])


def sample_stack(records: Sequence[LayerRecord], stride: int) -> torch.Tensor:
    """``torch.stack([sample_flat(r, stride) for r in records]).double()``: observe_peers' sample.

    One numba call per rank, straight into the float64 matrix, when every record is quantized
    (dithered or not) and of one size (the hot path); otherwise exactly that expression, which raises
    RuntimeError for records of different sizes (the caller skips such a layer).
    """
    quant = [r for r in records if isinstance(r, QuantRecord)]
    if (
        len(quant) == len(records)
        and len({r.numel for r in quant}) == 1
        # the kernel does no bounds checks
        and all(r.bucket_size >= 1 and r.scales.size == n_buckets(r.numel, r.bucket_size) for r in quant)
    ):
        out = np.empty((len(records), len(range(0, records[0].numel, stride))), dtype=np.float64)
        for row, r in zip(out, quant, strict=True):
            steps = bucket_steps(r.scales, r.bits)
            seed = decodable_seed(r)
            if seed is None:
                _sample_dequantized(r.levels.reshape(-1), steps, r.bucket_size, stride, row)
            else:
                levels = r.levels.reshape(-1)
                sample_undithered(levels, steps, r.bucket_size, seed, UNIFORM_TABLE, stride, row)
        return torch.from_numpy(out)
    return torch.stack([sample_flat(r, stride) for r in records]).double()
