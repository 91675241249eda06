"""The job table: insert, status updates, lookups and counts (shared SQL, both backends)."""

from __future__ import annotations

import json
import time
from typing import Any

from service.storage.base import TERMINAL, JobRow
from service.storage.sql import Row, SqlBase

_TERMINAL_SQL = "(" + ", ".join(f"'{s}'" for s in TERMINAL) + ")"


def _clean(text: str) -> str:
    """Without U+0000, which PostgreSQL's text cannot hold: a job Ray reports (its entrypoint,
    an error message) is copied as it is otherwise, on both backends."""
    return text.replace("\x00", "")


class JobsSql(SqlBase):
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
        now = time.time()
        text = (_clean(name), _clean(message), _clean(entrypoint))
        spec_json = json.dumps(spec) if spec is not None else None
        with self._write() as tx:
            inserted = tx.run(
                "INSERT INTO jobs (id, name, source, status, message, entrypoint, spec_json, created_at,"
                " updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
                (job_id, text[0], source, status, text[1], text[2], spec_json, created_at or now, now),
            )
            if inserted:
                tx.run(
                    "INSERT INTO ingest_cursors (job_id, updated_at) VALUES (?, ?)"
                    " ON CONFLICT (job_id) DO NOTHING",
                    (job_id, now),
                )
        return bool(inserted)

    def update_job_status(
        self,
        job_id: str,
        status: str,
        message: str | None = None,
        started_at: float | None = None,
        ended_at: float | None = None,
    ) -> None:
        message = None if message is None else _clean(message)
        with self._write() as tx:
            tx.run(
                "UPDATE jobs SET status = ?, message = COALESCE(?, message),"
                " started_at = COALESCE(?, started_at), ended_at = COALESCE(?, ended_at), updated_at = ?"
                " WHERE id = ?",
                (status, message, started_at, ended_at, time.time(), job_id),
            )

    def get_job(self, job_id: str) -> JobRow | None:
        with self._read() as tx:
            row = tx.one("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return job_row(row) if row else None

    def list_jobs(self, limit: int, offset: int) -> tuple[list[JobRow], int]:
        with self._read() as tx:
            rows = tx.all("SELECT * FROM jobs ORDER BY created_at DESC, id LIMIT ? OFFSET ?", (limit, offset))
            total = tx.one("SELECT COUNT(*) AS n FROM jobs")
        return [job_row(r) for r in rows], int(total["n"]) if total else 0

    def job_ids(self, *, terminal: bool | None = None) -> list[str]:
        sql = "SELECT id FROM jobs"
        if terminal is True:
            sql += f" WHERE status IN {_TERMINAL_SQL}"
        elif terminal is False:
            sql += f" WHERE status NOT IN {_TERMINAL_SQL}"
        with self._read() as tx:
            return [r["id"] for r in tx.all(sql + " ORDER BY created_at, id")]

    def status_counts(self) -> dict[str, int]:
        with self._read() as tx:
            rows = tx.all("SELECT status, COUNT(*) AS n FROM jobs GROUP BY status")
        return {r["status"]: int(r["n"]) for r in rows}


def job_row(row: Row) -> JobRow:
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
