"""The compressor contract: everything a collective asks of a compressor, with no-op defaults.

Roles follow GRACE: a compressor turns one exchange's gradients into ONE self-describing
payload and back; only the payload travels. Whatever state a compressor keeps (error-feedback
residuals, the bit-width controller) stays local, and decoding never needs it, so any
instance decodes any rank's payload.

A collective (tail_ray.collective) drives a compressor through these calls only, and never
looks inside a payload or a record:

    payload = c.compress(grads)                      # {name: gradient} -> bytes
    ... exchange payloads between ranks ...
    c.aggregate(payloads, grads, own=rank)           # decode, observe, mean into grads
    c.fold_residuals(grads)                          # a step sent uncompressed instead
    c.set_lr(lr)                                     # training signal, once per step
    c.state_dict() / c.load_state_dict(sd, residuals=...)

``grads`` maps parameter names to gradient tensors (views of a DDP bucket: writing them
writes what DDP reads back). A collective other than all-gather drives the same calls per
shard: ``compress`` any subset of layers, ``aggregate`` any number of payloads that each
hold exactly the layers of ``into``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tail_ray.compression.aggregate import mean_tensors_into
from tail_ray.compression.stats import LayerStats


class Compressor(ABC):
    """Base of every compressor; subclasses implement ``compress`` and ``decompress``.

    The defaults fit a stateless compressor: ``aggregate`` decodes every payload to tensors
    and averages them; there is nothing to fold, no schedule, nothing to checkpoint.
    """

    name = "compressor"

    def __init__(self) -> None:
        self._last_stats: list[LayerStats] = []

    @property
    def last_stats(self) -> list[LayerStats]:
        """Per-layer records of the latest ``compress`` call, in its layer order."""
        return self._last_stats

    @abstractmethod
    def compress(self, grads: Mapping[str, torch.Tensor]) -> bytes:
        """Compress gradients keyed by parameter name into one payload (never writes ``grads``)."""

    @abstractmethod
    def decompress(self, payload: bytes) -> dict[str, torch.Tensor]:
        """Decode any rank's payload to flat fp32 CPU tensors keyed by layer name."""

    def aggregate(
        self, payloads: Sequence[bytes], into: Mapping[str, torch.Tensor], *, own: int | None = None
    ) -> None:
        """Write the mean over ``payloads`` of each layer of ``into`` into it, in place.

        ``payloads[own]`` (when given) is what this compressor's latest ``compress`` returned,
        so a compressor may take it from what it still holds instead of decoding it. Every
        payload must hold every layer of ``into`` at its size; otherwise ``CodecError``, raised
        before anything is written. A compressor with a controller observes the payloads
        here (after decoding, before writing). Payloads are averaged in the order given.
        """
        mean_tensors_into([self.decompress(p) for p in payloads], into)

    def fold_residuals(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Add what error feedback still owes into ``grads`` (in place) and forget it: called
        for a step the collective sends uncompressed. No error feedback: nothing owed."""
        return None  # a no-op by default

    def set_lr(self, lr: float) -> None:
        """The learning rate of the coming step (a controller may tighten after a drop)."""
        return None  # a no-op by default

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state, keyed by layer name (never by DDP bucket index)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any], *, residuals: bool = True) -> None:
        """Restore ``state_dict()``; ``residuals=False`` (a resized job) starts error feedback
        from zero and keeps everything else."""
        return None  # a no-op by default
