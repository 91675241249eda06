"""The server backend: PostgreSQL (``postgresql://user:password@host:port/database``), for
deployments that run more than one replica of the service or must survive losing a volume.

- Connections: two psycopg 3 pools, used from worker threads like SQLite's (one sync interface
  for both backends, measured fast enough: see docs/operations.md). Readers run REPEATABLE
  READ, READ ONLY (one snapshot per read, never blocked by the writer: MVCC); writers READ
  COMMITTED with the job's cursor row locked ``FOR UPDATE`` for an ingest, so two writers of
  one job serialize and the second sees the first's cursor.
- Bulk insert: ``COPY`` (several times executemany's rate). If COPY ever meets a stored record
  (its key: job_id, step, seq, which a replay repeats), a savepoint rolls it back and the rows
  go in with ``ON CONFLICT DO NOTHING``.
- Migrations: ``schema.POSTGRES_MIGRATIONS``, tracked in ``schema_migrations``, under a
  transaction-scoped advisory lock: replicas that start together migrate once.
- Leader election: a session advisory lock held on a connection of its own; if the holder
  dies, PostgreSQL ends its session and the lock is free for the next replica.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import errors as pg_errors
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from service.storage.base import LeaderLease, StorageError
from service.storage.ingest import IngestSql
from service.storage.jobs import JobsSql
from service.storage.layer_bits import LayerBitsSql
from service.storage.reads import ReadsSql
from service.storage.retention import RetentionSql
from service.storage.schema import POSTGRES_MIGRATIONS
from service.storage.sql import Row, Tx, placeholders

logger = logging.getLogger(__name__)


def _lock_key(name: str) -> int:
    """A stable signed 64-bit advisory-lock key for a name."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


INGESTER_LOCK_KEY = _lock_key("tail-ray:ingester")
POOL_TIMEOUT_S = 10.0
MIGRATION_LOCK_KEY = _lock_key("tail-ray:migrations")


@functools.lru_cache(maxsize=256)
def _pg_sql(sql: str) -> str:
    """The shared SQL's ``?`` placeholders in psycopg's style (a literal ``%`` doubles)."""
    return sql.replace("%", "%%").replace("?", "%s")


class _PgTx:
    __slots__ = ("conn", "cur")

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.cur = conn.cursor()

    def _execute(self, sql: str, params: Sequence[Any]) -> None:
        # Without parameters psycopg sends the text as is (a migration may hold several
        # statements); with them, the placeholders are translated.
        if params:
            self.cur.execute(_pg_sql(sql), params)
        else:
            self.cur.execute(sql.encode())

    def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        self._execute(sql, params)
        row: Row | None = self.cur.fetchone()
        return row

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        self._execute(sql, params)
        return self.cur.fetchall()

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        self._execute(sql, params)
        return self.cur.rowcount

    def run_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        self.cur.executemany(_pg_sql(sql), rows)
        return self.cur.rowcount

    def bulk_insert(self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        try:
            self._copy(table, columns, [_COPY_TYPES[c] for c in columns], rows)
        except (pg_errors.DataError, TypeError, ValueError, OverflowError) as exc:
            # Never seen: the converters (records.py, columns.py) hand over int / float / str /
            # None only. Should one slip through, text COPY takes what binary would not.
            logger.warning("%s: binary COPY refused the batch (%s); sending it as text", table, exc)
            self._copy(table, columns, None, rows)

    def _copy(
        self, table: str, columns: Sequence[str], types: list[str] | None, rows: Sequence[Sequence[Any]]
    ) -> None:
        """COPY ``rows`` in; binary when ``types`` are given: PostgreSQL then parses no text and
        psycopg formats no floats as text (layer rows here: 175-183k -> 229-257k rows/s, client
        and server together). A conflict takes the batch row by row."""
        names, fmt = ", ".join(columns), " (FORMAT BINARY)" if types is not None else ""
        try:
            # A savepoint: only the COPY rolls back on a conflict.
            with (
                self.conn.transaction(),
                self.cur.copy(f"COPY {table} ({names}) FROM STDIN{fmt}".encode()) as copy,
            ):
                if types is not None:
                    copy.set_types(types)
                for row in rows:
                    copy.write_row(row)
        except pg_errors.UniqueViolation:
            logger.warning("%s: COPY met stored records; inserting the batch row by row", table)
            self.run_many(
                f"INSERT INTO {table} ({names}) VALUES ({placeholders(len(columns))}) ON CONFLICT DO NOTHING",
                rows,
            )

    def lock_job(self, job_id: str) -> None:
        self._execute("SELECT 1 FROM ingest_cursors WHERE job_id = ? FOR UPDATE", (job_id,))


# The PostgreSQL type of every column a batch inserts (schema.POSTGRES_MIGRATIONS), for binary COPY.
_TEXT_COLUMNS = ("job_id", "layer", "code", "method")
_FLOAT_COLUMNS = (
    "density", "ratio", "rel_error", "compress_s", "decode_s", "comm_s", "step_s", "loss", "wall_time_s",
)  # fmt: skip
_INT_COLUMNS = (
    "seq", "step", "rank", "numel", "bits", "raw_bytes", "encoded_bytes", "world_size", "bytes_sent",
    "bytes_received",
)  # fmt: skip
_COPY_TYPES: dict[str, str] = {
    **dict.fromkeys(_TEXT_COLUMNS, "text"),
    **dict.fromkeys(_FLOAT_COLUMNS, "float8"),
    **dict.fromkeys(_INT_COLUMNS, "int8"),
}

_LEASE_SESSION = (
    "SET tcp_keepalives_idle = 10",
    "SET tcp_keepalives_interval = 5",
    "SET tcp_keepalives_count = 3",
    # The holder pings its session every ingest pass and page (``held``); one silent for a
    # minute is gone or stuck, and ending its session frees the lock for another replica.
    "SET idle_session_timeout = '60s'",
)


class _AdvisoryLease(LeaderLease):
    """A session-level advisory lock on a dedicated autocommit connection."""

    def __init__(self, url: str, key: int) -> None:
        self.url, self.key = url, key
        self._conn: psycopg.Connection[Any] | None = None

    def try_acquire(self) -> bool:
        if self.held:
            return True
        try:
            # Client-side keepalives notice a dead server; the session settings below make the
            # server notice a dead or frozen holder (no FIN when a node is lost), so the lock
            # does not outlive it by the kernel's default of two hours.
            conn = psycopg.connect(
                self.url, autocommit=True, connect_timeout=10, keepalives=1, keepalives_idle=10,
                keepalives_interval=5, keepalives_count=3,
            )  # fmt: skip
            for setting in _LEASE_SESSION:
                with contextlib.suppress(psycopg.errors.UndefinedObject):  # idle_session_timeout: 14+
                    conn.execute(setting.encode())
        except psycopg.Error as exc:
            logger.warning("leader election: cannot connect: %s", exc)
            return False
        row = conn.execute("SELECT pg_try_advisory_lock(%s)", (self.key,)).fetchone()
        if row is None or not row[0]:
            conn.close()
            return False
        self._conn = conn
        return True

    def release(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                # Unlock before closing: the server ends a closed session's backend (and frees
                # its locks) some time after the client has gone, so a replica that tried at
                # once could find the lock still held. A dead session frees it all the same.
                self._conn.execute("SELECT pg_advisory_unlock(%s)", (self.key,))
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None

    @property
    def held(self) -> bool:
        if self._conn is None:
            return False
        try:  # the lock lives as long as this session: a broken session means it is gone
            self._conn.execute("SELECT 1")
        except psycopg.Error:
            logger.warning("leader election: lost the session holding the ingester lock")
            self.release()
            return False
        return True


def _configure_reader(conn: psycopg.Connection[Any]) -> None:
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    conn.read_only = True


class PostgresStorage(JobsSql, IngestSql, ReadsSql, RetentionSql, LayerBitsSql):
    backend = "postgresql"
    ingest_writers = 2  # measured: docs/operations.md, "Fifth pass"

    def __init__(self, url: str, max_readers: int = 16, max_writers: int = 4) -> None:
        self.url = url
        kwargs = {"row_factory": dict_row, "connect_timeout": 10}
        try:
            # timeout: how long a request waits for a connection before it fails (503) instead
            # of hanging while the database is down.
            self._writers: ConnectionPool[Any] = ConnectionPool(
                url, min_size=1, max_size=max_writers, kwargs=kwargs, open=True, name="tail-ray-write",
                timeout=POOL_TIMEOUT_S,
            )  # fmt: skip
            self._readers: ConnectionPool[Any] = ConnectionPool(
                url, min_size=1, max_size=max_readers, kwargs=kwargs, configure=_configure_reader,
                open=True, name="tail-ray-read", timeout=POOL_TIMEOUT_S,
            )  # fmt: skip
            self._writers.wait(timeout=30)
        except Exception as exc:
            raise StorageError(f"cannot connect to {self.describe()}: {exc}") from exc
        self.migrate()

    def describe(self) -> str:
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        netloc = f"{parts.username}@{host}" if parts.username else host
        if parts.port:
            netloc += f":{parts.port}"
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))

    @contextlib.contextmanager
    def _write(self) -> Iterator[Tx]:
        try:
            with self._writers.connection() as conn:  # commits on success, rolls back on error
                yield _PgTx(conn)
        except psycopg.OperationalError as exc:  # unreachable, restarting, no connection in time
            raise StorageError(f"{self.describe()}: {exc}") from exc

    @contextlib.contextmanager
    def _read(self) -> Iterator[Tx]:
        try:
            with self._readers.connection() as conn:
                yield _PgTx(conn)
        except psycopg.OperationalError as exc:
            raise StorageError(f"{self.describe()}: {exc}") from exc

    def close(self) -> None:
        self._readers.close()
        self._writers.close()

    def migrate(self) -> None:
        with self._write() as tx:
            tx.one("SELECT pg_advisory_xact_lock(?)", (MIGRATION_LOCK_KEY,))
            tx.run(
                "CREATE TABLE IF NOT EXISTS schema_migrations"
                " (version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
            )
            row = tx.one("SELECT COALESCE(MAX(version), 0) AS version FROM schema_migrations")
            version = int(row["version"]) if row else 0
            for number, script in enumerate(POSTGRES_MIGRATIONS[version:], start=version + 1):
                logger.info("applying database migration %d to %s", number, self.describe())
                tx.run(script)
                tx.run(
                    "INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)", (number, time.time())
                )

    def schema_version(self) -> int:
        with self._read() as tx:
            row = tx.one("SELECT COALESCE(MAX(version), 0) AS version FROM schema_migrations")
        return int(row["version"]) if row else 0

    def check_writable(self) -> None:
        try:
            with self._write() as tx:
                tx.run("UPDATE ingest_cursors SET updated_at = updated_at WHERE 0 = 1")
        except (psycopg.Error, OSError, StorageError) as exc:
            raise StorageError(f"{self.describe()} is not writable: {exc}") from exc

    def leader_lease(self) -> LeaderLease:
        return _AdvisoryLease(self.url, INGESTER_LOCK_KEY)

    def _database_bytes(self, tx: Tx) -> int:
        row = tx.one("SELECT pg_database_size(current_database()) AS n")
        return int(row["n"]) if row else 0
