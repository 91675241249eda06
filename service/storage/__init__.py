"""Storage: jobs, every ingested metric record, the ingest cursor per job, and read models.

One interface (``base.Storage``), two backends chosen by a URL (``open_storage``):

- ``sqlite:///absolute/path.sqlite`` (or a bare path): embedded, the default; one service.
- ``postgresql://user:password@host:port/database``: a server; several replicas, one ingester.

Layout: ``schema`` (migrations, both backends), ``jobs`` / ``ingest`` / ``reads`` /
``layer_bits`` / ``retention`` (the SQL, shared), ``records`` (record -> row conversion, no
SQL), ``sqlite`` and ``postgres`` (connections, locks, bulk insert).
"""

from __future__ import annotations

from pathlib import Path

from service.storage.base import (
    STOPPING,
    TERMINAL,
    IngestBatch,
    JobRow,
    LeaderLease,
    RetentionPolicy,
    Storage,
    StorageError,
    StorageSize,
)

__all__ = [
    "STOPPING",
    "TERMINAL",
    "IngestBatch",
    "JobRow",
    "LeaderLease",
    "RetentionPolicy",
    "Storage",
    "StorageError",
    "StorageSize",
    "open_storage",
    "parse_storage_url",
]

SCHEMES = ("sqlite", "postgresql", "postgres")


def parse_storage_url(url: str | Path) -> tuple[str, str]:
    """(backend, target): ``("sqlite", path)`` or ``("postgresql", url)``; ValueError saying
    what is accepted otherwise. Everything after ``sqlite://`` is the path, so
    ``sqlite:///var/lib/x.sqlite`` is absolute and ``sqlite://x.sqlite`` relative."""
    if isinstance(url, Path) or "://" not in url:
        return "sqlite", str(Path(url).expanduser())
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    if scheme == "sqlite":
        if not rest:
            raise ValueError("a sqlite URL needs a path: sqlite:///absolute/path.sqlite")
        return "sqlite", str(Path(rest).expanduser())
    if scheme in ("postgresql", "postgres"):
        return "postgresql", url
    raise ValueError(
        f"unsupported database URL scheme {scheme!r}: use sqlite:///path/to/file.sqlite or "
        "postgresql://user:password@host:port/database"
    )


def open_storage(url: str | Path) -> Storage:
    """Open (and migrate) the storage a URL or path names."""
    backend, target = parse_storage_url(url)
    if backend == "sqlite":
        from service.storage.sqlite import SqliteStorage

        return SqliteStorage(Path(target))
    # Imported here: a SQLite service never loads the PostgreSQL driver.
    from service.storage.postgres import PostgresStorage

    return PostgresStorage(target)
