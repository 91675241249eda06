"""Metric reads: per job (/v1/jobs/{id}/metrics/...) and Prometheus text (/metrics)."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from service.deps import (
    IngestStatusDep,
    JobDep,
    LiveDep,
    ReadCacheDep,
    ReadJobDep,
    SettingsDep,
    StorageDep,
    guard_reads,
)
from service.errors import InvalidHeader
from service.layer_bits import DEFAULT_MAX_POINTS, MAX_MAX_POINTS, LayerBitsHistory, layer_bits_view
from service.prometheus import render_prometheus
from service.read_cache import ReadCache
from service.routing import AuthFirstRoute
from service.schemas import LayerLatest, MetricsSummary, StepsPage
from service.storage import Storage
from service.views import Body, body_json, layers_body, recent_json, steps_page_body, summary_body

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


# The read routes return their cached JSON body as it is (views.py): response_model only
# documents it in the OpenAPI schema. A body young enough for ``read_max_staleness_s`` is
# answered on the event loop; only a rebuild goes to the thread pool (see deps.py for why).
@router.get("/layers", operation_id="get_layer_metrics", response_model=list[LayerLatest])
async def get_layer_metrics(job: ReadJobDep, storage: StorageDep, cache: ReadCacheDep) -> Response:
    """Per layer, its newest step aggregated over ranks: bits, density, ratio, bytes, error."""
    return await _answer(storage, cache, layers_body(storage, cache, job.id))


@router.get("/layers/bits", operation_id="get_layer_bits_history")
def get_layer_bits_history(
    job: JobDep,
    storage: StorageDep,
    cache: ReadCacheDep,
    max_points: Annotated[
        int,
        Query(
            ge=2,
            le=MAX_MAX_POINTS,
            description="Most windows per layer: the job's steps are cut into at most this many.",
        ),
    ] = DEFAULT_MAX_POINTS,
) -> LayerBitsHistory:
    """Per layer, its bits over the whole run (not only the newest step), downsampled to at most
    ``max_points`` step windows: mean, min and max bits over the ranks' records in each."""
    return layer_bits_view(storage, cache, job.id, max_points)


@router.get("/steps", operation_id="get_step_metrics", response_model=StepsPage)
async def get_step_metrics(
    job: ReadJobDep,
    storage: StorageDep,
    cache: ReadCacheDep,
    after_step: AfterStep = -1,
    limit: Annotated[int, Query(ge=1, le=5000)] = 500,
) -> Response:
    """The per-step series, oldest first; page with ``next_after_step``."""
    return await _answer(storage, cache, steps_page_body(storage, cache, job.id, after_step, limit))


@router.get("/summary", operation_id="get_metrics_summary", response_model=MetricsSummary)
async def get_metrics_summary(job: ReadJobDep, storage: StorageDep, cache: ReadCacheDep) -> Response:
    """Totals: traffic raw vs sent, traffic saved, overall and mean per-layer ratio."""
    return await _answer(storage, cache, summary_body(storage, cache, job.id))


async def _answer(storage: Storage, cache: ReadCache, body: Body) -> Response:
    """A young cached body on the event loop; a build in the thread pool."""
    json_bytes = recent_json(storage, cache, body)
    if json_bytes is None:
        json_bytes = await run_in_threadpool(body_json, storage, cache, body)
    return Response(json_bytes, media_type="application/json")


@router.get(
    "/stream",
    operation_id="stream_metrics",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"text/event-stream": {}},
            "description": "`step` (final steps, with ids), `newest`, `summary` and `layers` events as "
            "metrics arrive, then `end`.",
        }
    },
)
async def stream_metrics(
    job: JobDep,
    live: LiveDep,
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
    """Server-sent events, what the dashboard draws: one `step` event per finished step (id: the
    step, data: a StepPoint), `newest` (the newest step so far, may still change), `summary` (a
    MetricsSummary) and `layers` (list of LayerLatest) whenever the job's metrics change, and
    `end` once the job ended and its metrics are drained. Reconnects resume from
    ``Last-Event-ID`` (the last final step seen)."""
    start = after_step
    resumed = parse_last_event_id(last_event_id)
    if resumed is not None:
        start = max(start, resumed)
    return StreamingResponse(
        live.events(job.id, start, request.is_disconnected),
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


@prometheus_router.get(
    "/metrics",
    operation_id="prometheus_metrics",
    response_class=PlainTextResponse,
    dependencies=[Depends(guard_reads)],
    responses={200: {"content": {"text/plain": {}, "application/openmetrics-text": {}}}},
)
def prometheus_metrics(
    request: Request, storage: StorageDep, settings: SettingsDep, ingest: IngestStatusDep
) -> Response:
    """Prometheus text (OpenMetrics when Accept asks for it): job counts by status, per-job
    traffic and ratio for the newest ``prometheus_max_jobs`` jobs, per-layer ratio/bits capped at
    ``prometheus_max_layers``; the ingester lease and what storage holds."""
    accept = request.headers.get("accept")  # OpenAPI ignores an Accept parameter: read it here
    body, content_type = render_prometheus(
        storage,
        settings,
        ingest.last_error is None,
        accept,
        leader=ingest.leader,
        stored_here=ingest.stored_records,
    )
    return Response(body, media_type=content_type)
