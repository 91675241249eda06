"""Service errors, all in the TailError family, and the one handler that maps them to HTTP.

Code raises what went wrong (``JobNotFound``, ``RayUnavailable``); only this module knows
status codes. ``ConfigError`` from tail_ray (a job spec the runner's config rejects) is a
client mistake, so 422.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from service.storage.base import StorageError
from tail_ray.errors import ConfigError, TailError

logger = logging.getLogger(__name__)


class ServiceError(TailError):
    status_code = 500
    code = "internal_error"

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (self.message,))


class JobNotFound(ServiceError):
    status_code = 404
    code = "job_not_found"


class JobConflict(ServiceError):
    """The request does not fit the job's state (e.g. stopping a finished job)."""

    status_code = 409
    code = "job_conflict"


class RayUnavailable(ServiceError):
    """The Ray cluster (GCS or job server) did not answer or refused us."""

    status_code = 503
    code = "ray_unavailable"


class Unauthorized(ServiceError):
    status_code = 401
    code = "unauthorized"


class Forbidden(ServiceError):
    status_code = 403
    code = "forbidden"


def error_body(code: str, message: str) -> dict[str, str]:
    return {"code": code, "detail": message}


async def tail_error_handler(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, ServiceError):
        status, code = exc.status_code, exc.code
    elif isinstance(exc, StorageError):  # the database is down or refuses writes: retry later
        status, code = 503, "database_unavailable"
    elif isinstance(exc, ConfigError):
        status, code = 422, "invalid_config"
    else:
        status, code = 400, "bad_request"
    if status >= 500:
        logger.warning("%s %s -> %d %s", request.method, request.url.path, status, exc)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(code, str(exc)), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(TailError, tail_error_handler)
