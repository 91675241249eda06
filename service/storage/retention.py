"""Retention: thin a job's old records so a month of jobs does not fill the disk (shared SQL).

Per job, every step of the newest ``full_steps`` steps is kept; older steps keep only every
``every_k``-th step (step % every_k == 0), layer and step records alike. The running totals
(summary, Prometheus counters) are separate rows and never change. Each call thins at most
about ``max_rows`` records (a window of steps), so a first pass over a long job does not hold
the write lock for minutes; the job's ``pruned_below_step`` remembers where it got to.

A step re-run after it was thinned (a restart from a checkpoint older than the full window)
is stored again and counted as a new step in the totals; with the defaults the window is far
longer than any checkpoint interval.
"""

from __future__ import annotations

import time

from service.storage.base import RetentionPolicy, StorageSize
from service.storage.sql import SqlBase


class RetentionSql(SqlBase):
    def apply_retention(self, job_id: str, policy: RetentionPolicy, max_rows: int = 200_000) -> int:
        if policy.full_steps is None:
            return 0
        with self._write() as tx:
            tx.lock_job(job_id)
            cur = tx.one(
                "SELECT pruned_below_step, layer_records, step_records FROM ingest_cursors WHERE job_id = ?",
                (job_id,),
            )
            tot = tx.one("SELECT steps, last_step FROM step_totals WHERE job_id = ?", (job_id,))
            if cur is None or tot is None or tot["last_step"] is None:
                return 0
            lo = int(cur["pruned_below_step"])
            bound = int(tot["last_step"]) - policy.full_steps + 1  # steps >= bound keep full resolution
            if bound <= lo:
                return 0
            rows_per_step = (int(cur["layer_records"]) + int(cur["step_records"])) // max(
                1, int(tot["steps"])
            )
            hi = min(bound, lo + max(1, max_rows // max(1, rows_per_step)))
            thin = " AND step >= ? AND step < ? AND step % ? != 0"
            # One range of the (job_id, step) index.
            deleted_layers = tx.run(
                "DELETE FROM layer_metrics WHERE job_id = ?" + thin, (job_id, lo, hi, policy.every_k)
            )
            deleted_steps = tx.run(
                "DELETE FROM step_metrics WHERE job_id = ?" + thin, (job_id, lo, hi, policy.every_k)
            )
            tx.run(
                "UPDATE ingest_cursors SET pruned = pruned + ?, layer_records = layer_records - ?,"
                " step_records = step_records - ?, pruned_below_step = ?, updated_at = ? WHERE job_id = ?",
                (deleted_layers + deleted_steps, deleted_layers, deleted_steps, hi, time.time(), job_id),
            )
        return deleted_layers + deleted_steps

    def size(self) -> StorageSize:
        with self._read() as tx:
            row = tx.one(
                "SELECT CAST(COALESCE(SUM(layer_records), 0) AS BIGINT) AS layer_records,"
                " CAST(COALESCE(SUM(step_records), 0) AS BIGINT) AS step_records,"
                " CAST(COALESCE(SUM(pruned), 0) AS BIGINT) AS pruned FROM ingest_cursors"
            )
            database_bytes = self._database_bytes(tx)
        if row is None:  # never: an aggregate without GROUP BY returns one row
            return StorageSize(0, 0, 0, database_bytes)
        return StorageSize(
            layer_records=int(row["layer_records"]),
            step_records=int(row["step_records"]),
            pruned_records=int(row["pruned"]),
            database_bytes=database_bytes,
        )
