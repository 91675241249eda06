"""The metric read models as API objects, through the read cache: what the REST routes and the
live stream both serve, so a dashboard on SSE and a poller on REST share one computation."""

from __future__ import annotations

from collections.abc import Hashable

from service.read_cache import ReadCache
from service.schemas import LayerLatest, MetricsSummary, StepPoint
from service.storage import Storage


def layers_view(
    storage: Storage, cache: ReadCache, job_id: str, version: Hashable | None = None
) -> list[LayerLatest]:
    version = storage.ingest_version(job_id) if version is None else version
    return cache.get(
        ("layers", job_id), version, lambda: [LayerLatest(**row) for row in storage.latest_layers(job_id)]
    )


def summary_view(
    storage: Storage, cache: ReadCache, job_id: str, version: Hashable | None = None
) -> MetricsSummary:
    version = storage.ingest_version(job_id) if version is None else version
    return cache.get(("summary", job_id), version, lambda: MetricsSummary(**storage.summary(job_id)))


def steps_view(
    storage: Storage,
    cache: ReadCache,
    job_id: str,
    after_step: int,
    limit: int,
    before_step: int | None = None,
    version: Hashable | None = None,
) -> list[StepPoint]:
    version = storage.ingest_version(job_id) if version is None else version
    return cache.get(
        ("steps", job_id, after_step, limit, before_step),
        version,
        lambda: [StepPoint(**r) for r in storage.steps(job_id, after_step, limit, before_step)],
    )
