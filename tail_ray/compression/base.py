"""The interface every compressor (Tail and the fixed-setting peers) implements.

Roles follow GRACE: a compressor turns one step's gradients into ONE self-describing
payload and back. Only the payload travels; whatever state a compressor keeps (error
feedback residuals, the bit-width controller) stays local, and ``decompress`` never needs
it, so any instance decodes any peer's payload.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from tail_ray.compression.stats import LayerStats


@runtime_checkable
class Compressor(Protocol):
    name: str

    @property
    def last_stats(self) -> list[LayerStats]:
        """Per-layer records of the latest ``compress`` call."""
        ...

    def compress(self, grads: Mapping[str, torch.Tensor]) -> bytes:
        """Compress one step's gradients, keyed by parameter name, into one payload."""
        ...

    def decompress(self, payload: bytes) -> dict[str, torch.Tensor]:
        """Decode any peer's payload to fp32 CPU tensors keyed by layer name (flat, numel long)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state, keyed by layer name (never by DDP bucket index)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...
