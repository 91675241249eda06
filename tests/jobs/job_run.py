"""Run a ``python -m jobs.<name>`` benchmark the way a user does, from the repository root, and
read the JSON object it prints as its last line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_job(
    module: str, *args: str, timeout_s: float, env: dict[str, str] | None = None
) -> tuple[str, dict[str, Any]]:
    """The job's stdout and its last line as JSON; fails the test, with the output's tail,
    when the job exits non-zero."""
    cmd = [sys.executable, "-m", module, *args]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout, json.loads(proc.stdout.strip().splitlines()[-1])
