"""Service errors, all in the TailError family, and the handlers that map errors to HTTP.

Code raises what went wrong (``JobNotFound``, ``RayUnavailable``); only this module knows
status codes. ``ConfigError`` from tail_ray (a job spec the runner's config rejects) is a
client mistake, so 422.

Every error body is ``{"code": ..., "detail": ...}``; for request validation ``detail`` is a
list of ``{loc, msg, type, input?}``. The handlers answer for hostile input too, so they must
never fail themselves: everything that goes into an error body passes ``json_safe`` first
(non-finite floats, lone surrogates, huge integers, deep or huge containers all become
bounded plain JSON), and the validation handler has a fixed fallback body.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

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


class InvalidHeader(ServiceError):
    """A request header the route reads is malformed or out of range (e.g. Last-Event-ID)."""

    status_code = 400
    code = "invalid_header"


# What an error body may echo of the client's input: enough to see what was wrong, never an
# unbounded copy of a hostile body.
MAX_ECHO_CHARS = 200
MAX_ECHO_ITEMS = 10
MAX_ECHO_DEPTH = 3
MAX_VALIDATION_ERRORS = 50
# JSON numbers past 2**63 lose precision in most clients; Python's int -> str also refuses
# past 4300 digits. Echo a description instead.
_MAX_ECHO_INT = 2**63


def json_safe(value: Any, *, bounded: bool = True) -> Any:
    """``value`` as plain, strict, UTF-8-encodable JSON data. ``bounded``: cut to a few
    hundred characters, ten items per container, three levels (for echoes of client input;
    the service's own messages go out whole). Total: it answers for any object (falling back
    to a type name), so an error handler built on it cannot raise."""
    try:
        return _json_safe(value, 0, bounded)
    except Exception:
        return f"<{type(value).__name__}>"


def _json_safe(value: Any, depth: int, bounded: bool) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return (
            value if -_MAX_ECHO_INT <= value <= _MAX_ECHO_INT else f"<integer of {value.bit_length()} bits>"
        )
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, str):
        return _text(value, bounded)
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value[: MAX_ECHO_CHARS * 4] if bounded else value)
        return _text(data.decode("utf-8", errors="replace"), bounded)
    max_items = MAX_ECHO_ITEMS if bounded else None
    if isinstance(value, Mapping):
        if bounded and depth >= MAX_ECHO_DEPTH:
            return f"<object of {len(value)} keys>"
        items = list(value.items())
        out = {_text(str(k), bounded): _json_safe(v, depth + 1, bounded) for k, v in items[:max_items]}
        if max_items is not None and len(items) > max_items:
            out["..."] = f"{len(items) - max_items} more keys"
        return out
    if isinstance(value, list | tuple | set | frozenset):
        if bounded and depth >= MAX_ECHO_DEPTH:
            return f"<array of {len(value)} items>"
        seq = list(value)
        shown = [_json_safe(v, depth + 1, bounded) for v in seq[:max_items]]
        if max_items is not None and len(seq) > max_items:
            shown.append(f"... {len(seq) - max_items} more items")
        return shown
    return _text(str(value), bounded)  # exceptions in a pydantic error's ctx, enums, ...


def _text(text: str, bounded: bool = True) -> str:
    if bounded and len(text) > MAX_ECHO_CHARS:
        text = f"{text[:MAX_ECHO_CHARS]}... ({len(text)} characters)"
    # Lone surrogates (a JSON "\ud800" escape decodes to one) cannot be encoded as UTF-8.
    return text.encode("utf-8", errors="backslashreplace").decode("utf-8")


def json_response(status: int, body: Any, headers: Mapping[str, str] | None = None) -> Response:
    """Strict JSON (no NaN, always encodable) of a body the service built; parts that echo
    client input must already have passed ``json_safe``."""
    content = json.dumps(json_safe(body, bounded=False), allow_nan=False, ensure_ascii=False)
    return Response(
        content.encode("utf-8"), status_code=status, headers=headers, media_type="application/json"
    )


def error_body(code: str, message: str) -> dict[str, str]:
    return {"code": code, "detail": message}


async def tail_error_handler(request: Request, exc: Exception) -> Response:
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
    return json_response(status, error_body(code, str(exc)), headers)


# A fixed body for the impossible case that building the real one fails.
_FALLBACK_VALIDATION_BODY = json.dumps(
    {"code": "invalid_request", "detail": [{"loc": ["request"], "msg": "invalid request", "type": "invalid"}]}
).encode()


async def validation_error_handler(request: Request, exc: Exception) -> Response:
    """422 listing what is wrong where: ``{loc, msg, type}`` per error plus a bounded, strict-
    JSON echo of the offending ``input`` (FastAPI's own handler raised on NaN in a body, and
    would on a lone surrogate)."""
    try:
        raw = exc.errors() if isinstance(exc, RequestValidationError) else []
        errors = []
        for err in list(raw)[:MAX_VALIDATION_ERRORS]:
            item: dict[str, Any] = {
                "loc": [json_safe(p if isinstance(p, int) else str(p)) for p in err.get("loc", ())],
                "msg": json_safe(str(err.get("msg", "")), bounded=False),
                "type": str(err.get("type", "")),
            }
            if "input" in err:
                item["input"] = json_safe(err["input"])
            if err.get("ctx"):
                item["ctx"] = json_safe(err["ctx"])
            errors.append(item)
        if len(raw) > MAX_VALIDATION_ERRORS:
            more = len(raw) - MAX_VALIDATION_ERRORS
            errors.append({"loc": ["request"], "msg": f"{more} more errors", "type": "truncated"})
        return json_response(422, {"code": "invalid_request", "detail": errors})
    except Exception:
        logger.exception("building the 422 body failed; answering with the fallback body")
        return Response(_FALLBACK_VALIDATION_BODY, status_code=422, media_type="application/json")


# Codes for the errors Starlette/FastAPI raise themselves (unknown route, wrong method, a body
# that cannot be parsed at all, ...), so that every error body has the same shape.
_HTTP_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


async def http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)  # registered for HTTPException only
    if exc.status_code in (204, 304):  # no body allowed
        return Response(status_code=exc.status_code, headers=exc.headers)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    detail = str(exc.detail)
    if exc.status_code == 400 and exc.__cause__ is not None:
        # FastAPI's "There was an error parsing the body" hides why: nested too deeply, not
        # UTF-8, an integer past Python's 4300-digit limit, ... Say it (bounded).
        detail = f"{detail}: {json_safe(str(exc.__cause__))}"
    return json_response(exc.status_code, error_body(code, detail), exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(TailError, tail_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(HTTPException, http_error_handler)
