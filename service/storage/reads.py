"""Read models the API serves: newest layers, the per-step series, job totals (shared SQL).

Each method reads inside one snapshot (``_read``), on a connection that does not wait for the
ingest transaction. The totals come from the running read models (``step_totals``,
``layer_totals``, ``layer_newest``, ``job_world_sizes``): a handful of rows however many records
the job has. Aggregates are CAST so PostgreSQL returns int/float (not Decimal), as SQLite does.
"""

from __future__ import annotations

from typing import Any

from service.storage.ingest import ingest_state
from service.storage.sql import SqlBase

_NO_UPPER_STEP = 2**62

_LATEST_LAYERS = """
WITH newest_steps AS (
    -- layer_newest is kept by the ingest transaction (one row per layer, no scan of the
    -- records); its distinct steps are usually one: every layer reports every step
    SELECT DISTINCT step FROM layer_newest WHERE job_id = ?
), candidates AS MATERIALIZED (
    -- the records of those steps, found through the (job_id, step) index
    SELECT m.layer, m.step, m.rank, m.seq, m.numel, m.bits, m.density, m.raw_bytes,
           m.encoded_bytes, m.rel_error, m.code
    FROM newest_steps s {step_join} ON m.job_id = ? AND m.step = s.step
), per_rank AS (
    -- each record kept only at its layer's newest step (a primary-key seek each)
    SELECT c.*, ROW_NUMBER() OVER (PARTITION BY c.layer, c.rank ORDER BY c.seq DESC) AS rn
    FROM candidates c JOIN layer_newest n ON n.job_id = ? AND n.layer = c.layer AND n.step = c.step
)
SELECT layer, step, COUNT(*) AS ranks, MAX(numel) AS numel,
       CAST(AVG(bits) AS DOUBLE PRECISION) AS bits, CAST(AVG(density) AS DOUBLE PRECISION) AS density,
       CAST(SUM(raw_bytes) AS BIGINT) AS raw_bytes, CAST(SUM(encoded_bytes) AS BIGINT) AS encoded_bytes,
       CAST(AVG(rel_error) AS DOUBLE PRECISION) AS rel_error, MAX(code) AS code, MIN(seq) AS first_seq
FROM per_rank WHERE rn = 1 GROUP BY layer, step ORDER BY first_seq, layer
"""

_STEPS = """
WITH per_rank AS (
    SELECT *, ROW_NUMBER() OVER (PARTITION BY step, rank ORDER BY seq DESC) AS rn
    FROM step_metrics WHERE job_id = ? AND step > ? AND step < ?
)
SELECT step, COUNT(*) AS ranks, MAX(world_size) AS world_size,
       CAST(SUM(bytes_sent) AS BIGINT) AS bytes_sent, CAST(SUM(bytes_received) AS BIGINT) AS bytes_received,
       CAST(SUM(raw_bytes) AS BIGINT) AS raw_bytes, CAST(AVG(loss) AS DOUBLE PRECISION) AS loss,
       MAX(step_s) AS step_s, MAX(compress_s) AS compress_s, MAX(decode_s) AS decode_s,
       MAX(comm_s) AS comm_s, MAX(method) AS method, MAX(wall_time_s) AS wall_time_s
FROM per_rank WHERE rn = 1 GROUP BY step ORDER BY step LIMIT ?
"""


class ReadsSql(SqlBase):
    # How the newest-layers query joins the records (through the step index); SQLite overrides.
    step_join = "JOIN layer_metrics m"

    def record_counts(self, job_id: str) -> tuple[int, int]:
        with self._read() as tx:
            layers = tx.one("SELECT COUNT(*) AS n FROM layer_metrics WHERE job_id = ?", (job_id,))
            steps = tx.one("SELECT COUNT(*) AS n FROM step_metrics WHERE job_id = ?", (job_id,))
        return (int(layers["n"]) if layers else 0), (int(steps["n"]) if steps else 0)

    def seqs(self, job_id: str) -> list[int]:
        with self._read() as tx:
            rows = tx.all(
                "SELECT seq FROM layer_metrics WHERE job_id = ? UNION ALL"
                " SELECT seq FROM step_metrics WHERE job_id = ? ORDER BY 1",
                (job_id, job_id),
            )
        return [int(r["seq"]) for r in rows]

    def latest_layers(self, job_id: str) -> list[dict[str, Any]]:
        """Per layer, its newest step, aggregated over the ranks that reported that step.
        A rank that re-reports a step (after a restart) counts once: its newest record wins."""
        with self._read() as tx:
            rows = tx.all(_LATEST_LAYERS.format(step_join=self.step_join), (job_id, job_id, job_id))
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
        upper = before_step if before_step is not None else _NO_UPPER_STEP
        with self._read() as tx:
            # Bound the window to the first `limit` steps first (an index range scan), so a
            # page costs O(limit) rather than O(steps after after_step).
            last = tx.one(
                "SELECT step FROM (SELECT DISTINCT step FROM step_metrics WHERE job_id = ? AND step > ?"
                " AND step < ? ORDER BY step LIMIT ?) AS s ORDER BY step DESC LIMIT 1",
                (job_id, after_step, upper, limit),
            )
            if last is None:
                return []
            upper = min(upper, int(last["step"]) + 1)
            rows = tx.all(_STEPS, (job_id, after_step, upper, limit))
        out = []
        for r in rows:
            d = dict(r)
            d["ratio"] = d["raw_bytes"] / d["bytes_sent"] if d["bytes_sent"] else 0.0
            out.append(d)
        return out

    def max_step(self, job_id: str) -> int | None:
        with self._read() as tx:
            row = tx.one("SELECT MAX(step) AS step FROM step_metrics WHERE job_id = ?", (job_id,))
        return None if row is None or row["step"] is None else int(row["step"])

    def summary(self, job_id: str) -> dict[str, Any]:
        """Totals from the running read models: a handful of rows, however many records."""
        with self._read() as tx:
            tot = tx.one("SELECT * FROM step_totals WHERE job_id = ?", (job_id,))
            sizes = [
                int(r["world_size"])
                for r in tx.all(
                    "SELECT world_size FROM job_world_sizes WHERE job_id = ? ORDER BY 1", (job_id,)
                )
            ]
            last_step = None if tot is None or tot["last_step"] is None else int(tot["last_step"])
            loss = tx.one(
                "SELECT CAST(AVG(loss) AS DOUBLE PRECISION) AS loss FROM step_metrics"
                " WHERE job_id = ? AND step = ?",
                (job_id, last_step),
            )
            ratios = tx.one("SELECT ratio_sum, ratio_count FROM layer_totals WHERE job_id = ?", (job_id,))
            layers = tx.one("SELECT COUNT(*) AS n FROM layer_newest WHERE job_id = ?", (job_id,))
            ingest = ingest_state(tx, job_id)
        raw, sent = (int(tot["raw_bytes"]), int(tot["bytes_sent"])) if tot else (0, 0)
        return {
            "job_id": job_id,
            "steps": int(tot["steps"]) if tot else 0,
            "last_step": last_step,
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
            "last_loss": None if loss is None or loss["loss"] is None else float(loss["loss"]),
            "layers": int(layers["n"]) if layers else 0,
            "ingest": ingest,
        }
