"""A minimal HTTP/1.1 GET client on asyncio streams, for the load test's REST dashboards.

The load generator shares this machine's two cores with the service. httpx spends about a
millisecond of CPU per request; at a hundred dashboards the client's own queueing showed up as
the service's latency (a side probe on its own connection saw p50 2.4 ms while the httpx pollers
saw 13 ms for the same route). One keep-alive connection per dashboard, as a browser keeps one,
and only what the service's answers need: a status line, headers, a Content-Length body.
"""

from __future__ import annotations

import asyncio
import contextlib


class LeanHTTPError(Exception):
    """The connection failed or the answer was not HTTP/1.1 with a Content-Length."""


class LeanGet:
    """GET over one keep-alive connection to ``host:port``; reconnects after a failure."""

    def __init__(self, host: str, port: int, timeout_s: float = 30.0) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def get(self, path: str) -> tuple[int, bytes]:
        """(status, body) of ``GET path``."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._get(path)
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as exc:
            await self.close()
            raise LeanHTTPError(f"{type(exc).__name__}: {exc}") from exc

    async def _get(self, path: str) -> tuple[int, bytes]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        assert self._reader is not None
        self._writer.write(f"GET {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n\r\n".encode())
        head = await self._reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        length = None
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        if length is None:
            raise ValueError("no Content-Length in the answer")
        body = await self._reader.readexactly(length)
        return status, body

    async def close(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
