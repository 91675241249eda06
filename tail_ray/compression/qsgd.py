"""qsgd: fixed-bit-width stochastic quantization (Tail's quantizer with the controller off).

Classic QSGD is unbiased and sends Q(g) without error feedback; ``error_feedback=True``
turns Tail's residual memory on for an ablation. Small and non-finite layers go raw fp32,
exactly as in Tail (RecordCompressor's policy).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from tail_ray.bitwidth.quant_error import relative_errors
from tail_ray.compression.device import LayerArray
from tail_ray.compression.feedback import ErrorFeedback
from tail_ray.compression.quantize import layer_seed
from tail_ray.compression.record_compressor import CompressedLayer, RecordCompressor
from tail_ray.errors import ConfigError
from tail_ray.settings import coerce_fields

# Elements sampled for the stats' estimated relative error (same estimator as Tail's controller).
_STATS_SAMPLE_NUMEL = 4096


@dataclass(frozen=True)
class QSGDConfig:
    """qsgd's settings: ``bits`` per element (2..8), ``bucket_size`` elements per max-abs
    scale, ``raw_below_numel`` (smaller layers go raw fp32), ``error_feedback`` (off: classic
    unbiased QSGD), ``seed`` of the stochastic rounding (None: a random one per instance)."""

    bits: int = 4
    bucket_size: int = 512
    raw_below_numel: int = 4096
    error_feedback: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 2 <= int(self.bits) <= 8:
            raise ConfigError(f"qsgd bits must be in 2..8, got {self.bits}")
        if not 1 <= int(self.bucket_size) <= 1 << 20:
            raise ConfigError(f"qsgd bucket_size must be in 1..{1 << 20}, got {self.bucket_size}")
        coerce_fields(self, bits=int, bucket_size=int, raw_below_numel=int, error_feedback=bool)


class QSGDCompressor(RecordCompressor):
    name = "qsgd"
    device_backend = True  # CUDA gradients: the Triton kernels (see RecordCompressor)

    def __init__(self, config: QSGDConfig | None = None, *, feedback: ErrorFeedback | None = None) -> None:
        self.config = config if config is not None else QSGDConfig()
        super().__init__(self.config, feedback=feedback)
        self.bits = self.config.bits
        self.bucket_size = self.config.bucket_size
        self._seed = self.config.seed if self.config.seed is not None else secrets.randbits(32)
        self._rng = np.random.default_rng(self._seed)
        self._calls = 0

    @property
    def shard_alignment(self) -> int:
        """Slices are cut between quantizer buckets."""
        return self.config.bucket_size

    def begin_call(self, grads: Mapping[str, torch.Tensor]) -> None:
        self._calls += 1

    def compress_layer(self, name: str, g: LayerArray, sum_sq: float) -> CompressedLayer:
        residual = self.residual_of(name, g)
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
        seed = layer_seed(self._seed, self._calls, name)
        record, nnz = self.quantize_layer(name, g, self.bits, self.bucket_size, seed)
        return CompressedLayer(record, rel_error, nnz)
