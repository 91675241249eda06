"""Bounded load test of the service on loopback: dashboard pollers while metrics are ingested.

    python -m jobs.load_test [--pollers 100] [--duration-s 15] [--poll-interval-s 1.0]
                             [--records 200000] [--source sink|direct]

What runs (all on 127.0.0.1, all started here and stopped by pid/handle at the end):

- the real service, ``uvicorn --factory service.main:create_app``, as a subprocess with a fresh
  SQLite file and one RUNNING job in it;
- ``--source sink`` (default): a private Ray head (``ray start --head --block``, explicit free
  ports, stopped by pid) and the job's real ``MetricsSink`` actor, filled with ``--records``
  metric records (per step and rank: one record per layer plus one step record) before the
  service starts; the service's own ingester reads the sink in pages and persists them.
  ``--source direct``: no Ray; a writer process persists the same records in pages through
  ``Storage.ingest`` (exactly what the ingester does with each sink page).
- ``--pollers`` asyncio tasks (one shared httpx client) that each poll the dashboard's metric
  routes (layers, steps, summary) every ``--poll-interval-s`` (0: back to back) for
  ``--duration-s``.

Prints a table and, as the last line, one JSON object with the figures. Stops by itself: the
polling is bounded by ``--duration-s`` and the whole run by ``--timeout-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from service.ray_head import HeadPorts, LocalRayHead, free_port
from service.storage import IngestBatch, Storage
from tail_ray.metrics.records import LayerMetric, StepMetric

REPO_ROOT = Path(__file__).resolve().parents[1]
JOB_ID = "load-test-job"
LAYERS = 16  # per step and rank; like a small CNN/transformer
RANKS = 2
PAGE_RECORDS = 5_000  # the ingester's default page size (TAIL_RAY_INGEST_BATCH_RECORDS)


def make_records(n_records: int) -> list[dict[str, Any]]:
    """``n_records`` records as workers send them: per step and rank, LAYERS layer records and
    one step record."""
    out: list[dict[str, Any]] = []
    step = 0
    while len(out) < n_records:
        for rank in range(RANKS):
            for i in range(LAYERS):
                raw = 4 * 1000 * (i + 1)
                enc = max(1, raw // (3 + i % 5))
                out.append(
                    LayerMetric(
                        job_id=JOB_ID, step=step, rank=rank, layer=f"block{i // 2}.layer{i}.weight",
                        numel=raw // 4, bits=2 + (i + step) % 6, density=0.4, raw_bytes=raw,
                        encoded_bytes=enc, ratio=raw / enc, rel_error=0.02, code="tail",
                    ).to_dict()
                )  # fmt: skip
            out.append(
                StepMetric(
                    job_id=JOB_ID, step=step, rank=rank, world_size=RANKS, bytes_sent=1000,
                    bytes_received=1000, raw_bytes=8000, compress_s=0.001, decode_s=0.001,
                    comm_s=0.002, step_s=0.01, loss=1.0 / (step + 1), method="tail",
                    wall_time_s=time.time(),
                ).to_dict()
            )  # fmt: skip
        step += 1
    return out[:n_records]


def _direct_writer(db_path: str, n_records: int, start: Any, result: Any) -> None:
    """Child process: persist ``n_records`` in ingester-sized pages through Storage.ingest."""
    storage = Storage(Path(db_path))
    records = make_records(n_records)
    for seq, rec in enumerate(records, start=1):
        rec["seq"] = seq
    start.wait()
    t0 = time.perf_counter()
    for lo in range(0, len(records), PAGE_RECORDS):
        page = records[lo : lo + PAGE_RECORDS]
        storage.ingest(JOB_ID, IngestBatch(records=page, next_seq=page[-1]["seq"]))
    result.put(time.perf_counter() - t0)


@dataclass
class PollStats:
    latencies_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


async def poller(
    client: httpx.AsyncClient, deadline: float, interval_s: float, offset_s: float, stats: PollStats
) -> None:
    routes = (
        f"/v1/jobs/{JOB_ID}/metrics/layers",
        f"/v1/jobs/{JOB_ID}/metrics/steps?after_step=-1&limit=500",
        f"/v1/jobs/{JOB_ID}/metrics/summary",
    )
    await asyncio.sleep(offset_s)  # spread the pollers over one interval, as real browsers are
    i = 0
    while time.monotonic() < deadline:
        route = routes[i % len(routes)]
        i += 1
        t0 = time.perf_counter()
        try:
            resp = await client.get(route)
            if resp.status_code != 200:
                stats.errors.append(f"{route}: HTTP {resp.status_code}")
        except httpx.HTTPError as exc:
            stats.errors.append(f"{route}: {type(exc).__name__}")
        stats.latencies_s.append(time.perf_counter() - t0)
        if interval_s > 0:
            await asyncio.sleep(interval_s)


async def watch_ingest(
    storage: Storage, target: int, deadline: float, samples: list[tuple[float, int]]
) -> None:
    while time.monotonic() < deadline:
        count = (await asyncio.to_thread(storage.ingest_state, JOB_ID))["records"]
        samples.append((time.perf_counter(), count))
        if count >= target:
            return
        await asyncio.sleep(0.1)


def ingest_rate(samples: list[tuple[float, int]]) -> tuple[float | None, int]:
    """Records/s between the first sample that saw records and the first that saw them all
    (the first page's own time is not counted: the first sample can only see it done)."""
    stored = samples[-1][1] if samples else 0
    started = [(t, c) for t, c in samples if c > 0]
    if len(started) < 2:
        return None, stored
    (t0, c0), (t1, c1) = started[0], started[-1]
    return ((c1 - c0) / (t1 - t0) if t1 > t0 else None), stored


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def drive(args: argparse.Namespace, url: str, storage: Storage, start_writer: Any) -> dict[str, Any]:
    stats = PollStats()
    samples: list[tuple[float, int]] = []
    limits = httpx.Limits(max_connections=args.pollers, max_keepalive_connections=args.pollers)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=10.0) as client:
        t0 = time.monotonic()
        deadline = t0 + args.duration_s
        if start_writer is not None:
            start_writer.set()
        spread_s = args.poll_interval_s or 0.0
        tasks = [
            poller(client, deadline, args.poll_interval_s, spread_s * i / args.pollers, stats)
            for i in range(args.pollers)
        ]
        await asyncio.gather(watch_ingest(storage, args.records, t0 + args.timeout_s, samples), *tasks)
        wall_s = time.monotonic() - t0
    rate, stored = ingest_rate(samples)
    lat = stats.latencies_s
    return {
        "source": args.source,
        "pollers": args.pollers,
        "poll_interval_s": args.poll_interval_s,
        "duration_s": round(wall_s, 2),
        "requests": len(lat),
        "errors": len(stats.errors),
        "first_errors": stats.errors[:5],
        "requests_per_s": round(len(lat) / args.duration_s, 1),
        "p50_ms": round(1000 * percentile(lat, 0.50), 2) if lat else None,
        "p99_ms": round(1000 * percentile(lat, 0.99), 2) if lat else None,
        "max_ms": round(1000 * max(lat), 2) if lat else None,
        "records_target": args.records,
        "records_stored": stored,
        "ingest_records_per_s": round(rate) if rate else None,
    }


def start_service(env: dict[str, str], port: int, log_path: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "uvicorn", "--factory", "service.main:create_app",
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--no-access-log",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"service exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    stop_process(proc)
    raise RuntimeError("service did not answer /healthz within 60 s")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="tail-load-"))
    db_path = tmp / "service.sqlite"
    storage = Storage(db_path)
    storage.insert_job(
        job_id=JOB_ID, name="load-test", source="api", status="RUNNING", entrypoint="(load test)", spec=None
    )
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "TAIL_RAY_API_TOKEN": secrets.token_urlsafe(24),
        "TAIL_RAY_DB_PATH": str(db_path),
        "TAIL_RAY_INGEST_INTERVAL_S": "0.05",
        "TAIL_RAY_INGEST_BATCH_RECORDS": str(PAGE_RECORDS),
        "TAIL_RAY_SYNC_INTERVAL_S": "30",
    }
    head: LocalRayHead | None = None
    writer: mp.process.BaseProcess | None = None
    service: subprocess.Popen[bytes] | None = None
    start_writer = None
    result_q = None
    try:
        if args.source == "sink":
            import ray

            from tail_ray.metrics.sink import get_or_create_sink

            head = LocalRayHead(HeadPorts.pick(), num_cpus=1, log_path=tmp / "ray-head.log")
            head.start()
            ray.init(address=head.ports.gcs_address, log_to_driver=False, configure_logging=False)
            sink = get_or_create_sink(JOB_ID, capacity_records=args.records)
            records = make_records(args.records)
            for lo in range(0, len(records), 10_000):
                ray.get(sink.push.remote(records[lo : lo + 10_000]))
            del records
            env["TAIL_RAY_RAY_ADDRESS"] = head.ports.gcs_address
            env["TAIL_RAY_RAY_DASHBOARD_URL"] = head.ports.dashboard_url
        else:
            env["TAIL_RAY_INGEST_ENABLED"] = "false"
            env["TAIL_RAY_RAY_DASHBOARD_URL"] = f"http://127.0.0.1:{free_port()}"
            ctx = mp.get_context("fork")  # no threads yet; the child reuses our imports
            start_writer, result_q = ctx.Event(), ctx.Queue()
            writer = ctx.Process(
                target=_direct_writer, args=(str(db_path), args.records, start_writer, result_q)
            )
            writer.start()
        port = free_port()
        service = start_service(env, port, tmp / "service.log")
        out = asyncio.run(drive(args, f"http://127.0.0.1:{port}", storage, start_writer))
        if writer is not None and result_q is not None:
            writer_s = result_q.get(timeout=args.timeout_s)
            out["ingest_records_per_s"] = round(args.records / writer_s)
            out["records_stored"] = storage.ingest_state(JOB_ID)["records"]
        return out
    finally:
        if service is not None:
            stop_process(service)
        if writer is not None:
            writer.join(timeout=30)
            if writer.is_alive():
                writer.kill()
        if head is not None:
            import ray

            ray.shutdown()
            head.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pollers", type=int, default=100)
    parser.add_argument("--duration-s", type=float, default=15.0)
    parser.add_argument("--poll-interval-s", type=float, default=1.0, help="per poller; 0 = back to back")
    parser.add_argument("--records", type=int, default=200_000, help="metric records to ingest")
    parser.add_argument("--source", choices=("sink", "direct"), default="sink")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="bound on the whole ingest")
    args = parser.parse_args(argv)
    if args.pollers < 1 or args.duration_s <= 0 or args.records < 1:
        parser.error("--pollers, --duration-s and --records must be positive")
    out = run(args)
    rows = [
        ("pollers", out["pollers"]),
        ("poll interval", f"{out['poll_interval_s']} s"),
        ("requests", out["requests"]),
        ("errors", out["errors"]),
        ("requests/s", out["requests_per_s"]),
        ("latency p50", f"{out['p50_ms']} ms"),
        ("latency p99", f"{out['p99_ms']} ms (goal < 100)"),
        ("ingest source", out["source"]),
        ("records stored", f"{out['records_stored']} / {out['records_target']}"),
        ("ingest", f"{out['ingest_records_per_s']} records/s (goal >= 50000)"),
    ]
    for name, value in rows:
        print(f"{name:<16} {value}")
    print(json.dumps(out))
    return 0 if out["errors"] == 0 and out["records_stored"] == out["records_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
