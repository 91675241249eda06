"""Metric reads: per job (/v1/jobs/{id}/metrics/...) and Prometheus text (/metrics)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from service.deps import IngesterDep, JobDep, ReadCacheDep, SettingsDep, StorageDep, guard_reads
from service.errors import InvalidHeader
from service.prometheus import render_prometheus
from service.routing import AuthFirstRoute
from service.schemas import LayerLatest, MetricsSummary, StepPoint, StepsPage
from service.settings import Settings
from service.storage import Storage

router = APIRouter(
    prefix="/v1/jobs/{job_id}/metrics",
    tags=["metrics"],
    dependencies=[Depends(guard_reads)],
    route_class=AuthFirstRoute,
)
prometheus_router = APIRouter(tags=["metrics"], route_class=AuthFirstRoute)

# A step cursor: -1 (from the start) up to 2**53, which every JSON client (the dashboard is
# JavaScript) holds exactly and SQLite's 64-bit integers hold with room to spare (an
# unbounded cursor overflowed SQLite mid-stream).
MAX_STEP = 2**53
AfterStep = Annotated[int, Query(ge=-1, le=MAX_STEP, description="Only steps greater than this.")]
# ASCII digits only: int() also reads other scripts' digits (and str.isdigit() passes "²").
_STEP_TEXT = re.compile(r"-?[0-9]{1,16}")


@router.get("/layers", operation_id="get_layer_metrics")
def get_layer_metrics(job: JobDep, storage: StorageDep, cache: ReadCacheDep) -> list[LayerLatest]:
    """Per layer, its newest step aggregated over ranks: bits, density, ratio, bytes, error."""
    return cache.get(
        ("layers", job.id),
        storage.ingest_version(job.id),
        lambda: [LayerLatest(**row) for row in storage.latest_layers(job.id)],
    )


@router.get("/steps", operation_id="get_step_metrics")
def get_step_metrics(
    job: JobDep,
    storage: StorageDep,
    cache: ReadCacheDep,
    after_step: AfterStep = -1,
    limit: Annotated[int, Query(ge=1, le=5000)] = 500,
) -> StepsPage:
    """The per-step series, oldest first; page with ``next_after_step``."""

    def build() -> StepsPage:
        rows = storage.steps(job.id, after_step, limit)
        next_after = rows[-1]["step"] if rows else after_step
        return StepsPage(job_id=job.id, items=[StepPoint(**r) for r in rows], next_after_step=next_after)

    return cache.get(("steps", job.id, after_step, limit), storage.ingest_version(job.id), build)


@router.get("/summary", operation_id="get_metrics_summary")
def get_metrics_summary(job: JobDep, storage: StorageDep, cache: ReadCacheDep) -> MetricsSummary:
    """Totals: traffic raw vs sent, traffic saved, overall and mean per-layer ratio."""
    return cache.get(
        ("summary", job.id), storage.ingest_version(job.id), lambda: MetricsSummary(**storage.summary(job.id))
    )


@router.get(
    "/stream",
    operation_id="stream_metrics",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "`step` events, then `end`."}},
)
async def stream_metrics(
    job: JobDep,
    storage: StorageDep,
    settings: SettingsDep,
    request: Request,
    after_step: AfterStep = -1,
    last_event_id: Annotated[
        str | None,
        Header(
            description=f"The id of the last event received (a step, -1..{MAX_STEP}); browsers send it "
            "on reconnect. Anything else is a 400."
        ),
    ] = None,
) -> StreamingResponse:
    """Server-sent events: one `step` event per finished step (data: a StepPoint), an `end`
    event once the job ended and its metrics are drained. Reconnects resume from
    ``Last-Event-ID`` (the last step seen)."""
    start = after_step
    resumed = parse_last_event_id(last_event_id)
    if resumed is not None:
        start = max(start, resumed)
    return StreamingResponse(
        _step_events(job.id, start, storage, settings, request),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def parse_last_event_id(value: str | None) -> int | None:
    """The step a reconnecting client saw last; None when it sent none (an empty value is
    none too: the SSE spec sends the header only for a non-empty id)."""
    if not value:
        return None
    step = int(value) if _STEP_TEXT.fullmatch(value) else None
    if step is None or not -1 <= step <= MAX_STEP:
        raise InvalidHeader(
            f"Last-Event-ID must be a step number in -1..{MAX_STEP} (the id of the last event "
            f"received), got {value[:40]!r}"
        )
    return step


async def _step_events(
    job_id: str, after_step: int, storage: Storage, settings: Settings, request: Request
) -> AsyncIterator[str]:
    cursor = after_step
    yield "retry: 3000\n\n"
    while not await request.is_disconnected():
        job = await run_in_threadpool(storage.get_job, job_id)
        finished = job is not None and job.is_terminal
        drained = finished and (await run_in_threadpool(storage.ingest_state, job_id))["drained"]
        # While running, hold back the newest step: other ranks may not have reported it yet.
        newest = None if drained else await run_in_threadpool(storage.max_step, job_id)
        rows = await run_in_threadpool(storage.steps, job_id, cursor, 1000, newest)
        for row in rows:
            cursor = row["step"]
            payload = StepPoint(**row).model_dump_json()
            yield f"id: {cursor}\nevent: step\ndata: {payload}\n\n"
        if drained and len(rows) < 1000:
            end = json.dumps({"job_id": job_id, "status": job.status if job else ""})
            yield f"event: end\ndata: {end}\n\n"
            return
        if not rows:
            yield ": keep-alive\n\n"
        await asyncio.sleep(settings.sse_interval_s)


@prometheus_router.get(
    "/metrics",
    operation_id="prometheus_metrics",
    response_class=PlainTextResponse,
    dependencies=[Depends(guard_reads)],
    responses={200: {"content": {"text/plain": {}, "application/openmetrics-text": {}}}},
)
def prometheus_metrics(
    request: Request, storage: StorageDep, settings: SettingsDep, ingester: IngesterDep
) -> Response:
    """Prometheus text (OpenMetrics when Accept asks for it): job counts by status, per-job
    traffic and ratio for the newest ``prometheus_max_jobs`` jobs, per-layer ratio/bits capped at
    ``prometheus_max_layers``."""
    accept = request.headers.get("accept")  # OpenAPI ignores an Accept parameter: read it here
    body, content_type = render_prometheus(storage, settings, ingester.last_error is None, accept)
    return Response(body, media_type=content_type)
