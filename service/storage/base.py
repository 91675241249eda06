"""The storage interface: what the service asks of its database, whichever backend holds it.

Two backends implement it: SQLite (``sqlite.py``, embedded, the default) and PostgreSQL
(``postgres.py``, for deployments with more than one replica). The SQL both run is shared
(``jobs.py``, ``ingest.py``, ``reads.py``, ``retention.py`` over ``sql.SqlBase``); the
backends differ only in connections, locks, bulk insert and migrations (``schema.py``).

Every method is synchronous and thread-safe: the app calls them from worker threads
(FastAPI's pool for routes, ``asyncio.to_thread`` for the ingester), never on the event loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service.status import TERMINAL_STATUSES, JobStatus
from tail_ray.errors import TailError

TERMINAL = tuple(sorted(s.value for s in TERMINAL_STATUSES))  # for SQL: status IN (...)
STOPPING = JobStatus.STOPPING


class StorageError(TailError):
    """The database refused or failed an operation (unreachable, read-only, full, ...)."""


@dataclass(frozen=True)
class JobRow:
    id: str
    name: str
    source: str
    status: str
    message: str
    entrypoint: str
    spec: dict[str, Any] | None
    created_at: float
    started_at: float | None
    ended_at: float | None

    @property
    def is_terminal(self) -> bool:
        return JobStatus.from_ray(self.status).is_terminal


@dataclass(frozen=True)
class IngestBatch:
    """One or more sink reads, as the ingester hands them to storage in one transaction."""

    records: list[dict[str, Any]]
    next_seq: int
    missed: int = 0
    dropped_in_sink: int = 0
    dropped_by_workers: int = 0
    # A columnar page (``MetricsSink.read(columnar=True)``: "layer" / "step" field -> list, and
    # "records" for the odd ones) stored instead of ``records``: the fast path.
    columns: dict[str, Any] | None = None


@dataclass(frozen=True)
class RetentionPolicy:
    """Per job: every step of the newest ``full_steps`` steps, then only every ``every_k``-th.

    ``full_steps=None`` keeps everything. Running totals (summary, Prometheus) are kept
    separately and never change when old records are thinned out.
    """

    full_steps: int | None = None
    every_k: int = 10

    def __post_init__(self) -> None:
        if self.full_steps is not None and self.full_steps < 1:
            raise ValueError(f"full_steps must be >= 1 or None, got {self.full_steps}")
        if self.every_k < 1:
            raise ValueError(f"every_k must be >= 1, got {self.every_k}")


@dataclass(frozen=True)
class StorageSize:
    """How much the database holds: rows kept now and bytes on disk (backend's own measure)."""

    layer_records: int
    step_records: int
    pruned_records: int
    database_bytes: int


class LeaderLease(ABC):
    """A lock at most one holder across processes and replicas has: the ingester's."""

    @abstractmethod
    def try_acquire(self) -> bool:
        """Take the lease if free (never blocks); True while this object holds it."""

    @abstractmethod
    def release(self) -> None: ...

    @property
    @abstractmethod
    def held(self) -> bool:
        """Still ours: False once released or once the backend says the lock was lost."""


class Storage(ABC):
    """The one storage interface (see the module docstring)."""

    backend: str  # "sqlite" | "postgresql"
    # Ingest transactions worth running at once (the ingester's writer threads, unless the
    # ingest_writers setting says otherwise): SQLite has one write lock; a server commits
    # several, and two kept PostgreSQL busy while the ingest process prepared the next pages.
    ingest_writers: int = 1

    # ---------------------------------------------------------------- lifecycle
    @abstractmethod
    def close(self) -> None:
        """Close every connection; the object is unusable afterwards."""

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abstractmethod
    def migrate(self) -> None:
        """Apply the backend's pending migrations (safe to run from several processes)."""

    @abstractmethod
    def schema_version(self) -> int: ...

    @abstractmethod
    def check_writable(self) -> None:
        """Raise StorageError when the database cannot take a write transaction."""

    @abstractmethod
    def leader_lease(self) -> LeaderLease:
        """A new lease object for the ingester's leader election."""

    @abstractmethod
    def describe(self) -> str:
        """Where the data lives, for logs (no password)."""

    # ---------------------------------------------------------------- jobs
    @abstractmethod
    def insert_job(
        self,
        *,
        job_id: str,
        name: str,
        source: str,
        status: str,
        entrypoint: str,
        spec: dict[str, Any] | None,
        created_at: float | None = None,
        message: str = "",
    ) -> bool:
        """Insert a job unless it exists; True when inserted."""

    @abstractmethod
    def update_job_status(
        self,
        job_id: str,
        status: str,
        message: str | None = None,
        started_at: float | None = None,
        ended_at: float | None = None,
    ) -> None: ...

    @abstractmethod
    def get_job(self, job_id: str) -> JobRow | None: ...

    @abstractmethod
    def list_jobs(self, limit: int, offset: int) -> tuple[list[JobRow], int]: ...

    @abstractmethod
    def job_ids(self, *, terminal: bool | None = None) -> list[str]: ...

    @abstractmethod
    def status_counts(self) -> dict[str, int]: ...

    # ---------------------------------------------------------------- ingest
    @abstractmethod
    def undrained_jobs(self) -> list[tuple[JobRow, int]]:
        """Jobs whose sink may still hold records, with their cursor."""

    @abstractmethod
    def cursor(self, job_id: str) -> int: ...

    @abstractmethod
    def ingest(self, job_id: str, batch: IngestBatch) -> int:
        """Store a batch and advance the cursor in ONE transaction; returns records stored."""

    @abstractmethod
    def ingest_many(self, batches: Sequence[tuple[str, IngestBatch]]) -> list[int]:
        """Several jobs' batches and cursors in ONE transaction; records stored per batch."""

    @abstractmethod
    def mark_drained(self, job_id: str) -> None: ...

    @abstractmethod
    def ingest_version(self, job_id: str) -> tuple[Any, ...]:
        """A value that changes in every transaction that changes the job's metrics."""

    @abstractmethod
    def ingest_state(self, job_id: str) -> dict[str, Any]: ...

    # ---------------------------------------------------------------- reads
    @abstractmethod
    def record_counts(self, job_id: str) -> tuple[int, int]:
        """(layer records, step records) stored for a job."""

    @abstractmethod
    def seqs(self, job_id: str) -> list[int]:
        """Every stored sequence number of a job, sorted (for audits and tests)."""

    @abstractmethod
    def latest_layers(self, job_id: str) -> list[dict[str, Any]]: ...

    @abstractmethod
    def steps(
        self, job_id: str, after_step: int, limit: int, before_step: int | None = None
    ) -> list[dict[str, Any]]: ...

    @abstractmethod
    def max_step(self, job_id: str) -> int | None: ...

    @abstractmethod
    def summary(self, job_id: str) -> dict[str, Any]: ...

    @abstractmethod
    def layer_bits(self, job_id: str, max_points: int) -> dict[str, Any]:
        """Per layer, its bits over steps in at most ``max_points`` windows (layer_bits.py)."""

    # ---------------------------------------------------------------- retention and size
    @abstractmethod
    def apply_retention(self, job_id: str, policy: RetentionPolicy) -> int:
        """Thin the job's old records to ``policy``; returns records deleted."""

    @abstractmethod
    def size(self) -> StorageSize: ...
