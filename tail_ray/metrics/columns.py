"""Metric records in columnar form: one list per field instead of one dict per record.

Two places use it:
- a worker's push (``rows_of``, ``MetricsSink.push_rows``): the batch a ``MetricsClient`` sends,
  so the sink unpickles a dozen lists instead of thousands of dicts (stop 25's profile put 46 %
  of a loaded sink's time in unpickling pushed dicts);
- a sink's page (``columns_of``, ``MetricsSink.read(columnar=True)``): what the service ingests.

Both leave out ``job_id``: a sink belongs to one job, and the page names it once. A record that
fits neither kind (another ``type``, a field missing, not a dict) travels as it is, in
``records``, for the reader to judge.
"""

from __future__ import annotations

import operator
from typing import Any

from tail_ray.metrics.records import LAYER_FIELDS, STEP_FIELDS

KINDS: tuple[str, ...] = ("layer", "step")
FIELDS: dict[str, tuple[str, ...]] = {"layer": LAYER_FIELDS, "step": STEP_FIELDS}
_GETTERS = {kind: operator.itemgetter(*names) for kind, names in FIELDS.items()}


_Split = tuple[dict[str, list[tuple[Any, ...]]], dict[str, list[int]], list[int], list[Any]]


def _split(recs: list[Any]) -> _Split:
    """Each kind's rows (field tuples, in ``FIELDS`` order) and their positions in ``recs``; the
    positions and records of the ones that fit no kind."""
    rows: dict[str, list[tuple[Any, ...]]] = {kind: [] for kind in KINDS}
    positions: dict[str, list[int]] = {kind: [] for kind in KINDS}
    odd_at: list[int] = []
    odd: list[Any] = []
    for i, rec in enumerate(recs):
        try:
            kind = rec["type"]
            values = _GETTERS[kind](rec)
        except (KeyError, TypeError):  # not a dict, another type, or a field missing
            odd_at.append(i)
            odd.append(rec)
            continue
        rows[kind].append(values)
        positions[kind].append(i)
    return rows, positions, odd_at, odd


def _transpose(kind: str, rows: list[tuple[Any, ...]]) -> dict[str, list[Any]]:
    return dict(zip(FIELDS[kind], map(list, zip(*rows, strict=True)), strict=True))


def odd_with_seq(seq: int, rec: Any) -> dict[str, Any]:
    """A record that fits no kind, as a page carries it: its fields and its ``seq`` (a value
    that is not a dict goes under ``record``)."""
    return {"seq": seq, **rec} if isinstance(rec, dict) else {"seq": seq, "record": rec}


def columns_of(seqs: list[int] | range, recs: list[Any]) -> dict[str, Any]:
    """The body of a columnar page (``MetricsSink.read(columnar=True)``) for these records:
    ``layer`` / ``step`` map ``seq`` and each field to a list (None when the page has none of
    that kind), ``records`` holds the others as dicts with their ``seq``, ``count`` the total."""
    rows, positions, odd_at, odd = _split(recs)
    out: dict[str, Any] = {}
    for kind in KINDS:
        if rows[kind]:
            out[kind] = {"seq": [seqs[i] for i in positions[kind]], **_transpose(kind, rows[kind])}
        else:
            out[kind] = None
    out["records"] = [odd_with_seq(seqs[i], rec) for i, rec in zip(odd_at, odd, strict=True)]
    out["count"] = len(recs)
    return out


def rows_of(recs: list[Any]) -> dict[str, Any]:
    """A worker's batch as ``MetricsSink.push_rows`` takes it: ``layer`` / ``step`` map each
    field to a list (None for a kind the batch lacks), ``records`` the ones that fit no kind.

    The sink numbers a pushed batch kind by kind: its layer records, then its step records,
    then the others, each kind in the order given. A step's layer records stay ahead of its
    step record, which is all a reader may rely on within one push."""
    rows: dict[str, list[tuple[Any, ...]]] = {kind: [] for kind in KINDS}
    odd: list[Any] = []
    for rec in recs:  # the loop of _split without positions: this runs in the training process
        try:
            kind = rec["type"]
            rows[kind].append(_GETTERS[kind](rec))
        except (KeyError, TypeError):
            odd.append(rec)
    out: dict[str, Any] = {kind: _transpose(kind, rows[kind]) if rows[kind] else None for kind in KINDS}
    out["records"] = odd
    return out


def check_rows(rows: Any) -> tuple[int, ...]:
    """How many records each part of a pushed batch holds (layer, step, others), or ValueError
    naming what is wrong: a sink must not store a batch that it cannot page through."""
    if not isinstance(rows, dict):
        raise ValueError(f"push_rows: rows must be a dict, got {type(rows).__name__}")
    counts = []
    for kind in KINDS:
        cols = rows.get(kind)
        if cols is None:
            counts.append(0)
            continue
        if not isinstance(cols, dict) or set(cols) != set(FIELDS[kind]):
            raise ValueError(f"push_rows: {kind!r} must map exactly the fields {list(FIELDS[kind])} to lists")
        lengths = {len(col) if isinstance(col, list) else -1 for col in cols.values()}
        if len(lengths) != 1 or -1 in lengths:
            raise ValueError(f"push_rows: {kind!r} columns must be lists of one length, got {lengths}")
        counts.append(lengths.pop())
    odd = rows.get("records", [])
    if not isinstance(odd, list):
        raise ValueError(f"push_rows: 'records' must be a list, got {type(odd).__name__}")
    counts.append(len(odd))
    return tuple(counts)
