"""Ingest: a batch of sink records, its read-model deltas and the advanced cursor, in ONE
transaction (shared SQL, both backends).

Crash safety: the records, the running totals and the cursor commit together, so after a crash
the cursor never points past what was stored and the totals never count a record twice. The
job's cursor row is locked for the transaction (``Tx.lock_job``), and every record at or below
the cursor is dropped before any write (``records.batch_rows``): a replayed or overlapping page,
or a second ingester racing the first, stores nothing twice. The records' primary key
stays as the last guard: (job_id, seq) on SQLite, (job_id, step, seq) on PostgreSQL (a replay
repeats a record's step with its seq).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from service.storage.base import IngestBatch, JobRow
from service.storage.columns import column_rows
from service.storage.jobs import job_row
from service.storage.records import LAYER_COLUMNS, STEP_COLUMNS, BatchRows, StepNewest, batch_rows
from service.storage.sql import Row, SqlBase, Tx, placeholders

_EMPTY_STATE = {
    "cursor_seq": 0,
    "records": 0,
    "missed": 0,
    "dropped_in_sink": 0,
    "dropped_by_workers": 0,
    "drained": False,
}


class IngestSql(SqlBase):
    def undrained_jobs(self) -> list[tuple[JobRow, int]]:
        with self._read() as tx:
            rows = tx.all(
                "SELECT j.*, c.after_seq FROM jobs j JOIN ingest_cursors c ON c.job_id = j.id"
                " WHERE c.drained = 0 ORDER BY j.created_at, j.id"
            )
        return [(job_row(r), int(r["after_seq"])) for r in rows]

    def cursor(self, job_id: str) -> int:
        with self._read() as tx:
            row = tx.one("SELECT after_seq FROM ingest_cursors WHERE job_id = ?", (job_id,))
        return int(row["after_seq"]) if row else 0

    def ingest(self, job_id: str, batch: IngestBatch) -> int:
        """Store a batch and advance the cursor in ONE transaction; returns records stored.

        Malformed records are skipped and counted: a bad record must not wedge the cursor.
        """
        return self.ingest_many([(job_id, batch)])[0]

    def ingest_many(self, batches: Sequence[tuple[str, IngestBatch]]) -> list[int]:
        """Several jobs' batches, each with its cursor, in ONE transaction (one commit, one
        fsync, for a whole ingest round instead of one per page); records stored per batch."""
        # Convert outside the write transaction (the Python cost per record must not hold the
        # database's write lock); redo it only if another writer moved the cursor meanwhile.
        seen = self._cursors([job_id for job_id, _ in batches])
        prepared = [(j, batch, seen[j], _batch_rows(j, batch, seen[j])) for j, batch in batches]
        stored: dict[int, int] = {}
        with self._write() as tx:
            # Jobs' cursor rows are locked in one order, so two ingesters (a lease handover)
            # cannot deadlock on PostgreSQL.
            for i in sorted(range(len(prepared)), key=lambda k: prepared[k][0]):
                stored[i] = _store_batch(tx, *prepared[i])
        return [stored[i] for i in range(len(prepared))]

    def _cursors(self, job_ids: list[str]) -> dict[str, int]:
        """Every job's stored cursor (0 for a job never ingested) in one read: a round of 8 jobs
        made 8 reads, 9% of the ingest process's samples on PostgreSQL."""
        out = dict.fromkeys(job_ids, 0)
        if job_ids:
            sql = "SELECT job_id, after_seq FROM ingest_cursors WHERE job_id IN "
            sql += f"({placeholders(len(job_ids))})"
            with self._read() as tx:
                rows = tx.all(sql, job_ids)
            out.update((r["job_id"], int(r["after_seq"])) for r in rows)
        return out

    def mark_drained(self, job_id: str) -> None:
        with self._write() as tx:
            tx.run(
                "UPDATE ingest_cursors SET drained = 1, updated_at = ? WHERE job_id = ?",
                (time.time(), job_id),
            )

    def ingest_version(self, job_id: str) -> tuple[Any, ...]:
        """The job's cursor row as a tuple: every transaction that changes the job's metrics
        rewrites it (ingest, drain, retention), so cached reads key on it (read_cache.py)."""
        with self._read() as tx:
            row = tx.one("SELECT * FROM ingest_cursors WHERE job_id = ?", (job_id,))
        return tuple(dict(row).values()) if row is not None else ()

    def ingest_state(self, job_id: str) -> dict[str, Any]:
        with self._read() as tx:
            return ingest_state(tx, job_id)


def _store_batch(tx: Tx, job_id: str, batch: IngestBatch, seen: int, rows: BatchRows) -> int:
    """One job's batch, its read-model deltas and its cursor, inside the caller's transaction."""
    tx.run(
        "INSERT INTO ingest_cursors (job_id, updated_at) VALUES (?, ?) ON CONFLICT (job_id) DO NOTHING",
        (job_id, time.time()),
    )
    tx.lock_job(job_id)
    cur = tx.one("SELECT after_seq FROM ingest_cursors WHERE job_id = ?", (job_id,))
    after_seq = int(cur["after_seq"]) if cur else 0
    if after_seq != seen:
        rows = _batch_rows(job_id, batch, after_seq)
    _update_step_totals(tx, job_id, rows)  # reads the stored rows: before the insert
    if rows.layer_rows:
        tx.bulk_insert("layer_metrics", LAYER_COLUMNS, rows.layer_rows)
    if rows.step_rows:
        tx.bulk_insert("step_metrics", STEP_COLUMNS, rows.step_rows)
    _update_layer_models(tx, job_id, rows)
    tx.run(
        "UPDATE ingest_cursors SET after_seq = ?, records = records + ?, skipped = skipped + ?,"
        " missed = missed + ?, dropped_in_sink = ?, dropped_by_workers = ?,"
        " layer_records = layer_records + ?, step_records = step_records + ?, updated_at = ?"
        " WHERE job_id = ?",
        (
            max(after_seq, batch.next_seq, rows.max_seq), rows.stored, rows.skipped, batch.missed,
            batch.dropped_in_sink, batch.dropped_by_workers, len(rows.layer_rows),
            len(rows.step_rows), time.time(), job_id,
        ),
    )  # fmt: skip
    return rows.stored


def _batch_rows(job_id: str, batch: IngestBatch, after_seq: int) -> BatchRows:
    if batch.columns is not None:
        return column_rows(job_id, batch.columns, after_seq)
    return batch_rows(job_id, batch.records, after_seq)


def ingest_state(tx: Tx, job_id: str) -> dict[str, Any]:
    row = tx.one("SELECT * FROM ingest_cursors WHERE job_id = ?", (job_id,))
    if row is None:
        return dict(_EMPTY_STATE)
    return {
        "cursor_seq": int(row["after_seq"]),
        "records": int(row["records"]),
        "missed": int(row["missed"]),
        "dropped_in_sink": int(row["dropped_in_sink"]),
        "dropped_by_workers": int(row["dropped_by_workers"]),
        "drained": bool(row["drained"]),
    }


def _update_layer_models(tx: Tx, job_id: str, rows: BatchRows) -> None:
    if rows.layer_rows:
        tx.run(
            "INSERT INTO layer_totals (job_id, ratio_sum, ratio_count) VALUES (?, ?, ?)"
            " ON CONFLICT (job_id) DO UPDATE SET ratio_sum = layer_totals.ratio_sum + excluded.ratio_sum,"
            " ratio_count = layer_totals.ratio_count + excluded.ratio_count",
            (job_id, rows.ratio_sum, rows.ratio_count),
        )
    if rows.layer_newest:
        tx.run_many(
            "INSERT INTO layer_newest (job_id, layer, step) VALUES (?, ?, ?)"
            " ON CONFLICT (job_id, layer) DO UPDATE SET step = excluded.step"
            " WHERE excluded.step > layer_newest.step",
            [(job_id, layer, step) for layer, step in rows.layer_newest.items()],
        )
    if rows.world_sizes:
        tx.run_many(
            "INSERT INTO job_world_sizes (job_id, world_size) VALUES (?, ?) ON CONFLICT DO NOTHING",
            [(job_id, size) for size in sorted(rows.world_sizes)],
        )


def _stored_newest(tx: Tx, job_id: str, lo: int, hi: int) -> dict[tuple[int, int], StepNewest]:
    """Per (step, rank) in [lo, hi], the newest stored step record (through the step index)."""
    out: dict[tuple[int, int], StepNewest] = {}
    rows: list[Row] = tx.all(
        "SELECT step, rank, seq, raw_bytes, bytes_sent, bytes_received FROM step_metrics"
        " WHERE job_id = ? AND step >= ? AND step <= ?",
        (job_id, lo, hi),
    )
    for r in rows:
        key = (int(r["step"]), int(r["rank"]))
        seen = out.get(key)
        if seen is None or r["seq"] > seen.seq:
            out[key] = StepNewest(int(r["seq"]), r["raw_bytes"], r["bytes_sent"], r["bytes_received"])
    return out


def _update_step_totals(tx: Tx, job_id: str, rows: BatchRows) -> None:
    """Per (step, rank) the newest record counts (a rank that re-runs a step after a restart
    replaces its older record's bytes); every new record is newer than every stored one (its
    seq is above the cursor), so each key's delta is new bytes minus the stored newest's."""
    if not rows.step_newest:
        return
    steps = [step for step, _ in rows.step_newest]
    stored = _stored_newest(tx, job_id, min(steps), max(steps))
    known_steps = {step for step, _ in stored}
    raw = sent = received = 0
    for key, new in rows.step_newest.items():
        old = stored.get(key)
        raw += new.raw_bytes - (old.raw_bytes if old else 0)
        sent += new.bytes_sent - (old.bytes_sent if old else 0)
        received += new.bytes_received - (old.bytes_received if old else 0)
    new_steps = len(set(steps) - known_steps)
    tx.run(
        "INSERT INTO step_totals (job_id, steps, last_step, raw_bytes, bytes_sent, bytes_received)"
        " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (job_id) DO UPDATE SET"
        " steps = step_totals.steps + excluded.steps,"
        " last_step = CASE WHEN step_totals.last_step IS NULL OR excluded.last_step > step_totals.last_step"
        " THEN excluded.last_step ELSE step_totals.last_step END,"
        " raw_bytes = step_totals.raw_bytes + excluded.raw_bytes,"
        " bytes_sent = step_totals.bytes_sent + excluded.bytes_sent,"
        " bytes_received = step_totals.bytes_received + excluded.bytes_received",
        (job_id, new_steps, max(steps), raw, sent, received),
    )
