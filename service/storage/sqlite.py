"""The embedded backend: one SQLite file in WAL mode, the default (``sqlite:///path``).

Connections are opened once and kept (opening one per operation cost ~15% of the service's CPU
under load, and closing the last one checkpointed the WAL every time):

- one writer connection, used under a lock: every write is one ``BEGIN IMMEDIATE``
  transaction (the write lock taken up front, so no deadlock-prone lock upgrade), WAL with
  ``synchronous=FULL`` (a committed batch and its cursor survive a power cut together);
- the WAL is copied into the database file by a checkpoint thread (once a second, PASSIVE:
  it never blocks the writer or a reader), not by the commit that crosses SQLite's
  auto-checkpoint threshold: that commit used to take 80 ms in the ingester's path, a
  third of its time at 100k records/s;
- a pool of reader connections, one per concurrent reading thread: in WAL a reader reads its
  snapshot while the writer commits, it never waits for the ingest transaction.

Leader election (one ingester per database file, even across processes) is an exclusive
``flock`` on ``<database>.ingest-lock``, released by the kernel when the holder dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from service.storage.base import LeaderLease, StorageError
from service.storage.ingest import IngestSql
from service.storage.jobs import JobsSql
from service.storage.layer_bits import LayerBitsSql
from service.storage.reads import ReadsSql
from service.storage.retention import RetentionSql
from service.storage.schema import SQLITE_MIGRATIONS, sqlite_statements
from service.storage.sql import Row, Tx, placeholders

logger = logging.getLogger(__name__)
_BUSY_TIMEOUT_MS = 30_000
CHECKPOINT_INTERVAL_S = 1.0
# The WAL grows to hold what arrives between checkpoints (~500 MB while the load test's backlog
# drained) and SQLite then reuses the file at that size for good. With this limit the writer
# truncates it back once a checkpoint has copied it all: a PVC is not held by one burst.
WAL_SIZE_LIMIT_BYTES = 64 * 1024 * 1024


class _Checkpointer:
    """A daemon thread with its own connection that checkpoints the WAL every interval."""

    def __init__(self, path: Path, interval_s: float = CHECKPOINT_INTERVAL_S) -> None:
        self.path, self.interval_s = path, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sqlite-checkpoint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        conn = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                               check_same_thread=False)  # fmt: skip
        try:
            conn.execute("PRAGMA synchronous=FULL")
            while not self._stop.wait(self.interval_s):
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                except sqlite3.Error as exc:  # busy or I/O: the next interval tries again
                    logger.warning("%s: WAL checkpoint failed: %s", self.path, exc)
        finally:
            conn.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


class _SqliteTx:
    __slots__ = ("conn",)

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        row: Row | None = self.conn.execute(sql, params).fetchone()
        return row

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return self.conn.execute(sql, params).fetchall()

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self.conn.execute(sql, params).rowcount

    def run_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        return self.conn.executemany(sql, rows).rowcount

    def bulk_insert(self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        # ON CONFLICT DO NOTHING: the cursor already filtered replays; should a database ever
        # hold records above its cursor, this keeps ingest going instead of failing every pass.
        self.conn.executemany(
            f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({placeholders(len(columns))})"
            " ON CONFLICT DO NOTHING",
            rows,
        )

    def lock_job(self, job_id: str) -> None:
        """Nothing to do: ``BEGIN IMMEDIATE`` holds the database's one write lock."""


class _FlockLease(LeaderLease):
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        if self._fd is not None:
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


class SqliteStorage(JobsSql, IngestSql, ReadsSql, RetentionSql, LayerBitsSql):
    backend = "sqlite"
    step_join = "CROSS JOIN layer_metrics m INDEXED BY layer_metrics_by_step"

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path).expanduser()
        if not self.path.parent.exists():
            self.path.parent.mkdir(mode=0o700, parents=True)
        if not self.path.exists():
            # Owner only: job specs, entrypoints and metrics. SQLite gives the -wal and -shm
            # files the database file's mode.
            os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
        self._write_lock = threading.Lock()  # the one writer connection, one transaction at a time
        self._pool_lock = threading.Lock()  # the reader free list (never held while reading)
        self._free_readers: list[sqlite3.Connection] = []
        self._closed = False
        self._checkpointer: _Checkpointer | None = None  # started by this process's first write
        self._writer = self._connect(writer=True)
        self.migrate()

    def describe(self) -> str:
        return f"sqlite://{self.path}"

    def _connect(self, writer: bool) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                               check_same_thread=False)  # fmt: skip
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
        if writer:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA wal_autocheckpoint=0")  # the checkpoint thread does it
            conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT_BYTES}")
        return conn

    @contextlib.contextmanager
    def _write(self) -> Iterator[Tx]:
        with self._write_lock:
            if self._closed:
                raise StorageError(f"storage {self.describe()} is closed")
            conn = self._writer
            if self._checkpointer is None:
                self._checkpointer = _Checkpointer(self.path)
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield _SqliteTx(conn)
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
            except sqlite3.OperationalError as exc:  # locked past the busy timeout, disk full, I/O
                raise StorageError(f"{self.describe()}: {exc}") from exc

    @contextlib.contextmanager
    def _read(self) -> Iterator[Tx]:
        with self._pool_lock:
            if self._closed:
                raise StorageError(f"storage {self.describe()} is closed")
            conn = self._free_readers.pop() if self._free_readers else None
        try:
            if conn is None:
                conn = self._connect(writer=False)
            conn.execute("BEGIN")  # one snapshot for every statement of this read
            try:
                yield _SqliteTx(conn)
            finally:
                conn.execute("COMMIT")
        except sqlite3.OperationalError as exc:
            raise StorageError(f"{self.describe()}: {exc}") from exc
        finally:
            if conn is not None:
                with self._pool_lock:
                    if self._closed:
                        conn.close()
                    else:
                        self._free_readers.append(conn)

    def close(self) -> None:
        with self._write_lock, self._pool_lock:
            if self._closed:
                return
            self._closed = True
            if self._checkpointer is not None:
                self._checkpointer.stop()
            for conn in (self._writer, *self._free_readers):
                conn.close()
            self._free_readers.clear()

    def migrate(self) -> None:
        with self._write() as tx:
            row = tx.one("PRAGMA user_version")
            version = int(row["user_version"]) if row is not None else 0
            for number, script in enumerate(SQLITE_MIGRATIONS[version:], start=version + 1):
                logger.info("applying database migration %d to %s", number, self.path)
                for statement in sqlite_statements(script):
                    tx.run(statement)
                tx.run(f"PRAGMA user_version={number}")

    def schema_version(self) -> int:
        with self._read() as tx:
            row = tx.one("PRAGMA user_version")
        return int(row["user_version"]) if row is not None else 0

    def check_writable(self) -> None:
        try:
            with self._write() as tx:
                tx.run("UPDATE ingest_cursors SET updated_at = updated_at WHERE 0 = 1")
        except (sqlite3.Error, StorageError) as exc:
            raise StorageError(f"{self.describe()} is not writable: {exc}") from exc

    def leader_lease(self) -> LeaderLease:
        return _FlockLease(self.path.with_name(self.path.name + ".ingest-lock"))

    def _database_bytes(self, tx: Tx) -> int:
        pages = tx.one("PRAGMA page_count")
        size = tx.one("PRAGMA page_size")
        main = int(pages["page_count"]) * int(size["page_size"]) if pages and size else 0
        wal = self.path.with_name(self.path.name + "-wal")
        return main + (wal.stat().st_size if wal.exists() else 0)
