"""RecordCompressor: what the record-producing compressors (qsgd, topk, tail) share."""

Each of them turns gradients into ``LayerRecord``s its own way; everything after that is the
same: encode the records with per-layer stats, keep them so the hook can take this rank's own
without entropy decoding (``records_last``), decode any peer's payload to records or tensors,
and fold error-feedback residuals into a step the link-aware switch sends uncompressed.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tail_ray.compression.feedback import ErrorFeedback
from tail_ray.compression.layers import encode_with_stats, records_to_flat
from tail_ray.compression.stats import LayerStats
from tail_ray.compression.wire import MAX_NUMEL, LayerRecord, decode_payload


class RecordCompressor:
    """Base of QSGDCompressor, TopKCompressor and TailCompressor; see the module docstring.

    A subclass implements ``compress_records`` and sets ``self._pending`` there: one
    (rel_error, nnz) per record, paired with each layer's wire cost in ``last_stats``.
    """

    name = "recorded"

    def __init__(self) -> None:
        self.feedback = ErrorFeedback()
        self._last: list[LayerStats] = []
        self._pending: list[tuple[float, int | None]] = []  # (rel_error, nnz) per record
        self._last_records: list[LayerRecord] | None = None  # what the last ``compress`` sent

    @property
    def last_stats(self) -> list[LayerStats]:
        return self._last

    # --- sending -------------------------------------------------------------------------
    def compress(self, grads: Mapping[str, torch.Tensor]) -> bytes:
        records = self.compress_records(grads)
        payload, self._last = encode_with_stats(records, self._pending)
        self._last_records = records
        return payload

    def compress_records(self, grads: Mapping[str, torch.Tensor]) -> list[LayerRecord]:
        """The engine's part of ``compress`` (everything but the wire's encoding)."""
        raise NotImplementedError

    def records_last(self) -> list[LayerRecord] | None:
        """The records of the last ``compress`` call (what its payload decodes to: the coding is
        lossless), without entropy-decoding anything; the hook's fused decode-average uses them
        for its own rank. Raw layers' values alias the caller's gradient: read them before
        overwriting it. None before the first ``compress``; handed out once.
        """
        records, self._last_records = self._last_records, None
        return records

    def fold_residuals(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Add each layer's residual into its gradient (in place) and clear it: the hook calls
        this for a step it sends by plain all-reduce (see tail_ray/collective/gate.py)."""
        self.feedback.fold_into(grads)

    # --- receiving -----------------------------------------------------------------------
    def decompress(self, payload: bytes) -> dict[str, torch.Tensor]:
        return records_to_flat(decode_payload(payload))

    @staticmethod
    def decode_records(payload: bytes, *, max_numel: int = MAX_NUMEL) -> list[LayerRecord]:
        """Any peer's payload to records (levels and scales, not yet dequantized)."""
        return decode_payload(payload, max_numel=max_numel)

    @staticmethod
    def decompress_records(records: list[LayerRecord]) -> dict[str, torch.Tensor]:
        """The engine's part of ``decompress``: dequantize decoded records."""
        return records_to_flat(records)
