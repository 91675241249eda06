"""Storage on both backends (SQLite file, real PostgreSQL server): migrations, idempotent
crash-safe ingest, the aggregations the API serves, running totals, retention, the leader lease,
concurrent writers and readers that never wait for the writer."""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from service_support import LAYERS, make_settings, raw_rows, step_records

from jobs.local_postgres import LocalPostgres
from service.ingester import Ingester
from service.prometheus import render_prometheus
from service.storage import IngestBatch, RetentionPolicy, Storage, open_storage, parse_storage_url
from service.storage.records import LAYER_COLUMNS, LAYER_FIELDS
from service.storage.schema import POSTGRES_MIGRATIONS, SQLITE_MIGRATIONS, sqlite_statements


@pytest.fixture
def store(storage_url: str) -> Iterator[Storage]:
    s = open_storage(storage_url)
    s.insert_job(job_id="j1", name="j1", source="api", status="RUNNING", entrypoint="x", spec={"a": 1})
    yield s
    s.close()


def _batch(records: list[dict], first_seq: int) -> tuple[list[dict], int]:
    numbered = [{"seq": first_seq + i, **r} for i, r in enumerate(records)]
    return numbered, first_seq + len(records) - 1


def test_migrations_are_applied_once_and_tracked(storage_url: str) -> None:
    expected = len(SQLITE_MIGRATIONS if storage_url.startswith("sqlite") else POSTGRES_MIGRATIONS)
    first = open_storage(storage_url)
    first.insert_job(job_id="j1", name="j1", source="api", status="RUNNING", entrypoint="x", spec=None)
    assert first.schema_version() == expected
    again = open_storage(storage_url)  # re-opening must not re-run a migration
    assert again.schema_version() == expected and again.get_job("j1") is not None
    first.close()
    again.close()
    if storage_url.startswith("sqlite"):
        assert raw_rows(storage_url, "PRAGMA journal_mode") == [("wal",)]
    else:
        rows = raw_rows(storage_url, "SELECT version FROM schema_migrations ORDER BY version")
        assert rows == [(v,) for v in range(1, expected + 1)]


def test_replayed_batch_is_not_doubled_and_cursor_only_moves_forward(store: Storage) -> None:
    recs, last = _batch(step_records("j1", 0), 1)
    assert store.ingest("j1", IngestBatch(recs, last)) == len(recs)
    assert store.ingest("j1", IngestBatch(recs, last)) == 0  # a crash before the cursor... replays
    assert store.ingest("j1", IngestBatch([], 3)) == 0  # an older cursor never moves it back
    assert store.cursor("j1") == last
    assert store.seqs("j1") == list(range(1, last + 1))
    assert store.ingest_state("j1")["records"] == len(recs)


def test_malformed_records_are_skipped_but_the_cursor_advances(store: Storage) -> None:
    good, _ = _batch(step_records("j1", 0, ranks=1), 1)
    bad = [{"seq": 100, "type": "layer", "step": 1}, {"seq": 101, "type": "mystery"}, {"seq": 102}]
    store.ingest("j1", IngestBatch(good + bad, 102))
    assert store.cursor("j1") == 102
    assert len(store.seqs("j1")) == len(good)


def test_latest_layers_aggregate_ranks_at_the_newest_step(store: Storage) -> None:
    seq = 1
    for step in range(3):
        recs, last = _batch(step_records("j1", step, ranks=2, ratio_scale=1 + step), seq)
        store.ingest("j1", IngestBatch(recs, last))
        seq = last + 1
    layers = store.latest_layers("j1")
    assert [row["layer"] for row in layers] == list(LAYERS)
    expected = {r["layer"]: r for r in step_records("j1", 2, ranks=2, ratio_scale=3) if r["type"] == "layer"}
    for row in layers:
        ref = expected[row["layer"]]
        assert row["step"] == 2 and row["ranks"] == 2
        assert row["raw_bytes"] == 2 * ref["raw_bytes"]
        assert row["encoded_bytes"] == 2 * ref["encoded_bytes"]
        assert row["ratio"] == pytest.approx(ref["raw_bytes"] / ref["encoded_bytes"])
        assert row["bits"] == ref["bits"]
        assert type(row["bits"]) is float and type(row["raw_bytes"]) is int  # never Decimal


def test_steps_sum_bytes_max_times_and_count_a_rerun_step_once(store: Storage) -> None:
    recs, last = _batch(step_records("j1", 0) + step_records("j1", 1), 1)
    store.ingest("j1", IngestBatch(recs, last))
    # A restart from a checkpoint re-runs step 1 on both ranks: the newest records win.
    rerun, last2 = _batch(step_records("j1", 1, ratio_scale=2), last + 1)
    store.ingest("j1", IngestBatch(rerun, last2))
    points = store.steps("j1", after_step=-1, limit=10)
    assert [p["step"] for p in points] == [0, 1]
    step_recs = [r for r in rerun if r["type"] == "step"]
    p1 = points[1]
    assert p1["ranks"] == 2 and p1["world_size"] == 2
    assert p1["bytes_sent"] == sum(r["bytes_sent"] for r in step_recs)
    assert p1["raw_bytes"] == sum(r["raw_bytes"] for r in step_recs)
    assert p1["step_s"] == max(r["step_s"] for r in step_recs)
    assert p1["loss"] == pytest.approx(sum(r["loss"] for r in step_recs) / 2)
    assert p1["ratio"] == pytest.approx(p1["raw_bytes"] / p1["bytes_sent"])
    assert store.steps("j1", after_step=0, limit=10)[0]["step"] == 1
    assert store.steps("j1", after_step=-1, limit=1)[0]["step"] == 0
    assert [p["step"] for p in store.steps("j1", -1, 10, before_step=1)] == [0]


def test_summary_totals_match_the_records(store: Storage) -> None:
    recs, last = _batch(step_records("j1", 0) + step_records("j1", 1), 1)
    store.ingest("j1", IngestBatch(recs, last))
    steps = [r for r in recs if r["type"] == "step"]
    s = store.summary("j1")
    raw, sent = sum(r["raw_bytes"] for r in steps), sum(r["bytes_sent"] for r in steps)
    assert (s["steps"], s["last_step"], s["world_sizes"], s["layers"]) == (2, 1, [2], len(LAYERS))
    assert (s["raw_bytes"], s["bytes_sent"], s["traffic_saved_bytes"]) == (raw, sent, raw - sent)
    assert s["ratio"] == pytest.approx(raw / sent)
    assert s["ingest"]["cursor_seq"] == last


_SABOTAGE = {
    "sqlite": [
        "CREATE TRIGGER boom BEFORE UPDATE ON ingest_cursors BEGIN SELECT RAISE(ABORT, 'disk full'); END"
    ],
    "postgresql": [
        "CREATE FUNCTION boom() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION 'disk full'; END $$"
        " LANGUAGE plpgsql",
        "CREATE TRIGGER boom BEFORE UPDATE ON ingest_cursors FOR EACH ROW EXECUTE FUNCTION boom()",
    ],
}


def test_a_failed_transaction_leaves_records_and_cursor_untouched(store: Storage, storage_url: str) -> None:
    recs, last = _batch(step_records("j1", 0), 1)
    # Make the cursor write (the last statement of the transaction) fail, as a full disk would.
    for sql in _SABOTAGE[parse_storage_url(storage_url)[0]]:
        raw_rows(storage_url, sql)
    with pytest.raises((sqlite3.Error, psycopg.Error), match="disk full"):
        store.ingest("j1", IngestBatch(recs, last))
    assert store.cursor("j1") == 0 and store.seqs("j1") == []  # the records rolled back with it
    assert store.summary("j1")["steps"] == 0 and store.latest_layers("j1") == []  # and the totals


def test_out_of_range_integers_are_skipped_not_fatal(store: Storage) -> None:
    recs, last = _batch(step_records("j1", 0, ranks=1), 1)
    recs[-1] = {**recs[-1], "raw_bytes": 2**70}
    store.ingest("j1", IngestBatch(recs, last))
    assert store.cursor("j1") == last and len(store.seqs("j1")) == len(recs) - 1


def test_non_finite_floats_keep_their_record_as_null(store: Storage) -> None:
    recs, last = _batch(step_records("j1", 0, ranks=1), 1)
    recs[0] = {**recs[0], "rel_error": float("nan"), "ratio": float("inf")}  # a layer record
    recs[-1] = {**recs[-1], "loss": float("nan")}  # the step record
    store.ingest("j1", IngestBatch(recs, last))
    assert store.seqs("j1") == list(range(1, last + 1))  # every record kept
    first = store.latest_layers("j1")[0]
    assert first["layer"] == LAYERS[0] and first["rel_error"] is None
    assert store.latest_layers("j1")[1]["rel_error"] is not None
    assert store.steps("j1", -1, 10)[0]["loss"] is None
    assert store.summary("j1")["last_loss"] is None


def _recompute(url: str, job_id: str) -> dict:
    """The summary's totals and each layer's newest step, straight from the raw records."""
    steps = raw_rows(
        url,
        "SELECT step, rank, seq, world_size, raw_bytes, bytes_sent, bytes_received FROM step_metrics"
        " WHERE job_id = ?",
        (job_id,),
    )
    layers = raw_rows(url, "SELECT layer, step, ratio FROM layer_metrics WHERE job_id = ?", (job_id,))
    newest: dict[tuple[int, int], tuple] = {}
    for row in steps:
        key = (row[0], row[1])
        if key not in newest or row[2] > newest[key][2]:
            newest[key] = row
    ratios = [r[2] for r in layers if r[2] is not None]
    newest_step: dict[str, int] = {}
    for layer, step, _ in layers:
        newest_step[layer] = max(step, newest_step.get(layer, step))
    return {
        "steps": len({s for s, _ in newest}),
        "last_step": max((s for s, _ in newest), default=None),
        "world_sizes": sorted({r[3] for r in steps}),
        "raw_bytes": sum(r[4] for r in newest.values()),
        "bytes_sent": sum(r[5] for r in newest.values()),
        "bytes_received": sum(r[6] for r in newest.values()),
        "mean_layer_ratio": sum(ratios) / len(ratios) if ratios else None,
        "layers": len(newest_step),
        "newest_step": newest_step,
    }


def check_read_models(store: Storage, url: str, job_id: str) -> None:
    expected = _recompute(url, job_id)
    s = store.summary(job_id)
    for key in ("steps", "last_step", "world_sizes", "raw_bytes", "bytes_sent", "bytes_received", "layers"):
        assert s[key] == expected[key], key
    if expected["mean_layer_ratio"] is None:
        assert s["mean_layer_ratio"] is None
    else:
        assert s["mean_layer_ratio"] == pytest.approx(expected["mean_layer_ratio"], rel=1e-12)
    assert {r["layer"]: r["step"] for r in store.latest_layers(job_id)} == expected["newest_step"]


def _messy_ingest(store: Storage) -> None:
    """Pages as a crashing, restarting ingester and a restarted training job produce them:
    replays, a re-run step (newer seqs for old steps), a world-size change, a NULL ratio."""
    first, last1 = _batch(step_records("j1", 0) + step_records("j1", 1) + step_records("j1", 2), 1)
    first[0] = {**first[0], "ratio": float("nan")}
    store.ingest("j1", IngestBatch(first, last1))
    store.ingest("j1", IngestBatch(first, last1))  # replayed whole page: nothing counted twice
    # The job restarts from step 1 at world size 1 (one rank re-runs steps 1 and 2).
    rerun = step_records("j1", 1, ranks=1, ratio_scale=3) + step_records("j1", 2, ranks=1, ratio_scale=3)
    rerun = [{**r, "world_size": 1} if r["type"] == "step" else r for r in rerun]
    second, last2 = _batch(rerun + step_records("j1", 3, ranks=1), last1 + 1)
    store.ingest("j1", IngestBatch(second[:5], second[4]["seq"]))
    store.ingest("j1", IngestBatch(second, last2))  # overlaps the page before it
    store.ingest("j1", IngestBatch(first[3:9], last1))  # a stale replay of an older page
    assert store.seqs("j1") == list(range(1, last2 + 1))


def test_running_totals_equal_a_recomputation_after_replays_and_reruns(
    store: Storage, storage_url: str
) -> None:
    check_read_models(store, storage_url, "j1")  # a job with no records yet
    _messy_ingest(store)
    check_read_models(store, storage_url, "j1")
    s = store.summary("j1")
    assert s["world_sizes"] == [1, 2] and s["steps"] == 4 and s["last_step"] == 3


def _ingest_steps(store: Storage, steps: range, ranks: int = 1) -> None:
    for step in steps:
        recs, last = _batch(step_records("j1", step, ranks=ranks), store.cursor("j1") + 1)
        store.ingest("j1", IngestBatch(recs, last))


def test_retention_keeps_the_newest_steps_then_every_kth_and_the_totals(store: Storage) -> None:
    _ingest_steps(store, range(100))
    before_summary, before_layers, before_size = store.summary("j1"), store.latest_layers("j1"), store.size()
    per_step = len(LAYERS) + 1
    assert (before_size.layer_records, before_size.step_records) == (100 * len(LAYERS), 100)

    policy = RetentionPolicy(full_steps=20, every_k=10)
    deleted = 0
    while (n := store.apply_retention("j1", policy, max_rows=25 * per_step)) > 0:  # in windows
        deleted += n
    kept = [s for s in range(100) if s >= 80 or s % 10 == 0]
    assert [p["step"] for p in store.steps("j1", -1, 1000)] == kept
    assert deleted == (100 - len(kept)) * per_step
    size = store.size()
    assert (size.layer_records, size.step_records) == (len(kept) * len(LAYERS), len(kept))
    assert size.pruned_records == deleted and size.database_bytes > 0
    after_summary = store.summary("j1")
    assert {k: v for k, v in after_summary.items() if k != "ingest"} == {
        k: v for k, v in before_summary.items() if k != "ingest"
    }  # the running totals never change
    assert store.latest_layers("j1") == before_layers
    assert store.apply_retention("j1", policy) == 0  # nothing left to thin

    _ingest_steps(store, range(100, 130))  # training goes on: the window moves to 110..129
    assert store.apply_retention("j1", policy) == (30 - 3) * per_step  # 80..109 but 80, 90, 100
    assert RetentionPolicy(full_steps=None).full_steps is None
    assert store.apply_retention("j1", RetentionPolicy(full_steps=None)) == 0


def test_one_leader_lease_at_a_time_and_a_dead_holder_frees_it(storage_url: str) -> None:
    a, b = open_storage(storage_url), open_storage(storage_url)
    first, second = a.leader_lease(), b.leader_lease()
    assert first.try_acquire() and first.held
    assert not second.try_acquire() and not second.held
    first.release()
    assert second.try_acquire()
    if storage_url.startswith("postgresql"):
        # The holder's session dies (a replica's process killed): the lock is free again. The
        # timeout makes the call wait until the backend has gone, locks and all.
        raw_rows(
            storage_url,
            "SELECT pg_terminate_backend(pid, 10000) FROM pg_locks WHERE locktype = 'advisory' AND granted",
        )
        assert not second.held
        assert first.try_acquire()
    first.release()
    second.release()
    a.close()
    b.close()


def test_a_released_lease_is_free_at_once_even_while_the_old_session_lingers(
    postgres_server: LocalPostgres,
) -> None:
    """A replica that steps down hands over at once: the server ends a closed session's
    backend some time after the client goes (late on a loaded host), so release must unlock
    first. Here the old backend is frozen (SIGSTOP) as its client closes, and stays alive."""
    url = postgres_server.create_database()
    a, b = open_storage(url), open_storage(url)
    first, second = a.leader_lease(), b.leader_lease()
    assert first.try_acquire()
    conn = first._conn
    assert conn is not None
    backend_pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
    really_close = conn.close

    def close_while_the_backend_is_frozen() -> None:
        os.kill(backend_pid, signal.SIGSTOP)
        really_close()

    conn.close = close_while_the_backend_is_frozen  # type: ignore[method-assign]
    try:
        first.release()
        alive = raw_rows(url, "SELECT count(*) FROM pg_stat_activity WHERE pid = ?", (backend_pid,))
        assert alive == [(1,)]  # the old session is still there...
        assert second.try_acquire()  # ...and the lease is free all the same
    finally:
        os.kill(backend_pid, signal.SIGCONT)
        second.release()
        a.close()
        b.close()


def test_two_writers_racing_on_one_job_store_each_record_once(store: Storage, storage_url: str) -> None:
    """Two ingesters (separate connections, as two replicas would be) drain one sink at once:
    each reads the stored cursor and stores the sink's page after it, so they race for the same
    pages. The job's cursor row lock makes the later one see the earlier one's cursor."""
    other = open_storage(storage_url)
    sink, last = _batch([r for step in range(40) for r in step_records("j1", step)], 1)
    errors: list[BaseException] = []

    def drain(storage: Storage, page_records: int) -> None:
        try:
            while (cursor := storage.cursor("j1")) < last:
                page = sink[cursor : cursor + page_records]  # the sink serves seqs after the cursor
                storage.ingest("j1", IngestBatch(page, page[-1]["seq"]))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=drain, args=(s, n)) for s, n in ((store, 30), (other, 47))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    other.close()
    assert not errors
    assert store.seqs("j1") == list(range(1, last + 1))
    assert store.ingest_state("j1")["records"] == last
    check_read_models(store, storage_url, "j1")


def test_a_page_behind_the_cursor_stores_nothing(store: Storage) -> None:
    """Pages arrive in sink order; one that is entirely behind the cursor (a slower replica's
    read) changes nothing, even after retention thinned those records."""
    _ingest_steps(store, range(50))
    per_step = len(LAYERS) + 1
    late, _ = _batch(step_records("j1", 1, ranks=1), per_step + 1)  # step 1's records, seqs 6..10
    store.apply_retention("j1", RetentionPolicy(full_steps=10, every_k=10))
    thinned = store.seqs("j1")
    assert late[0]["seq"] not in thinned
    assert store.ingest("j1", IngestBatch(late, late[-1]["seq"])) == 0
    assert store.seqs("j1") == thinned


_HOLD_WRITE = {
    "sqlite": ["BEGIN IMMEDIATE", "UPDATE ingest_cursors SET records = 999, after_seq = 999"],
    "postgresql": [
        "BEGIN",
        "SELECT 1 FROM ingest_cursors WHERE job_id = 'j1' FOR UPDATE",
        "UPDATE ingest_cursors SET records = 999, after_seq = 999",
    ],
}


def test_reads_never_wait_for_an_open_write_transaction(store: Storage, storage_url: str) -> None:
    _ingest_steps(store, range(3), ranks=2)
    backend, target = parse_storage_url(storage_url)
    conn = (
        sqlite3.connect(target, isolation_level=None)
        if backend == "sqlite"
        else psycopg.connect(target, autocommit=True)
    )
    try:
        for sql in _HOLD_WRITE[backend]:  # an ingest transaction that has not committed yet
            conn.execute(sql)
        t0 = time.monotonic()
        summary, layers, steps = store.summary("j1"), store.latest_layers("j1"), store.steps("j1", -1, 10)
        elapsed = time.monotonic() - t0
        assert summary["ingest"]["records"] == 3 * 2 * (len(LAYERS) + 1)  # the committed state
        assert len(layers) == len(LAYERS) and len(steps) == 3
        # A reader that waited would sit out the writer (here: forever) or the 30 s busy timeout.
        assert elapsed < 10, elapsed
    finally:
        conn.execute("ROLLBACK")
        conn.close()


def _old_sqlite_database(path: Path, version: int) -> None:
    """A database as an older release left it: its migrations only, records written by that
    release's triggers (version 2) or with no read models at all (version 1)."""
    with sqlite3.connect(path, isolation_level=None) as conn:
        for script in SQLITE_MIGRATIONS[:version]:
            for statement in sqlite_statements(script):
                conn.execute(statement)
        conn.execute(f"PRAGMA user_version={version}")
        conn.execute(
            "INSERT INTO jobs (id, name, source, status, entrypoint, created_at, updated_at)"
            " VALUES ('j1', 'j1', 'api', 'RUNNING', 'x', 1, 1)"
        )
        conn.execute("INSERT INTO ingest_cursors (job_id, updated_at) VALUES ('j1', 1)")


@pytest.mark.parametrize("version", [1, 2])
def test_an_older_sqlite_database_migrates_with_its_totals(tmp_path: Path, version: int) -> None:
    """SQLite's migration history (PostgreSQL starts at today's schema): an old file keeps its
    records and gets running totals equal to a recomputation, kept up to date from then on."""
    path = tmp_path / "old.sqlite"
    url = f"sqlite://{path}"
    _old_sqlite_database(path, version)
    recs, last = _batch(step_records("j1", 0) + step_records("j1", 1) + step_records("j1", 1, ranks=1), 1)
    layer_cols = ("seq", "step", "rank", "layer", "numel", "bits", "density", "raw_bytes",
                  "encoded_bytes", "ratio", "rel_error", "code")  # fmt: skip
    step_cols = ("seq", "step", "rank", "world_size", "bytes_sent", "bytes_received", "raw_bytes",
                 "compress_s", "decode_s", "comm_s", "step_s", "loss", "method", "wall_time_s")  # fmt: skip
    for r in recs:
        cols = layer_cols if r["type"] == "layer" else step_cols
        table = "layer_metrics" if r["type"] == "layer" else "step_metrics"
        raw_rows(
            url,
            f"INSERT INTO {table} (job_id, {', '.join(cols)}) VALUES ('j1', {', '.join('?' * len(cols))})",
            tuple(r[c] for c in cols),
        )
    raw_rows(url, "UPDATE ingest_cursors SET after_seq = ?, records = ?", (last, len(recs)))
    store = open_storage(url)
    assert store.schema_version() == len(SQLITE_MIGRATIONS)
    check_read_models(store, url, "j1")
    assert store.size().layer_records == sum(r["type"] == "layer" for r in recs)
    more, last2 = _batch(step_records("j1", 2, ranks=1), last + 1)
    store.ingest("j1", IngestBatch(more, last2))
    check_read_models(store, url, "j1")
    store.close()


def test_database_urls_name_the_backend_or_say_what_is_accepted() -> None:
    assert parse_storage_url("sqlite:///var/lib/x.sqlite") == ("sqlite", "/var/lib/x.sqlite")
    assert parse_storage_url(Path("rel.sqlite")) == ("sqlite", "rel.sqlite")
    assert parse_storage_url("postgresql://u:p@h:5/db")[0] == "postgresql"
    with pytest.raises(ValueError, match="use sqlite:///path"):
        parse_storage_url("mysql://h/db")


def test_the_ingester_thins_every_job_to_the_retention_setting(store: Storage, tmp_path: Path) -> None:
    """The settings reach retention: ``Ingester.retain`` (run every RETENTION_INTERVAL_S by the
    leader) thins every job until nothing is left to thin, and /metrics' size reflects it."""
    store.insert_job(job_id="j2", name="j2", source="api", status="SUCCEEDED", entrypoint="x", spec=None)
    _ingest_steps(store, range(60))
    for step in range(30):
        recs = [
            {"seq": store.cursor("j2") + 1 + i, **r} for i, r in enumerate(step_records("j2", step, ranks=1))
        ]
        store.ingest("j2", IngestBatch(recs, recs[-1]["seq"]))
    settings = make_settings(
        tmp_path / "unused.sqlite", None, retention_full_steps=10, retention_every_k_steps=5
    )
    deleted = Ingester(settings, store, ray_gateway=None).retain()  # type: ignore[arg-type]  # no Ray needed
    kept_j1 = [s for s in range(60) if s >= 50 or s % 5 == 0]
    kept_j2 = [s for s in range(30) if s >= 20 or s % 5 == 0]
    assert [p["step"] for p in store.steps("j1", -1, 100)] == kept_j1
    assert [p["step"] for p in store.steps("j2", -1, 100)] == kept_j2
    per_step = len(LAYERS) + 1
    assert deleted == (60 - len(kept_j1) + 30 - len(kept_j2)) * per_step
    text = render_prometheus(store, settings, ingest_ok=True)[0].decode()
    assert f'tail_ray_storage_records{{kind="step"}} {float(len(kept_j1) + len(kept_j2))!r}' in text
    assert f"tail_ray_storage_pruned_records_total {float(deleted)!r}" in text


def test_text_with_a_nul_byte_is_skipped_not_fatal(store: Storage) -> None:
    """PostgreSQL's text cannot hold U+0000: one such layer name from a worker failed the whole
    page there, so the cursor never moved and ingest stalled on it. Both backends skip it."""
    recs, last = _batch(step_records("j1", 0, ranks=1), 1)
    recs[0] = {**recs[0], "layer": "conv1\x00.weight"}
    recs[-1] = {**recs[-1], "method": "tail\x00"}
    store.ingest("j1", IngestBatch(recs, last))
    assert store.cursor("j1") == last and store.seqs("j1") == list(range(2, last))


def test_job_text_from_ray_with_a_nul_byte_is_stored_without_it(store: Storage) -> None:
    """A job Ray reports (entrypoint, status message) is copied as it is, less any U+0000."""
    store.insert_job(
        job_id="j2", name="j2", source="ray", status="RUNNING", entrypoint="python\x00 x", spec=None
    )
    store.update_job_status("j2", "FAILED", "died: \x00core dumped")
    job = store.get_job("j2")
    assert job is not None and (job.entrypoint, job.message) == ("python x", "died: core dumped")


def test_the_sqlite_wal_is_truncated_after_a_burst_once_checkpointed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint thread copies the WAL into the database; the next write then truncates a
    WAL a burst grew back to ``WAL_SIZE_LIMIT_BYTES`` instead of keeping its size for good."""
    from service.storage import sqlite as sqlite_storage

    limit = 64 * 1024
    monkeypatch.setattr(sqlite_storage, "WAL_SIZE_LIMIT_BYTES", limit)
    path = tmp_path / "burst.sqlite"
    wal = Path(f"{path}-wal")
    store = open_storage(f"sqlite://{path}")
    store.insert_job(job_id="j1", name="j1", source="api", status="RUNNING", entrypoint="x", spec=None)
    layers = tuple(f"block{i}.weight" for i in range(50))
    seq = 1
    for step in range(10):  # the burst: 10 steps x 8 ranks x 50 layers in one transaction each
        recs = [{"seq": seq + i, **r} for i, r in enumerate(step_records("j1", step, ranks=8, layers=layers))]
        seq += len(recs)
        store.ingest("j1", IngestBatch(recs, seq - 1))
    burst_bytes = wal.stat().st_size
    assert burst_bytes > 4 * limit
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        time.sleep(sqlite_storage.CHECKPOINT_INTERVAL_S * 1.5)  # let the thread checkpoint it all
        recs = [{"seq": seq + i, **r} for i, r in enumerate(step_records("j1", 100, ranks=1))]
        seq += len(recs)
        store.ingest("j1", IngestBatch(recs, seq - 1))  # a write after the checkpoint resets the WAL
        if wal.stat().st_size <= limit:
            break
    assert wal.stat().st_size <= limit < burst_bytes
    assert store.seqs("j1") == list(range(1, seq))  # nothing lost on the way
    store.close()


def test_postgresql_copies_in_binary_and_takes_a_stray_type_as_text(
    postgres_server: LocalPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    """Batches go in by binary COPY. A value of a type binary COPY cannot send as its column's
    (here a numeric string for a float column: the converters never hand one over) makes the
    batch go in as text instead of failing the ingest transaction."""
    from service.storage.records import STEP_COLUMNS

    url = postgres_server.create_database()
    store = open_storage(url)
    store.insert_job(job_id="j1", name="j1", source="api", status="RUNNING", entrypoint="x", spec=None)
    recs, last = _batch(step_records("j1", 0), 1)
    assert store.ingest("j1", IngestBatch(recs, last)) == len(recs)
    assert "binary COPY refused" not in caplog.text
    row = ["j1", last + 1, 1, 0, 2, 10, 10, 40, 0.1, 0.1, 0.1, 0.5, "1.25", "tail", 1.0]
    assert len(row) == len(STEP_COLUMNS) and STEP_COLUMNS[12] == "loss"
    with caplog.at_level("WARNING"), store._write() as tx:  # type: ignore[attr-defined]
        tx.bulk_insert("step_metrics", STEP_COLUMNS, [row])
    assert "binary COPY refused" in caplog.text
    assert raw_rows(url, "SELECT loss FROM step_metrics WHERE seq = ?", (last + 1,)) == [(1.25,)]
    store.close()


def test_an_older_postgresql_database_migrates_to_one_index_per_record_table(
    postgres_server: LocalPostgres,
) -> None:
    """PostgreSQL's migration 3 (one key per record table, led by (job_id, step)) on a database
    that holds records: they are all kept, the read models still equal a recomputation, a
    replayed record is still refused by the key, and each record table keeps ONE index (its
    second one cost a quarter of the server's CPU per ingested record)."""
    url = postgres_server.create_database()
    with psycopg.connect(url, autocommit=True) as conn:  # the schema as release 2 left it
        conn.execute(
            "CREATE TABLE schema_migrations"
            " (version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
        )
        for number, script in enumerate(POSTGRES_MIGRATIONS[:2], start=1):
            conn.execute(script.encode())
            conn.execute("INSERT INTO schema_migrations VALUES (%s, 0)", (number,))
    old = open_storage(url)
    old.insert_job(job_id="j1", name="j1", source="api", status="RUNNING", entrypoint="x", spec=None)
    recs, last = _batch([r for step in range(3) for r in step_records("j1", step)], 1)
    assert old.ingest("j1", IngestBatch(recs, last)) == len(recs)
    old.close()
    raw_rows(url, "DELETE FROM schema_migrations WHERE version > 2")  # opening migrated it: undo the mark
    # ...and its effect, so that the open below runs migration 3 on release 2's schema.
    raw_rows(url, "ALTER TABLE layer_metrics DROP CONSTRAINT layer_metrics_pkey")
    raw_rows(url, "ALTER TABLE layer_metrics ADD PRIMARY KEY (job_id, seq)")
    raw_rows(url, "CREATE INDEX IF NOT EXISTS layer_metrics_by_step ON layer_metrics (job_id, step)")
    raw_rows(url, "ALTER TABLE step_metrics DROP CONSTRAINT step_metrics_pkey")
    raw_rows(url, "ALTER TABLE step_metrics ADD PRIMARY KEY (job_id, seq)")
    raw_rows(url, "CREATE INDEX IF NOT EXISTS step_metrics_by_step ON step_metrics (job_id, step, rank, seq)")

    store = open_storage(url)
    assert store.schema_version() == len(POSTGRES_MIGRATIONS)
    assert store.seqs("j1") == list(range(1, last + 1))
    check_read_models(store, url, "j1")
    for table in ("layer_metrics", "step_metrics"):
        indexes = raw_rows(url, "SELECT indexdef FROM pg_indexes WHERE tablename = ?", (table,))
        assert len(indexes) == 1 and "(job_id, step, " in indexes[0][0], indexes
    with store._write() as tx:  # type: ignore[attr-defined]  # past the cursor check: the key's turn
        tx.bulk_insert(
            "layer_metrics",
            LAYER_COLUMNS,
            [("j1", r["seq"], *(r[f] for f in LAYER_FIELDS)) for r in recs if r["type"] == "layer"][:3],
        )
    assert store.seqs("j1") == list(range(1, last + 1))  # nothing doubled
    store.close()
