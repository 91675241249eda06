"""Per-layer statistics every compressor reports after ``compress``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LayerStats:
    """What compressing one layer cost and bought, for one step.

    ``raw_bytes`` is the fp32 size of the layer; ``encoded_bytes`` is everything this layer
    adds to the payload (its header share, scales, positions and body). ``bits`` is the
    quantizer's bit-width, 32 for layers sent raw in fp32 and 16 for fp16.
    """

    layer: str
    numel: int
    bits: int
    density: float
    raw_bytes: int
    encoded_bytes: int
    rel_error: float
    code: str

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.encoded_bytes if self.encoded_bytes else float("inf")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ratio"] = self.ratio
        return out
