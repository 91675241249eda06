"""jobs.bench_sink reads back every record pushed in both forms and reports CPU per record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_bench_sink_reports_both_forms_and_their_ratio() -> None:
    cmd = [sys.executable, "-m", "jobs.bench_sink", "--ranks", "3", "--layers", "7", "--steps", "4",
           "--page-records", "10", "--repeat", "2"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["records"] == 4 * 3 * (7 + 1)
    for form in ("records", "rows"):
        parts = out["cpu_us_per_record"][form]
        assert set(parts) == {"worker", "sink_push", "sink_read", "reader", "sink"}
        assert parts["sink"] == parts["sink_push"] + parts["sink_read"] > 0
    assert out["records_over_rows"]["sink"] > 0
    assert "records/rows" in proc.stdout


def test_bench_sink_rejects_an_empty_shape() -> None:
    cmd = [sys.executable, "-m", "jobs.bench_sink", "--steps", "0"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "must be positive" in proc.stderr
