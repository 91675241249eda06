"""A throwaway PostgreSQL server: ``initdb`` into a temp dir, ``pg_ctl start`` on a free loopback
port, stopped (and its directory removed) by the same object. For the test suite and
``jobs.load_test --backend postgresql``; never for production data.

Uses the server binaries of Debian's ``postgresql`` package (``/usr/lib/postgresql/<v>/bin``,
which are not on PATH) or whatever ``initdb`` is on PATH. PostgreSQL refuses to run as root:
as root the server runs as the ``postgres`` system user the package creates (``runuser -u
postgres``), in a directory handed to that user.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
SUPERUSER = "tailray"


def server_bin_dir() -> Path:
    """Where initdb and pg_ctl are; RuntimeError saying how to install them otherwise."""
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    raise RuntimeError(
        "PostgreSQL server binaries not found (initdb): install them with "
        "`apt-get install postgresql` (Debian/Ubuntu), as .ci/run does"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalPostgres:
    """``with LocalPostgres() as pg: url = pg.create_database()``."""

    def __init__(self, durable: bool = False) -> None:
        # durable=False turns fsync off: fine for tests, wrong for a benchmark of real writes.
        self.durable = durable
        self.bin_dir = server_bin_dir()
        self.port = _free_port()
        self.root = Path(tempfile.mkdtemp(prefix="tail-pg-"))
        self.data_dir = self.root / "data"
        self._as_postgres = os.geteuid() == 0
        self._started = False

    def _cmd(self, *argv: str) -> list[str]:
        return (["runuser", "-u", "postgres", "--"] if self._as_postgres else []) + list(argv)

    def _run(self, *argv: str) -> None:
        proc = subprocess.run(self._cmd(*argv), capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:2])} failed ({proc.returncode}): {proc.stderr[-2000:]}")

    def start(self) -> LocalPostgres:
        if self._as_postgres:
            shutil.chown(self.root, user="postgres", group="postgres")
        self._run(
            str(self.bin_dir / "initdb"), "-D", str(self.data_dir), "-U", SUPERUSER, "--auth=trust",
            "--encoding=UTF8", "--locale=C", "--no-sync",
        )  # fmt: skip
        self.start_server()
        logger.info("PostgreSQL started on 127.0.0.1:%d (%s)", self.port, self.root)
        return self

    def start_server(self) -> None:
        """Start the server on the initialized data directory (again, after ``stop_server``)."""
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -c unix_socket_directories={self.root}"
        if not self.durable:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run(
            str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-l", str(self.root / "server.log"),
            "-o", options, "-w", "-t", "60", "start",
        )  # fmt: skip
        self._started = True

    def stop_server(self) -> None:
        """Stop the server, keeping its data (an outage, for tests)."""
        if self._started:
            self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", "fast", "-w", "stop")
            self._started = False

    def stop(self) -> None:
        self.stop_server()
        shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str | None = None) -> str:
        """A new empty database; returns its URL."""
        import psycopg

        name = name or f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"'.encode())
        return self.url(name)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        import psycopg

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with psycopg.connect(self.url(), connect_timeout=2):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def __enter__(self) -> LocalPostgres:
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
