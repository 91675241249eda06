"""The metric read models as API objects, through the read cache: what the REST routes and the
live stream both serve, so a dashboard on SSE and a poller on REST share one computation.

The ``*_json`` views cache the rendered response body too: at a hundred dashboards a second,
validating and serializing 200 layer objects per request (FastAPI does both for a returned
model) cost more than the cached query saved. ``version=None`` (a REST read) may take a result
younger than the cache's ``max_age_s`` without reading the version, and refreshes it ahead of
expiry (read_cache.py); the live stream passes the exact version of its snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
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
    if version is None:
        hit = _recent(storage, cache, key, build)
        if hit is not MISS:
            return hit  # type: ignore[return-value]
        return _current(storage, cache, key, build)
    exact = version
    return cache.get(key, exact, lambda: build(exact))


def _recent(
    storage: Storage, cache: ReadCache, key: tuple[Hashable, ...], build: Callable[[Hashable], T]
) -> object:
    """The cached result if young enough (else MISS), refreshed ahead of expiry (read_cache.py)."""
    return cache.recent(key, refresh=lambda: _current(storage, cache, key, build))


def _current(
    storage: Storage, cache: ReadCache, key: tuple[Hashable, ...], build: Callable[[Hashable], T]
) -> T:
    """The result at the job's ingest version now (read before the data: never older than it)."""
    versioned_at = time.monotonic()
    version = storage.ingest_version(str(key[1]))  # every key's second part is its job id
    return cache.get(key, version, lambda: build(version), versioned_at=versioned_at)


def layers_view(
    storage: Storage, cache: ReadCache, job_id: str, version: Hashable | None = None
) -> list[LayerLatest]:
    return _cached(
        storage, cache, ("layers", job_id), version,
        lambda _v: [LayerLatest(**row) for row in storage.latest_layers(job_id)],
    )  # fmt: skip


@dataclass(frozen=True)
class Body:
    """A route's JSON body in the cache: its key (the job id second) and how it is built at a
    version."""

    key: tuple[Hashable, ...]
    build: Callable[[Hashable], bytes]


def body_json(storage: Storage, cache: ReadCache, body: Body, version: Hashable | None = None) -> bytes:
    return _cached(storage, cache, body.key, version, body.build)


def recent_json(storage: Storage, cache: ReadCache, body: Body) -> bytes | None:
    """The body if the cache holds one younger than its ``max_age_s``, else None: what the
    routes answer on the event loop, without the database. Like ``body_json`` it starts a
    refresh ahead of expiry."""
    hit = _recent(storage, cache, body.key, body.build)
    return None if hit is MISS else hit  # type: ignore[return-value]


def layers_body(storage: Storage, cache: ReadCache, job_id: str) -> Body:
    """``layers_view`` as the JSON body of the layers route (and the stream's layers event)."""
    return Body(("layers.json", job_id), lambda v: _LAYERS.dump_json(layers_view(storage, cache, job_id, v)))


def layers_json(storage: Storage, cache: ReadCache, job_id: str, version: Hashable | None = None) -> bytes:
    return body_json(storage, cache, layers_body(storage, cache, job_id), version)


def summary_view(
    storage: Storage, cache: ReadCache, job_id: str, version: Hashable | None = None
) -> MetricsSummary:
    return _cached(
        storage, cache, ("summary", job_id), version, lambda _v: MetricsSummary(**storage.summary(job_id))
    )


def summary_body(storage: Storage, cache: ReadCache, job_id: str) -> Body:
    return Body(
        ("summary.json", job_id), lambda v: summary_view(storage, cache, job_id, v).model_dump_json().encode()
    )


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


def steps_page_body(storage: Storage, cache: ReadCache, job_id: str, after_step: int, limit: int) -> Body:
    """The steps route's body: a page of the series and the cursor of the next one."""

    def build(version: Hashable) -> bytes:
        items = steps_view(storage, cache, job_id, after_step, limit, None, version)
        next_after = items[-1].step if items else after_step
        return StepsPage(job_id=job_id, items=items, next_after_step=next_after).model_dump_json().encode()

    return Body(("steps.json", job_id, after_step, limit), build)
