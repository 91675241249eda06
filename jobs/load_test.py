"""Load test of the control plane at cluster scale, on loopback: many jobs' metrics ingesting
while dashboards read.

    python -m jobs.load_test [--jobs 8] [--ranks 32] [--layers 200] [--step-interval-s 1]
                             [--backlog-steps 10] [--pollers 100] [--poll-interval-s 1]
                             [--streams 0] [--duration-s 30] [--backend sqlite|postgresql]
                             [--source sink|direct] [--client lean|httpx] [--service-root PATH]
                             [--profile-out FILE]

What runs (all on 127.0.0.1, all started here and stopped by pid/handle at the end):

- the real service, ``uvicorn --factory service.main:create_app``, as a subprocess, on a fresh
  SQLite file or a fresh PostgreSQL database (``--backend postgresql``: a throwaway server,
  jobs/local_postgres.py, with fsync on; or ``--database-url``), with ``--jobs`` RUNNING jobs;
- ``--source sink`` (default): a private Ray head and one real ``MetricsSink`` actor per job; a
  producer process pushes ``--backlog-steps`` steps of every job before the service sees the
  jobs (a backlog to measure how fast ingest catches up), then one step of every job per
  ``--step-interval-s``, per rank, as the workers do (``--ranks`` x (``--layers`` + 1) records
  per job and step). The service's own ingester drains the sinks. ``--source direct``: no Ray;
  the producer stores the same records through ``Storage.ingest``;
- ``--pollers`` REST dashboards (one route per ``--poll-interval-s``, round robin over layers,
  steps, summary) and ``--streams`` dashboards on the SSE stream, spread over the jobs;
- a watcher reading every job's ingest cursor from the database: records stored per second
  while the backlog drains, and per pushed step the ingest lag (push -> committed).

``--service-root`` runs the service from another checkout (e.g. an older commit, for a
before/after in one sitting). Prints a table and, as the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from jobs.cpu_time import cpu_seconds, machine_busy_seconds, tree_cpu_seconds
from jobs.load_clients import (
    CursorReader,
    HttpxPolls,
    IngestWatch,
    LeanPolls,
    Producer,
    RouteStats,
    Shape,
    poller,
    start_producer,
    streamer,
    watch_ingest,
)
from jobs.local_postgres import LocalPostgres
from service.ray_head import HeadPorts, LocalRayHead, free_port
from service.storage import parse_storage_url

REPO_ROOT = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _ms(values: list[float], q: float) -> float | None:
    return round(1000 * percentile(values, q), 1) if values else None


def insert_jobs(url: str, shape: Shape) -> None:
    """The RUNNING jobs, written with plain SQL into the two tables every schema version has,
    after the service migrated the database (so an older service works on its own schema)."""
    now = time.time()
    rows = [(shape.job_id(j), shape.job_id(j), now) for j in range(shape.jobs)]
    backend, target = parse_storage_url(url)
    jobs_sql = (
        "INSERT INTO jobs (id, name, source, status, entrypoint, created_at, updated_at)"
        " VALUES (?, ?, 'api', 'RUNNING', '(load test)', ?, ?)"
    )
    cursors_sql = "INSERT INTO ingest_cursors (job_id, updated_at) VALUES (?, ?)"
    if backend == "sqlite":
        with contextlib.closing(sqlite3.connect(target, timeout=30)) as conn, conn:
            conn.executemany(jobs_sql, [(j, n, t, t) for j, n, t in rows])
            conn.executemany(cursors_sql, [(j, t) for j, _, t in rows])
        return
    import psycopg

    with psycopg.connect(target) as conn, conn.cursor() as cur:
        cur.executemany(jobs_sql.replace("?", "%s"), [(j, n, t, t) for j, n, t in rows])
        cur.executemany(cursors_sql.replace("?", "%s"), [(j, t) for j, _, t in rows])


def start_service(root: Path, env: dict[str, str], port: int, log_path: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "uvicorn", "--factory", "service.main:create_app",
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--no-access-log",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
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
    raise RuntimeError("service did not answer /healthz within 90 s")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def start_profiler(pid: int, out: Path, duration_s: float) -> subprocess.Popen[bytes]:
    """py-spy (the bench extra) on the service for the measured window."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    fmt = "raw" if out.suffix in (".txt", ".raw") else "flamegraph"
    cmd = [py_spy, "record", "--pid", str(pid), "--duration", str(int(duration_s)), "--rate", "100",
           "--format", fmt, "--output", str(out), "--nonblocking"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


async def drive(
    args: argparse.Namespace, shape: Shape, url: str, base_url: str, producer: Producer, service_pid: int
) -> dict:
    stats, watch, stop_watch = RouteStats(), IngestWatch(), asyncio.Event()
    reader = CursorReader(url)
    backlog_end = args.backlog_steps * shape.records_per_step
    limits = httpx.Limits(max_connections=args.pollers + args.streams + 10)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=30.0) as client:
        await asyncio.to_thread(insert_jobs, url, shape)  # the ingester finds them on its next pass
        t_go, wall_go, cpu_go = time.monotonic(), time.time(), cpu_seconds(service_pid)
        client_cpu_go, ingest_cpu_go = time.process_time(), tree_cpu_seconds(service_pid, include_root=False)
        busy_go = machine_busy_seconds()
        producer.go.set()
        watcher = asyncio.create_task(
            watch_ingest(reader, shape, backlog_end, producer.out, stop_watch, watch)
        )
        deadline = t_go + args.duration_s
        spread = args.poll_interval_s or 0.0
        job = [shape.job_id(i % shape.jobs) for i in range(max(args.pollers, args.streams))]
        port = httpx.URL(base_url).port or 80
        polls = [
            LeanPolls("127.0.0.1", port) if args.client == "lean" else HttpxPolls(client)
            for _ in range(args.pollers)
        ]
        readers = [
            # A job's dashboards start at different routes, as browsers opened at different
            # times would: all starting at /layers put every job's reads of one route into the
            # same second of each three, and two seconds of none (each result expired between).
            poller(
                polls[i],
                job[i],
                deadline,
                args.poll_interval_s,
                spread * i / args.pollers,
                stats,
                first_route=(i // shape.jobs) % 3,
            )
            for i in range(args.pollers)
        ]
        readers += [streamer(client, job[i], deadline, wall_go, stats) for i in range(args.streams)]
        await asyncio.gather(*readers)
        wall_s = time.monotonic() - t_go
        service_cores = (cpu_seconds(service_pid) - cpu_go) / wall_s
        ingest_cores = (tree_cpu_seconds(service_pid, include_root=False) - ingest_cpu_go) / wall_s
        client_cores = (time.process_time() - client_cpu_go) / wall_s
        busy_cores = (machine_busy_seconds() - busy_go) / wall_s
        producer.stop.set()
        await _settle(watch, args.drain_timeout_s)
        stop_watch.set()
        await watcher
    reader.close()
    out = report(args, shape, stats, watch, t_go, wall_go, wall_s)
    out["service_cpu_cores"] = round(service_cores, 2)
    out["ingest_cpu_cores"] = round(ingest_cores, 2)
    out["client_cpu_cores"] = round(client_cores, 2)
    out["machine_busy_cores"] = round(busy_cores, 2)
    return out


async def _settle(watch: IngestWatch, timeout_s: float) -> None:
    """Let ingest finish what was pushed (bounded), so the lag of the last steps counts."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        stored = watch.samples[-1][1] if watch.samples else 0
        if stored == last and watch.caught_up_at is not None:
            return
        last = stored


def report(args: argparse.Namespace, shape: Shape, stats: RouteStats, watch: IngestWatch, t_go: float,
           wall_go: float, wall_s: float) -> dict[str, Any]:  # fmt: skip
    routes = {
        route: {"requests": len(v), "p50_ms": _ms(v, 0.5), "p99_ms": _ms(v, 0.99), "max_ms": _ms(v, 1.0)}
        for route, v in sorted(stats.latencies_s.items())
    }
    every = [x for v in stats.latencies_s.values() for x in v]
    steady_reads = stats.since(watch.caught_up_at) if watch.caught_up_at is not None else []
    backlog = args.backlog_steps * shape.records_per_step * shape.jobs
    caught = watch.caught_up_at
    stored_then = next((n for t, n in watch.samples if caught is not None and t >= caught), None)
    rate = stored_then / (caught - t_go) if caught is not None and stored_then and caught > t_go else None
    caught_wall = wall_go + (caught - t_go) if caught is not None else None
    steady = [lag for pushed, lag in watch.lags_s if caught_wall is not None and pushed >= caught_wall]
    every_lag = [lag for _, lag in watch.lags_s]
    layer_share = shape.layers / (shape.layers + 1)
    per_step = shape.jobs * shape.records_per_step
    offered = round(per_step / shape.step_interval_s) if shape.step_interval_s > 0 else 0
    return {
        "shape": {
            "jobs": shape.jobs,
            "ranks": shape.ranks,
            "layers": shape.layers,
            "step_interval_s": shape.step_interval_s,
        },
        "backend": parse_storage_url(args.database_url)[0] if args.database_url else args.backend,
        "generator_niceness": args.generator_niceness,
        "source": args.source,
        "push": args.push,
        "pollers": args.pollers,
        "client": args.client,
        "poll_interval_s": args.poll_interval_s,
        "streams": args.streams,
        "duration_s": round(wall_s, 1),
        "requests": len(every),
        "requests_per_s": round(len(every) / wall_s, 1) if wall_s else None,
        "errors": len(stats.errors),
        "first_errors": stats.errors[:5],
        "p50_ms": _ms(every, 0.5),
        "p99_ms": _ms(every, 0.99),
        # Requests sent after the backlog caught up: the steady state the targets are
        # about, without the seconds when ingest takes every cycle to catch up.
        "steady_requests": len(steady_reads),
        "steady_p50_ms": _ms(steady_reads, 0.5),
        "steady_p99_ms": _ms(steady_reads, 0.99),
        "routes": routes,
        "stream_events": stats.stream_events,
        "stream_delay_p50_ms": _ms(stats.stream_delays_s, 0.5),
        "stream_delay_p99_ms": _ms(stats.stream_delays_s, 0.99),
        "offered_records_per_s": offered,
        "backlog_records": backlog,
        "records_stored": watch.samples[-1][1] if watch.samples else 0,
        "caught_up_s": round(caught - t_go, 2) if caught is not None else None,
        "ingest_records_per_s": round(rate) if rate else None,
        "ingest_layer_records_per_s": round(rate * layer_share) if rate else None,
        "lag_all_steps": len(every_lag),
        "lag_all_p99_s": round(percentile(every_lag, 0.99), 2) if every_lag else None,
        "lag_all_max_s": round(max(every_lag), 2) if every_lag else None,
        "lag_steps": len(steady),
        "lag_p50_s": round(percentile(steady, 0.5), 2) if steady else None,
        "lag_p99_s": round(percentile(steady, 0.99), 2) if steady else None,
        "lag_max_s": round(max(steady), 2) if steady else None,
        "machine": machine(),
    }


def machine() -> str:
    model = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end"


def prepare_database(args: argparse.Namespace, tmp: Path, stack: contextlib.ExitStack) -> str:
    if args.database_url:
        return str(args.database_url)
    if args.backend == "sqlite":
        return f"sqlite://{tmp / 'service.sqlite'}"
    server = stack.enter_context(LocalPostgres(durable=True))
    return server.create_database("tail_ray_load")


def service_env(args: argparse.Namespace, url: str) -> dict[str, str]:
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "TAIL_RAY_API_TOKEN": secrets.token_urlsafe(24),
        "TAIL_RAY_DATABASE_URL": url,
        "TAIL_RAY_INGEST_INTERVAL_S": str(args.ingest_interval_s),
        "TAIL_RAY_SYNC_INTERVAL_S": "300",  # no Ray jobs to discover: the jobs are in the database
        "PYTHONPATH": str(args.service_root),
    }
    backend, target = parse_storage_url(url)
    if backend == "sqlite":
        env["TAIL_RAY_DB_PATH"] = target  # what a service older than database_url reads
    if args.source == "direct":
        env["TAIL_RAY_INGEST_ENABLED"] = "false"
        env["TAIL_RAY_RAY_DASHBOARD_URL"] = f"http://127.0.0.1:{free_port()}"
    return env


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = Shape(args.jobs, args.ranks, args.layers, args.step_interval_s, push_rows=args.push == "rows")
    tmp = Path(tempfile.mkdtemp(prefix="tail-load-"))
    live_steps = int(args.duration_s / args.step_interval_s) + 30 if args.step_interval_s > 0 else 0
    capacity = (args.backlog_steps + live_steps) * shape.records_per_step
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        if args.log_dir:  # keep the service's and the Ray head's logs (copied before tmp goes)
            stack.callback(_keep_logs, tmp, args.log_dir)
        url = prepare_database(args, tmp, stack)
        env = service_env(args, url)
        address = url
        if args.source == "sink":
            head = LocalRayHead(HeadPorts.pick(), num_cpus=1, log_path=tmp / "ray-head.log")
            head.start()
            stack.callback(head.stop)
            if args.generator_niceness and head.process is not None:
                # The head's process group: GCS, raylet, and the sink actors they start.
                os.setpriority(os.PRIO_PGRP, os.getpgid(head.process.pid), args.generator_niceness)
            address = head.ports.gcs_address
            env["TAIL_RAY_RAY_ADDRESS"] = head.ports.gcs_address
            env["TAIL_RAY_RAY_DASHBOARD_URL"] = head.ports.dashboard_url
        producer = start_producer(
            shape, args.source, address, args.backlog_steps, capacity, args.generator_niceness
        )
        stack.callback(_stop_producer, producer)
        if not producer.ready.wait(timeout=args.timeout_s):
            raise RuntimeError("the producer did not fill the sinks in time")
        port = free_port()
        service = start_service(args.service_root, env, port, tmp / "service.log")
        stack.callback(stop_process, service)
        if args.profile_out:
            stack.callback(start_profiler(service.pid, args.profile_out, args.duration_s).wait, 60)
        return asyncio.run(drive(args, shape, url, f"http://127.0.0.1:{port}", producer, service.pid))


def _keep_logs(tmp: Path, log_dir: Path) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    for log in tmp.glob("*.log"):
        shutil.copy(log, log_dir / log.name)


def _stop_producer(producer: Producer) -> None:
    producer.stop.set()
    producer.go.set()
    producer.process.join(timeout=30)
    if producer.process.is_alive():
        producer.process.kill()
        producer.process.join(timeout=10)


def print_table(out: dict[str, Any]) -> None:
    s, o = out["shape"], out
    lines = [
        f"{s['jobs']} jobs x {s['ranks']} ranks x {s['layers']} layers, a step every"
        f" {s['step_interval_s']} s; {o['backend']}, source {o['source']} (push {o['push']})"
        + (f", generator at niceness {o['generator_niceness']}" if o["generator_niceness"] else "")
        + f"; {o['machine']}",
        f"{'route':<10} {'requests':>9} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}",
    ]
    for route, r in o["routes"].items():
        lines.append(
            f"{route:<10} {r['requests']:>9} {r['p50_ms']!s:>8} {r['p99_ms']!s:>8} {r['max_ms']!s:>8}"
        )
    lines.append(
        f"{'all':<10} {o['requests']:>9} {o['p50_ms']!s:>8} {o['p99_ms']!s:>8}   ({o['requests_per_s']}"
        f" requests/s, {o['errors']} errors; goal p99 < 100 ms, 0 errors)"
    )
    lines.append(
        f"{'steady':<10} {o['steady_requests']:>9} {o['steady_p50_ms']!s:>8} {o['steady_p99_ms']!s:>8}"
        "   (requests sent after the backlog caught up)"
    )
    if o["streams"]:
        lines.append(
            f"streams    {o['streams']} SSE dashboards, {o['stream_events']} step events, push -> event"
            f" p50 {o['stream_delay_p50_ms']} ms, p99 {o['stream_delay_p99_ms']} ms"
        )
    lines.append(
        f"ingest     backlog of {o['backlog_records']} records caught up in {o['caught_up_s']} s:"
        f" {o['ingest_records_per_s']} records/s ({o['ingest_layer_records_per_s']} layer-records/s;"
        f" goal >= 100000); offered {o['offered_records_per_s']} records/s"
    )
    lines.append(
        f"service    {o['service_cpu_cores']} cores on average (of {os.cpu_count()}), its ingest process "
        f"{o['ingest_cpu_cores']}; the dashboards' client ({o['client']}) and watcher "
        f"{o['client_cpu_cores']}; the machine busy {o['machine_busy_cores']}"
        " (the rest: Ray, the sinks, the producer, the database)"
    )
    lines.append(
        f"lag        push -> stored, {o['lag_steps']} steps after catching up: p50 {o['lag_p50_s']} s,"
        f" p99 {o['lag_p99_s']} s, max {o['lag_max_s']} s (goal < 5 s); all {o['lag_all_steps']} live"
        f" steps: p99 {o['lag_all_p99_s']} s, max {o['lag_all_max_s']} s"
    )
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=32, help="workers per job")
    parser.add_argument("--layers", type=int, default=200, help="layers per model")
    parser.add_argument("--step-interval-s", type=float, default=1.0, help="0: no live steps, backlog only")
    parser.add_argument("--backlog-steps", type=int, default=10, help="steps per job buffered before ingest")
    parser.add_argument("--pollers", type=int, default=100, help="REST dashboards")
    parser.add_argument(
        "--client",
        choices=("lean", "httpx"),
        default="lean",
        help="the pollers' HTTP client: lean (jobs/lean_http.py, one keep-alive connection each, "
        "little CPU) or httpx (one shared client; about 1 ms of CPU per request here, which "
        "showed up as service latency on two cores)",
    )
    parser.add_argument("--poll-interval-s", type=float, default=1.0, help="per poller; 0 = back to back")
    parser.add_argument("--streams", type=int, default=0, help="SSE dashboards")
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--database-url", help="an existing database instead of a fresh one")
    parser.add_argument("--source", choices=("sink", "direct"), default="sink")
    parser.add_argument(
        "--push",
        choices=("rows", "records"),
        default="rows",
        help="how the producer pushes to the sinks: rows (columns, as workers' MetricsClient "
        "does) or records (dicts, as before push_rows)",
    )
    parser.add_argument("--ingest-interval-s", type=float, default=0.2, help="TAIL_RAY_INGEST_INTERVAL_S")
    parser.add_argument(
        "--service-root", type=Path, default=REPO_ROOT, help="checkout to run the service from"
    )
    parser.add_argument(
        "--profile-out", type=Path, help="py-spy the service: .svg flamegraph, .txt raw stacks"
    )
    parser.add_argument(
        "--generator-niceness",
        type=int,
        default=0,
        help="CPU niceness of the load generator (the producer, the Ray head and its sink "
        "actors; not the dashboards): approximates a generator on other machines",
    )
    parser.add_argument("--log-dir", type=Path, help="keep the service's and Ray head's logs here")
    parser.add_argument("--drain-timeout-s", type=float, default=60.0, help="wait for ingest after the run")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="bound on filling the sinks")
    args = parser.parse_args(argv)
    if min(args.jobs, args.ranks, args.layers) < 1 or args.duration_s <= 0 or args.pollers < 0:
        parser.error("--jobs, --ranks, --layers and --duration-s must be positive")
    if args.backlog_steps < 0 or args.step_interval_s < 0 or args.streams < 0:
        parser.error("--backlog-steps, --step-interval-s and --streams must be >= 0")
    out = run(args)
    print_table(out)
    print(json.dumps(out))
    complete = out["records_stored"] >= out["backlog_records"]
    return 0 if out["errors"] == 0 and complete else 1


if __name__ == "__main__":
    sys.exit(main())
