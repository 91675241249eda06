"""Where a training process's metric records go: the job's Ray sink, or a local JSON-lines file.

A ``MetricsWriter`` takes the plain-dict records of one optimizer step (``extend``), sends
what it holds without waiting (``flush``) and may wait, boundedly, only in ``close``. Inside
Ray (a Ray Train worker, or any process connected to a cluster) records go to the job's
``MetricsSink`` actor through ``MetricsClient``, fire-and-forget, so the service finds them
by job id. Outside Ray (torchrun, plain DDP, a notebook) they go to one JSON-lines file per
rank, ``<dir>/<job_id>.rank<r>.jsonl``, which ``tail-ray`` and ``jq`` read alike.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import IO, Any, Protocol

logger = logging.getLogger(__name__)

METRICS_DIR_ENV = "TAIL_RAY_METRICS_DIR"
DEFAULT_METRICS_DIR = "tail-ray-metrics"
CLOSE_TIMEOUT_S = 5.0
# How long a worker waits, once, at start-up for its job's sink actor to be up. Pushes to an
# actor still being created queue inside the calling process, and a worker that dies before
# the actor is up (Ray Train tears down the whole group when one rank fails) loses them all:
# CI lost a first attempt's steps 0-5 that way on a slow machine. Pushes to a live actor have
# left the process within milliseconds.
SINK_READY_TIMEOUT_S = 10.0


class MetricsWriter(Protocol):
    """What a training session hands its records to (one per process)."""

    def extend(self, records: list[dict[str, Any]]) -> None: ...

    def flush(self) -> None: ...

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None: ...

    @property
    def dropped_records(self) -> int: ...

    def describe(self) -> str: ...


def _wait_until_up(sink: Any, name: str) -> None:
    """Wait (at most SINK_READY_TIMEOUT_S, once per worker) for the sink actor to answer.
    ``__ray_ready__`` is every actor's own no-op, so a sink of an older release answers too.
    Not up in time: training goes on and the records queue as before (never an error)."""
    import ray

    try:
        ray.get(sink.__ray_ready__.remote(), timeout=SINK_READY_TIMEOUT_S)
    except Exception as exc:  # GetTimeoutError, RayActorError: metrics must not stop training
        logger.warning(
            "metrics sink %s not up after %.0f s (%s): records queue until it is",
            name,
            SINK_READY_TIMEOUT_S,
            type(exc).__name__,
        )


class RaySinkWriter:
    """The job's sink actor (created on first use, detached, named after the job id)."""

    def __init__(self, job_id: str, rank: int, queue_records: int = 20_000) -> None:
        from tail_ray.metrics.client import MetricsClient
        from tail_ray.metrics.sink import get_or_create_sink, sink_actor_name

        self._name = sink_actor_name(job_id)
        sink = get_or_create_sink(job_id)
        _wait_until_up(sink, self._name)
        self._client = MetricsClient(sink, rank=rank, queue_records=queue_records)

    def extend(self, records: list[dict[str, Any]]) -> None:
        self._client.extend(records)

    def flush(self) -> None:
        self._client.flush()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        self._client.close(timeout_s=timeout_s)

    @property
    def dropped_records(self) -> int:
        return self._client.dropped_records

    def describe(self) -> str:
        return f"Ray actor {self._name!r}"


class JsonlWriter:
    """One JSON object per line, appended to ``directory/<job_id>.rank<r>.jsonl``."""

    def __init__(self, directory: str | Path, job_id: str, rank: int) -> None:
        self.path = Path(directory) / f"{job_id}.rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")

    def extend(self, records: list[dict[str, Any]]) -> None:
        if self._file is None:
            return
        for record in records:
            # allow_nan: a NaN loss stays a record (the service stores such values as NULL).
            self._file.write(json.dumps(record, allow_nan=True) + "\n")

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    @property
    def dropped_records(self) -> int:
        return 0

    def describe(self) -> str:
        return str(self.path)


class ListWriter:
    """Records kept in memory (``records``): for tests and for code that reads them itself."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.closed = False

    def extend(self, records: list[dict[str, Any]]) -> None:
        self.records.extend(records)

    def flush(self) -> None:
        return None

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        self.closed = True

    @property
    def dropped_records(self) -> int:
        return 0

    def describe(self) -> str:
        return "memory"


def ray_connected() -> bool:
    """True in a process connected to a Ray cluster (a Ray Train worker always is). Never
    imports ray itself: a torchrun process without it stays without it."""
    import sys

    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


def open_writer(target: MetricsWriter | str | Path | None, job_id: str, rank: int) -> MetricsWriter:
    """``target`` as a writer: a writer as it is; a path: JSON lines in that directory; None:
    the Ray sink when connected to Ray, else JSON lines in ``$TAIL_RAY_METRICS_DIR`` (default
    ``./tail-ray-metrics``)."""
    if target is not None and not isinstance(target, str | Path):
        return target
    if target is not None:
        return JsonlWriter(target, job_id, rank)
    if ray_connected():
        return RaySinkWriter(job_id, rank)
    return JsonlWriter(os.environ.get(METRICS_DIR_ENV) or DEFAULT_METRICS_DIR, job_id, rank)
