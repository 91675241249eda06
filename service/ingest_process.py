"""The ingester in its own process: the service's reads never wait for ingest's interpreter lock.

Ingest is pure Python per record (deserializing sink pages, checking and converting them) at
up to 100k records a second. In a thread of the service process it held the interpreter lock
85% of the time the lock was held at all (py-spy --gil, under the cluster-scale load test),
and every read route waited for it at each hop between the event loop and its worker thread.
In a child process the two are scheduled by the kernel instead, each with its own lock.

``IngestProcess`` (in the service) starts ``python -m service.ingest_process`` under the
lifeline (the kernel stops the child when the service dies, even by SIGKILL), hands it the
settings on stdin (the database URL and tokens never appear in argv or the environment of a
process listing), follows the status line the child prints after each pass (leader or not,
records stored, last error: what /metrics and /readyz show), and restarts it with backoff if
it exits. Crash safety is the ingester's own: each page commits with its cursor, so a child
killed mid-page resumes from the stored cursor, nothing lost and nothing doubled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from pydantic import SecretStr

from service.ingester import Ingester, IngestStatus
from service.ray_client import RayGateway
from service.settings import Settings
from service.storage import open_storage

logger = logging.getLogger(__name__)

STATUS_EVERY_S = 2.0  # a status line at least this often, so a stuck child shows as stale
STOP_TIMEOUT_S = 15.0  # SIGTERM, then this long for the page in flight, then SIGKILL
MAX_BACKOFF_S = 30.0


def settings_payload(settings: Settings) -> bytes:
    """The settings as the child reads them: JSON with the secrets' values, not their masks."""
    values: dict[str, Any] = {}
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        values[name] = value.get_secret_value() if isinstance(value, SecretStr) else value
    return json.dumps(values, default=str).encode()


class IngestProcess:
    """Runs and supervises the child; ``status`` is what it reported last."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.status = IngestStatus(leader=False, stored_records=0, last_error="ingest process starting")
        self.pid: int | None = None
        self.restarts = 0

    async def run_forever(self, stop: asyncio.Event) -> None:
        backoff_s = 1.0
        while not stop.is_set():
            started = time.monotonic()
            rc = await self._run_child(stop)
            if stop.is_set():
                return
            self.restarts += 1
            backoff_s = 1.0 if time.monotonic() - started > 60 else min(2 * backoff_s, MAX_BACKOFF_S)
            message = f"ingest process exited with code {rc}; restarting in {backoff_s:.0f} s"
            logger.warning(message)
            self.status = IngestStatus(False, self.status.stored_records, message)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=backoff_s)

    async def _run_child(self, stop: asyncio.Event) -> int | None:
        cmd = [sys.executable, "-m", "service.lifeline", str(os.getpid()), "--",
               sys.executable, "-m", "service.ingest_process"]  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        self.pid = proc.pid
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(settings_payload(self.settings))
        await proc.stdin.drain()
        proc.stdin.close()
        follow = asyncio.create_task(self._follow(proc.stdout))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({follow, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if stopped.done():
            await self._stop_child(proc)
        stopped.cancel()
        rc = await proc.wait()
        await follow
        self.pid = None
        return rc

    async def _follow(self, stdout: asyncio.StreamReader) -> None:
        """Read status lines until the child closes its stdout (it exited)."""
        while line := await stdout.readline():
            try:
                self.status = IngestStatus(**json.loads(line))
            except (ValueError, TypeError):
                logger.warning("ingest process: unreadable status line %r", line[:200])

    async def _stop_child(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout=STOP_TIMEOUT_S)
        except TimeoutError:
            logger.warning("ingest process did not stop within %.0f s; killing it", STOP_TIMEOUT_S)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()


def _emit(status: IngestStatus) -> None:
    sys.stdout.write(json.dumps(status.__dict__) + "\n")
    sys.stdout.flush()


def child_main() -> int:
    """The child: ingest passes every ``ingest_interval_s`` until SIGTERM (or its stdout, the
    service's pipe, breaks), a status line after each pass that changed it."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s ingest: %(message)s")
    settings = Settings(**json.loads(sys.stdin.buffer.read()))
    if settings.ingest_niceness:
        # Catching up on a backlog takes every cycle it can get; reads are what a person waits
        # for. A lower CPU priority lets the kernel run the service's request threads first on a
        # busy machine, and costs ingest nothing when a core is free.
        os.nice(settings.ingest_niceness)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    storage = open_storage(settings.storage_url)
    ingester = Ingester(settings, storage, RayGateway(settings))
    last: IngestStatus | None = None
    last_at = 0.0
    try:
        while not stop.is_set():
            try:
                ingester.run_once()
            except Exception:  # keep ingesting whatever one bad pass did
                logger.exception("ingest pass failed")
            status = ingester.status()
            if status != last or time.monotonic() - last_at >= STATUS_EVERY_S:
                _emit(status)
                last, last_at = status, time.monotonic()
            stop.wait(settings.ingest_interval_s)
    except BrokenPipeError:  # the service is gone; the lifeline's SIGTERM is on its way
        pass
    finally:
        ingester.close()
        storage.close()
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
