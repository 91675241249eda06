"""jobs.bench_sink reads back every record pushed in both forms and reports CPU per record."""

from __future__ import annotations

import subprocess
import sys

from tests.jobs.job_run import REPO_ROOT, run_job


def test_bench_sink_reports_both_forms_and_their_ratio() -> None:
    stdout, out = run_job("jobs.bench_sink", "--ranks", "3", "--layers", "7", "--steps", "4",
                          "--page-records", "10", "--repeat", "2", timeout_s=120)  # fmt: skip
    assert out["records"] == 4 * 3 * (7 + 1)
    for form in ("records", "rows"):
        parts = out["cpu_us_per_record"][form]
        assert set(parts) == {"worker", "sink_push", "sink_read", "reader", "sink"}
        assert parts["sink"] == parts["sink_push"] + parts["sink_read"] > 0
    assert out["records_over_rows"]["sink"] > 0
    assert "records/rows" in stdout


def test_bench_sink_rejects_an_empty_shape() -> None:
    cmd = [sys.executable, "-m", "jobs.bench_sink", "--steps", "0"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "must be positive" in proc.stderr
