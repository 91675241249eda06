"""Per-layer bits over steps as an API object, through the read cache (the dashboard's heat map).

Kept apart from ``schemas.py`` / ``views.py`` (the hot read models) because it is read far
less often: the dashboard refetches it when the live stream says the job's metrics changed, at
most every few seconds, never on every SSE tick.
"""

from __future__ import annotations

from collections.abc import Hashable

from pydantic import BaseModel, Field

from service.read_cache import MISS, ReadCache
from service.storage import Storage

DEFAULT_MAX_POINTS = 200
BITS_MAX_AGE_S = 5.0  # the dashboard refetches the heat map at most this often anyway
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
    lowrank_share: list[float] = Field(
        description="Fraction of the window's records (ranks x steps) that sent the layer as "
        "low-rank factors (code lowrank-r<rank>); their bits are the factors' (8), not the layer's."
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
    key = ("layer_bits", job_id, max_points)
    if version is None and cache.max_age_s > 0:
        # A whole run's history (0.15 s of SQL at 200k records) changes little per ingest round:
        # with a hundred dashboards refetching it every few seconds, one build per job per
        # BITS_MAX_AGE_S instead of one per ingest version.
        hit = cache.recent(key, max(cache.max_age_s, BITS_MAX_AGE_S))
        if hit is not MISS:
            return hit  # type: ignore[return-value]
    version = storage.ingest_version(job_id) if version is None else version

    def build() -> LayerBitsHistory:
        found = storage.layer_bits(job_id, max_points)
        return LayerBitsHistory(job_id=job_id, max_points=max_points, **found)

    return cache.get(key, version, build)
