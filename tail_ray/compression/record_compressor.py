"""RecordCompressor: the template the record-producing compressors (qsgd, topk, tail) fill in.

``compress`` is a template method. Per layer it applies one policy, the same for every
subclass, then asks the subclass for the layer's record:

    small layer (< raw_below_numel)  -> raw fp32 record
    non-finite layer (NaN/Inf)       -> raw fp32 record, UNCHANGED, residual left as it was
                                        (DDP and GradScaler see what plain DDP would)
    otherwise                        -> ``compress_layer(name, g, sum_sq)``: the subclass's code

then encodes the records into one payload with per-layer stats. It keeps the records of the
latest call, so ``aggregate`` takes this rank's own entry from them instead of entropy-decoding
its own payload (the coding is lossless, so this is bit-identical).

Two backends, chosen per layer from the gradient tensor (``device.uses_triton``): CUDA
gradients of a compressor that supports it (``device_backend``: qsgd and tail) are handed to
``compress_layer`` as a ``DeviceFlat`` and quantized by the Triton kernels where they are
(device_codec.py), everything else as a numpy array to the numba kernels. Both give the same
records (levels on one grid, float32 scales), so the wire, the payload and the receivers do
not know which backend made them.

Residuals live in an injected ``ErrorFeedback`` (None: error feedback off), which also owns
their norms; ``fold_residuals`` and ``state_dict`` / ``load_state_dict`` of the residuals are
defined here once. Subclasses add hooks where they need them: ``begin_call`` (counters
before a call's layers), ``observe_peers`` (a controller's view of every rank's records) and
``state_dict`` / ``load_state_dict`` extensions.

Sharded collectives (``compress_shards``): the layers are compressed exactly as by
``compress`` (one step of error feedback and of the controller per layer, on the whole layer),
then each record is cut into the shards' slices (``records.slice_record``: between quantizer
buckets, so the levels and scales sent are the same) and every shard is encoded into its own
payload. ``second_stage`` is a fresh instance of the same class from the same settings (the
seed salted, so its rounding is independent of the first stage's), with its own residuals.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch

from tail_ray.compression.aggregate import mean_records_into
from tail_ray.compression.base import Compressor
from tail_ray.compression.device import MAX_DEVICE_BUCKET, DeviceFlat, LayerArray, device_flat, uses_triton
from tail_ray.compression.dither_slices import dither_in_slices, dither_on_device
from tail_ray.compression.feedback import ErrorFeedback
from tail_ray.compression.peer_spread import PeerSums
from tail_ray.compression.quantize import is_dither, n_buckets, quantize_finite, sum_squares
from tail_ray.compression.record_tensors import as_flat_f32, records_to_flat
from tail_ray.compression.records import (
    LayerRecord,
    LowRankRecord,
    QuantRecord,
    RawRecord,
    SparseRecord,
    slice_record,
)
from tail_ray.compression.stats import LayerStats
from tail_ray.compression.wire import EncodedLayer, decode_payload, encode_payload
from tail_ray.errors import ConfigError

log = logging.getLogger(__name__)

# Salt of a spawned compressor's seed: its stochastic rounding must not replay its parent's.
_SPAWN_SEED_SALT = 0x9E3779B9

# Warn about non-finite layers at most this many times per process: a diverging run would
# otherwise flood the log every step.
_NONFINITE_WARNINGS = 5
_nonfinite_warned = 0


def warn_nonfinite(name: str) -> None:
    global _nonfinite_warned
    if _nonfinite_warned < _NONFINITE_WARNINGS:
        _nonfinite_warned += 1
        log.warning(
            "layer %r has NaN/Inf gradients: sent raw fp32 unchanged (as plain DDP would), "
            "its error-feedback residual is left as it was",
            name,
        )


@dataclass(frozen=True, slots=True)
class CompressedLayer:
    """What compressing one layer gave: its record, the engine's estimate of the relative
    error it adds, and its non-zero levels / kept values (None: dense, every value sent)."""

    record: LayerRecord
    rel_error: float = 0.0
    nnz: int | None = None


@functools.cache
def _warn_big_bucket(bucket_size: int) -> None:
    log.warning(
        "bucket_size %d is above the Triton quantizer's %d: CUDA layers are quantized on the host",
        bucket_size,
        MAX_DEVICE_BUCKET,
    )


def _host(g: LayerArray) -> np.ndarray:
    return g.host() if isinstance(g, DeviceFlat) else g


def layer_stats(rec: LayerRecord, cost: EncodedLayer, rel_error: float, nnz: int | None = None) -> LayerStats:
    """One LayerStats from what was sent and its cost.

    Density is the share of elements the payload carries as non-zero: the wire's own count
    (``cost.nnz``: non-zero levels of a quantized layer whatever its code, kept values of a
    sparse one), so it is in [0, 1] for every code; 1 for a raw layer (every value is sent).
    ``nnz``, the compressor's count of the same thing, is no longer needed for it (a kernel
    that miscounted once put -1.3e8 on the dashboard) and is kept only for the callers.
    """
    match rec:
        case QuantRecord():
            bits, density = rec.bits, cost.nnz / rec.numel if rec.numel else 0.0
        case RawRecord():
            bits, density = (16 if rec.fp16 else 32), 1.0
        case SparseRecord():
            bits, density = 32, cost.nnz / rec.numel if rec.numel else 0.0
        case LowRankRecord():
            # bits of the factors; density: their non-zero levels per element of the layer
            bits, density = rec.bits, cost.nnz / rec.numel if rec.numel else 0.0
    code = f"lowrank-r{rec.rank}" if isinstance(rec, LowRankRecord) else cost.code
    return LayerStats(
        layer=rec.name,
        numel=rec.numel,
        bits=bits,
        density=float(density),
        raw_bytes=4 * rec.numel,
        encoded_bytes=cost.encoded_bytes,
        rel_error=float(rel_error),
        code=code,
    )


def encode_with_stats(layers: Sequence[CompressedLayer]) -> tuple[bytes, list[LayerStats]]:
    """Encode one call's records into one payload and pair each layer's wire cost with its
    error and density, so ``last_stats`` means the same for every record compressor."""
    payload, costs = encode_payload([layer.record for layer in layers])
    stats = [
        layer_stats(layer.record, cost, layer.rel_error, layer.nnz)
        for layer, cost in zip(layers, costs, strict=True)
    ]
    return payload, stats


def sliced_layer_stats(layer: CompressedLayer, slices: Sequence[EncodedLayer]) -> LayerStats:
    """One layer's stats when it was sent as slices (a sharded collective): the whole layer's
    bits, error and density (the slices' non-zeros together), the bytes of all its slices, and
    the code that carried most."""
    biggest = max(slices, key=lambda c: c.encoded_bytes)
    cost = EncodedLayer(
        layer.record.name,
        sum(c.encoded_bytes for c in slices),
        biggest.code,
        sum(c.nnz for c in slices),
    )
    return layer_stats(layer.record, cost, layer.rel_error, layer.nnz)


class RecordSettings(Protocol):
    """What the template reads from a record compressor's settings (QSGDConfig, TopKConfig,
    TailConfig): the raw policy's threshold and whether error feedback is on."""

    @property
    def raw_below_numel(self) -> int: ...

    @property
    def error_feedback(self) -> bool: ...


class RecordCompressor(Compressor):
    """Base of QSGDCompressor, TopKCompressor and TailCompressor; see the module docstring."""

    name = "record"
    shardable = True
    # Whether CUDA gradients may go to the Triton backend (the subclass's compress_layer then
    # works on a DeviceFlat through the dispatching helpers below).
    device_backend = False

    def __init__(self, settings: RecordSettings, *, feedback: ErrorFeedback | None = None) -> None:
        """``feedback``: the error-feedback memory to run with (injected, e.g. one kept on another
        device or shared with a second stage); a fresh one when None; none at all when
        ``settings.error_feedback`` is off."""
        super().__init__()
        self.settings = settings
        self.raw_below_numel = int(settings.raw_below_numel)
        if not settings.error_feedback and feedback is not None:
            raise ConfigError(f"{self.name}: an error-feedback memory was given but error_feedback is false")
        self.feedback: ErrorFeedback | None = None
        if settings.error_feedback:
            self.feedback = feedback if feedback is not None else ErrorFeedback()
        self._own_records: list[LayerRecord] | None = None  # what the latest ``compress`` sent

    # --- sending: the template ------------------------------------------------------------
    def compress(self, grads: Mapping[str, torch.Tensor]) -> bytes:
        layers = self.compress_records(grads)
        payload, self._last_stats = encode_with_stats(layers)
        self._own_records = [layer.record for layer in layers]
        return payload

    def compress_shards(
        self,
        grads: Mapping[str, torch.Tensor],
        shards: Sequence[Mapping[str, slice]],
        *,
        own_shard: int | None = None,
    ) -> list[bytes]:
        layers = {layer.record.name: layer for layer in self.compress_records(grads)}
        payloads: list[bytes] = []
        slice_costs: dict[str, list[EncodedLayer]] = {name: [] for name in layers}
        own: list[LayerRecord] | None = None
        for k, shard in enumerate(shards):
            cut = []
            for name, part in shard.items():
                record = layers[name].record
                start, stop, _ = part.indices(record.numel)
                cut.append(slice_record(record, start, stop))
            payload, costs = encode_payload(cut)
            for cost in costs:
                slice_costs[cost.name].append(cost)
            payloads.append(payload)
            if k == own_shard:
                own = cut
        self._last_stats = [
            sliced_layer_stats(layer, slice_costs[name])
            for name, layer in layers.items()
            if slice_costs[name]
        ]
        self._own_records = own
        return payloads

    def second_stage(self) -> RecordCompressor:
        return self.spawn()

    def spawn(self) -> RecordCompressor:
        """A fresh instance from the same settings (a set seed salted: independent rounding)."""
        # Settings are frozen dataclasses (the registry builds them); a set seed is salted.
        values = dataclasses.asdict(self.settings)  # type: ignore[call-overload]
        settings = self.settings
        if values.get("seed") is not None:
            seed = (int(values["seed"]) * _SPAWN_SEED_SALT + 1) & 0xFFFF_FFFF
            settings = dataclasses.replace(settings, seed=seed)  # type: ignore[type-var]
        return type(self)(settings)

    def compress_records(self, grads: Mapping[str, torch.Tensor]) -> list[CompressedLayer]:
        """The engine's part of ``compress``: everything but the wire's encoding."""
        self.begin_call(grads)
        return [self._compress_one(name, self._layer_array(t)) for name, t in grads.items()]

    def _layer_array(self, t: torch.Tensor) -> LayerArray:
        """The backend's view of one gradient: a DeviceFlat for the Triton path, else numpy."""
        if self.device_backend and t.numel() >= max(self.raw_below_numel, 1) and uses_triton(t):
            return device_flat(t)
        return as_flat_f32(t)

    def _compress_one(self, name: str, g: LayerArray) -> CompressedLayer:
        if g.size < max(self.raw_below_numel, 1):
            return self.compress_small(name, _host(g))
        if isinstance(g, DeviceFlat):
            from tail_ray.compression import device_codec

            sum_sq = device_codec.sum_squares(g)
        else:
            sum_sq = float(sum_squares(g))
        if not math.isfinite(sum_sq):
            warn_nonfinite(name)
            return CompressedLayer(RawRecord(name, _host(g)))
        return self.compress_layer(name, g, sum_sq)

    def compress_small(self, name: str, g: np.ndarray) -> CompressedLayer:
        """A layer below ``raw_below_numel`` (host array, not checked for finiteness): raw fp32
        by default; a subclass may send it some cheaper near-lossless way."""
        return CompressedLayer(RawRecord(name, g))

    def begin_call(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Called once per ``compress`` before any layer (counters, seeds); nothing by default."""
        return None  # a no-op by default

    @abstractmethod
    def compress_layer(self, name: str, g: LayerArray, sum_sq: float) -> CompressedLayer:
        """The subclass's code for one finite layer of at least ``raw_below_numel`` elements:
        ``g`` is its flat float32 gradient (read-only; a DeviceFlat only when the class sets
        ``device_backend``), ``sum_sq`` its sum of squares."""

    def residual_of(self, name: str, g: LayerArray) -> np.ndarray | torch.Tensor | None:
        """The layer's error-feedback residual where ``g`` lives (None: error feedback off)."""
        if self.feedback is None:
            return None
        if isinstance(g, DeviceFlat):
            return self.feedback.device_buffer(name, g.size, g.tensor.device)
        return self.feedback.buffer(name, g.size)

    def quantize_layer(
        self,
        name: str,
        g: LayerArray,
        bits: int,
        bucket_size: int,
        seed: int,
        rounding: str = "stochastic",
        cuts: Sequence[int] | None = None,
    ) -> tuple[QuantRecord, int]:
        """Quantization of g + e in one fused pass (Tail's and qsgd's kernel), which also writes
        the new residual and its norm; returns the record and its non-zero levels. ``rounding``
        is a kernel rounding (quantize.ROUNDINGS), on either backend (under "dither" the record
        carries ``seed`` for the receiver).
        ``cuts``: under dither, the element starts of the slices a sharded exchange sends (at
        multiples of ``bucket_size``): each slice is dithered from its own seed
        (``quantize.slice_seed``), so each decodes alone (``records.slice_record``)."""
        if isinstance(g, DeviceFlat) and bucket_size > MAX_DEVICE_BUCKET:
            _warn_big_bucket(bucket_size)
            g = g.host()  # and its residual moves to the host with it (residual_of below)
        dither = is_dither(rounding)
        # Dither keeps no residual: one left by another code (low-rank, a checkpoint of another
        # rounding) is added in once, and then dropped.
        carried = self.feedback is not None and name in self.feedback
        residual = self.residual_of(name, g) if carried or not dither else None
        if isinstance(g, DeviceFlat):
            assert residual is None or isinstance(residual, torch.Tensor)
            if dither:
                record, nnz = dither_on_device(g, residual, bits, bucket_size, seed, cuts)
                if self.feedback is not None:
                    self.feedback.reset(name)  # the kernel emptied a residual carried in
                return replace(record, name=name), nnz
            from tail_ray.compression import device_codec

            out = device_codec.quantize(g, residual, bits, bucket_size, seed, rounding)
            if self.feedback is not None:
                self.feedback.measured(name, out.err_sq)
            return QuantRecord(name, bits, bucket_size, out.scales, out.levels), out.nnz
        levels = np.empty(g.size, dtype=np.int8)
        scales = np.empty(n_buckets(g.size, bucket_size), dtype=np.float32)
        assert residual is None or isinstance(residual, np.ndarray)
        if dither and cuts is not None and list(cuts) != [0]:
            record, nnz = dither_in_slices(g, residual, bits, bucket_size, seed, cuts, levels, scales)
            if self.feedback is not None:
                self.feedback.reset(name)
            return replace(record, name=name), nnz
        nnz, err_sq = quantize_finite(g, residual, bits, bucket_size, seed, levels, scales, rounding=rounding)
        if self.feedback is not None and dither:
            self.feedback.reset(name)
        elif self.feedback is not None:
            self.feedback.measured(name, err_sq)
        record = QuantRecord(
            name, bits, bucket_size, scales, levels, dither_seed=seed & 0xFFFFFFFF if dither else None
        )
        return record, int(nnz)

    # --- receiving ------------------------------------------------------------------------
    def decompress(self, payload: bytes) -> dict[str, torch.Tensor]:
        return records_to_flat(decode_payload(payload))

    @staticmethod
    def decompress_records(records: Sequence[LayerRecord]) -> dict[str, torch.Tensor]:
        """The engine's part of ``decompress``: dequantize decoded records."""
        return records_to_flat(records)

    def aggregate(
        self, payloads: Sequence[bytes], into: Mapping[str, torch.Tensor], *, own: int | None = None
    ) -> None:
        """Decode every rank's payload to records (this rank's own from the latest ``compress``,
        handed out once), show them to ``observe_peers``, and write the mean into ``into``."""
        mine, self._own_records = self._own_records, None
        # A payload may describe at most these elements: a crafted or garbled one that claims a
        # huge (e.g. all-zero sparse) layer fails before anything that size is allocated.
        max_numel = sum(g.numel() for g in into.values())
        records_by_rank = [
            {
                rec.name: rec
                for rec in (
                    mine if rank == own and mine is not None else decode_payload(p, max_numel=max_numel)
                )
            }
            for rank, p in enumerate(payloads)
        ]
        # The controller's spread sample is read by the mean itself (or, where it cannot be,
        # before the layer's mean is written: this rank's raw records alias its gradients).
        sums = mean_records_into(records_by_rank, into, sample_strides=self.spread_strides(records_by_rank))
        self.observe_peers(records_by_rank, sums)

    def spread_strides(self, records_by_rank: Sequence[Mapping[str, LayerRecord]]) -> dict[str, int]:
        """The layers whose between-rank spread ``observe_peers`` reads, at what sample stride
        (peer_spread.py); none by default."""
        return {}

    def observe_peers(
        self, records_by_rank: Sequence[Mapping[str, LayerRecord]], sums: Mapping[str, PeerSums] | None = None
    ) -> None:
        """Every rank's decoded records of one exchange, and the spread sums ``aggregate`` read
        for ``spread_strides``' layers (a controller's noise estimate); no-op by default."""
        return None

    # --- error feedback and checkpoints --------------------------------------------------
    def fold_residuals(self, grads: Mapping[str, torch.Tensor]) -> None:
        if self.feedback is not None:
            self.feedback.fold_into(grads)

    def residuals_of(self, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return {str(name): torch.as_tensor(e).reshape(-1) for name, e in dict(state["residuals"]).items()}

    def state_dict(self) -> dict[str, Any]:
        """``{"residuals": {name: tensor}}``; subclasses add their own keys."""
        return {"residuals": self.feedback.state_dict() if self.feedback is not None else {}}

    def load_state_dict(self, state: Mapping[str, Any], *, residuals: bool = True) -> None:
        """Residuals are per worker: restored on a restart with the same workers; with
        ``residuals=False`` (a resize) every worker starts from zero. Giving rank 0's residual
        to every new worker would apply it W times over; dropping it loses at most one step's
        compression error per layer. A residual whose size no longer matches its layer is
        reset to zero on first use."""
        if self.feedback is None:
            return
        if residuals:
            self.feedback.load_state_dict(state["residuals"])
        else:
            self.feedback.reset()
