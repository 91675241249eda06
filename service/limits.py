"""Request body limits: a request body over ``max_body_bytes`` gets 413 before any route
reads it, whether it declares its size (Content-Length, refused at once) or streams it chunked
(counted as it arrives, refused when it crosses the limit). The biggest legitimate body, a
job spec, is well under 4 KiB. A body that stops arriving for ``read_timeout_s`` gets 408 and
the connection is closed (a slow-body client would otherwise hold it forever; the request
head has its own deadline, see service/serve.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` while a route reads a chunked body. An HTTPException, because
    FastAPI turns any other error while reading a body into a 400."""

    def __init__(self, max_body_bytes: int) -> None:
        super().__init__(413, f"request body over {max_body_bytes} bytes")


class BodyReadTimeout(HTTPException):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the request body stalled for {timeout_s:g} s")


def declares_body(scope: Scope) -> bool:
    """True when the request says a body follows (a non-zero Content-Length, or chunked)."""
    headers = dict(scope.get("headers") or [])
    if b"transfer-encoding" in headers:
        return True
    return headers.get(b"content-length", b"0").strip() not in (b"", b"0")


def with_connection_close(message: Message) -> Message:
    """``message`` (an http.response.start) saying ``Connection: close``: the client then opens
    a new connection for its next request instead of reusing one the server is about to close
    (a reused one would be reset: the server closes a connection whose body it did not read,
    see service/serve.py)."""
    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
    return {**message, "headers": [*headers, (b"connection", b"close")]}


class BodySizeLimit:
    """``max_body_bytes`` for every route but those in ``path_limits`` (exact paths: the
    package upload takes a zip of megabytes)."""

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        read_timeout_s: float = 30.0,
        path_limits: dict[str, int] | None = None,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s
        self.path_limits = dict(path_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope.get("path", ""), self.max_body_bytes)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > limit
            except ValueError:
                too_big = False  # the server rejects a malformed Content-Length itself
            if too_big:
                await self._reject(send, detail=f"request body over {limit} bytes")
                return
        seen = 0
        started = False
        body_done = False

        async def limited_receive() -> Message:
            nonlocal seen, body_done
            if body_done:  # only http.disconnect is left to wait for (an SSE stream waits long)
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), timeout=self.read_timeout_s)
            except TimeoutError:
                raise BodyReadTimeout(self.read_timeout_s) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        has_body = declares_body(scope)

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if has_body and not body_done:  # answered before the body was read (401, 404 ...)
                    message = with_connection_close(message)
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._reject(send, detail=f"request body over {limit} bytes")
        except BodyReadTimeout as exc:
            if not started:
                await self._reject(send, 408, "body_timeout", str(exc.detail))

    async def _reject(
        self, send: Send, status: int = 413, code: str = "body_too_large", detail: str = ""
    ) -> None:
        detail = detail or f"request body over {self.max_body_bytes} bytes"
        body: dict[str, Any] = {"code": code, "detail": detail}
        data = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                    # The rest of the body may still be on its way: never read it as a request.
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})
