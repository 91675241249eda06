"""jobs.bench_ingest stores every page on both backends and reports its figures."""

from __future__ import annotations

import subprocess
import sys

from tests.jobs.job_run import REPO_ROOT, run_job


def test_bench_ingest_stores_every_record_on_both_backends() -> None:
    # 40 steps: PostgreSQL's CPU is read from /proc in 10 ms clock ticks, and 5 steps (660
    # records a backend) took 10-20 ms of it on a fast machine, a tick or two from reading 0.
    _stdout, out = run_job("jobs.bench_ingest", "--jobs", "3", "--ranks", "4", "--layers", "10",
                           "--steps", "40", "--page-records", "37", timeout_s=240)  # fmt: skip
    per_job = 40 * 4 * (10 + 1)  # steps x ranks x (layers + the step record)
    # Each backend before the writer threads (0) and with its own default (SQLite 1, PostgreSQL 2).
    assert [(r["backend"], r["writers"]) for r in out["results"]] == [
        ("sqlite", 0), ("sqlite", 1), ("postgresql", 0), ("postgresql", 2),
    ]  # fmt: skip
    for r in out["results"]:
        assert r["records"] == 3 * per_job
        assert r["rounds"] == -(-per_job // 37)  # pages of 37 records, one per job per round
        assert r["records_per_s"] > 0 and r["client_cpu_s"] > 0
        assert r["latest_layers_ms"] > 0
    assert all(r["server_cpu_s"] > 0 for r in out["results"][2:])  # PostgreSQL's own processes


def test_bench_ingest_rejects_a_shape_with_nothing_in_it() -> None:
    cmd = [sys.executable, "-m", "jobs.bench_ingest", "--layers", "0"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "--layers must be >= 1, got 0" in proc.stderr


def test_bench_ingest_rejects_writers_it_cannot_run() -> None:
    cmd = [sys.executable, "-m", "jobs.bench_ingest", "--writers", "0,two"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "--writers takes numbers or 'auto'" in proc.stderr
