"""Request body size limit: a request body over ``max_body_bytes`` gets 413 before any route
reads it, whether it declares its size (Content-Length, refused at once) or streams it chunked
(counted as it arrives, refused when it crosses the limit). The biggest legitimate body, a
job spec, is well under 4 KiB."""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` while a route reads a chunked body. An HTTPException, because
    FastAPI turns any other error while reading a body into a 400."""

    def __init__(self, max_body_bytes: int) -> None:
        super().__init__(413, f"request body over {max_body_bytes} bytes")


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.max_body_bytes
            except ValueError:
                too_big = False  # the server rejects a malformed Content-Length itself
            if too_big:
                await self._reject(send)
                return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._reject(send)

    async def _reject(self, send: Send) -> None:
        body: dict[str, Any] = {
            "code": "body_too_large",
            "detail": f"request body over {self.max_body_bytes} bytes",
        }
        data = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})
