"""Metric reads: per job (/v1/jobs/{id}/metrics/...) and Prometheus text (/metrics)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from service.deps import IngesterDep, JobDep, LiveDep, ReadCacheDep, SettingsDep, StorageDep, guard_reads
from service.prometheus import render_prometheus
from service.schemas import LayerLatest, MetricsSummary, StepsPage
from service.views import layers_view, steps_view, summary_view

router = APIRouter(prefix="/v1/jobs/{job_id}/metrics", tags=["metrics"], dependencies=[Depends(guard_reads)])
prometheus_router = APIRouter(tags=["metrics"])

AfterStep = Annotated[int, Query(ge=-1, le=2**53, description="Only steps greater than this.")]


@router.get("/layers", operation_id="get_layer_metrics")
def get_layer_metrics(job: JobDep, storage: StorageDep, cache: ReadCacheDep) -> list[LayerLatest]:
    """Per layer, its newest step aggregated over ranks: bits, density, ratio, bytes, error."""
    return layers_view(storage, cache, job.id)


@router.get("/steps", operation_id="get_step_metrics")
def get_step_metrics(
    job: JobDep,
    storage: StorageDep,
    cache: ReadCacheDep,
    after_step: AfterStep = -1,
    limit: Annotated[int, Query(ge=1, le=5000)] = 500,
) -> StepsPage:
    """The per-step series, oldest first; page with ``next_after_step``."""
    items = steps_view(storage, cache, job.id, after_step, limit)
    next_after = items[-1].step if items else after_step
    return StepsPage(job_id=job.id, items=items, next_after_step=next_after)


@router.get("/summary", operation_id="get_metrics_summary")
def get_metrics_summary(job: JobDep, storage: StorageDep, cache: ReadCacheDep) -> MetricsSummary:
    """Totals: traffic raw vs sent, traffic saved, overall and mean per-layer ratio."""
    return summary_view(storage, cache, job.id)


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
    last_event_id: Annotated[str | None, Header(max_length=32)] = None,
) -> StreamingResponse:
    """Server-sent events, what the dashboard draws: one `step` event per finished step (id: the
    step, data: a StepPoint), `newest` (the newest step so far, may still change), `summary` (a
    MetricsSummary) and `layers` (list of LayerLatest) whenever the job's metrics change, and
    `end` once the job ended and its metrics are drained. Reconnects resume from
    ``Last-Event-ID`` (the last final step seen)."""
    start = after_step
    if last_event_id is not None and last_event_id.lstrip("-").isdigit():
        start = max(start, int(last_event_id))
    return StreamingResponse(
        live.events(job.id, start, request.is_disconnected),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@prometheus_router.get(
    "/metrics",
    operation_id="prometheus_metrics",
    response_class=PlainTextResponse,
    dependencies=[Depends(guard_reads)],
    responses={200: {"content": {"text/plain": {}}}},
)
def prometheus_metrics(
    storage: StorageDep, settings: SettingsDep, ingester: IngesterDep
) -> PlainTextResponse:
    """Prometheus text: job counts by status, per-job traffic and ratio for the newest
    ``prometheus_max_jobs`` jobs, per-layer ratio/bits capped at ``prometheus_max_layers``."""
    body = render_prometheus(
        storage,
        settings,
        ingest_ok=ingester.last_error is None,
        leader=ingester.is_leader,
        stored_here=ingester.stored_records,
    )
    return PlainTextResponse(body, media_type="text/plain; version=0.0.4; charset=utf-8")
