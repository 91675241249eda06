"""Migrations, one list per backend, applied in order and tracked by version.

SQLite tracks its version in ``PRAGMA user_version``; PostgreSQL in ``schema_migrations``
(applied under a transaction-scoped advisory lock, so replicas starting together migrate once).
Both schemas hold the same tables and columns; the SQL in ``jobs.py`` / ``ingest.py`` /
``reads.py`` / ``retention.py`` runs unchanged on either.

Read models (``layer_totals``, ``layer_newest``, ``step_totals``, ``job_world_sizes``): per-job
running totals and each layer's newest step, so the read routes read a handful of rows instead
of aggregating every record of a job. SQLite migration 2 kept them with per-row triggers;
since migration 3 the ingest transaction updates them from the batch itself
(``records.batch_rows``, ``ingest.py``): once per batch instead of once per record, and in SQL
both backends share.
"""

from __future__ import annotations

import sqlite3

SQLITE_MIGRATIONS: tuple[str, ...] = (
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
    # 3: the read models move from per-row triggers to the ingest transaction (one upsert per
    # batch and key instead of several statements per record: ingest ran at half speed with
    # the triggers). step_newest goes: a batch finds the (step, rank)s it replaces through the
    # step_metrics index instead. Per-kind row counters make the table size a cheap read (/metrics), and
    # retention records what it thinned.
    """
    DROP TRIGGER IF EXISTS layer_metrics_read_model;
    DROP TRIGGER IF EXISTS step_metrics_read_model;
    DROP TABLE IF EXISTS step_newest;
    ALTER TABLE ingest_cursors ADD COLUMN layer_records INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE ingest_cursors ADD COLUMN step_records INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE ingest_cursors ADD COLUMN pruned INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE ingest_cursors ADD COLUMN pruned_below_step INTEGER NOT NULL DEFAULT 0;
    UPDATE ingest_cursors SET
        layer_records = (SELECT COUNT(*) FROM layer_metrics m WHERE m.job_id = ingest_cursors.job_id),
        step_records = (SELECT COUNT(*) FROM step_metrics m WHERE m.job_id = ingest_cursors.job_id);
    """,
    # 4: the layer records' secondary index by (job_id, step) instead of (job_id, layer, step,
    # rank, seq). Records arrive in step order, so each insert lands at the end of its job's
    # range (one index page per job and batch instead of one per layer), and the key holds no
    # layer name: executemany of the load test's rows ran at 217k rows/s with the old index and
    # 353k with this one (that insert was 54% of the ingest process's samples). The newest-layers read
    # finds the rows of the newest steps through it, retention deletes step ranges, the bits
    # history's span reads the job's first step.
    """
    DROP INDEX IF EXISTS layer_metrics_by_layer;
    CREATE INDEX layer_metrics_by_step ON layer_metrics (job_id, step);
    """,
)

POSTGRES_MIGRATIONS: tuple[str, ...] = (
    # 1: the schema SQLite has after its migration 3, in PostgreSQL types: BIGINT for every
    # integer a record carries (records.py admits any 64-bit value), DOUBLE PRECISION for reals.
    """
    CREATE TABLE jobs (
        id          TEXT PRIMARY KEY,
        name        TEXT NOT NULL,
        source      TEXT NOT NULL CHECK (source IN ('api', 'ray')),
        status      TEXT NOT NULL,
        message     TEXT NOT NULL DEFAULT '',
        entrypoint  TEXT NOT NULL,
        spec_json   TEXT,
        created_at  DOUBLE PRECISION NOT NULL,
        started_at  DOUBLE PRECISION,
        ended_at    DOUBLE PRECISION,
        updated_at  DOUBLE PRECISION NOT NULL
    );
    CREATE INDEX jobs_by_created ON jobs (created_at DESC, id);

    CREATE TABLE layer_metrics (
        job_id        TEXT NOT NULL,
        seq           BIGINT NOT NULL,
        step          BIGINT NOT NULL,
        rank          BIGINT NOT NULL,
        layer         TEXT NOT NULL,
        numel         BIGINT NOT NULL,
        bits          BIGINT NOT NULL,
        density       DOUBLE PRECISION,
        raw_bytes     BIGINT NOT NULL,
        encoded_bytes BIGINT NOT NULL,
        ratio         DOUBLE PRECISION,
        rel_error     DOUBLE PRECISION,
        code          TEXT NOT NULL,
        PRIMARY KEY (job_id, seq)
    );
    CREATE INDEX layer_metrics_by_layer ON layer_metrics (job_id, layer, step, rank, seq);

    CREATE TABLE step_metrics (
        job_id         TEXT NOT NULL,
        seq            BIGINT NOT NULL,
        step           BIGINT NOT NULL,
        rank           BIGINT NOT NULL,
        world_size     BIGINT NOT NULL,
        bytes_sent     BIGINT NOT NULL,
        bytes_received BIGINT NOT NULL,
        raw_bytes      BIGINT NOT NULL,
        compress_s     DOUBLE PRECISION,
        decode_s       DOUBLE PRECISION,
        comm_s         DOUBLE PRECISION,
        step_s         DOUBLE PRECISION,
        loss           DOUBLE PRECISION,
        method         TEXT NOT NULL,
        wall_time_s    DOUBLE PRECISION,
        PRIMARY KEY (job_id, seq)
    );
    CREATE INDEX step_metrics_by_step ON step_metrics (job_id, step, rank, seq);

    CREATE TABLE ingest_cursors (
        job_id             TEXT PRIMARY KEY,
        after_seq          BIGINT NOT NULL DEFAULT 0,
        records            BIGINT NOT NULL DEFAULT 0,
        skipped            BIGINT NOT NULL DEFAULT 0,
        missed             BIGINT NOT NULL DEFAULT 0,
        dropped_in_sink    BIGINT NOT NULL DEFAULT 0,
        dropped_by_workers BIGINT NOT NULL DEFAULT 0,
        drained            INTEGER NOT NULL DEFAULT 0,
        updated_at         DOUBLE PRECISION NOT NULL,
        layer_records      BIGINT NOT NULL DEFAULT 0,
        step_records       BIGINT NOT NULL DEFAULT 0,
        pruned             BIGINT NOT NULL DEFAULT 0,
        pruned_below_step  BIGINT NOT NULL DEFAULT 0
    );

    CREATE TABLE layer_totals (
        job_id      TEXT PRIMARY KEY,
        ratio_sum   DOUBLE PRECISION NOT NULL,
        ratio_count BIGINT NOT NULL
    );
    CREATE TABLE layer_newest (
        job_id TEXT NOT NULL,
        layer  TEXT NOT NULL,
        step   BIGINT NOT NULL,
        PRIMARY KEY (job_id, layer)
    );
    CREATE TABLE step_totals (
        job_id         TEXT PRIMARY KEY,
        steps          BIGINT NOT NULL,
        last_step      BIGINT,
        raw_bytes      BIGINT NOT NULL,
        bytes_sent     BIGINT NOT NULL,
        bytes_received BIGINT NOT NULL
    );
    CREATE TABLE job_world_sizes (
        job_id     TEXT NOT NULL,
        world_size BIGINT NOT NULL,
        PRIMARY KEY (job_id, world_size)
    );
    """,
    # 2: as SQLite's 4, the layer records' index by (job_id, step).
    """
    DROP INDEX IF EXISTS layer_metrics_by_layer;
    CREATE INDEX layer_metrics_by_step ON layer_metrics (job_id, step);
    """,
    # 3: one index per record table instead of two. The records' key leads with (job_id, step),
    # which every read, the retention DELETE and the totals' step lookup seek by, so the separate
    # step index goes. Its upkeep was a quarter of the server's CPU per ingested record (a
    # (job_id, step) key repeats for every layer and rank of a step; measured with binary COPY:
    # server 1.89 -> 1.47 s per 617k layer records). (job_id, seq) stays unique through the
    # key: a replayed record carries its step with its seq, so it still conflicts and is dropped.
    # Rebuilding a key takes the table's lock for the time a CREATE INDEX takes (once).
    """
    ALTER TABLE layer_metrics DROP CONSTRAINT layer_metrics_pkey;
    ALTER TABLE layer_metrics ADD PRIMARY KEY (job_id, step, seq);
    DROP INDEX IF EXISTS layer_metrics_by_step;
    ALTER TABLE step_metrics DROP CONSTRAINT step_metrics_pkey;
    ALTER TABLE step_metrics ADD PRIMARY KEY (job_id, step, rank, seq);
    DROP INDEX IF EXISTS step_metrics_by_step;
    """,
)


def sqlite_statements(script: str) -> list[str]:
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
