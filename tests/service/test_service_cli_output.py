"""What the CLI prints, in its two modes: plain lines with no escape codes when stdout is not a
terminal (pipes, logs, CI: progress one line per change), rich tables, colour and a live
progress bar on a terminal (a real pseudo-terminal here). The REST commands run against the
real app under uvicorn, with jobs written through Storage; no Ray."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from service_support import API_TOKEN, LiveServer, make_settings, seed_finished_job

from service import cli
from service.storage import open_storage
from service.terminal import Output

ESC = "\x1b["


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    db = tmp_path / "db.sqlite"
    with open_storage(db) as store:
        for job_id in ("done-a", "done-b"):
            seed_finished_job(store, job_id, steps=3)
    with LiveServer(make_settings(db, None)) as live:
        yield live


def test_off_a_terminal_every_line_is_plain(server: LiveServer, capsys: pytest.CaptureFixture) -> None:
    base = ["--url", server.url, "--token", API_TOKEN]
    assert cli.main([*base, "jobs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["JOB", "NAME", "METHOD", "STATUS", "CREATED"]
    assert set(lines[1].replace(" ", "")) == {"-"}  # the dashed rule under the header
    assert {line.split()[0] for line in lines[2:4]} == {"done-a", "done-b"}
    assert lines[4] == "2 of 2 jobs"
    assert cli.main([*base, "metrics", "done-a"]) == 0
    table = capsys.readouterr().out
    assert "fc1.weight" in table and "steps 3 (last 2)" in table
    assert cli.main(["--url", server.url, "--token", "wrong-token-0000000000", "stop", "x"]) == cli.EXIT_API
    err = capsys.readouterr().err
    assert err.startswith("tail-ray: ") and "HTTP 403" in err and err.count("\n") == 1
    # a token that begins with '-' is still the token's value, not an option (argparse alone
    # exits 2 on it: "expected one argument"); the service answers 403 to it, not 401
    assert cli.main(["--url", server.url, "--token", "-wrong-token-000000000", "stop", "x"]) == cli.EXIT_API
    assert "HTTP 403" in capsys.readouterr().err
    assert ESC not in table + err + "\n".join(lines)

    out = io.StringIO()
    polls = [(0, "PENDING"), (0, "RUNNING"), (0, "RUNNING"), (4, "RUNNING"), (10, "SUCCEEDED")]
    with Output(out=out, err=out).progress("tail", 10) as update:
        for done, status in polls:
            update(done, status)
    assert out.getvalue().splitlines() == [
        "tail: 0/10 steps, PENDING",
        "tail: 0/10 steps, RUNNING",  # the repeated poll printed nothing
        "tail: 4/10 steps, RUNNING",
        "tail: 10/10 steps, SUCCEEDED",
    ]
    assert "\r" not in out.getvalue()


def test_on_a_terminal_tables_progress_and_errors_are_rich(server: LiveServer) -> None:
    primary, secondary = pty.openpty()
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    cmd = [sys.executable, "-m", "service.cli", "--url", server.url, "--token", API_TOKEN, "jobs"]
    proc = subprocess.Popen(cmd, stdout=secondary, stderr=secondary, env=env)
    os.close(secondary)
    chunks = []
    while True:
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(primary)
    assert proc.wait(timeout=60) == 0
    shown = b"".join(chunks).decode()
    assert ESC in shown  # bold header: rich drew it, knowing it writes to a terminal
    assert "━" in shown or "─" in shown  # a box rule, not the plain dashes
    assert "done-a" in shown and "done-b" in shown and "2 of 2 jobs" in shown

    out, err = io.StringIO(), io.StringIO()
    terminal = Output(out=out, err=err, terminal=True)
    with terminal.progress("tail", 10) as update:
        update(4, "RUNNING")
        update(10, "SUCCEEDED")
    assert "10/10" in out.getvalue() and "SUCCEEDED" in out.getvalue()
    terminal.error("bad spec [bold]steps[/bold]: must be > 0")  # never read as markup
    assert ESC in err.getvalue() and "[bold]steps[/bold]" in err.getvalue()


def test_tokens_that_up_makes_never_read_as_an_option() -> None:
    from service.stack import _new_token

    # a base64 token begins with '-' once in 64 draws; 2,000 draws catch that all but surely
    tokens = [_new_token() for _ in range(2000)]
    assert not [t for t in tokens if t.startswith("-")]
    assert len(set(tokens)) == len(tokens) and min(map(len, tokens)) >= 43  # >= 256 bits in base64
