"""The columnar ingest path (sink ``read(columnar=True)`` -> service/storage/columns.py) stores, skips
and counts exactly what the per-record path (records.py ``batch_rows``) does with the same
records as dicts: for well-formed pages (the fast path) and for every kind of bad value a
worker could send (the fallback). No Ray: ``columnar`` is the function the sink actor runs."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.storage.columns import column_rows
from service.storage.records import BatchRows, batch_rows
from tail_ray.metrics.records import LAYER_FIELDS, STEP_FIELDS
from tail_ray.metrics.sink import MetricsSink, columns_of


def layer_record(step: int, rank: int, i: int) -> dict:
    raw = 4000 * (1 + i)
    return {
        "type": "layer", "job_id": "j", "step": step, "rank": rank, "layer": f"l{i}.weight",
        "numel": raw // 4, "bits": 2 + i % 6, "density": 0.25 * (i % 5), "raw_bytes": raw,
        "encoded_bytes": raw // 7, "ratio": 7.0, "rel_error": 0.01 * i, "code": "rans",
    }  # fmt: skip


def step_record(step: int, rank: int) -> dict:
    return {
        "type": "step", "job_id": "j", "step": step, "rank": rank, "world_size": 2, "bytes_sent": 100,
        "bytes_received": 200, "raw_bytes": 800, "compress_s": 0.001, "decode_s": 0.002,
        "comm_s": 0.003, "step_s": 0.01, "loss": 1.5, "method": "tail", "wall_time_s": 1.7e9 + step,
    }  # fmt: skip


def training_records(steps: int, ranks: int, layers: int) -> list[dict]:
    out = []
    for step in range(steps):
        for rank in range(ranks):
            out += [layer_record(step, rank, i) for i in range(layers)] + [step_record(step, rank)]
    return out


def same(a: BatchRows, b: BatchRows) -> None:
    def rows(r: list) -> list:  # NaN-free by construction (non-finite values are stored as None)
        return sorted(r, key=lambda row: row[1])

    assert rows(a.layer_rows) == rows(b.layer_rows)
    assert rows(a.step_rows) == rows(b.step_rows)
    assert (a.skipped, a.max_seq, a.ratio_count) == (b.skipped, b.max_seq, b.ratio_count)
    assert a.ratio_sum == b.ratio_sum  # fsum: exactly rounded whatever the order
    assert a.layer_newest == b.layer_newest
    assert a.step_newest == b.step_newest
    assert a.world_sizes == b.world_sizes


def both_paths(records: list, after_seq: int) -> tuple[BatchRows, BatchRows]:
    seqs = list(range(1, len(records) + 1))
    reference = batch_rows("j", [{"seq": q, **r} for q, r in zip(seqs, records, strict=True)], after_seq)
    return column_rows("j", columns_of(seqs, records), after_seq), reference


@pytest.mark.parametrize("after_seq", [0, 1, 150, 401, 10_000])
def test_well_formed_pages_take_the_fast_path_and_match(after_seq: int) -> None:
    records = training_records(steps=4, ranks=2, layers=49)  # 400 records
    page = columns_of(list(range(1, 401)), records)
    assert page["records"] == [] and page["count"] == 400  # all columnar: nothing odd
    assert len(page["layer"]["seq"]) == 392 and len(page["step"]["seq"]) == 8
    fast, reference = both_paths(records, after_seq)
    same(fast, reference)
    assert fast.stored == max(0, 400 - after_seq)


BAD_VALUES = st.sampled_from([
    float("nan"), float("inf"), -float("inf"), 1e308, -1.0, 1.5, 2.0, True, "3", "x", "a\x00b", None,
    2**63, -(2**63) - 1, 10**400, [], {}, 0,
])  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    corruptions=st.lists(
        st.tuples(st.integers(0, 59), st.sampled_from(LAYER_FIELDS + STEP_FIELDS + ("type",)), BAD_VALUES),
        max_size=6,
    ),
    drops=st.lists(st.tuples(st.integers(0, 59), st.sampled_from(LAYER_FIELDS + STEP_FIELDS)), max_size=3),
    after_seq=st.integers(0, 70),
)
def test_bad_values_are_stored_skipped_and_counted_as_the_record_path_does(
    corruptions: list, drops: list, after_seq: int
) -> None:
    records = training_records(steps=3, ranks=2, layers=9)  # 60 records
    for i, name, value in corruptions:
        if name in records[i] or name == "type":
            records[i][name] = value
    for i, name in drops:
        records[i].pop(name, None)
    fast, reference = both_paths(records, after_seq)
    same(fast, reference)


def test_non_finite_and_out_of_range_values_become_null_on_the_fast_path() -> None:
    records = training_records(steps=1, ranks=1, layers=4)
    records[0]["ratio"] = float("inf")
    records[1]["density"] = 1.5
    records[2]["rel_error"] = float("nan")
    fast, reference = both_paths(records, 0)
    same(fast, reference)
    by_seq = {row[1]: row for row in fast.layer_rows}
    ratio, density, rel_error = (2 + LAYER_FIELDS.index(f) for f in ("ratio", "density", "rel_error"))
    assert by_seq[1][ratio] is None and by_seq[2][density] is None and by_seq[3][rel_error] is None
    assert fast.skipped == 0 and not math.isnan(fast.ratio_sum)


def test_ring_pages_by_cursor_across_pushes_and_drops() -> None:
    sink = MetricsSink.__ray_actor_class__("j", capacity_records=50)  # the actor's class, in process
    ring = sink._ring
    pushed = []
    rng = random.Random(0)
    for _ in range(30):
        batch = [{"n": len(pushed) + k} for k in range(rng.randint(0, 7))]
        pushed += batch
        sink.push(records=batch)
    assert ring.size == 50 and ring.dropped == len(pushed) - 50
    assert ring.first_seq == len(pushed) - 49 and ring.next_seq == len(pushed) + 1
    for after in (0, ring.first_seq - 1, ring.first_seq + 3, len(pushed) - 1, len(pushed)):
        recs = sink.read(after_seq=after, limit=11)["records"]
        want = list(range(max(after + 1, ring.first_seq), len(pushed) + 1))[:11]
        assert [r["seq"] for r in recs] == want
        assert [r["n"] for r in recs] == [q - 1 for q in want]
