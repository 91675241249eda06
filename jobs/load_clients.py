"""The load test's parts (``jobs.load_test`` wires them): the training jobs' records, the producer
that pushes them at one step per interval, dashboards (REST pollers and SSE streams), and the
watcher that measures ingest progress and lag straight from the database.

The watcher reads only ``ingest_cursors`` (job_id, after_seq), a table every schema version of
the service has, so the same load test measures an older checkout (``--service-root``) too.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from jobs.lean_http import LeanGet, LeanHTTPError
from service.storage import parse_storage_url


@dataclass(frozen=True)
class Shape:
    """What the cluster trains: ``jobs`` jobs of ``ranks`` workers, ``layers`` layers each."""

    jobs: int
    ranks: int
    layers: int
    step_interval_s: float  # one step of every job per interval; 0: no live steps (backlog only)
    push_rows: bool = True  # push as workers do (columns, ``push_rows``); False: dicts, as before

    @property
    def records_per_step(self) -> int:
        """Per job: one record per layer and rank, plus one step record per rank."""
        return self.ranks * (self.layers + 1)

    def job_id(self, i: int) -> str:
        return f"load-{i:03d}"


def rank_templates(shape: Shape, job_id: str) -> list[list[dict[str, Any]]]:
    """Per rank, the records of one step (``step`` and ``wall_time_s`` filled in per step)."""
    out = []
    for rank in range(shape.ranks):
        recs: list[dict[str, Any]] = []
        for i in range(shape.layers):
            raw = 4 * 1000 * (1 + i % 50)
            enc = max(1, raw // (3 + i % 5))
            recs.append({
                "type": "layer", "job_id": job_id, "rank": rank, "layer": f"block{i // 4}.layer{i}.weight",
                "numel": raw // 4, "bits": 2 + i % 6, "density": 0.4, "raw_bytes": raw,
                "encoded_bytes": enc, "ratio": raw / enc, "rel_error": 0.02, "code": "rans",
            })  # fmt: skip
        recs.append({
            "type": "step", "job_id": job_id, "rank": rank, "world_size": shape.ranks, "bytes_sent": 1000,
            "bytes_received": 1000 * (shape.ranks - 1), "raw_bytes": 8000, "compress_s": 0.001,
            "decode_s": 0.001, "comm_s": 0.002, "step_s": 0.01, "loss": 1.0, "method": "tail",
        })  # fmt: skip
        out.append(recs)
    return out


def step_batch(template: list[dict[str, Any]], step: int, wall_time_s: float) -> list[dict[str, Any]]:
    return [{**rec, "step": step, "wall_time_s": wall_time_s} for rec in template]


# ------------------------------------------------------------------ the producer (own process)
def produce(
    shape: Shape,
    gcs_address: str,
    backlog_steps: int,
    capacity: int,
    ready: Any,
    go: Any,
    stop: Any,
    out: Any,
) -> None:
    """Create each job's sink, push ``backlog_steps`` steps, signal ``ready``; after ``go``, push
    one step of every job per ``step_interval_s`` (per rank, as each worker would) until
    ``stop``. Puts (job index, step, last seq of the step, push time) on ``out``."""
    import ray

    from tail_ray.metrics.columns import rows_of
    from tail_ray.metrics.sink import get_or_create_sink

    ray.init(address=gcs_address, log_to_driver=False, configure_logging=False)
    sinks = [get_or_create_sink(shape.job_id(j), capacity_records=capacity) for j in range(shape.jobs)]
    templates = [rank_templates(shape, shape.job_id(j)) for j in range(shape.jobs)]

    def push(j: int, rank: int, records: list[dict[str, Any]]) -> Any:
        # As a worker's MetricsClient does: the batch as columns, or (push_rows=False) as dicts.
        if shape.push_rows:
            return sinks[j].push_rows.remote(rows=rows_of(records), rank=rank)
        return sinks[j].push.remote(records=records, rank=rank)

    now = time.time()
    for step in range(backlog_steps):
        ray.get([push(j, r, step_batch(t, step, now))
                 for j in range(shape.jobs) for r, t in enumerate(templates[j])])  # fmt: skip
    ready.set()
    go.wait()
    step, t0 = backlog_steps, time.monotonic()
    while shape.step_interval_s > 0 and not stop.is_set():
        wall = time.time()
        for j in range(shape.jobs):
            for r, t in enumerate(templates[j]):
                push(j, r, step_batch(t, step, wall))  # fire and forget, as workers do
            out.put((j, step, (step + 1) * shape.records_per_step, time.time()))
        step += 1
        time.sleep(max(0.0, t0 + (step - backlog_steps) * shape.step_interval_s - time.monotonic()))
    ray.shutdown()


def produce_direct(
    shape: Shape,
    database_url: str,
    backlog_steps: int,
    _capacity: int,
    ready: Any,
    go: Any,
    stop: Any,
    out: Any,
) -> None:
    """No Ray: after ``go``, store the backlog as fast as ``Storage.ingest`` takes it, in pages of
    about 5,000 records per job (as the ingester does), then one step of every job per
    interval until ``stop``."""
    from service.storage import open_storage

    storage = open_storage(database_url)
    templates = [rank_templates(shape, shape.job_id(j)) for j in range(shape.jobs)]
    ready.set()
    go.wait()
    per_page = max(1, 5000 // shape.records_per_step)
    step = 0
    while step < backlog_steps and not stop.is_set():
        steps = range(step, min(backlog_steps, step + per_page))
        _store_steps(storage, shape, templates, steps, out)
        step = steps.stop
    t0, live = time.monotonic(), 0
    while shape.step_interval_s > 0 and not stop.is_set():
        _store_steps(storage, shape, templates, range(step, step + 1), out)
        step, live = step + 1, live + 1
        time.sleep(max(0.0, t0 + live * shape.step_interval_s - time.monotonic()))
    storage.close()


def _store_steps(storage: Any, shape: Shape, templates: list[Any], steps: range, out: Any) -> None:
    from service.storage import IngestBatch

    wall = time.time()
    for j in range(shape.jobs):
        first = steps.start * shape.records_per_step + 1
        records = [r for step in steps for t in templates[j] for r in step_batch(t, step, wall)]
        numbered = [{"seq": first + i, **r} for i, r in enumerate(records)]
        storage.ingest(shape.job_id(j), IngestBatch(numbered, first + len(numbered) - 1))
        for step in steps:
            out.put((j, step, (step + 1) * shape.records_per_step, wall))


def _niced(target: Any, niceness: int, *args: Any) -> None:
    os.nice(niceness)  # before any thread starts: Ray's threads inherit it
    target(*args)


def start_producer(
    shape: Shape, source: str, address: str, backlog_steps: int, capacity: int, niceness: int = 0
) -> Producer:
    """``address``: the Ray GCS (source "sink") or the database URL (source "direct")."""
    ctx = mp.get_context("spawn")  # a fresh interpreter: this process is a Ray driver already
    p = Producer(ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue())
    target = produce if source == "sink" else produce_direct
    p.process = ctx.Process(
        target=_niced,
        args=(target, niceness, shape, address, backlog_steps, capacity, p.ready, p.go, p.stop, p.out),
        daemon=True,
    )
    p.process.start()
    return p


@dataclass
class Producer:
    ready: Any
    go: Any
    stop: Any
    out: Any
    process: Any = None


# ------------------------------------------------------------------ dashboards
@dataclass
class RouteStats:
    latencies_s: dict[str, list[float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    stream_delays_s: list[float] = field(default_factory=list)
    stream_events: int = 0

    sent_at: list[float] = field(default_factory=list)  # monotonic send time of each latency, in order
    ordered_s: list[float] = field(default_factory=list)  # every latency, in the order added

    def add(self, route: str, seconds: float, sent_at: float) -> None:
        self.latencies_s.setdefault(route, []).append(seconds)
        self.sent_at.append(sent_at)
        self.ordered_s.append(seconds)

    def since(self, t: float) -> list[float]:
        """The latencies of requests sent at or after monotonic time ``t``."""
        return [s for at, s in zip(self.sent_at, self.ordered_s, strict=True) if at >= t]


class PollError(Exception):
    """A dashboard's request failed before an HTTP status came back."""


class HttpxPolls:
    """The pollers' GETs through one shared httpx client (``--client httpx``)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def status_of(self, path: str) -> int:
        try:
            return (await self.client.get(path)).status_code
        except httpx.HTTPError as exc:
            raise PollError(type(exc).__name__) from exc

    async def close(self) -> None:
        pass  # the client belongs to the caller


class LeanPolls:
    """One keep-alive connection of the lean client (jobs/lean_http.py), as a browser keeps
    one (``--client lean``, the default)."""

    def __init__(self, host: str, port: int) -> None:
        self.conn = LeanGet(host, port)

    async def status_of(self, path: str) -> int:
        try:
            return (await self.conn.get(path))[0]
        except LeanHTTPError as exc:
            raise PollError(str(exc)) from exc

    async def close(self) -> None:
        await self.conn.close()


async def poller(
    polls: HttpxPolls | LeanPolls,
    job_id: str,
    deadline: float,
    interval_s: float,
    offset_s: float,
    stats: RouteStats,
    first_route: int = 0,
) -> None:
    """A dashboard that polls: one route per interval, round robin over layers, steps, summary
    (steps: the first 500, as the load test always asked, so figures compare across versions;
    a client following the series incrementally is what the SSE streams measure), starting at
    ``first_route`` of the three."""
    await asyncio.sleep(offset_s)  # spread the pollers over one interval, as real browsers are
    i = first_route
    try:
        while time.monotonic() < deadline:
            route = ("layers", "steps", "summary")[i % 3]
            i += 1
            path = f"/v1/jobs/{job_id}/metrics/{route}"
            if route == "steps":
                path += "?after_step=-1&limit=500"
            t0, sent_at = time.perf_counter(), time.monotonic()
            try:
                status = await polls.status_of(path)
                if status != 200:
                    stats.errors.append(f"{route}: HTTP {status}")
            except PollError as exc:
                stats.errors.append(f"{route}: {exc}")
            stats.add(route, time.perf_counter() - t0, sent_at)
            if interval_s > 0:
                await asyncio.sleep(interval_s)
    finally:
        await polls.close()


async def streamer(
    client: httpx.AsyncClient, job_id: str, deadline: float, live_since: float, stats: RouteStats
) -> None:
    """A dashboard on server-sent events: how long after the producer pushed a step its first
    `newest` / `step` event arrives (push -> sink -> ingest -> database -> event), for the steps
    pushed since ``live_since`` (the backlog's steps were pushed before the service saw them)."""
    seen: set[int] = set()
    try:
        async with client.stream("GET", f"/v1/jobs/{job_id}/metrics/stream", timeout=None) as resp:
            if resp.status_code != 200:
                stats.errors.append(f"stream: HTTP {resp.status_code}")
                return
            event = ""
            async for line in resp.aiter_lines():
                if time.monotonic() > deadline:
                    return
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event in ("newest", "step"):
                    stats.stream_events += 1
                    point = json.loads(line[6:])
                    if point["step"] not in seen and point["wall_time_s"] >= live_since:
                        stats.stream_delays_s.append(time.time() - point["wall_time_s"])
                    seen.add(point["step"])
    except httpx.HTTPError as exc:
        stats.errors.append(f"stream: {type(exc).__name__}")


# ------------------------------------------------------------------ the watcher
class CursorReader:
    """``{job_id: after_seq}`` from the database, read-only, outside the service."""

    def __init__(self, url: str) -> None:
        self.backend, self.target = parse_storage_url(url)
        self._conn: Any = None

    def read(self) -> dict[str, int]:
        sql = "SELECT job_id, after_seq FROM ingest_cursors"
        if self.backend == "sqlite":
            if self._conn is None:
                self._conn = sqlite3.connect(
                    f"file:{self.target}?mode=ro", uri=True, timeout=30, check_same_thread=False
                )
            return dict(self._conn.execute(sql).fetchall())
        import psycopg

        if self._conn is None:
            self._conn = psycopg.connect(self.target, autocommit=True)
        return dict(self._conn.execute(sql).fetchall())

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


@dataclass
class IngestWatch:
    samples: list[tuple[float, int]] = field(default_factory=list)  # (monotonic, records stored)
    lags_s: list[tuple[float, float]] = field(default_factory=list)  # (push time, lag)
    caught_up_at: float | None = None  # monotonic time the backlog was drained


async def watch_ingest(
    reader: CursorReader, shape: Shape, backlog_end_seq: int, producer_out: Any, stop: asyncio.Event,
    watch: IngestWatch, interval_s: float = 0.1,
) -> None:  # fmt: skip
    """Sample every job's cursor; per pushed step, the lag from its push to the database."""
    pending: list[tuple[int, int, float]] = []  # (job index, last seq of the step, push time)
    jobs = [shape.job_id(j) for j in range(shape.jobs)]
    while not stop.is_set():
        cursors = await asyncio.to_thread(reader.read)
        now_mono, now = time.monotonic(), time.time()
        stored = [cursors.get(job, 0) for job in jobs]
        watch.samples.append((now_mono, sum(stored)))
        if watch.caught_up_at is None and all(s >= backlog_end_seq for s in stored):
            watch.caught_up_at = now_mono
        while not producer_out.empty():
            j, _step, end_seq, pushed = producer_out.get_nowait()
            pending.append((j, end_seq, pushed))
        still = []
        for j, end_seq, pushed in pending:
            if stored[j] >= end_seq:
                watch.lags_s.append((pushed, now - pushed))
            else:
                still.append((j, end_seq, pushed))
        pending = still
        await asyncio.sleep(interval_s)
