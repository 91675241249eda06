"""The README's second command on a fresh machine (issue 10): `tail-ray demo` from an EMPTY HOME
(no ~/.ray, no ~/.tail_ray) and a PATH without the virtual environment runs both jobs to
SUCCEEDED and prints the side-by-side table; the stack is gone when it returns."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TAIL_RAY = Path(sys.executable).parent / "tail-ray"


def test_demo_from_an_empty_home_prints_the_table(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TAIL_RAY_", "RAY_"))}
    env.update(HOME=str(home), PATH="/usr/bin:/bin")
    proc = subprocess.run(
        [str(TAIL_RAY), "demo", "--steps", "20", "--port", "0", "--num-cpus", "2"],
        cwd=home,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"^\s+tail\s+none\s*$", proc.stdout, re.MULTILINE), out[-3000:]
    assert re.search(r"^status\s+SUCCEEDED\s+SUCCEEDED\s*$", proc.stdout, re.MULTILINE), out[-3000:]
    ratio = re.search(r"^ratio \(raw/sent\)\s+([\d.]+)x\s+([\d.]+)x\s*$", proc.stdout, re.MULTILINE)
    assert ratio and float(ratio.group(1)) > 1.0 and float(ratio.group(2)) == 1.0, out[-3000:]
    assert re.search(r"^val accuracy\s+0\.\d+\s+0\.\d+\s*$", proc.stdout, re.MULTILINE)
    # Zero set-up: the demo made Ray's token itself, owner-only, and printed no token.
    token = (home / ".ray" / "auth_token").read_text().strip()
    assert (home / ".ray" / "auth_token").stat().st_mode & 0o777 == 0o600
    assert token not in out
    # ... and stopped what it started.
    pids = re.search(r"pids up \d+, service (\d+), ray head (\d+)\)", proc.stdout)
    assert pids, out[-3000:]
    for pid in map(int, pids.groups()):
        assert not psutil.pid_exists(pid), pid
