"""Live metrics over server-sent events: one watcher per job, shared by all its subscribers.

A dashboard used to poll four routes every few seconds; now it holds one stream
(``GET /v1/jobs/{id}/metrics/stream``) and the server pushes what changed. Per job with at
least one subscriber, a ``_Feed`` task reads the job's ingest version every
``sse_interval_s`` (one primary-key read, however many subscribers); when it changed, it builds
the summary, the layers and the newest step once (through the read cache, shared with the REST
routes) and wakes every subscriber. Each subscriber then sends the finished steps after its
own cursor (also through the cache: subscribers at the same cursor share one query), then the
shared events.

Events: ``step`` (id = the step; final: every rank reported, or a newer step exists),
``newest`` (the newest step as reported so far, may still change, no id so ``Last-Event-ID``
only ever names final steps), ``summary``, ``layers``, and ``end`` once the job ended and its
metrics are drained.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from dataclasses import dataclass

from service.read_cache import ReadCache
from service.settings import Settings
from service.storage import Storage
from service.views import layers_json, steps_view, summary_view

logger = logging.getLogger(__name__)
PAGE_STEPS = 1000
KEEPALIVE_S = 15.0


@dataclass(frozen=True)
class Snapshot:
    """One version of a job's metrics, its events serialized once for every subscriber."""

    tick: int
    version: Hashable
    final_below: int | None  # steps below this are final; None: all are (the job is drained)
    shared_events: str  # newest + summary + layers
    end_event: str | None  # set once the job ended and was drained


class _Feed:
    def __init__(self, job_id: str, storage: Storage, cache: ReadCache, interval_s: float) -> None:
        self.job_id = job_id
        self.storage, self.cache, self.interval_s = storage, cache, interval_s
        self.subscribers = 0
        self.snapshot: Snapshot | None = None
        self.changed = asyncio.Condition()
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        last_version: Hashable = object()
        while self.subscribers > 0:
            try:
                version = await asyncio.to_thread(self.storage.ingest_version, self.job_id)
                if version != last_version:
                    tick = self.snapshot.tick + 1 if self.snapshot else 0
                    snapshot = await asyncio.to_thread(self._build, tick, version)
                    last_version = version
                    async with self.changed:
                        self.snapshot = snapshot
                        self.changed.notify_all()
                    if snapshot.end_event is not None:
                        return  # drained: nothing will change any more
            except Exception:  # a failed read (database restarting): try again next interval
                logger.exception("live metrics for job %s: read failed", self.job_id)
            await asyncio.sleep(self.interval_s)

    def _build(self, tick: int, version: Hashable) -> Snapshot:
        storage, cache, job_id = self.storage, self.cache, self.job_id
        job = storage.get_job(job_id)
        summary = summary_view(storage, cache, job_id, version)
        drained = job is not None and job.is_terminal and summary.ingest.drained
        events = []
        newest = summary.last_step
        final_below = None if drained else newest
        if newest is not None and not drained:
            # While running, the newest step may still miss ranks: sent as `newest`, not final.
            points = steps_view(storage, cache, job_id, newest - 1, 1, None, version)
            if points and points[0].step == newest:
                events.append(f"event: newest\ndata: {points[0].model_dump_json()}\n\n")
        events.append(f"event: summary\ndata: {summary.model_dump_json()}\n\n")
        events.append(f"event: layers\ndata: {layers_json(storage, cache, job_id, version).decode()}\n\n")
        end = None
        if drained:
            status = job.status if job else ""
            end = f"event: end\ndata: {json.dumps({'job_id': job_id, 'status': status})}\n\n"
        return Snapshot(tick, version, final_below, "".join(events), end)


class LiveMetrics:
    def __init__(self, storage: Storage, cache: ReadCache, settings: Settings) -> None:
        self.storage, self.cache, self.settings = storage, cache, settings
        self._feeds: dict[str, _Feed] = {}

    @contextlib.asynccontextmanager
    async def _subscribe(self, job_id: str) -> AsyncIterator[_Feed]:
        feed = self._feeds.get(job_id)
        if feed is None or feed.task is None or feed.task.done():
            feed = self._feeds[job_id] = _Feed(job_id, self.storage, self.cache, self.settings.sse_interval_s)
        feed.subscribers += 1
        if feed.task is None:
            feed.task = asyncio.create_task(feed.run(), name=f"live-metrics:{job_id}")
        try:
            yield feed
        finally:
            feed.subscribers -= 1
            if feed.subscribers == 0 and self._feeds.get(job_id) is feed:
                del self._feeds[job_id]  # its task ends at its next interval

    async def events(
        self, job_id: str, after_step: int, is_disconnected: Callable[[], Awaitable[bool]]
    ) -> AsyncIterator[str]:
        """One subscriber's stream: its final steps after ``after_step``, then the shared events
        of every new snapshot; ``end`` closes it."""
        yield "retry: 3000\n\n"
        cursor = after_step
        async with self._subscribe(job_id) as feed:
            seen = -1
            while True:
                snapshot = await self._next(feed, seen)
                if snapshot is None:  # nothing new for a while
                    if await is_disconnected():
                        return
                    yield ": keep-alive\n\n"
                    continue
                seen = snapshot.tick
                async for event, step in self._final_steps(job_id, cursor, snapshot):
                    cursor = step
                    yield event
                yield snapshot.shared_events
                if snapshot.end_event is not None:
                    yield snapshot.end_event
                    return

    async def _next(self, feed: _Feed, seen: int) -> Snapshot | None:
        async with feed.changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    feed.changed.wait_for(lambda: feed.snapshot is not None and feed.snapshot.tick > seen),
                    timeout=KEEPALIVE_S,
                )
            snapshot = feed.snapshot
        return snapshot if snapshot is not None and snapshot.tick > seen else None

    async def _final_steps(
        self, job_id: str, cursor: int, snapshot: Snapshot
    ) -> AsyncIterator[tuple[str, int]]:
        while True:
            points = await asyncio.to_thread(
                steps_view, self.storage, self.cache, job_id, cursor, PAGE_STEPS, snapshot.final_below,
                snapshot.version,
            )  # fmt: skip
            for point in points:
                cursor = point.step
                yield f"id: {cursor}\nevent: step\ndata: {point.model_dump_json()}\n\n", cursor
            if len(points) < PAGE_STEPS:
                return

    async def close(self) -> None:
        feeds, self._feeds = list(self._feeds.values()), {}
        for feed in feeds:
            feed.subscribers = 0
            if feed.task is not None:
                feed.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await feed.task
