"""qsgd: fixed-bit-width stochastic quantization (Tail's quantizer with the controller off).

Classic QSGD is unbiased and sends Q(g) without error feedback; ``error_feedback=True``
turns Tail's residual memory on for an ablation. Small and non-finite layers go raw fp32,
exactly as in Tail.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from tail_ray.bitwidth.stats import relative_errors
from tail_ray.compression.layers import (
    as_flat_f32,
    raw_record,
    warn_nonfinite,
)
from tail_ray.compression.quantize import (
    layer_seed,
    n_buckets,
    quantize_finite,
    sum_squares,
)
from tail_ray.compression.record_compressor import RecordCompressor
from tail_ray.compression.registry import register_compressor
from tail_ray.compression.wire import Kind, LayerRecord
from tail_ray.errors import ConfigError

# Elements sampled for the stats' estimated relative error (same estimator as Tail's controller).
_STATS_SAMPLE_NUMEL = 4096


@register_compressor("qsgd")
class QSGDCompressor(RecordCompressor):
    name = "qsgd"

    def __init__(
        self,
        bits: int = 4,
        bucket_size: int = 512,
        raw_below_numel: int = 4096,
        error_feedback: bool = False,
        seed: int | None = None,
    ) -> None:
        if not 2 <= int(bits) <= 8:
            raise ConfigError(f"qsgd bits must be in 2..8, got {bits}")
        if not 1 <= int(bucket_size) <= 1 << 20:
            raise ConfigError(f"qsgd bucket_size must be in 1..{1 << 20}, got {bucket_size}")
        self.bits = int(bits)
        self.bucket_size = int(bucket_size)
        self.raw_below_numel = int(raw_below_numel)
        self.error_feedback = bool(error_feedback)
        self._seed = seed if seed is not None else secrets.randbits(32)
        self._rng = np.random.default_rng(self._seed)
        super().__init__()
        self._calls = 0

    def compress_records(self, grads: Mapping[str, torch.Tensor]) -> list[LayerRecord]:
        """The engine's part of ``compress`` (everything but the wire's encoding)."""
        self._calls += 1
        records: list[LayerRecord] = []
        extras: list[tuple[float, int | None]] = []
        for name, tensor in grads.items():
            g = as_flat_f32(tensor)
            if g.size < max(self.raw_below_numel, 1):
                records.append(raw_record(name, g))
                extras.append((0.0, None))
                continue
            if not math.isfinite(float(sum_squares(g))):
                warn_nonfinite(name)
                records.append(raw_record(name, g))
                extras.append((0.0, None))
                continue
            levels = np.empty(g.size, dtype=np.int8)
            scales = np.empty(n_buckets(g.size, self.bucket_size), dtype=np.float32)
            seed = layer_seed(self._seed, self._calls, name)
            residual = self.feedback.buffer(name, g.size) if self.error_feedback else None
            rel_error = float(
                relative_errors(
                    g,
                    residual,
                    self.bucket_size,
                    (self.bits,),
                    sample_numel=_STATS_SAMPLE_NUMEL,
                    rng=self._rng,
                )[0]
            )
            nnz, _ = quantize_finite(g, residual, self.bits, self.bucket_size, seed, levels, scales)
            records.append(
                LayerRecord(
                    name=name,
                    numel=int(g.size),
                    kind=Kind.QUANT,
                    bits=self.bits,
                    bucket_size=self.bucket_size,
                    scales=scales,
                    levels=levels,
                )
            )
            extras.append((rel_error, int(nnz)))
        self._pending = extras
        return records

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: torch.from_numpy(v) for k, v in self.feedback.state_dict().items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.feedback.load_state_dict(
            {str(k): np.asarray(torch.as_tensor(v), dtype=np.float32) for k, v in state["residuals"].items()}
        )
