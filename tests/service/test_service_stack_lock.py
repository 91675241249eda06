"""One `tail-ray up` per HOME (issue 17, finding 2: a second `up` on the same HOME was answered
by the first one's service, overwrote cli.json with its own token, then failed on the port).
The lock is an flock the kernel drops when its holder dies, plus the pids (and start times) of
what that `up` started, so leftovers of a killed one are named too. No Ray needed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from service.client import CliError
from service.settings import REPO_ROOT
from service.stack import StackLock, process_start_id

HOLD = """
import sys, time
from pathlib import Path
from service.stack import StackLock
lock = StackLock(Path(sys.argv[1]))
lock.acquire()
lock.set_url("http://127.0.0.1:1234")
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_up_on_the_same_home_is_refused_and_names_the_first(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(CliError) as refused:
            StackLock(tmp_path).acquire()
        message = str(refused.value)
        assert f"already running for {tmp_path}: pid {holder.pid}" in message
        assert "http://127.0.0.1:1234" in message and f"kill -TERM {holder.pid}" in message
    finally:
        holder.kill()
        holder.wait()
    # The holder died without releasing anything: the kernel dropped its flock.
    lock = StackLock(tmp_path)
    lock.acquire()
    lock.release()


def test_leftovers_of_a_killed_up_are_named_until_they_are_gone(tmp_path: Path) -> None:
    orphan = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        record = {
            "pid": 999_999_999,
            "children": [{"what": "service", "pid": orphan.pid, "start": process_start_id(orphan.pid)}],
        }
        (tmp_path / "up.pid").write_text(json.dumps(record))
        with pytest.raises(CliError) as refused:
            StackLock(tmp_path).acquire()
        assert f"service pid {orphan.pid} still running" in str(refused.value)
        assert f"kill -TERM -{orphan.pid}" in str(refused.value)
        # A recycled pid (same number, another start time) is not taken for the orphan.
        record["children"][0]["start"] = "1"
        (tmp_path / "up.pid").write_text(json.dumps(record))
        lock = StackLock(tmp_path)
        lock.acquire()
        lock.release()
    finally:
        orphan.kill()
        orphan.wait()
    record["children"][0]["start"] = process_start_id(orphan.pid)  # None: gone
    (tmp_path / "up.pid").write_text(json.dumps(record))
    lock = StackLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / "up.pid").read_text())["children"] == []
    assert (tmp_path / "up.pid").stat().st_mode & 0o777 == 0o600
    lock.release()
