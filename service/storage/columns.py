"""Columnar sink pages (``MetricsSink.read(columnar=True)``) -> database rows, checked a column at a
time.

The per-record path (records.py) costs a few microseconds of Python per record, which at
100k records/s is most of a core, all of it holding the interpreter lock that the read
routes need too. A columnar page holds one list per field; when every value of a column
already has the stored type and range (what ``LayerMetric`` / ``StepMetric`` always send),
checking it is a few passes in C (``set(map(type, col))``, ``min``, ``max``, ``sum``) and the
rows are one ``zip``. A column that fails a check sends that kind's records through the
per-record path, so what is stored, skipped and counted is exactly what records.py would do
with the same records as dicts (tests/service/test_storage_columns.py compares the two).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from itertools import pairwise, repeat
from typing import Any

from service.storage.records import (
    _BIGINT_MAX,
    _BIGINT_MIN,
    LAYER_FIELDS,
    STEP_FIELDS,
    BatchRows,
    convert_records,
    finish_deltas,
)

Column = list[Any]


def _ints(col: Column) -> Column | None:
    if not set(map(type, col)) <= {int}:
        return None  # floats, strings, bools: int() them one by one as records.py does
    return col if min(col) >= _BIGINT_MIN and max(col) <= _BIGINT_MAX else None


def _floats(col: Column) -> Column | None:
    types = set(map(type, col))
    if not types <= {float, int}:
        return None
    try:
        return col if types <= {float} else list(map(float, col))
    except OverflowError:  # an int beyond a double: the per-record path skips that record
        return None


def _reals(col: Column) -> Column | None:
    """Non-finite values become None (records.py ``_real``)."""
    vals = _floats(col)
    if vals is None or math.isfinite(sum(vals)):
        return vals
    return [v if math.isfinite(v) else None for v in vals]


def _shares(col: Column) -> Column | None:
    """Values outside [0, 1] (NaN included) become None (records.py ``_share``)."""
    vals = _floats(col)
    if vals is None or (math.isfinite(sum(vals)) and min(vals) >= 0.0 and max(vals) <= 1.0):
        return vals
    return [v if 0.0 <= v <= 1.0 else None for v in vals]


def _texts(col: Column) -> Column | None:
    if not set(map(type, col)) <= {str}:
        return None
    return col if "\x00" not in "".join(col) else None  # PostgreSQL text cannot hold NUL


Check = Callable[[Column], "Column | None"]
_I, _R, _S, _T = _ints, _reals, _shares, _texts
_CHECKS: dict[str, tuple[Check, ...]] = {
    # LAYER_FIELDS: step rank layer numel bits density raw_bytes encoded_bytes ratio rel_error code
    "layer": (_I, _I, _T, _I, _I, _S, _I, _I, _R, _R, _T),
    # STEP_FIELDS: step rank world_size bytes_sent bytes_received raw_bytes compress_s decode_s
    # comm_s step_s loss method wall_time_s
    "step": (_I, _I, _I, _I, _I, _I, _R, _R, _R, _R, _R, _T, _R),
}
_FIELDS = {"layer": LAYER_FIELDS, "step": STEP_FIELDS}


def column_rows(job_id: str, page: dict[str, Any], after_seq: int) -> BatchRows:
    """Rows for a columnar page's records newer than ``after_seq``, with their deltas."""
    out = BatchRows(max_seq=after_seq)
    for kind in ("layer", "step"):
        columns = page.get(kind)
        if columns:
            _add_kind(job_id, kind, columns, after_seq, out)
    convert_records(job_id, page.get("records") or [], after_seq, out)  # what fit no column
    finish_deltas(out)
    return out


def _add_kind(job_id: str, kind: str, columns: dict[str, Column], after_seq: int, out: BatchRows) -> None:
    fields, checks = _FIELDS[kind], _CHECKS[kind]
    try:
        seqs = columns["seq"]
        raw = [columns[name] for name in fields]
        ok = _ints(seqs) is not None and all(len(col) == len(seqs) for col in raw)
    except (KeyError, TypeError):
        out.skipped += _count(columns)
        return
    if ok and all(a < b for a, b in pairwise(seqs)):
        start = bisect.bisect_right(seqs, after_seq)  # replayed or overlapping: already handled
        new_seqs = seqs[start:]
        if not new_seqs:
            return
        checked = [check(col[start:]) for check, col in zip(checks, raw, strict=True)]
        if all(col is not None for col in checked):
            rows = out.layer_rows if kind == "layer" else out.step_rows
            rows.extend(zip(repeat(job_id), new_seqs, *checked))
            out.max_seq = max(out.max_seq, new_seqs[-1])
            return
    if not ok:
        out.skipped += _count(columns)
        return
    records = [
        dict(zip(("seq", *fields), values, strict=False), type=kind)
        for values in zip(seqs, *raw, strict=False)
    ]
    convert_records(job_id, records, after_seq, out)  # the exact per-record rules


def _count(columns: dict[str, Any]) -> int:
    seqs = columns.get("seq") if isinstance(columns, dict) else None
    return len(seqs) if isinstance(seqs, list) else 0
