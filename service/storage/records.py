"""Metric records (the dicts workers send) -> database rows, and the read-model deltas of a batch.

Pure Python, no database: both backends store exactly these tuples. A malformed record is
skipped and counted (it must not wedge the cursor); non-finite floats become NULL (JSON has
no NaN, and a worker that measured 0/0 still sent a record worth keeping), and so does a share
(density) outside [0, 1]; integers outside SQL BIGINT and text with a NUL byte are malformed
(beyond BIGINT, or with U+0000 on PostgreSQL, the whole batch would fail).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

LAYER_FIELDS = (
    "step", "rank", "layer", "numel", "bits", "density", "raw_bytes", "encoded_bytes", "ratio",
    "rel_error", "code",
)  # fmt: skip
STEP_FIELDS = (
    "step", "rank", "world_size", "bytes_sent", "bytes_received", "raw_bytes", "compress_s",
    "decode_s", "comm_s", "step_s", "loss", "method", "wall_time_s",
)  # fmt: skip
LAYER_COLUMNS = ("job_id", "seq", *LAYER_FIELDS)
STEP_COLUMNS = ("job_id", "seq", *STEP_FIELDS)
_BIGINT_MIN, _BIGINT_MAX = -(2**63), 2**63 - 1


def _int(value: Any) -> int:
    number = int(value)
    if not _BIGINT_MIN <= number <= _BIGINT_MAX:
        raise ValueError(f"{number} is outside a 64-bit integer")
    return number


def _real(value: Any) -> float | None:
    real = float(value)
    return real if math.isfinite(real) else None


def _text(value: Any) -> str:
    text = str(value)
    if "\x00" in text:  # PostgreSQL's text cannot hold it: the whole page would fail there
        raise ValueError("text with a NUL byte")
    return text


def _share(value: Any) -> float | None:
    """A share (density) is stored only when in [0, 1]: outside it is a worker's bug, shown as
    unknown rather than plotted."""
    real = float(value)
    return real if 0.0 <= real <= 1.0 else None


# One explicit converter per kind: the column order is LAYER_COLUMNS / STEP_COLUMNS. Written
# out rather than looped over field names, because this runs once per record at 100k records/s.
def _layer_row(job_id: str, seq: int, r: dict[str, Any]) -> tuple[Any, ...]:
    return (
        job_id, seq, _int(r["step"]), _int(r["rank"]), _text(r["layer"]), _int(r["numel"]),
        _int(r["bits"]), _share(r["density"]), _int(r["raw_bytes"]), _int(r["encoded_bytes"]),
        _real(r["ratio"]), _real(r["rel_error"]), _text(r["code"]),
    )  # fmt: skip


def _step_row(job_id: str, seq: int, r: dict[str, Any]) -> tuple[Any, ...]:
    return (
        job_id, seq, _int(r["step"]), _int(r["rank"]), _int(r["world_size"]), _int(r["bytes_sent"]),
        _int(r["bytes_received"]), _int(r["raw_bytes"]), _real(r["compress_s"]), _real(r["decode_s"]),
        _real(r["comm_s"]), _real(r["step_s"]), _real(r["loss"]), _text(r["method"]),
        _real(r["wall_time_s"]),
    )  # fmt: skip


# Positions in the row tuples above, for the delta computation.
_L_STEP, _L_LAYER, _L_RATIO = 2, 4, 10
_S_STEP, _S_RANK, _S_WORLD, _S_SENT, _S_RECV, _S_RAW = 2, 3, 4, 5, 6, 7


@dataclass
class StepNewest:
    """A (step, rank)'s newest record: the one whose bytes the running totals count."""

    seq: int
    raw_bytes: int
    bytes_sent: int
    bytes_received: int


@dataclass
class BatchRows:
    """The new rows of one batch and what they change in the read models."""

    layer_rows: list[tuple[Any, ...]] = field(default_factory=list)
    step_rows: list[tuple[Any, ...]] = field(default_factory=list)
    skipped: int = 0
    max_seq: int = 0
    ratio_sum: float = 0.0
    ratio_count: int = 0
    layer_newest: dict[str, int] = field(default_factory=dict)  # layer -> newest step
    step_newest: dict[tuple[int, int], StepNewest] = field(default_factory=dict)  # (step, rank)
    world_sizes: set[int] = field(default_factory=set)

    @property
    def stored(self) -> int:
        return len(self.layer_rows) + len(self.step_rows)


def batch_rows(job_id: str, records: list[dict[str, Any]], after_seq: int) -> BatchRows:
    """Rows for the records newer than ``after_seq`` (the job's cursor), with their deltas.

    A record at or below the cursor was handled by an earlier transaction (stored, or skipped
    as malformed): replays and overlapping pages are dropped here, before any write, so the
    running totals below count each record once.
    """
    out = BatchRows(max_seq=after_seq)
    convert_records(job_id, records, after_seq, out)
    finish_deltas(out)
    return out


def convert_records(job_id: str, records: list[dict[str, Any]], after_seq: int, out: BatchRows) -> None:
    """Append the rows of ``records`` newer than ``after_seq`` to ``out``, one record at a time
    (the reference path: the columnar one in columns.py falls back to it)."""
    layer_rows, step_rows = out.layer_rows, out.step_rows
    for rec in records:
        try:
            seq = _int(rec["seq"])
            if seq <= after_seq:
                continue
            kind = rec["type"]
            if kind == "layer":
                layer_rows.append(_layer_row(job_id, seq, rec))
            elif kind == "step":
                step_rows.append(_step_row(job_id, seq, rec))
            else:
                out.skipped += 1
        except (KeyError, TypeError, ValueError, OverflowError):
            out.skipped += 1
            continue
        if seq > out.max_seq:
            out.max_seq = seq


def finish_deltas(out: BatchRows) -> None:
    """The read-model deltas of the rows in ``out``."""
    _layer_deltas(out)
    _step_deltas(out)


def _layer_deltas(out: BatchRows) -> None:
    newest = out.layer_newest
    ratios = [row[_L_RATIO] for row in out.layer_rows if row[_L_RATIO] is not None]
    out.ratio_sum, out.ratio_count = math.fsum(ratios), len(ratios)
    for row in out.layer_rows:
        layer, step = row[_L_LAYER], row[_L_STEP]
        if step > newest.get(layer, step - 1):
            newest[layer] = step


def _step_deltas(out: BatchRows) -> None:
    newest = out.step_newest
    for row in out.step_rows:
        key = (row[_S_STEP], row[_S_RANK])
        seen = newest.get(key)
        if seen is None or row[1] > seen.seq:
            newest[key] = StepNewest(row[1], row[_S_RAW], row[_S_SENT], row[_S_RECV])
        out.world_sizes.add(row[_S_WORLD])
