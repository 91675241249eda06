"""The sink's columnar pushes (``push_rows``) against its dict pushes, without Ray: the actor's
own class, called in this process.

The reference is the dict path: whatever mix of ``push`` and ``push_rows`` filled the ring, a
columnar page must equal ``columns_of`` over the same page read as dicts, and the dicts must be
what was pushed (layer records, then step records, then the others, per columnar push)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tail_ray.metrics.columns import FIELDS, check_rows, columns_of, rows_of
from tail_ray.metrics.records import LayerMetric, StepMetric
from tail_ray.metrics.sink import MetricsSink

JOB = "rows-job"
Sink = MetricsSink.__ray_actor_class__  # the class behind the actor, as the actor runs it


def layer(step: int, rank: int, i: int) -> dict[str, Any]:
    return LayerMetric(
        job_id=JOB, step=step, rank=rank, layer=f"l{i}.weight", numel=100 * (i + 1), bits=2 + i % 6,
        density=0.5, raw_bytes=400 * (i + 1), encoded_bytes=40 * (i + 1), ratio=10.0, rel_error=0.01 * i,
        code="tail",
    ).to_dict()  # fmt: skip


def step_rec(step: int, rank: int) -> dict[str, Any]:
    return StepMetric(
        job_id=JOB, step=step, rank=rank, world_size=2, bytes_sent=10, bytes_received=10, raw_bytes=100,
        compress_s=0.001, decode_s=0.001, comm_s=0.002, step_s=0.01, loss=float(step), method="tail",
        wall_time_s=1.5e9 + step,
    ).to_dict()  # fmt: skip


def batch(rng: random.Random, step: int) -> list[Any]:
    """One rank's step as a worker sends it, now and then with records that fit no kind."""
    out: list[Any] = [layer(step, 0, i) for i in range(rng.randint(0, 6))]
    if rng.random() < 0.3:
        out.insert(rng.randint(0, len(out)), {"type": "event", "step": step})
    if rng.random() < 0.2:
        out.insert(rng.randint(0, len(out)), {"type": "layer", "step": step})  # a field missing
    if rng.random() < 0.8:
        out.append(step_rec(step, 0))
    return out


def _fits(rec: Any, kind: str) -> bool:
    return isinstance(rec, dict) and rec.get("type") == kind and set(FIELDS[kind]) <= set(rec)


def in_rows_order(recs: list[Any]) -> list[Any]:
    """The order a columnar push numbers its records in: layers, steps, then the others."""
    odd = [r for r in recs if not any(_fits(r, kind) for kind in FIELDS)]
    return [r for r in recs if _fits(r, "layer")] + [r for r in recs if _fits(r, "step")] + odd


@pytest.mark.parametrize("seed", range(6))
def test_columnar_pages_equal_the_dict_path_for_any_mix_cursor_and_capacity(seed: int) -> None:
    rng = random.Random(seed)
    sink = Sink(JOB, capacity_records=rng.choice([7, 40, 1000]))
    expected: list[Any] = []  # every record in seq order, as a dict read returns it
    for step in range(30):
        recs = batch(rng, step)
        if rng.random() < 0.5:
            last = sink.push_rows(rows=rows_of(recs), dropped_by_worker=0, rank=0)
            expected.extend(in_rows_order(recs))
        else:
            last = sink.push(records=recs, rank=0)
            expected.extend(recs)
        assert last == len(expected)
    first_kept = len(expected) - sink._ring.size + 1
    for _ in range(40):
        after, limit = rng.randint(0, len(expected) + 2), rng.randint(1, 60)
        as_dicts = sink.read(after_seq=after, limit=limit)
        as_columns = sink.read(after_seq=after, limit=limit, columnar=True)
        recs = as_dicts["records"]
        want_seqs = list(range(max(after + 1, first_kept), len(expected) + 1))[:limit]
        assert [r["seq"] for r in recs] == want_seqs
        bare = [{k: v for k, v in r.items() if k != "seq"} for r in recs]
        assert bare == [expected[q - 1] for q in want_seqs]
        reference = columns_of([r["seq"] for r in recs], bare)
        assert {k: as_columns[k] for k in reference} == reference
        for key in ("next_seq", "last_seq", "missed", "dropped_in_sink"):
            assert as_columns[key] == as_dicts[key], key


def test_a_columnar_push_numbers_layers_then_steps_then_the_rest() -> None:
    sink = Sink(JOB)
    odd = {"type": "event", "step": 0}
    recs = [step_rec(0, 0), odd, layer(0, 0, 0), layer(0, 0, 1)]
    assert sink.push_rows(rows=rows_of(recs)) == 4
    page = sink.read(after_seq=0, limit=10)["records"]
    assert [(r["seq"], r["type"]) for r in page] == [(1, "layer"), (2, "layer"), (3, "step"), (4, "event")]
    assert page[0] == {"seq": 1, **recs[2]}  # job_id and type rebuilt: the very dict pushed
    # A cursor inside the batch, and a limit that ends inside it.
    cols = sink.read(after_seq=1, limit=2, columnar=True)
    assert cols["layer"]["seq"] == [2] and cols["layer"]["layer"] == ["l1.weight"]
    assert cols["step"]["seq"] == [3] and cols["records"] == [] and cols["count"] == 2
    assert cols["next_seq"] == 3


@pytest.mark.parametrize(
    ("rows", "reason"),
    [
        ([1, 2], "must be a dict"),
        ({"layer": {"step": [1]}}, "exactly the fields"),
        ({"step": {f: [1] for f in FIELDS["step"]} | {"loss": [1.0, 2.0]}}, "one length"),
        ({"step": {f: 1 for f in FIELDS["step"]}}, "one length"),
        ({"records": {"a": 1}}, "'records' must be a list"),
    ],
)
def test_a_malformed_columnar_push_is_refused_and_stores_nothing(rows: Any, reason: str) -> None:
    sink = Sink(JOB)
    sink.push_rows(rows=rows_of([step_rec(0, 0)]))
    with pytest.raises(ValueError, match=reason):
        sink.push_rows(rows=rows, rank=3, dropped_by_worker=9)
    assert sink.stats()["last_seq"] == 1
    assert sink.read(after_seq=0)["records"][0]["type"] == "step"


def test_check_rows_counts_each_part() -> None:
    recs = [layer(0, 0, 0), layer(0, 0, 1), step_rec(0, 0), {"type": "event"}, "not a dict"]
    assert check_rows(rows_of(recs)) == (2, 1, 2)
    assert check_rows({}) == (0, 0, 0)
