"""Run the service under uvicorn with a request-head read timeout:
`python -m service.serve [--host H --port P | --fd N]`.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but has no timeout for a
request that is still arriving: a client that connects and sends its headers a byte at a time
(slowloris), or nothing at all, holds a connection and its buffers forever; every byte it sends
even cancels the keep-alive timer. ``HeadTimeoutH11Protocol`` gives each request head
``request_head_timeout_s`` from its first byte (or from the connection's start) to arrive
complete, then closes the connection. A body that stalls is cut by ``BodySizeLimit``'s read
timeout (service/limits.py), and a connection whose request was answered before its body was
all read is closed.

``--fd``: serve on a listening socket inherited from the parent. `tail-ray up` binds the port
itself and hands the same socket to every service process it (re)starts, so the port is ours
for the stack's whole life, and clients that connect while the service restarts wait in the
backlog instead of being refused.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.main import create_app
from service.settings import Settings


class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for each request head."""

    head_timeout_s: float = 10.0  # set per server by ``protocol_with_head_timeout``

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        # The deadline runs from the first byte of a head: a new request on a kept-alive
        # connection gets a fresh one, trickling bytes do not extend it.
        if self.conn.their_state is h11.IDLE:
            self._arm_head_timer()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()  # the head is complete (or the connection failed)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            # Answered before the body was all read (413, 408, 401): what is still on its way
            # must not be read as the next request, nor keep the connection open.
            self.transport.close()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection whose request head took over %.0f s", self.head_timeout_s)
            self.transport.close()


def protocol_with_head_timeout(head_timeout_s: float) -> type[HeadTimeoutH11Protocol]:
    return type("HeadTimeoutH11Protocol", (HeadTimeoutH11Protocol,), {"head_timeout_s": head_timeout_s})


def uvicorn_config(settings: Settings, **kwargs: Any) -> uvicorn.Config:
    """The one uvicorn configuration of the service (`up`, tests, deployments)."""
    kwargs.setdefault("log_level", "warning")
    return uvicorn.Config(
        create_app(settings),
        http=protocol_with_head_timeout(settings.request_head_timeout_s),
        timeout_keep_alive=5,
        # SSE streams never end by themselves: bound how long a stop waits for them.
        timeout_graceful_shutdown=5,
        **kwargs,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--fd", type=int, help="serve on this inherited listening socket instead")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--no-access-log", action="store_true")
    args = parser.parse_args(argv)
    settings = Settings()  # type: ignore[call-arg]  # fields come from the environment
    options: dict[str, Any] = {"log_level": args.log_level, "access_log": not args.no_access_log}
    if args.fd is None:
        uvicorn.Server(uvicorn_config(settings, host=args.host, port=args.port, **options)).run()
    else:
        sock = socket.socket(fileno=args.fd)
        uvicorn.Server(uvicorn_config(settings, **options)).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
