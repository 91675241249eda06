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

import collections
import logging
from typing import Any

import ray

logger = logging.getLogger(__name__)

SINK_NAMESPACE = "tail_ray"
DEFAULT_CAPACITY_RECORDS = 1_000_000


def sink_actor_name(job_id: str) -> str:
    """The actor name for a job, keyed by the Ray job's submission id."""
    return f"metrics-sink:{job_id}"


@ray.remote(num_cpus=0, max_restarts=0)
class MetricsSink:
    def __init__(self, job_id: str, capacity_records: int = DEFAULT_CAPACITY_RECORDS) -> None:
        if capacity_records < 1:
            raise ValueError(f"capacity_records must be >= 1, got {capacity_records}")
        self.job_id = job_id
        self.capacity_records = capacity_records
        self._buf: collections.deque[tuple[int, dict[str, Any]]] = collections.deque(maxlen=capacity_records)
        self._next_seq = 1
        self._dropped_in_sink = 0
        self._dropped_by_workers: dict[int, int] = {}
        self._closed = False

    def push(self, records: list[dict[str, Any]], dropped_by_worker: int = 0, rank: int = -1) -> int:
        """Append records; returns the last sequence number given. ``dropped_by_worker`` is the
        running count of records that worker could not send (its own bounded queue overflowed)."""
        for rec in records:
            if len(self._buf) == self.capacity_records:
                self._dropped_in_sink += 1
            self._buf.append((self._next_seq, rec))
            self._next_seq += 1
        if rank >= 0:
            self._dropped_by_workers[rank] = max(self._dropped_by_workers.get(rank, 0), dropped_by_worker)
        return self._next_seq - 1

    def read(self, after_seq: int = 0, limit: int = 10_000) -> dict[str, Any]:
        """Records with seq > after_seq, oldest first, at most ``limit``.

        ``next_seq`` is the cursor to pass next time; ``missed`` counts records the reader
        asked for that the ring buffer had already dropped.
        """
        limit = max(1, min(int(limit), 100_000))
        first_seq = self._buf[0][0] if self._buf else self._next_seq
        missed = max(0, first_seq - 1 - after_seq)
        out = []
        if self._buf:
            start = max(0, after_seq + 1 - first_seq)
            for i in range(start, min(len(self._buf), start + limit)):
                seq, rec = self._buf[i]
                out.append({"seq": seq, **rec})
        cursor = out[-1]["seq"] if out else max(after_seq, first_seq - 1)
        return {
            "job_id": self.job_id,
            "records": out,
            "next_seq": cursor,
            "last_seq": self._next_seq - 1,
            "missed": missed,
            "dropped_in_sink": self._dropped_in_sink,
            "dropped_by_workers": sum(self._dropped_by_workers.values()),
            "closed": self._closed,
        }

    def close(self) -> None:
        """Mark the job's stream complete (the driver calls this when training ends)."""
        self._closed = True

    def stats(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "buffered": len(self._buf),
            "capacity_records": self.capacity_records,
            "last_seq": self._next_seq - 1,
            "dropped_in_sink": self._dropped_in_sink,
            "dropped_by_workers": sum(self._dropped_by_workers.values()),
            "closed": self._closed,
        }


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
