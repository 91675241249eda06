"""What the shared SQL needs from a backend: transactions, a per-job lock, a bulk insert.

The queries in ``jobs.py``, ``ingest.py``, ``reads.py`` and ``retention.py`` are written once,
with ``?`` placeholders, in the SQL both SQLite and PostgreSQL accept (``ON CONFLICT``,
window functions, ``CAST`` around aggregates so PostgreSQL returns int/float rather than
Decimal). A backend subclasses ``SqlBase`` and provides:

- ``_read()``: a consistent snapshot for multi-statement reads, on a connection that never
  waits for the writer (SQLite: WAL reader connections; PostgreSQL: MVCC);
- ``_write()``: one transaction (commit on success, rollback on any error);
- ``Tx.lock_job``: serialize the writers of one job's records (SQLite: the database write
  lock already does; PostgreSQL: ``SELECT ... FOR UPDATE`` on the job's cursor row);
- ``Tx.bulk_insert``: the fastest way the backend has to append many rows.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from service.storage.base import Storage

Row = Mapping[str, Any]  # sqlite3.Row and psycopg's dict rows both index by column name


class Tx(Protocol):
    """One open transaction (or read snapshot) on one connection."""

    def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None: ...

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]: ...

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Execute one statement; returns the rows it changed."""
        ...

    def run_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> int: ...

    def bulk_insert(self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """Append rows the caller knows are new (the job's cursor filtered them)."""
        ...

    def lock_job(self, job_id: str) -> None:
        """Hold the job's cursor row until this transaction ends."""
        ...


class SqlBase(Storage):
    """A backend: the connection side of the shared SQL."""

    @abstractmethod
    def _read(self) -> AbstractContextManager[Tx]: ...

    @abstractmethod
    def _write(self) -> AbstractContextManager[Tx]: ...

    @abstractmethod
    def _database_bytes(self, tx: Tx) -> int: ...


def placeholders(n: int) -> str:
    return ", ".join("?" * n)


def chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for lo in range(0, len(items), size):
        yield items[lo : lo + size]
