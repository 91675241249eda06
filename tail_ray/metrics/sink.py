"""The metrics sink: a named, detached Ray actor per job that workers push records to.

Workers push batches fire-and-forget (``sink.push_rows.remote(rows)``, the batch as columns,
with the ObjectRef dropped), so training never waits on metrics. The sink keeps a bounded ring buffer; each
record gets a monotonically increasing sequence number, and readers page with a cursor
(``read(after_seq)``), so a reader that starts late or restarts gets everything still
buffered. When the buffer is full the oldest records are dropped and counted.

The actor is detached: it outlives the job's driver so the control plane can drain the
tail of a finished job, then ``close_sink`` removes it.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable
from typing import Any

import ray

from tail_ray.metrics.columns import FIELDS, KINDS, check_rows, columns_of, odd_with_seq

__all__ = [
    "DEFAULT_CAPACITY_RECORDS",
    "SINK_NAMESPACE",
    "MetricsSink",
    "close_sink",
    "columns_of",
    "find_sink",
    "get_or_create_sink",
    "sink_actor_name",
    "sink_job_ids",
]

logger = logging.getLogger(__name__)

SINK_NAMESPACE = "tail_ray"
DEFAULT_CAPACITY_RECORDS = 1_000_000


def sink_actor_name(job_id: str) -> str:
    """The actor name for a job, keyed by the Ray job's submission id."""
    return f"metrics-sink:{job_id}"


class _Records:
    """A batch pushed as dicts (``push``): a sink's batches before ``push_rows``, and any pusher's
    that still sends them."""

    __slots__ = ("recs",)

    def __init__(self, recs: list[Any]) -> None:
        self.recs = recs

    def __len__(self) -> int:
        return len(self.recs)

    def records(self, lo: int, hi: int, job_id: str) -> list[Any]:
        return self.recs[lo:hi]

    def add_columns(self, page: _Page, first: int, lo: int, hi: int) -> None:
        page.add(columns_of(range(first + lo, first + hi), self.recs[lo:hi]))


class _Rows:
    """A batch pushed as columns (``push_rows``), numbered kind by kind: the layer records, the
    step records, then the others. A page's slice of it is a slice of each list."""

    __slots__ = ("cols", "counts", "odd")

    def __init__(self, rows: dict[str, Any]) -> None:
        self.counts = check_rows(rows)
        self.cols = [rows.get(kind) for kind in KINDS]
        self.odd = list(rows.get("records", []))

    def __len__(self) -> int:
        return sum(self.counts)

    def _spans(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(part, start, end) of each part of [lo, hi), offsets within the part."""
        spans, base = [], 0
        for part, n in enumerate(self.counts):
            a, b = max(lo, base) - base, min(hi, base + n) - base
            if a < b:
                spans.append((part, a, b))
            base += n
        return spans

    def records(self, lo: int, hi: int, job_id: str) -> list[Any]:
        out: list[Any] = []
        for part, a, b in self._spans(lo, hi):
            if part == len(KINDS):
                out.extend(self.odd[a:b])
                continue
            kind, cols = KINDS[part], self.cols[part]
            assert cols is not None  # a part with records has its columns (check_rows)
            head = {"type": kind, "job_id": job_id}
            names = FIELDS[kind]
            out.extend(
                {**head, **dict(zip(names, values, strict=True))}
                for values in zip(*(cols[f][a:b] for f in names), strict=True)
            )
        return out

    def add_columns(self, page: _Page, first: int, lo: int, hi: int) -> None:
        for part, a, b in self._spans(lo, hi):
            start = first + sum(self.counts[:part])  # the part's first seq
            if part == len(KINDS):
                page.add_odd(range(start + a, start + b), self.odd[a:b])
                continue
            cols = self.cols[part]
            assert cols is not None
            page.add_kind(KINDS[part], range(start + a, start + b), cols, a, b)


class _Page:
    """A columnar page put together from the slices of the chunks it spans."""

    def __init__(self) -> None:
        self.kinds: dict[str, dict[str, list[Any]] | None] = {kind: None for kind in KINDS}
        self.odd: list[dict[str, Any]] = []
        self.count = 0

    def add_kind(self, kind: str, seqs: Iterable[int], cols: dict[str, list[Any]], a: int, b: int) -> None:
        """Records a..b of a kind's columns, with their seqs."""
        acc = self.kinds[kind]
        if acc is None:
            acc = self.kinds[kind] = {"seq": [], **{f: [] for f in FIELDS[kind]}}
        acc["seq"].extend(seqs)
        for f in FIELDS[kind]:
            acc[f].extend(cols[f][a:b])
        self.count += b - a

    def add_odd(self, seqs: Iterable[int], recs: list[Any]) -> None:
        self.odd.extend(odd_with_seq(q, r) for q, r in zip(seqs, recs, strict=True))
        self.count += len(recs)

    def add(self, body: dict[str, Any]) -> None:
        """A body of ``columns_of`` (a slice of a batch pushed as dicts)."""
        for kind in KINDS:
            cols = body[kind]
            if cols is not None:
                self.add_kind(kind, cols["seq"], cols, 0, len(cols["seq"]))
        self.odd.extend(body["records"])
        self.count += len(body["records"])

    def body(self) -> dict[str, Any]:
        return {**self.kinds, "records": self.odd, "count": self.count}


class _Ring:
    """The sink's bounded buffer: the pushed batches as they came (one chunk per push, not one
    entry per record), so a push costs one append and a read finds its start by bisection
    instead of walking records. Beyond ``capacity_records`` the oldest records are dropped."""

    def __init__(self, capacity_records: int) -> None:
        self.capacity_records = capacity_records
        self._chunks: list[tuple[int, _Records | _Rows]] = []  # (seq of its first record, batch)
        self._head = 0  # index of the oldest live chunk
        self._head_skip = 0  # records already dropped from that chunk
        self.size = 0
        self.next_seq = 1
        self.dropped = 0

    def append(self, chunk: _Records | _Rows) -> None:
        n = len(chunk)
        if n:
            self._chunks.append((self.next_seq, chunk))
            self.next_seq += n
            self.size += n
        while self.size > self.capacity_records:
            _first, old = self._chunks[self._head]
            drop = min(self.size - self.capacity_records, len(old) - self._head_skip)
            self._head_skip += drop
            self.size -= drop
            self.dropped += drop
            if self._head_skip == len(old):
                self._head, self._head_skip = self._head + 1, 0
        if self._head > 1024 and self._head * 2 > len(self._chunks):
            del self._chunks[: self._head]  # amortized: the list is rewritten once per half
            self._head = 0

    @property
    def first_seq(self) -> int:
        """The oldest buffered record's seq (``next_seq`` when empty)."""
        if self.size == 0:
            return self.next_seq
        return self._chunks[self._head][0] + self._head_skip

    def spans_after(self, after_seq: int, limit: int) -> list[tuple[int, _Records | _Rows, int, int]]:
        """(first seq, chunk, lo, hi) of the chunks' parts holding the first ``limit`` buffered
        records with seq > after_seq, oldest first."""
        spans: list[tuple[int, _Records | _Rows, int, int]] = []
        want = max(after_seq + 1, self.first_seq)
        if want >= self.next_seq:
            return spans
        i = bisect.bisect_right(self._chunks, want, lo=self._head, key=lambda c: c[0]) - 1
        left = limit
        while i < len(self._chunks) and left > 0:
            first, chunk = self._chunks[i]
            lo = max(0, want - first)
            hi = min(len(chunk), lo + left)
            spans.append((first, chunk, lo, hi))
            left -= hi - lo
            i += 1
        return spans


@ray.remote(num_cpus=0, max_restarts=0)
class MetricsSink:
    def __init__(self, job_id: str, capacity_records: int = DEFAULT_CAPACITY_RECORDS) -> None:
        if capacity_records < 1:
            raise ValueError(f"capacity_records must be >= 1, got {capacity_records}")
        self.job_id = job_id
        self.capacity_records = capacity_records
        self._ring = _Ring(capacity_records)
        self._dropped_by_workers: dict[int, int] = {}
        self._closed = False

    def push(self, records: list[dict[str, Any]], dropped_by_worker: int = 0, rank: int = -1) -> int:
        """Append records as dicts; returns the last sequence number given. ``dropped_by_worker``
        is the running count of records that worker could not send (its own bounded queue
        overflowed)."""
        self._ring.append(_Records(list(records)))
        return self._pushed(dropped_by_worker, rank)

    def push_rows(self, rows: dict[str, Any], dropped_by_worker: int = 0, rank: int = -1) -> int:
        """Append a batch in columnar form (``tail_ray.metrics.columns.rows_of``): what a
        ``MetricsClient`` sends. Numbered kind by kind (layers, steps, others); a malformed batch
        raises ValueError and stores nothing."""
        self._ring.append(_Rows(rows))
        return self._pushed(dropped_by_worker, rank)

    def _pushed(self, dropped_by_worker: int, rank: int) -> int:
        if rank >= 0:
            self._dropped_by_workers[rank] = max(self._dropped_by_workers.get(rank, 0), dropped_by_worker)
        return self._ring.next_seq - 1

    # A detached sink outlives upgrades of the service that reads it. A process that cannot
    # load this class as it was when the sink started (another tail-ray version) gets a handle
    # whose methods take keyword arguments only ("too many positional arguments" otherwise):
    # callers pass keywords, and a new parameter must have a default.
    def read(self, after_seq: int = 0, limit: int = 10_000, columnar: bool = False) -> dict[str, Any]:
        """Records with seq > after_seq, oldest first, at most ``limit``, each a dict with its
        ``seq``.

        ``next_seq`` is the cursor to pass next time; ``missed`` counts records the reader
        asked for that the ring buffer had already dropped.

        ``columnar=True``: the same page columnar, what the service ingests. ``layer`` and
        ``step`` map each field (``seq`` first) to a list with one value per record of that
        kind; ``records`` holds, as dicts, only the records that fit neither (another type, a
        missing field), for the reader to judge; ``count`` is the page's size. A page of lists
        of numbers costs the reader a fraction of what as many dicts cost to deserialize and
        convert.
        """
        spans = self._ring.spans_after(after_seq, _clamp(limit))
        if columnar:
            page = _Page()
            for first, chunk, lo, hi in spans:
                chunk.add_columns(page, first, lo, hi)
            body = page.body()
        else:
            records: list[dict[str, Any]] = []
            for first, chunk, lo, hi in spans:
                recs = chunk.records(lo, hi, self.job_id)
                records.extend({"seq": first + lo + i, **r} for i, r in enumerate(recs))
            body = {"records": records}
        first_seq = self._ring.first_seq
        return {
            "job_id": self.job_id,
            **body,
            "next_seq": spans[-1][0] + spans[-1][3] - 1 if spans else max(after_seq, first_seq - 1),
            "last_seq": self._ring.next_seq - 1,
            "missed": max(0, first_seq - 1 - after_seq),
            "dropped_in_sink": self._ring.dropped,
            "dropped_by_workers": sum(self._dropped_by_workers.values()),
            "closed": self._closed,
        }

    def close(self) -> None:
        """Mark the job's stream complete (the driver calls this when training ends)."""
        self._closed = True

    def stats(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "buffered": self._ring.size,
            "capacity_records": self.capacity_records,
            "last_seq": self._ring.next_seq - 1,
            "dropped_in_sink": self._ring.dropped,
            "dropped_by_workers": sum(self._dropped_by_workers.values()),
            "closed": self._closed,
        }


def _clamp(limit: int) -> int:
    return max(1, min(int(limit), 100_000))


def get_or_create_sink(
    job_id: str, capacity_records: int = DEFAULT_CAPACITY_RECORDS
) -> ray.actor.ActorHandle:
    """The job's sink, created detached on first use (idempotent across restarts of the driver)."""
    # MetricsSink is an ActorClass at run time (@ray.remote); mypy sees the plain class.
    return MetricsSink.options(  # type: ignore[attr-defined]
        name=sink_actor_name(job_id),
        namespace=SINK_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
    ).remote(job_id, capacity_records)


def find_sink(job_id: str) -> ray.actor.ActorHandle | None:
    """The job's sink if it exists, else None."""
    try:
        return ray.get_actor(sink_actor_name(job_id), namespace=SINK_NAMESPACE)
    except ValueError:
        return None


def sink_job_ids() -> set[str]:
    """The job ids of every sink on the connected cluster (a sink exists from the first
    ``get_or_create_sink`` of a job until ``close_sink``)."""
    prefix = sink_actor_name("")
    return {
        str(actor["name"]).removeprefix(prefix)
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor.get("namespace") == SINK_NAMESPACE and str(actor.get("name", "")).startswith(prefix)
    }


def close_sink(job_id: str) -> None:
    """Remove a drained sink."""
    handle = find_sink(job_id)
    if handle is not None:
        ray.kill(handle)
