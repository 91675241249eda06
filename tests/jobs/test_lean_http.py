"""The load test's lean HTTP client (jobs/lean_http.py) against a real asyncio server on
loopback: keep-alive reuse, statuses and bodies as sent, and a clear error (then a fresh
connection) for answers it cannot read."""

from __future__ import annotations

import asyncio

import pytest

from jobs.lean_http import LeanGet, LeanHTTPError


async def _serve(answers: dict[str, bytes]) -> tuple[asyncio.Server, int, list[int]]:
    """A server answering each request line's path from ``answers``; it records, per request,
    which connection (a counter) carried it."""
    connections: list[int] = []
    opened = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal opened
        opened += 1
        me = opened
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                connections.append(me)
                writer.write(answers[path])
                await writer.drain()
                if path == "/close":
                    break
        except asyncio.IncompleteReadError:
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], connections


def test_statuses_bodies_and_keep_alive() -> None:
    async def run() -> None:
        body = b'{"ok": true}'
        server, port, connections = await _serve({
            "/a": b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body),
            "/missing": b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\n{}",
        })  # fmt: skip
        async with server:
            get = LeanGet("127.0.0.1", port)
            assert await get.get("/a") == (200, body)
            assert await get.get("/missing") == (404, b"{}")
            assert await get.get("/a") == (200, body)
            await get.close()
        assert connections == [1, 1, 1]  # one connection carried all three

    asyncio.run(run())


def test_unreadable_answers_raise_and_the_next_request_reconnects() -> None:
    async def run() -> None:
        server, port, connections = await _serve({
            "/chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            "/close": b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
            "/a": b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n",
        })  # fmt: skip
        async with server:
            get = LeanGet("127.0.0.1", port, timeout_s=5)
            with pytest.raises(LeanHTTPError, match="Content-Length"):
                await get.get("/chunked")
            assert await get.get("/a") == (204, b"")
            with pytest.raises(LeanHTTPError, match="IncompleteReadError"):
                await get.get("/close")  # the body ends early: the server closed
            assert await get.get("/a") == (204, b"")
            await get.close()
        # a failed answer drops its connection; a good one keeps it for the next request
        assert connections == [1, 2, 2, 3]

    asyncio.run(run())
