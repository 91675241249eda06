"""Storage: migrations, idempotent crash-safe ingest, and the aggregations the API serves."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from service_support import LAYERS, step_records

from service.storage import MIGRATIONS, IngestBatch, Storage


def _store(tmp_path: Path) -> Storage:
    store = Storage(tmp_path / "db.sqlite")
    store.insert_job(job_id="j1", name="j1", source="api", status="RUNNING", entrypoint="x", spec={"a": 1})
    return store


def _batch(records: list[dict], first_seq: int) -> tuple[list[dict], int]:
    numbered = [{"seq": first_seq + i, **r} for i, r in enumerate(records)]
    return numbered, first_seq + len(records) - 1


def test_migrations_are_applied_once_and_tracked(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert store.schema_version() == len(MIGRATIONS)
    again = Storage(tmp_path / "db.sqlite")  # re-opening must not re-run a migration
    assert again.schema_version() == len(MIGRATIONS)
    assert again.get_job("j1") is not None
    mode = sqlite3.connect(tmp_path / "db.sqlite").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_replayed_batch_is_not_doubled_and_cursor_only_moves_forward(tmp_path: Path) -> None:
    store = _store(tmp_path)
    recs, last = _batch(step_records("j1", 0), 1)
    assert store.ingest("j1", IngestBatch(recs, last)) == len(recs)
    assert store.ingest("j1", IngestBatch(recs, last)) == 0  # a crash before the cursor... replays
    assert store.ingest("j1", IngestBatch([], 3)) == 0  # an older cursor never moves it back
    assert store.cursor("j1") == last
    assert store.seqs("j1") == list(range(1, last + 1))
    assert store.ingest_state("j1")["records"] == len(recs)


def test_malformed_records_are_skipped_but_the_cursor_advances(tmp_path: Path) -> None:
    store = _store(tmp_path)
    good, _ = _batch(step_records("j1", 0, ranks=1), 1)
    bad = [{"seq": 100, "type": "layer", "step": 1}, {"seq": 101, "type": "mystery"}, {"seq": 102}]
    store.ingest("j1", IngestBatch(good + bad, 102))
    assert store.cursor("j1") == 102
    assert len(store.seqs("j1")) == len(good)


def test_latest_layers_aggregate_ranks_at_the_newest_step(tmp_path: Path) -> None:
    store = _store(tmp_path)
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


def test_steps_sum_bytes_max_times_and_count_a_rerun_step_once(tmp_path: Path) -> None:
    store = _store(tmp_path)
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


def test_summary_totals_match_the_records(tmp_path: Path) -> None:
    store = _store(tmp_path)
    recs, last = _batch(step_records("j1", 0) + step_records("j1", 1), 1)
    store.ingest("j1", IngestBatch(recs, last))
    steps = [r for r in recs if r["type"] == "step"]
    s = store.summary("j1")
    raw, sent = sum(r["raw_bytes"] for r in steps), sum(r["bytes_sent"] for r in steps)
    assert (s["steps"], s["last_step"], s["world_sizes"], s["layers"]) == (2, 1, [2], len(LAYERS))
    assert (s["raw_bytes"], s["bytes_sent"], s["traffic_saved_bytes"]) == (raw, sent, raw - sent)
    assert s["ratio"] == pytest.approx(raw / sent)
    assert s["ingest"]["cursor_seq"] == last


def test_a_failed_transaction_leaves_records_and_cursor_untouched(tmp_path: Path) -> None:
    store = _store(tmp_path)
    recs, last = _batch(step_records("j1", 0), 1)
    # Make the cursor write (the last statement of the transaction) fail, as a full disk would.
    with sqlite3.connect(tmp_path / "db.sqlite") as conn:
        conn.execute(
            "CREATE TRIGGER boom BEFORE UPDATE ON ingest_cursors BEGIN SELECT RAISE(ABORT, 'disk full'); END"
        )
    with pytest.raises(sqlite3.IntegrityError, match="disk full"):
        store.ingest("j1", IngestBatch(recs, last))
    assert store.cursor("j1") == 0 and store.seqs("j1") == []  # the records rolled back with it


def test_out_of_range_integers_are_skipped_not_fatal(tmp_path: Path) -> None:
    store = _store(tmp_path)
    recs, last = _batch(step_records("j1", 0, ranks=1), 1)
    recs[-1] = {**recs[-1], "raw_bytes": 2**70}
    store.ingest("j1", IngestBatch(recs, last))
    assert store.cursor("j1") == last and len(store.seqs("j1")) == len(recs) - 1


def test_non_finite_floats_keep_their_record_as_null(tmp_path: Path) -> None:
    store = _store(tmp_path)
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


def _recompute(path: Path, job_id: str) -> dict:
    """The summary's totals and each layer's newest step, straight from the raw records."""
    conn = sqlite3.connect(path)
    steps = conn.execute(
        "SELECT step, rank, seq, world_size, raw_bytes, bytes_sent, bytes_received FROM step_metrics"
        " WHERE job_id = ?",
        (job_id,),
    ).fetchall()
    layers = conn.execute(
        "SELECT layer, step, ratio FROM layer_metrics WHERE job_id = ?", (job_id,)
    ).fetchall()
    conn.close()
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


def _check_read_models(store: Storage, job_id: str) -> None:
    expected = _recompute(store.path, job_id)
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


def test_running_totals_equal_a_recomputation_after_replays_and_reruns(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _check_read_models(store, "j1")  # a job with no records yet
    _messy_ingest(store)
    _check_read_models(store, "j1")
    s = store.summary("j1")
    assert s["world_sizes"] == [1, 2] and s["steps"] == 4 and s["last_step"] == 3


def test_migration_backfills_the_read_models_of_an_existing_database(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _messy_ingest(store)
    store.insert_job(job_id="j2", name="j2", source="api", status="RUNNING", entrypoint="x", spec=None)
    before = (store.summary("j1"), store.latest_layers("j1"), store.summary("j2"))
    # Turn the file back into a version-1 database: records only, no read models.
    with sqlite3.connect(store.path) as conn:
        for name in ("layer_metrics_read_model", "step_metrics_read_model"):
            conn.execute(f"DROP TRIGGER {name}")
        for name in ("layer_totals", "layer_newest", "step_newest", "step_totals", "job_world_sizes"):
            conn.execute(f"DROP TABLE {name}")
        conn.execute("PRAGMA user_version=1")
    reopened = Storage(store.path)
    assert reopened.schema_version() == len(MIGRATIONS)
    _check_read_models(reopened, "j1")
    assert (reopened.summary("j1"), reopened.latest_layers("j1"), reopened.summary("j2")) == before
    # ... and the triggers keep them up to date from there on.
    more, last = _batch(step_records("j1", 4, ranks=1), reopened.cursor("j1") + 1)
    reopened.ingest("j1", IngestBatch(more, last))
    _check_read_models(reopened, "j1")
