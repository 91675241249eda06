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
