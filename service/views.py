"""The metric read models as API objects, through the read cache: what the REST routes and the
live stream both serve, so a dashboard on SSE and a poller on REST share one computation.

The ``*_json`` views cache the rendered response body too: at a hundred dashboards a second,
validating and serializing 200 layer objects per request (FastAPI does both for a returned
model) cost more than the cached query saved. ``version=None`` (a REST read) may take a result
younger than the cache's ``max_age_s`` without reading the version; the live stream passes the
exact version of its snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

from pydantic import TypeAdapter

from service.read_cache import MISS, ReadCache
from service.schemas import LayerLatest, MetricsSummary, StepPoint, StepsPage
from service.storage import Storage

T = TypeVar("T")
_LAYERS = TypeAdapter(list[LayerLatest])


def _cached(
    storage: Storage,
    cache: ReadCache,
    key: tuple[Hashable, ...],
    version: Hashable | None,
    build: Callable[[Hashable], T],
) -> T:
    job_id = key[1]
    if version is None:
        hit = cache.recent(key)
        if hit is not MISS:
            return hit  # type: ignore[return-value]
        version = storage.ingest_version(str(job_id))
    exact = version
    return cache.get(key, exact, lambda: build(exact))


def recent_body(cache: ReadCache, key: tuple[Hashable, ...]) -> bytes | None:
    """A ``*_json`` view's body if one younger than the cache's ``max_age_s`` is cached (the key
    as that view builds it), else None: the routes answer this on the event loop without
    touching the database."""
    hit = cache.recent(key)
    return None if hit is MISS else hit  # type: ignore[return-value]


def layers_view(
    storage: Storage, cache: ReadCache, job_id: str, version: Hashable | None = None
) -> list[LayerLatest]:
    return _cached(
        storage, cache, ("layers", job_id), version,
        lambda _v: [LayerLatest(**row) for row in storage.latest_layers(job_id)],
    )  # fmt: skip


def layers_json(storage: Storage, cache: ReadCache, job_id: str, version: Hashable | None = None) -> bytes:
    """``layers_view`` as the JSON body of the layers route (and the stream's layers event)."""
    return _cached(
        storage, cache, ("layers.json", job_id), version,
        lambda v: _LAYERS.dump_json(layers_view(storage, cache, job_id, v)),
    )  # fmt: skip


def summary_view(
    storage: Storage, cache: ReadCache, job_id: str, version: Hashable | None = None
) -> MetricsSummary:
    return _cached(
        storage, cache, ("summary", job_id), version, lambda _v: MetricsSummary(**storage.summary(job_id))
    )


def summary_json(storage: Storage, cache: ReadCache, job_id: str) -> bytes:
    return _cached(
        storage, cache, ("summary.json", job_id), None,
        lambda v: summary_view(storage, cache, job_id, v).model_dump_json().encode(),
    )  # fmt: skip


def steps_view(
    storage: Storage,
    cache: ReadCache,
    job_id: str,
    after_step: int,
    limit: int,
    before_step: int | None = None,
    version: Hashable | None = None,
) -> list[StepPoint]:
    return _cached(
        storage, cache, ("steps", job_id, after_step, limit, before_step), version,
        lambda _v: [StepPoint(**r) for r in storage.steps(job_id, after_step, limit, before_step)],
    )  # fmt: skip


def steps_page_json(storage: Storage, cache: ReadCache, job_id: str, after_step: int, limit: int) -> bytes:
    """The steps route's body: a page of the series and the cursor of the next one."""

    def build(version: Hashable) -> bytes:
        items = steps_view(storage, cache, job_id, after_step, limit, None, version)
        next_after = items[-1].step if items else after_step
        return StepsPage(job_id=job_id, items=items, next_after_step=next_after).model_dump_json().encode()

    return _cached(storage, cache, ("steps.json", job_id, after_step, limit), None, build)
