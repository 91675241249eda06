"""/v1/jobs: submit, list, read, stop, logs."""

from __future__ import annotations

import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Query, status

from service.deps import (
    IngesterDep,
    JobDep,
    PackagesDep,
    RayDep,
    SettingsDep,
    StorageDep,
    guard_reads,
    require_token,
)
from service.errors import JobConflict, JobNotFound, RayUnavailable
from service.routing import AuthFirstRoute
from service.schemas import JobCreate, JobLogs, JobPublic, JobsPage
from service.status import JobStatus
from service.storage import JobRow
from service.submission import plan_submission

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=AuthFirstRoute)


def to_public(job: JobRow) -> JobPublic:
    return JobPublic(
        id=job.id,
        name=job.name,
        source=job.source,  # type: ignore[arg-type]
        status=JobStatus.from_ray(job.status),
        message=job.message,
        entrypoint=job.entrypoint,
        spec=job.spec,
        created_at=job.created_at,
        started_at=job.started_at,
        ended_at=job.ended_at,
    )


def _reload(storage: StorageDep, job_id: str) -> JobRow:
    job = storage.get_job(job_id)
    if job is None:  # jobs are never deleted; only a swapped database file gets here
        raise JobNotFound(f"job {job_id!r} vanished from the database")
    return job


@router.post(
    "",
    operation_id="create_job",
    status_code=status.HTTP_201_CREATED,
    dependencies=[Depends(require_token)],
    responses={
        403: {"description": "Custom entrypoints are turned off on this service"},
        503: {"description": "Ray did not take the job"},
    },
)
def create_job(
    spec: JobCreate, storage: StorageDep, ray: RayDep, settings: SettingsDep, packages: PackagesDep
) -> JobPublic:
    """Validate a job spec and hand it to Ray: the built-in trainer as `python -m jobs.train
    --set ...`, or your own entrypoint in your uploaded working_dir (needs the token: it runs
    your code on the cluster)."""
    plan = plan_submission(spec, settings, packages)  # every check first: nothing half-stored
    job_id = f"tail-{uuid.uuid4().hex[:16]}"
    storage.insert_job(
        job_id=job_id,
        name=plan.name,
        source="api",
        status=JobStatus.PENDING,
        entrypoint=plan.entrypoint,
        spec=plan.spec,
    )
    try:
        ray.submit(job_id, plan.entrypoint, plan.runtime_env)
    except RayUnavailable as exc:
        storage.update_job_status(job_id, JobStatus.FAILED, f"submission failed: {exc}")
        raise
    return to_public(_reload(storage, job_id))


@router.get("", operation_id="list_jobs", dependencies=[Depends(guard_reads)])
def list_jobs(
    storage: StorageDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
) -> JobsPage:
    """Newest first; includes jobs submitted by hand with `ray job submit`."""
    rows, total = storage.list_jobs(limit, offset)
    return JobsPage(items=[to_public(r) for r in rows], total=total, limit=limit, offset=offset)


@router.get("/{job_id}", operation_id="get_job", dependencies=[Depends(guard_reads)])
def get_job(job: JobDep) -> JobPublic:
    return to_public(job)


@router.post(
    "/{job_id}/stop",
    operation_id="stop_job",
    dependencies=[Depends(require_token)],
    responses={409: {"description": "The job already ended"}, 503: {"description": "Ray unavailable"}},
)
def stop_job(job: JobDep, storage: StorageDep, ray: RayDep, ingester: IngesterDep) -> JobPublic:
    """Ask Ray to stop the job. Stopping is asynchronous in Ray: the answer carries the state
    Ray reports once asked, or STOPPING while Ray has not finished (the job then reads STOPPING
    until Ray says it ended)."""
    if job.is_terminal:
        raise JobConflict(f"job {job.id} already ended ({job.status}); nothing to stop")
    try:
        ray.stop(job.id)
    except JobConflict:  # Ray does not know it: the job was lost with its cluster
        ingester.mark_lost(job.id, job.status)
        raise JobConflict(
            f"Ray has no job {job.id!r}: it was lost with the cluster it ran on; marked FAILED"
        ) from None
    now = ray.job(job.id)
    if now.status.is_terminal:
        storage.update_job_status(job.id, now.status, now.message, now.start_time_s, now.end_time_s)
    else:
        asked = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())
        message = f"stop requested at {asked}; Ray reported {now.status} and is stopping it"
        storage.update_job_status(job.id, JobStatus.STOPPING, message, now.start_time_s)
    return to_public(_reload(storage, job.id))


@router.get(
    "/{job_id}/logs",
    operation_id="get_job_logs",
    # Always: driver output and the full entrypoint are no dashboard figures.
    dependencies=[Depends(require_token)],
    responses={503: {"description": "Ray unavailable"}},
)
def get_job_logs(job: JobDep, ray: RayDep, settings: SettingsDep) -> JobLogs:
    """The job driver's output from Ray (its tail, at most ``logs_max_bytes``). Needs the token."""
    text = ray.logs(job.id)
    data = text.encode()
    truncated = len(data) > settings.logs_max_bytes
    if truncated:
        text = data[-settings.logs_max_bytes :].decode(errors="replace")
    return JobLogs(job_id=job.id, logs=text, truncated=truncated)
