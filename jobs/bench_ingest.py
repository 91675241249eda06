"""Benchmark of the storage side of ingest alone: no Ray, no sinks, no HTTP, no load generator.

    python -m jobs.bench_ingest [--backend sqlite|postgresql|both] [--steps 12] [--jobs 8]
                                [--ranks 32] [--layers 200] [--page-records 5000]
                                [--writers 0,auto] [--repeat 1]

``jobs.load_test`` measures the whole path (sinks on Ray -> ingest process -> database) with
its load generator on the same cores; where the generator is the limit (its report says how
busy the machine was beside the service), this tells what the database side alone can take.
The pages are the sinks' own columnar form (``columns_of``), stored as the ingester's
``drain`` stores them: through its writer threads (``IngestPipeline``, ``--writers N``, "auto"
= the backend's default), or with ``--writers 0`` as before them: each round of pages (one
per job) in one transaction, the next round only after it. Several ``--writers`` values, with
``--repeat``, run alternately on one fresh database each: ratios side by side in one run. The
PostgreSQL server is a fresh local one, durable (fsync on); its CPU is counted apart from
this process's. After the ingest, the reads the dashboards make are timed on the full tables.
Prints a table and, as the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from jobs.cpu_time import tree_cpu_seconds
from jobs.load_clients import Shape, rank_templates, step_batch
from service.ingest_pipeline import IngestPipeline
from service.storage import IngestBatch, Storage, open_storage
from tail_ray.metrics.sink import columns_of

logger = logging.getLogger("jobs.bench_ingest")


def pages(shape: Shape, steps: int, page_records: int) -> list[list[tuple[str, IngestBatch]]]:
    """The rounds: in each, the next page of every job (the sink's columnar form)."""
    per_job: list[list[IngestBatch]] = []
    for j in range(shape.jobs):
        job_id = shape.job_id(j)
        templates = rank_templates(shape, job_id)
        records = [
            rec for step in range(steps) for t in templates for rec in step_batch(t, step, 1.0e9 + step)
        ]
        batches = []
        for lo in range(0, len(records), page_records):
            seqs = list(range(lo + 1, min(lo + page_records, len(records)) + 1))
            page = columns_of(seqs, records[lo : lo + page_records])
            batches.append(
                IngestBatch(records=page["records"], columns=page, next_seq=seqs[-1])
            )  # the sink's cursor
        per_job.append(batches)
    rounds = max(len(b) for b in per_job)
    return [
        [(shape.job_id(j), per_job[j][r]) for j in range(shape.jobs) if r < len(per_job[j])]
        for r in range(rounds)
    ]


def _server_cpu_s(data_dir: Path | None) -> float:
    """CPU of a PostgreSQL server's processes (postmaster and backends), 0 for SQLite."""
    if data_dir is None:
        return 0.0
    return tree_cpu_seconds(int((data_dir / "postmaster.pid").read_text().split()[0]))


@contextmanager
def database(backend: str, root: Path) -> Iterator[tuple[str, Path | None]]:
    """(storage URL, PostgreSQL data dir or None) of a fresh database."""
    if backend == "sqlite":
        yield f"sqlite:///{root / 'bench.sqlite'}", None
        return
    from jobs.local_postgres import LocalPostgres

    pg = LocalPostgres(durable=True)  # a benchmark of real writes: fsync on
    try:
        pg.start()
        yield pg.create_database(), pg.data_dir
    finally:
        pg.stop()


def _check_stored(store: Storage, rounds: list[list[tuple[str, IngestBatch]]]) -> None:
    """Every job's cursor is past its last page: a figure for rows that were not stored is
    no figure."""
    expected = {job_id: batch.next_seq for batches in rounds for job_id, batch in batches}
    for job_id, last_seq in expected.items():
        if store.cursor(job_id) != last_seq:
            raise RuntimeError(f"job {job_id}: cursor {store.cursor(job_id)}, expected {last_seq}")


def _timed_ms(fn: Any, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return round(best, 3)  # microseconds: a small table's read on a fast machine is under 0.05 ms


def _store_rounds(store: Storage, rounds: list[list[tuple[str, IngestBatch]]], writers: int) -> None:
    """Every round, as the ingester stores it: synchronously by round (0 writers), or through
    the writer threads."""
    if writers == 0:
        for batches in rounds:
            store.ingest_many(batches)
        return
    pipeline = IngestPipeline(store, writers)
    try:
        for batches in rounds:
            for job_id, batch in batches:
                pipeline.submit(job_id, batch)
        pipeline.wait()
    finally:
        pipeline.close()


def run_backend(
    backend: str, shape: Shape, rounds: list[list[tuple[str, IngestBatch]]], writers: int | None
) -> dict[str, Any]:
    records = sum(
        len(b.columns["layer"]["seq"]) + len(b.columns["step"]["seq"]) for r in rounds for _, b in r
    )
    with (
        tempfile.TemporaryDirectory(prefix="tail-bench-ingest-") as tmp,
        database(backend, Path(tmp)) as (
            url,
            data_dir,
        ),
    ):
        store: Storage = open_storage(url)
        writers = store.ingest_writers if writers is None else writers
        try:
            for j in range(shape.jobs):
                store.insert_job(
                    job_id=shape.job_id(j), name=shape.job_id(j), source="api", status="RUNNING",
                    entrypoint="(bench)", spec=None,
                )  # fmt: skip
            cpu0, server0, t0 = time.process_time(), _server_cpu_s(data_dir), time.perf_counter()
            _store_rounds(store, rounds, writers)
            wall_s = time.perf_counter() - t0
            client_s, server_s = time.process_time() - cpu0, _server_cpu_s(data_dir) - server0
            _check_stored(store, rounds)
            job = shape.job_id(0)
            reads = {
                "summary_ms": _timed_ms(lambda: store.summary(job)),
                "latest_layers_ms": _timed_ms(lambda: store.latest_layers(job)),
                "steps_ms": _timed_ms(lambda: store.steps(job, after_step=-1, limit=500)),
            }
        finally:
            store.close()
    return {
        "backend": backend,
        "writers": writers,
        "records": records,
        "rounds": len(rounds),
        # Four places: a small run on a fast machine stores everything in a few milliseconds of
        # CPU, which two places rounded to 0.0.
        "wall_s": round(wall_s, 4),
        "records_per_s": round(records / wall_s),
        "client_cpu_s": round(client_s, 4),
        "server_cpu_s": round(server_s, 4),
        **reads,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=32, help="workers per job")
    parser.add_argument("--layers", type=int, default=200, help="layers per model")
    parser.add_argument("--steps", type=int, default=12, help="steps per job stored")
    parser.add_argument(
        "--page-records",
        type=int,
        default=5_000,
        help="records per sink page (ingest_batch_records)",
    )
    parser.add_argument(
        "--writers",
        default="0,auto",
        help="comma-separated writer-thread counts to compare: 0 = a transaction per round, "
        "stored before the next (the ingester before its writer threads); auto = the backend's "
        "default (SQLite 1, PostgreSQL 2)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs of each --writers value, alternating")
    args = parser.parse_args(argv)
    try:
        writer_counts = [None if w.strip() == "auto" else int(w) for w in args.writers.split(",")]
    except ValueError:
        parser.error(f"--writers takes numbers or 'auto', comma-separated; got {args.writers!r}")
    if any(w is not None and not 0 <= w <= 8 for w in writer_counts):
        parser.error(f"--writers must each be 0-8 or 'auto', got {args.writers!r}")
    for name in ("jobs", "ranks", "layers", "steps", "page_records", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    shape = Shape(args.jobs, args.ranks, args.layers, step_interval_s=0.0)
    rounds = pages(shape, args.steps, args.page_records)
    backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
    results = []
    for backend in backends:
        for _ in range(args.repeat):
            for writers in writer_counts:
                logger.info(
                    "%s, writers %s: storing %d rounds of %d jobs' pages",
                    backend, "auto" if writers is None else writers, len(rounds), shape.jobs,
                )  # fmt: skip
                results.append(run_backend(backend, shape, rounds, writers))
    print(
        f"{shape.jobs} jobs x {shape.ranks} ranks x {shape.layers} layers x {args.steps} steps, pages of "
        f"{args.page_records} records; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        "backend     writers  records   records/s   client cpu s   server cpu s   summary ms   latest ms"
        "   steps ms"
    )
    for r in results:
        print(
            f"{r['backend']:<11} {r['writers']:>7} {r['records']:>8} {r['records_per_s']:>11}"
            f" {r['client_cpu_s']:>14}"
            f" {r['server_cpu_s']:>14} {r['summary_ms']:>12} {r['latest_layers_ms']:>11} {r['steps_ms']:>9}"
        )
    print(json.dumps({"shape": vars(args), "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
