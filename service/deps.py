"""Dependencies: the app's singletons, auth, and a job loaded once or 404.

The singletons (settings, storage, Ray gateway) are built once in ``main.create_app`` and
kept on ``app.state``; routes receive them through the ``Annotated`` aliases below.

Every dependency that does not touch the database is ``async def``: FastAPI runs a plain
``def`` dependency in its thread pool, and on a busy machine each such hop waits for a thread
to be scheduled and for the interpreter lock. A metric read used to make six of them before
its handler ran (docs/operations.md, "Third pass").
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from service.errors import Forbidden, JobNotFound, Unauthorized
from service.exposure import arrived_beyond_loopback
from service.ingester import Ingester, IngestStatus
from service.live import LiveMetrics
from service.packages import PackageStore
from service.ray_client import RayGateway
from service.read_cache import MISS, ReadCache
from service.settings import Settings
from service.storage import JobRow, Storage


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_storage(request: Request) -> Storage:
    storage: Storage = request.app.state.storage
    return storage


async def get_read_cache(request: Request) -> ReadCache:
    cache: ReadCache = request.app.state.read_cache
    return cache


async def get_live(request: Request) -> LiveMetrics:
    live: LiveMetrics = request.app.state.live
    return live


async def get_ray(request: Request) -> RayGateway:
    gateway: RayGateway = request.app.state.ray
    return gateway


async def get_packages(request: Request) -> PackageStore:
    store: PackageStore = request.app.state.packages
    return store


async def get_ingester(request: Request) -> Ingester:
    ingester: Ingester = request.app.state.ingester
    return ingester


async def get_ingest_status(request: Request) -> IngestStatus:
    """The ingester's status, from the thread or the child process that runs it."""
    status: IngestStatus = request.app.state.ingest_status()
    return status


SettingsDep = Annotated[Settings, Depends(get_settings)]
StorageDep = Annotated[Storage, Depends(get_storage)]
RayDep = Annotated[RayGateway, Depends(get_ray)]
IngesterDep = Annotated[Ingester, Depends(get_ingester)]
IngestStatusDep = Annotated[IngestStatus, Depends(get_ingest_status)]
ReadCacheDep = Annotated[ReadCache, Depends(get_read_cache)]
LiveDep = Annotated[LiveMetrics, Depends(get_live)]
PackagesDep = Annotated[PackageStore, Depends(get_packages)]

_bearer = HTTPBearer(auto_error=False, description="The service's API token (TAIL_RAY_API_TOKEN).")
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _check_token(settings: Settings, credentials: HTTPAuthorizationCredentials | None) -> None:
    if credentials is None:
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <TAIL_RAY_API_TOKEN>'")
    expected = settings.api_token.get_secret_value().encode()
    if not secrets.compare_digest(credentials.credentials.encode(), expected):
        raise Forbidden("invalid bearer token")


async def require_token(settings: SettingsDep, credentials: BearerDep) -> None:
    """Every mutating route depends on this."""
    _check_token(settings, credentials)


async def guard_reads(request: Request, settings: SettingsDep, credentials: BearerDep) -> None:
    """Read routes: open on loopback, guarded when the request came in beyond loopback (the
    service is bound to a network address) or ``read_requires_token`` says so."""
    required = settings.read_requires_token
    if required is None:
        required = arrived_beyond_loopback(request.scope)
    if required:
        _check_token(settings, credentials)


JobIdPath = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]


def load_job(job_id: JobIdPath, storage: StorageDep) -> JobRow:
    job = storage.get_job(job_id)
    if job is None:
        raise JobNotFound(f"no job {job_id!r}; list jobs with GET /v1/jobs")
    return job


JobDep = Annotated[JobRow, Depends(load_job)]


async def load_job_for_reads(job_id: JobIdPath, storage: StorageDep, cache: ReadCacheDep) -> JobRow:
    """``load_job`` for the metric reads, within their bounded staleness: a job row read less
    than ``read_max_staleness_s`` ago is taken from the read cache on the event loop (a metric
    read only needs the job to exist); otherwise it is read in the thread pool. The job routes
    keep ``load_job``, exact: a client that just cancelled a job must see it cancelled."""
    key = ("job", job_id)

    def read() -> JobRow:
        return load_job(job_id, storage)  # raises JobNotFound: nothing cached for a missing job

    def reread() -> JobRow:
        # A fresh version object: ``get`` always reads; it only records when (for ``recent``).
        return cache.get(key, object(), read)

    hit = cache.recent(key, refresh=reread)  # refreshed ahead of expiry, as the bodies are
    if hit is not MISS:
        return hit  # type: ignore[return-value]
    return await run_in_threadpool(reread)


ReadJobDep = Annotated[JobRow, Depends(load_job_for_reads)]


async def check_token_of(request: Request) -> None:
    """``require_token`` on a bare request: ``routing.AuthFirstRoute`` runs it before FastAPI
    reads the body (and so before any dependency)."""
    _check_token(request.app.state.settings, await _bearer(request))
