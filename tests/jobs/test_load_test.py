"""Smoke test of `python -m jobs.load_test`: a few seconds of pollers against the real service
(uvicorn subprocess) while records are persisted. Asserts no errors and that figures came
out; never asserts speed (figures are printed by the script, see docs/operations.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_load_test_runs_clean_and_reports_figures() -> None:
    cmd = [
        sys.executable, "-m", "jobs.load_test", "--source", "direct", "--pollers", "10",
        "--duration-s", "2", "--poll-interval-s", "0.2", "--records", "5000", "--timeout-s", "60",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["errors"] == 0, out["first_errors"]
    assert out["requests"] > 0 and out["p50_ms"] > 0 and out["p99_ms"] >= out["p50_ms"]
    assert out["records_stored"] == out["records_target"] == 5000
    assert out["ingest_records_per_s"] > 0
