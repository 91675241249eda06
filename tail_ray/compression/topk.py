"""topk: keep the ``density`` share of largest-magnitude entries of g + e, with error feedback.

Sent as Kind.SPARSE_F32 (sorted int64 positions + fp32 values); everything not sent stays in
the residual. Small and non-finite layers go raw fp32, as in Tail.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from tail_ray.compression.layers import (
    as_flat_f32,
    raw_record,
    warn_nonfinite,
)
from tail_ray.compression.quantize import sum_squares
from tail_ray.compression.record_compressor import RecordCompressor
from tail_ray.compression.registry import register_compressor
from tail_ray.compression.wire import Kind, LayerRecord
from tail_ray.errors import ConfigError


@register_compressor("topk")
class TopKCompressor(RecordCompressor):
    name = "topk"

    def __init__(
        self, density: float = 0.01, raw_below_numel: int = 4096, error_feedback: bool = True
    ) -> None:
        if not (isinstance(density, int | float) and 0 < density <= 1):
            raise ConfigError(f"topk density must be in (0, 1], got {density!r}")
        self.density = float(density)
        self.raw_below_numel = int(raw_below_numel)
        self.error_feedback = bool(error_feedback)
        super().__init__()

    def compress_records(self, grads: Mapping[str, torch.Tensor]) -> list[LayerRecord]:
        """The engine's part of ``compress`` (everything but the wire's encoding)."""
        records: list[LayerRecord] = []
        extras: list[tuple[float, int | None]] = []
        for name, tensor in grads.items():
            g = as_flat_f32(tensor)
            if g.size < max(self.raw_below_numel, 1) or not math.isfinite(float(sum_squares(g))):
                if g.size >= max(self.raw_below_numel, 1):
                    warn_nonfinite(name)
                records.append(raw_record(name, g))
                extras.append((0.0, None))
                continue
            x = self.feedback.compensate(name, g) if self.error_feedback else g.copy()
            k = max(1, round(self.density * x.size))
            idx = np.argpartition(np.abs(x), x.size - k)[x.size - k :]
            idx.sort()
            values = x[idx]
            total = float(np.dot(x.astype(np.float64), x.astype(np.float64)))
            kept = float(np.dot(values.astype(np.float64), values.astype(np.float64)))
            if self.error_feedback:
                # residual <- x - sparse(x): zero the sent positions in place, keep the rest.
                x[idx] = 0.0
                np.copyto(self.feedback.buffer(name, x.size), x)
            records.append(
                LayerRecord(
                    name=name,
                    numel=int(x.size),
                    kind=Kind.SPARSE_F32,
                    indices=idx.astype(np.int64),
                    values=values,
                )
            )
            extras.append(((total - kept) / total if total > 0 else 0.0, k))
        self._pending = extras
        return records

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: torch.from_numpy(v) for k, v in self.feedback.state_dict().items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.feedback.load_state_dict(
            {str(k): np.asarray(torch.as_tensor(v), dtype=np.float32) for k, v in state["residuals"].items()}
        )
