"""Fixed-setting peers Tail is compared against, one small class each."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from tail_ray.compression.quantize import dequantize
from tail_ray.compression.registry import register_compressor
from tail_ray.compression.stats import LayerStats
from tail_ray.compression.wire import Kind, LayerRecord, decode_payload, encode_payload
from tail_ray.errors import CodecError


def records_to_tensors(records: list[LayerRecord]) -> dict[str, torch.Tensor]:
    """Dequantize decoded records into flat fp32 tensors (shared by every compressor)."""
    out: dict[str, torch.Tensor] = {}
    for rec in records:
        if rec.kind in (Kind.RAW_F32, Kind.RAW_F16):
            assert rec.values is not None
            out[rec.name] = torch.from_numpy(rec.values)
        elif rec.kind == Kind.SPARSE_F32:
            assert rec.indices is not None and rec.values is not None
            dense = np.zeros(rec.numel, dtype=np.float32)
            dense[rec.indices] = rec.values
            out[rec.name] = torch.from_numpy(dense)
        elif rec.kind == Kind.QUANT:
            assert rec.levels is not None and rec.scales is not None
            out[rec.name] = torch.from_numpy(dequantize(rec.levels, rec.scales, rec.bits, rec.bucket_size))
        else:
            raise CodecError(f"unknown kind {rec.kind}", layer=rec.name, field="kind")
    return out


@register_compressor("none")
class NoneCompressor:
    """Raw fp32: exact, the accuracy baseline (and what the hook's all-reduce path sends)."""

    name = "none"

    def __init__(self) -> None:
        self._last: list[LayerStats] = []

    @property
    def last_stats(self) -> list[LayerStats]:
        return self._last

    def compress(self, grads: Mapping[str, torch.Tensor]) -> bytes:
        records = [
            LayerRecord(
                name=name,
                numel=t.numel(),
                kind=Kind.RAW_F32,
                values=t.detach().reshape(-1).to("cpu", torch.float32).numpy(),
            )
            for name, t in grads.items()
        ]
        payload, costs = encode_payload(records)
        self._last = [
            LayerStats(c.name, r.numel, 32, 1.0, 4 * r.numel, c.encoded_bytes, 0.0, c.code)
            for r, c in zip(records, costs, strict=True)
        ]
        return payload

    def decompress(self, payload: bytes) -> dict[str, torch.Tensor]:
        return records_to_tensors(decode_payload(payload))

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None
