"""Metric records that leave every worker (TAIL.md, "Metrics that leave every worker").

Records travel as plain dicts (``to_dict``) so the sink, the service and the database need
no import of torch or of these classes; ``type`` tells the two kinds apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # records stay importable without torch (the service reads them)
    from tail_ray.compression.stats import LayerStats


@dataclass(frozen=True, slots=True)
class LayerMetric:
    """One layer, one step, one worker."""

    job_id: str
    step: int
    rank: int
    layer: str
    numel: int
    bits: int
    density: float
    raw_bytes: int
    encoded_bytes: int
    ratio: float
    rel_error: float
    code: str

    @classmethod
    def from_stats(cls, stats: LayerStats, *, job_id: str, step: int, rank: int) -> LayerMetric:
        """The record of what the hook reported for one layer (``LayerStats``) at ``step``."""
        return cls(
            job_id=job_id,
            step=step,
            rank=rank,
            layer=stats.layer,
            numel=stats.numel,
            bits=stats.bits,
            density=stats.density,
            raw_bytes=stats.raw_bytes,
            encoded_bytes=stats.encoded_bytes,
            ratio=stats.ratio,
            rel_error=stats.rel_error,
            code=stats.code,
        )

    def to_dict(self) -> dict[str, Any]:
        return {"type": "layer", **asdict(self)}


@dataclass(frozen=True, slots=True)
class StepMetric:
    """One step, one worker: traffic and where the time went."""

    job_id: str
    step: int
    rank: int
    world_size: int
    bytes_sent: int
    bytes_received: int
    raw_bytes: int
    compress_s: float
    decode_s: float
    comm_s: float
    step_s: float
    loss: float
    method: str
    wall_time_s: float  # unix time the step ended

    def to_dict(self) -> dict[str, Any]:
        return {"type": "step", **asdict(self)}


# The fields of each kind as they travel in a columnar sink page (``MetricsSink.read(columnar=True)``):
# everything but job_id, which the page names once. The service stores them in this order.
LAYER_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(LayerMetric) if f.name != "job_id")
STEP_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(StepMetric) if f.name != "job_id")
