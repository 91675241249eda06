"""SQLite storage: jobs, every ingested metric record, and the ingest cursor per job.

Crash safety: WAL journal with ``synchronous=FULL``; each ingest batch (its records AND the
advanced cursor) commits in one transaction, so after a crash the cursor never points past
what was stored, and records are keyed by (job_id, seq) so a re-read batch is ignored, not
doubled. Migrations are code (``MIGRATIONS``), applied in order and tracked in
``PRAGMA user_version``.

Read models: per-job running totals (``step_totals``, ``layer_totals``, ``job_world_sizes``)
and each layer's / (step, rank)'s newest record (``layer_newest``, ``step_newest``) are kept
by AFTER INSERT triggers, so they commit with the ingest transaction and count only records
really inserted (a replayed record fires nothing). The read routes use them instead of
aggregating every record of a job.

Connections are opened per operation: SQLite makes that cheap, it is thread-safe for
FastAPI's thread pool, and WAL lets readers run while the ingester writes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.status import TERMINAL_STATUSES, JobStatus

logger = logging.getLogger(__name__)

MIGRATIONS: tuple[str, ...] = (
    # 1: jobs, metric records, ingest cursors. Float metric columns are nullable: a worker that
    # measured NaN or inf (0/0 somewhere) still sent a record, and JSON has no NaN; NULL keeps
    # the record (and its bytes) instead of losing it.
    """
    CREATE TABLE jobs (
        id          TEXT PRIMARY KEY,
        name        TEXT NOT NULL,
        source      TEXT NOT NULL CHECK (source IN ('api', 'ray')),
        status      TEXT NOT NULL,
        message     TEXT NOT NULL DEFAULT '',
        entrypoint  TEXT NOT NULL,
        spec_json   TEXT,
        created_at  REAL NOT NULL,
        started_at  REAL,
        ended_at    REAL,
        updated_at  REAL NOT NULL
    );
    CREATE INDEX jobs_by_created ON jobs (created_at DESC, id);

    CREATE TABLE layer_metrics (
        job_id        TEXT NOT NULL,
        seq           INTEGER NOT NULL,
        step          INTEGER NOT NULL,
        rank          INTEGER NOT NULL,
        layer         TEXT NOT NULL,
        numel         INTEGER NOT NULL,
        bits          INTEGER NOT NULL,
        density       REAL,
        raw_bytes     INTEGER NOT NULL,
        encoded_bytes INTEGER NOT NULL,
        ratio         REAL,
        rel_error     REAL,
        code          TEXT NOT NULL,
        PRIMARY KEY (job_id, seq)
    ) WITHOUT ROWID;
    CREATE INDEX layer_metrics_by_layer ON layer_metrics (job_id, layer, step, rank, seq);

    CREATE TABLE step_metrics (
        job_id         TEXT NOT NULL,
        seq            INTEGER NOT NULL,
        step           INTEGER NOT NULL,
        rank           INTEGER NOT NULL,
        world_size     INTEGER NOT NULL,
        bytes_sent     INTEGER NOT NULL,
        bytes_received INTEGER NOT NULL,
        raw_bytes      INTEGER NOT NULL,
        compress_s     REAL,
        decode_s       REAL,
        comm_s         REAL,
        step_s         REAL,
        loss           REAL,
        method         TEXT NOT NULL,
        wall_time_s    REAL,
        PRIMARY KEY (job_id, seq)
    ) WITHOUT ROWID;
    CREATE INDEX step_metrics_by_step ON step_metrics (job_id, step, rank, seq);

    CREATE TABLE ingest_cursors (
        job_id             TEXT PRIMARY KEY,
        after_seq          INTEGER NOT NULL DEFAULT 0,
        records            INTEGER NOT NULL DEFAULT 0,
        skipped            INTEGER NOT NULL DEFAULT 0,
        missed             INTEGER NOT NULL DEFAULT 0,
        dropped_in_sink    INTEGER NOT NULL DEFAULT 0,
        dropped_by_workers INTEGER NOT NULL DEFAULT 0,
        drained            INTEGER NOT NULL DEFAULT 0,
        updated_at         REAL NOT NULL
    );
    """,
    # 2: read models kept by triggers, so they change in the SAME transaction as each ingest
    # page and only for rows really inserted (a replayed record hits ON CONFLICT DO NOTHING and
    # fires nothing). The summary, layer and Prometheus routes read these few rows instead of
    # aggregating every record of the job (80 ms per summary at 200k records). The backfill
    # below computes the same aggregates from the records already stored.
    """
    CREATE TABLE layer_totals (
        job_id      TEXT PRIMARY KEY,
        ratio_sum   REAL NOT NULL,
        ratio_count INTEGER NOT NULL
    );
    CREATE TABLE layer_newest (
        job_id TEXT NOT NULL,
        layer  TEXT NOT NULL,
        step   INTEGER NOT NULL,
        PRIMARY KEY (job_id, layer)
    ) WITHOUT ROWID;
    CREATE TABLE step_newest (
        job_id         TEXT NOT NULL,
        step           INTEGER NOT NULL,
        rank           INTEGER NOT NULL,
        seq            INTEGER NOT NULL,
        raw_bytes      INTEGER NOT NULL,
        bytes_sent     INTEGER NOT NULL,
        bytes_received INTEGER NOT NULL,
        PRIMARY KEY (job_id, step, rank)
    ) WITHOUT ROWID;
    CREATE TABLE step_totals (
        job_id         TEXT PRIMARY KEY,
        steps          INTEGER NOT NULL,
        last_step      INTEGER,
        raw_bytes      INTEGER NOT NULL,
        bytes_sent     INTEGER NOT NULL,
        bytes_received INTEGER NOT NULL
    );
    CREATE TABLE job_world_sizes (
        job_id     TEXT NOT NULL,
        world_size INTEGER NOT NULL,
        PRIMARY KEY (job_id, world_size)
    ) WITHOUT ROWID;

    INSERT INTO layer_totals (job_id, ratio_sum, ratio_count)
        SELECT job_id, TOTAL(ratio), COUNT(ratio) FROM layer_metrics GROUP BY job_id;
    INSERT INTO layer_newest (job_id, layer, step)
        SELECT job_id, layer, MAX(step) FROM layer_metrics GROUP BY job_id, layer;
    INSERT INTO step_newest (job_id, step, rank, seq, raw_bytes, bytes_sent, bytes_received)
        SELECT job_id, step, rank, seq, raw_bytes, bytes_sent, bytes_received FROM (
            SELECT *, ROW_NUMBER() OVER (PARTITION BY job_id, step, rank ORDER BY seq DESC) AS rn
            FROM step_metrics
        ) WHERE rn = 1;
    INSERT INTO step_totals (job_id, steps, last_step, raw_bytes, bytes_sent, bytes_received)
        SELECT job_id, COUNT(DISTINCT step), MAX(step), SUM(raw_bytes), SUM(bytes_sent),
               SUM(bytes_received)
        FROM step_newest GROUP BY job_id;
    INSERT INTO job_world_sizes (job_id, world_size)
        SELECT DISTINCT job_id, world_size FROM step_metrics;

    CREATE TRIGGER layer_metrics_read_model AFTER INSERT ON layer_metrics BEGIN
        INSERT INTO layer_totals (job_id, ratio_sum, ratio_count)
            VALUES (NEW.job_id, COALESCE(NEW.ratio, 0.0), NEW.ratio IS NOT NULL)
            ON CONFLICT (job_id) DO UPDATE SET ratio_sum = ratio_sum + excluded.ratio_sum,
                ratio_count = ratio_count + excluded.ratio_count;
        INSERT INTO layer_newest (job_id, layer, step) VALUES (NEW.job_id, NEW.layer, NEW.step)
            ON CONFLICT (job_id, layer) DO UPDATE SET step = excluded.step WHERE excluded.step > step;
    END;

    -- Per (step, rank) the newest record (highest seq) counts, as in the aggregating queries:
    -- a rank that re-runs a step after a restart replaces its older record's bytes.
    CREATE TRIGGER step_metrics_read_model AFTER INSERT ON step_metrics BEGIN
        INSERT INTO job_world_sizes (job_id, world_size) VALUES (NEW.job_id, NEW.world_size)
            ON CONFLICT DO NOTHING;
        INSERT INTO step_totals (job_id, steps, last_step, raw_bytes, bytes_sent, bytes_received)
            VALUES (NEW.job_id, 0, NULL, 0, 0, 0) ON CONFLICT DO NOTHING;
        UPDATE step_totals SET
            steps = steps + NOT EXISTS (
                SELECT 1 FROM step_newest WHERE job_id = NEW.job_id AND step = NEW.step),
            last_step = CASE WHEN last_step IS NULL OR NEW.step > last_step THEN NEW.step
                             ELSE last_step END
            WHERE job_id = NEW.job_id;
        UPDATE step_totals SET
            raw_bytes = raw_bytes + NEW.raw_bytes - COALESCE((SELECT o.raw_bytes FROM step_newest o
                WHERE o.job_id = NEW.job_id AND o.step = NEW.step AND o.rank = NEW.rank), 0),
            bytes_sent = bytes_sent + NEW.bytes_sent - COALESCE((SELECT o.bytes_sent FROM step_newest o
                WHERE o.job_id = NEW.job_id AND o.step = NEW.step AND o.rank = NEW.rank), 0),
            bytes_received = bytes_received + NEW.bytes_received - COALESCE((SELECT o.bytes_received
                FROM step_newest o
                WHERE o.job_id = NEW.job_id AND o.step = NEW.step AND o.rank = NEW.rank), 0)
            WHERE job_id = NEW.job_id AND NOT EXISTS (SELECT 1 FROM step_newest o
                WHERE o.job_id = NEW.job_id AND o.step = NEW.step AND o.rank = NEW.rank
                AND o.seq > NEW.seq);
        INSERT INTO step_newest (job_id, step, rank, seq, raw_bytes, bytes_sent, bytes_received)
            VALUES (NEW.job_id, NEW.step, NEW.rank, NEW.seq, NEW.raw_bytes, NEW.bytes_sent,
                    NEW.bytes_received)
            ON CONFLICT (job_id, step, rank) DO UPDATE SET seq = excluded.seq,
                raw_bytes = excluded.raw_bytes, bytes_sent = excluded.bytes_sent,
                bytes_received = excluded.bytes_received
            WHERE excluded.seq > seq;
    END;
    """,
)

LAYER_FIELDS = (
    "step", "rank", "layer", "numel", "bits", "density", "raw_bytes", "encoded_bytes", "ratio",
    "rel_error", "code",
)  # fmt: skip
STEP_FIELDS = (
    "step", "rank", "world_size", "bytes_sent", "bytes_received", "raw_bytes", "compress_s",
    "decode_s", "comm_s", "step_s", "loss", "method", "wall_time_s",
)  # fmt: skip
_UNIT_FIELDS = frozenset({"density"})  # shares: stored only when in [0, 1]
_INT_FIELDS = frozenset(
    {
        "step",
        "rank",
        "numel",
        "bits",
        "raw_bytes",
        "encoded_bytes",
        "world_size",
        "bytes_sent",
        "bytes_received",
    }
)
_STR_FIELDS = frozenset({"layer", "code", "method"})
TERMINAL = tuple(sorted(s.value for s in TERMINAL_STATUSES))  # for SQL: status IN (...)
STOPPING = JobStatus.STOPPING


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
    """One sink read, as the ingester hands it to storage."""

    records: list[dict[str, Any]]
    next_seq: int
    missed: int = 0
    dropped_in_sink: int = 0
    dropped_by_workers: int = 0


class Storage:
    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.parent.exists():
            path.parent.mkdir(mode=0o700, parents=True)
        if not path.exists():
            # Owner only: job specs, entrypoints and metrics. SQLite gives the -wal and -shm
            # files the database file's mode.
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
        self.migrate()

    @contextmanager
    def _connect(self, write: bool = False) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        try:
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA busy_timeout=30000")
            if write:
                # IMMEDIATE takes the write lock up front: no deadlock-prone lock upgrade.
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
            else:
                yield conn
        finally:
            conn.close()

    def migrate(self) -> None:
        with self._connect(write=True) as conn:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
                logger.info("applying database migration %d to %s", number, self.path)
                for statement in _statements(script):
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version={number}")

    def schema_version(self) -> int:
        with self._connect() as conn:
            return int(conn.execute("PRAGMA user_version").fetchone()[0])

    def check_writable(self) -> None:
        """Raises sqlite3.Error when the database cannot take a write transaction."""
        with self._connect(write=True) as conn:
            conn.execute("UPDATE ingest_cursors SET updated_at = updated_at WHERE 0")

    # ---------------------------------------------------------------- jobs
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
        """Insert a job unless it exists; returns True when inserted."""
        now = time.time()
        with self._connect(write=True) as conn:
            cur = conn.execute(
                "INSERT OR IGNORE INTO jobs (id, name, source, status, message, entrypoint, spec_json,"
                " created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    job_id, name, source, status, message, entrypoint,
                    json.dumps(spec) if spec is not None else None, created_at or now, now,
                ),
            )  # fmt: skip
            if cur.rowcount:
                conn.execute(
                    "INSERT OR IGNORE INTO ingest_cursors (job_id, updated_at) VALUES (?, ?)", (job_id, now)
                )
            return bool(cur.rowcount)

    def update_job_status(
        self,
        job_id: str,
        status: str,
        message: str | None = None,
        started_at: float | None = None,
        ended_at: float | None = None,
    ) -> None:
        with self._connect(write=True) as conn:
            conn.execute(
                "UPDATE jobs SET status = ?, message = COALESCE(?, message),"
                " started_at = COALESCE(?, started_at), ended_at = COALESCE(?, ended_at), updated_at = ?"
                " WHERE id = ?",
                (status, message, started_at, ended_at, time.time(), job_id),
            )

    def get_job(self, job_id: str) -> JobRow | None:
        with self._connect() as conn:
            row = conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _job_row(row) if row else None

    def list_jobs(self, limit: int, offset: int) -> tuple[list[JobRow], int]:
        with self._connect() as conn:
            rows = conn.execute(
                "SELECT * FROM jobs ORDER BY created_at DESC, id LIMIT ? OFFSET ?", (limit, offset)
            ).fetchall()
            total = conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
        return [_job_row(r) for r in rows], int(total)

    def job_ids(self, *, terminal: bool | None = None) -> list[str]:
        sql = "SELECT id FROM jobs"
        if terminal is True:
            sql += f" WHERE status IN {TERMINAL}"
        elif terminal is False:
            sql += f" WHERE status NOT IN {TERMINAL}"
        with self._connect() as conn:
            return [r[0] for r in conn.execute(sql)]

    def status_counts(self) -> dict[str, int]:
        with self._connect() as conn:
            return {
                r[0]: int(r[1]) for r in conn.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status")
            }

    # ---------------------------------------------------------------- ingest
    def undrained_jobs(self) -> list[tuple[JobRow, int]]:
        """Jobs whose sink may still hold records, with their cursor."""
        with self._connect() as conn:
            rows = conn.execute(
                "SELECT j.*, c.after_seq FROM jobs j JOIN ingest_cursors c ON c.job_id = j.id"
                " WHERE c.drained = 0 ORDER BY j.created_at"
            ).fetchall()
        return [(_job_row(r), int(r["after_seq"])) for r in rows]

    def cursor(self, job_id: str) -> int:
        with self._connect() as conn:
            row = conn.execute("SELECT after_seq FROM ingest_cursors WHERE job_id = ?", (job_id,)).fetchone()
        return int(row[0]) if row else 0

    def ingest(self, job_id: str, batch: IngestBatch) -> int:
        """Store a batch and advance the cursor in ONE transaction; returns records stored.

        Records already stored (same seq) are ignored, so replaying a batch is harmless (only
        that uniqueness conflict: ``ON CONFLICT DO NOTHING``, not ``OR IGNORE``, which would
        also drop rows silently on NOT NULL). Malformed records are skipped and counted: a bad
        record must not wedge the cursor. Non-finite floats are stored as NULL.
        """
        layer_rows, step_rows, skipped = [], [], 0
        for rec in batch.records:
            try:
                kind = rec["type"]
                if kind == "layer":
                    layer_rows.append((job_id, int(rec["seq"]), *_coerce(rec, LAYER_FIELDS)))
                elif kind == "step":
                    step_rows.append((job_id, int(rec["seq"]), *_coerce(rec, STEP_FIELDS)))
                else:
                    skipped += 1
            except (KeyError, TypeError, ValueError):
                skipped += 1
        if skipped:
            logger.warning("job %s: skipped %d malformed metric records", job_id, skipped)
        with self._connect(write=True) as conn:
            stored = 0
            if layer_rows:
                cur = conn.executemany(
                    f"INSERT INTO layer_metrics (job_id, seq, {', '.join(LAYER_FIELDS)})"
                    f" VALUES ({', '.join('?' * (len(LAYER_FIELDS) + 2))}) ON CONFLICT DO NOTHING",
                    layer_rows,
                )
                stored += cur.rowcount
            if step_rows:
                cur = conn.executemany(
                    f"INSERT INTO step_metrics (job_id, seq, {', '.join(STEP_FIELDS)})"
                    f" VALUES ({', '.join('?' * (len(STEP_FIELDS) + 2))}) ON CONFLICT DO NOTHING",
                    step_rows,
                )
                stored += cur.rowcount
            conn.execute(
                "INSERT INTO ingest_cursors (job_id, after_seq, records, skipped, missed, dropped_in_sink,"
                " dropped_by_workers, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (job_id) DO UPDATE SET after_seq = MAX(after_seq, excluded.after_seq),"
                " records = records + excluded.records, skipped = skipped + excluded.skipped,"
                " missed = missed + excluded.missed, dropped_in_sink = excluded.dropped_in_sink,"
                " dropped_by_workers = excluded.dropped_by_workers, updated_at = excluded.updated_at",
                (
                    job_id, batch.next_seq, stored, skipped, batch.missed, batch.dropped_in_sink,
                    batch.dropped_by_workers, time.time(),
                ),
            )  # fmt: skip
        return stored

    def mark_drained(self, job_id: str) -> None:
        with self._connect(write=True) as conn:
            conn.execute(
                "UPDATE ingest_cursors SET drained = 1, updated_at = ? WHERE job_id = ?",
                (time.time(), job_id),
            )

    def ingest_version(self, job_id: str) -> tuple[Any, ...]:
        """The job's cursor row as a tuple: it changes in every transaction that changes the
        job's metrics (see service/read_cache.py)."""
        with self._connect() as conn:
            row = conn.execute("SELECT * FROM ingest_cursors WHERE job_id = ?", (job_id,)).fetchone()
        return tuple(row) if row is not None else ()

    def ingest_state(self, job_id: str) -> dict[str, Any]:
        with self._connect() as conn:
            return self._ingest_state(conn, job_id)

    @staticmethod
    def _ingest_state(conn: sqlite3.Connection, job_id: str) -> dict[str, Any]:
        row = conn.execute("SELECT * FROM ingest_cursors WHERE job_id = ?", (job_id,)).fetchone()
        if row is None:
            return {
                "cursor_seq": 0,
                "records": 0,
                "missed": 0,
                "dropped_in_sink": 0,
                "dropped_by_workers": 0,
                "drained": False,
            }
        return {
            "cursor_seq": int(row["after_seq"]),
            "records": int(row["records"]),
            "missed": int(row["missed"]),
            "dropped_in_sink": int(row["dropped_in_sink"]),
            "dropped_by_workers": int(row["dropped_by_workers"]),
            "drained": bool(row["drained"]),
        }

    # ---------------------------------------------------------------- metric reads
    def record_counts(self, job_id: str) -> tuple[int, int]:
        """(layer records, step records) stored for a job."""
        with self._connect() as conn:
            layers = conn.execute(
                "SELECT COUNT(*) FROM layer_metrics WHERE job_id = ?", (job_id,)
            ).fetchone()[0]
            steps = conn.execute("SELECT COUNT(*) FROM step_metrics WHERE job_id = ?", (job_id,)).fetchone()[
                0
            ]
        return int(layers), int(steps)

    def seqs(self, job_id: str) -> list[int]:
        """Every stored sequence number of a job, sorted (for audits and tests)."""
        with self._connect() as conn:
            rows = conn.execute(
                "SELECT seq FROM layer_metrics WHERE job_id = ? UNION ALL SELECT seq FROM step_metrics"
                " WHERE job_id = ? ORDER BY 1",
                (job_id, job_id),
            ).fetchall()
        return [int(r[0]) for r in rows]

    def latest_layers(self, job_id: str) -> list[dict[str, Any]]:
        """Per layer, its newest step, aggregated over the ranks that reported that step.
        A rank that re-reports a step (after a restart) counts once: its newest record wins."""
        sql = """
        WITH newest AS (
            -- kept by the layer_metrics trigger: one row per layer, no scan of the records
            SELECT layer, step FROM layer_newest WHERE job_id = ?
        ), per_rank AS (
            SELECT m.*, ROW_NUMBER() OVER (PARTITION BY m.layer, m.rank ORDER BY m.seq DESC) AS rn
            -- newest drives the join and m is found through (job_id, layer, step): left to
            -- itself the planner scanned every record of the job (0.86 s at 200k records,
            -- 0.07 s this way).
            FROM newest n CROSS JOIN layer_metrics m INDEXED BY layer_metrics_by_layer
                ON m.job_id = ? AND m.layer = n.layer AND m.step = n.step
        )
        SELECT layer, step, COUNT(*) AS ranks, MAX(numel) AS numel, AVG(bits) AS bits,
               AVG(density) AS density, SUM(raw_bytes) AS raw_bytes, SUM(encoded_bytes) AS encoded_bytes,
               AVG(rel_error) AS rel_error, MAX(code) AS code, MIN(seq) AS first_seq
        FROM per_rank WHERE rn = 1 GROUP BY layer, step ORDER BY first_seq, layer
        """
        with self._connect() as conn:
            rows = conn.execute(sql, (job_id, job_id)).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            d.pop("first_seq")
            d["ratio"] = d["raw_bytes"] / d["encoded_bytes"] if d["encoded_bytes"] else 0.0
            out.append(d)
        return out

    def steps(
        self, job_id: str, after_step: int, limit: int, before_step: int | None = None
    ) -> list[dict[str, Any]]:
        """Per-step points after ``after_step``: bytes summed over ranks, times maxed (the
        slowest rank bounds a synchronous step), loss averaged. A rank that re-ran a step
        after a restart counts once (its newest record)."""
        sql = """
        WITH per_rank AS (
            SELECT *, ROW_NUMBER() OVER (PARTITION BY step, rank ORDER BY seq DESC) AS rn
            FROM step_metrics WHERE job_id = ? AND step > ? AND step < ?
        )
        SELECT step, COUNT(*) AS ranks, MAX(world_size) AS world_size, SUM(bytes_sent) AS bytes_sent,
               SUM(bytes_received) AS bytes_received, SUM(raw_bytes) AS raw_bytes, AVG(loss) AS loss,
               MAX(step_s) AS step_s, MAX(compress_s) AS compress_s, MAX(decode_s) AS decode_s,
               MAX(comm_s) AS comm_s, MAX(method) AS method, MAX(wall_time_s) AS wall_time_s
        FROM per_rank WHERE rn = 1 GROUP BY step ORDER BY step LIMIT ?
        """
        upper = before_step if before_step is not None else 2**62
        with self._connect() as conn:
            # Bound the window to the first `limit` steps first (an index range scan), so a
            # page costs O(limit) rather than O(steps after after_step).
            last = conn.execute(
                "SELECT step FROM (SELECT DISTINCT step FROM step_metrics WHERE job_id = ? AND step > ?"
                " AND step < ? ORDER BY step LIMIT ?) ORDER BY step DESC LIMIT 1",
                (job_id, after_step, upper, limit),
            ).fetchone()
            if last is None:
                return []
            upper = min(upper, int(last[0]) + 1)
            rows = conn.execute(sql, (job_id, after_step, upper, limit)).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            d["ratio"] = d["raw_bytes"] / d["bytes_sent"] if d["bytes_sent"] else 0.0
            out.append(d)
        return out

    def max_step(self, job_id: str) -> int | None:
        with self._connect() as conn:
            row = conn.execute("SELECT MAX(step) FROM step_metrics WHERE job_id = ?", (job_id,)).fetchone()
        return None if row[0] is None else int(row[0])

    def summary(self, job_id: str) -> dict[str, Any]:
        """Totals from the trigger-kept read models (``step_totals``, ``layer_totals``, ...):
        a handful of rows, however many records the job has."""
        with self._connect() as conn:
            tot = conn.execute("SELECT * FROM step_totals WHERE job_id = ?", (job_id,)).fetchone()
            sizes = [
                int(r[0])
                for r in conn.execute(
                    "SELECT world_size FROM job_world_sizes WHERE job_id = ? ORDER BY 1", (job_id,)
                )
            ]
            loss_row = conn.execute(
                "SELECT AVG(loss) FROM step_metrics WHERE job_id = ? AND step = "
                "(SELECT MAX(step) FROM step_metrics WHERE job_id = ?)",
                (job_id, job_id),
            ).fetchone()
            ratios = conn.execute(
                "SELECT ratio_sum, ratio_count FROM layer_totals WHERE job_id = ?", (job_id,)
            ).fetchone()
            layers = conn.execute("SELECT COUNT(*) FROM layer_newest WHERE job_id = ?", (job_id,)).fetchone()[
                0
            ]
            ingest = self._ingest_state(conn, job_id)
        raw, sent = (int(tot["raw_bytes"]), int(tot["bytes_sent"])) if tot else (0, 0)
        return {
            "job_id": job_id,
            "steps": int(tot["steps"]) if tot else 0,
            "last_step": None if tot is None or tot["last_step"] is None else int(tot["last_step"]),
            "world_sizes": sizes,
            "raw_bytes": raw,
            "bytes_sent": sent,
            "bytes_received": int(tot["bytes_received"]) if tot else 0,
            "traffic_saved_bytes": raw - sent,
            "traffic_saved_fraction": (raw - sent) / raw if raw else 0.0,
            "ratio": raw / sent if sent else 0.0,
            "mean_layer_ratio": (
                float(ratios["ratio_sum"]) / int(ratios["ratio_count"])
                if ratios and ratios["ratio_count"]
                else None
            ),
            "last_loss": None if loss_row[0] is None else float(loss_row[0]),
            "layers": int(layers),
            "ingest": ingest,
        }


def _coerce(rec: dict[str, Any], fields: tuple[str, ...]) -> list[Any]:
    out: list[Any] = []
    for name in fields:
        value = rec[name]
        if name in _INT_FIELDS:
            number = int(value)
            if not -(2**63) <= number < 2**63:  # SQLite INTEGER; beyond it the whole batch would fail
                raise ValueError(f"{name}={number} is out of range")
            out.append(number)
        elif name in _STR_FIELDS:
            out.append(str(value))
        else:
            real = float(value)
            if name in _UNIT_FIELDS and not 0.0 <= real <= 1.0:
                real = math.nan  # a share outside [0, 1] is a worker's bug: shown as unknown, not plotted
            out.append(real if math.isfinite(real) else None)
    return out


def _job_row(row: sqlite3.Row) -> JobRow:
    return JobRow(
        id=row["id"],
        name=row["name"],
        source=row["source"],
        status=row["status"],
        message=row["message"],
        entrypoint=row["entrypoint"],
        spec=json.loads(row["spec_json"]) if row["spec_json"] else None,
        created_at=row["created_at"],
        started_at=row["started_at"],
        ended_at=row["ended_at"],
    )


def _statements(script: str) -> list[str]:
    """Split a migration into statements; a trigger body's inner ``;`` does not end it."""
    out, pending = [], ""
    for piece in script.split(";"):
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \n;"):
                out.append(pending.strip())
            pending = ""
    if pending.strip(" \n;"):
        raise ValueError(f"incomplete SQL statement in a migration: {pending.strip()[:80]!r}")
    return out
