"""The metrics sink: a named, detached Ray actor per job that workers push records to.

Workers push batches fire-and-forget (``sink.push.remote(batch)`` with the ObjectRef
dropped), so training never waits on metrics. The sink keeps a bounded ring buffer; each
record gets a monotonically increasing sequence number, and readers page with a cursor
(``read(after_seq)``), so a reader that starts late or restarts gets everything still
buffered. When the buffer is full the oldest records are dropped and counted.

The actor is detached: it outlives the job's driver so the control plane can drain the
tail of a finished job, then ``close_sink`` removes it.
"""

from __future__ import annotations

import bisect
import logging
import operator
from typing import Any

import ray

from tail_ray.metrics.records import LAYER_FIELDS, STEP_FIELDS

logger = logging.getLogger(__name__)

SINK_NAMESPACE = "tail_ray"
DEFAULT_CAPACITY_RECORDS = 1_000_000


def sink_actor_name(job_id: str) -> str:
    """The actor name for a job, keyed by the Ray job's submission id."""
    return f"metrics-sink:{job_id}"


class _Ring:
    """The sink's bounded buffer: the pushed batches as they came (one chunk per push, not one
    entry per record), so a push costs one append and a read finds its start by bisection
    instead of walking records. Beyond ``capacity_records`` the oldest records are dropped."""

    def __init__(self, capacity_records: int) -> None:
        self.capacity_records = capacity_records
        self._chunks: list[tuple[int, list[dict[str, Any]]]] = []  # (seq of its first record, records)
        self._head = 0  # index of the oldest live chunk
        self._head_skip = 0  # records already dropped from that chunk
        self.size = 0
        self.next_seq = 1
        self.dropped = 0

    def append(self, records: list[dict[str, Any]]) -> None:
        if records:
            self._chunks.append((self.next_seq, records))
            self.next_seq += len(records)
            self.size += len(records)
        while self.size > self.capacity_records:
            _first, recs = self._chunks[self._head]
            drop = min(self.size - self.capacity_records, len(recs) - self._head_skip)
            self._head_skip += drop
            self.size -= drop
            self.dropped += drop
            if self._head_skip == len(recs):
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

    def records_after(self, after_seq: int, limit: int) -> tuple[list[int], list[dict[str, Any]]]:
        """Up to ``limit`` buffered records with seq > after_seq, oldest first, with their seqs."""
        seqs: list[int] = []
        out: list[dict[str, Any]] = []
        want = max(after_seq + 1, self.first_seq)
        if want >= self.next_seq:
            return seqs, out
        i = bisect.bisect_right(self._chunks, want, lo=self._head, key=lambda c: c[0]) - 1
        while i < len(self._chunks) and len(out) < limit:
            first, recs = self._chunks[i]
            lo = max(0, want - first)
            part = recs[lo : lo + limit - len(out)]
            seqs.extend(range(first + lo, first + lo + len(part)))
            out.extend(part)
            i += 1
        return seqs, out


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
        """Append records; returns the last sequence number given. ``dropped_by_worker`` is the
        running count of records that worker could not send (its own bounded queue overflowed)."""
        self._ring.append(list(records))
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
        seqs, recs = self._ring.records_after(after_seq, _clamp(limit))
        if columnar:
            body = columns_of(seqs, recs)
        else:
            body = {"records": [{"seq": q, **r} for q, r in zip(seqs, recs, strict=True)]}
        first_seq = self._ring.first_seq
        return {
            "job_id": self.job_id,
            **body,
            "next_seq": seqs[-1] if seqs else max(after_seq, first_seq - 1),
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


def columns_of(seqs: list[int], recs: list[Any]) -> dict[str, Any]:
    """The body of a columnar page (``MetricsSink.read(columnar=True)``) for these records."""
    kinds: dict[str, tuple[list[int], list[tuple[Any, ...]]]] = {"layer": ([], []), "step": ([], [])}
    odd: list[dict[str, Any]] = []
    for seq, rec in zip(seqs, recs, strict=False):
        try:
            kind = kinds[rec["type"]]
            values = _GETTERS[rec["type"]](rec)
        except (KeyError, TypeError):  # not a dict, another type, or a field missing
            odd.append({"seq": seq, **rec} if isinstance(rec, dict) else {"seq": seq, "record": rec})
            continue
        kind[0].append(seq)
        kind[1].append(values)
    columns = {
        name: {
            "seq": kseqs,
            **dict(zip(_FIELDS[name], map(list, zip(*rows, strict=False)), strict=False)),
        }
        if kseqs
        else None
        for name, (kseqs, rows) in kinds.items()
    }
    return {**columns, "records": odd, "count": len(seqs)}


def _clamp(limit: int) -> int:
    return max(1, min(int(limit), 100_000))


_FIELDS = {"layer": LAYER_FIELDS, "step": STEP_FIELDS}
_GETTERS = {kind: operator.itemgetter(*names) for kind, names in _FIELDS.items()}


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
