"""topk: keep the ``density`` share of largest-magnitude entries of g + e, with error feedback.

Sent as a SparseRecord (sorted int64 positions + fp32 values); everything not sent stays in
the residual. Small and non-finite layers go raw fp32, as in Tail (RecordCompressor's policy).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tail_ray.compression.device import LayerArray
from tail_ray.compression.feedback import ErrorFeedback
from tail_ray.compression.fixedsum import sum_squares
from tail_ray.compression.record_compressor import CompressedLayer, RecordCompressor
from tail_ray.compression.records import SparseRecord
from tail_ray.errors import ConfigError
from tail_ray.settings import coerce_fields


@dataclass(frozen=True)
class TopKConfig:
    """topk's settings: ``density`` (share of each layer's entries sent, in (0, 1]),
    ``raw_below_numel`` (smaller layers go raw fp32), ``error_feedback`` (keep what was not
    sent for the next step; off only for ablations)."""

    density: float = 0.01
    raw_below_numel: int = 4096
    error_feedback: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.density, int | float) and 0 < self.density <= 1):
            raise ConfigError(f"topk density must be in (0, 1], got {self.density!r}")
        coerce_fields(self, density=float, raw_below_numel=int, error_feedback=bool)


class TopKCompressor(RecordCompressor):
    name = "topk"

    def __init__(self, config: TopKConfig | None = None, *, feedback: ErrorFeedback | None = None) -> None:
        self.config = config if config is not None else TopKConfig()
        super().__init__(self.config, feedback=feedback)
        self.density = self.config.density

    def compress_layer(self, name: str, g: LayerArray, sum_sq: float) -> CompressedLayer:
        # device_backend is off: the template always hands top-k a host array.
        assert isinstance(g, np.ndarray)
        x = self.feedback.compensate(name, g) if self.feedback is not None else g.copy()
        k = max(1, round(self.density * x.size))
        idx = np.argpartition(np.abs(x), x.size - k)[x.size - k :]
        idx.sort()
        values = x[idx]
        # The fixed-order sums, not np.dot: OpenBLAS threads a dot over a large layer, and on a
        # busy host the caller spins waiting for descheduled threads (measured in the low-rank
        # trials, docs/engine.md "Cost."); its rounding also follows the CPU's BLAS kernel.
        total = float(sum_squares(x))
        kept = float(sum_squares(values))
        if self.feedback is not None:
            # residual <- x - sparse(x): zero the sent positions of x (a fresh array), keep the rest.
            x[idx] = 0.0
            self.feedback.keep(name, x)
        record = SparseRecord(name, int(x.size), idx.astype(np.int64), values)
        return CompressedLayer(record, (total - kept) / total if total > 0 else 0.0, k)
