"""Per-layer bits over steps as an API object, through the read cache (the dashboard's heat map).

Kept apart from ``schemas.py`` / ``views.py`` (the hot read models) because it is read far
less often: the dashboard refetches it when the live stream says the job's metrics changed, at
most every few seconds, never on every SSE tick.
"""

from __future__ import annotations

from collections.abc import Hashable

from pydantic import BaseModel, Field

from service.read_cache import ReadCache
from service.storage import Storage

DEFAULT_MAX_POINTS = 200
MAX_MAX_POINTS = 2000


class LayerBitsSeries(BaseModel):
    """One layer's windows, oldest first, as parallel lists (one entry per window)."""

    layer: str
    numel: int
    steps: list[int] = Field(description="The newest step in each window.")
    bits: list[float] = Field(description="Mean bits over every rank's records in the window.")
    min_bits: list[int] = Field(description="Fewest bits any rank sent in the window.")
    max_bits: list[int] = Field(
        description="Most bits any rank sent in the window (32 or 16: sent raw or all-reduced)."
    )


class LayerBitsHistory(BaseModel):
    """Per layer, its bit-width over the job's steps, cut into at most ``max_points`` windows of
    ``step_width`` steps (aligned at step 0). Ranks choose bits independently, so each window
    has the mean over ranks and steps and the min and max: min < max means the bits changed in
    the window or the ranks disagreed."""

    job_id: str
    max_points: int
    first_step: int | None = Field(description="The first step any layer reported; null before any.")
    last_step: int | None
    step_width: int = Field(description="Steps per window.")
    layers: list[LayerBitsSeries] = Field(description="In the order the layers first reported.")


def layer_bits_view(
    storage: Storage, cache: ReadCache, job_id: str, max_points: int, version: Hashable | None = None
) -> LayerBitsHistory:
    version = storage.ingest_version(job_id) if version is None else version

    def build() -> LayerBitsHistory:
        found = storage.layer_bits(job_id, max_points)
        return LayerBitsHistory(job_id=job_id, max_points=max_points, **found)

    return cache.get(("layer_bits", job_id, max_points), version, build)
