"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from service.deps import RayDep, StorageDep
from service.errors import RayUnavailable
from service.routing import AuthFirstRoute
from service.schemas import Health
from service.storage import StorageError

router = APIRouter(tags=["health"], route_class=AuthFirstRoute)


@router.get("/healthz", operation_id="healthz")
def healthz() -> Health:
    """The process is up and serving."""
    return Health(status="ok")


@router.get("/readyz", operation_id="readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(storage: StorageDep, ray: RayDep) -> JSONResponse:
    """Ready when the database takes a write and Ray answers (job server and GCS); else 503."""
    checks: dict[str, str] = {}
    try:
        await run_in_threadpool(storage.check_writable)
        checks["database"] = "ok"
    except StorageError as exc:
        checks["database"] = str(exc)
    try:
        await run_in_threadpool(ray.ping_jobs)
        await run_in_threadpool(ray.connect)
        checks["ray"] = "ok"
    except RayUnavailable as exc:
        checks["ray"] = str(exc)
    ok = all(v == "ok" for v in checks.values())
    body = Health(status="ok" if ok else "unavailable", checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)
