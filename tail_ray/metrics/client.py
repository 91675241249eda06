"""The worker side of the metrics path: batch records, push them fire-and-forget to the sink.

Training must never wait on metrics. So:

- ``add`` only appends to a bounded local queue (a deque); when it is full the OLDEST record
  is dropped and counted (the newest records are what a live view wants).
- ``flush`` sends what is queued as one batch with ``sink.push_rows.remote(...)`` (the batch as
  columns, ``tail_ray.metrics.columns.rows_of``: a sink unpickles a dozen lists where it
  unpickled thousands of dicts) and keeps the ObjectRef only to know whether the sink is
  keeping up. A sink of a release without ``push_rows`` (its handle does not list the method)
  gets ``push(records)``, as before. At most ``max_inflight_batches``
  pushes may be unacknowledged; beyond that ``flush`` leaves the records queued (checked with
  a zero-timeout ``ray.wait``), so a slow or dead sink costs bounded memory, never time.
- The running drop count travels with every push, so the sink (and the service reading it)
  can show how much a worker had to drop.
- ``close(timeout_s)`` is the one call allowed to wait, and only up to ``timeout_s``: at the
  end of training it gives the last batch a chance to land.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import ray

from tail_ray.metrics.columns import rows_of

logger = logging.getLogger(__name__)

DEFAULT_QUEUE_RECORDS = 20_000
DEFAULT_MAX_BATCH_RECORDS = 5_000
DEFAULT_MAX_INFLIGHT_BATCHES = 4


class MetricsClient:
    """Queue metric records (plain dicts) and push them in batches to a sink actor.

    ``sink`` is an actor handle with ``push_rows(rows, dropped_by_worker, rank)`` (a
    ``MetricsSink``) or, from older releases, only ``push(records, ...)``; or None to count
    everything as dropped (e.g. the sink could not be found).
    """

    def __init__(
        self,
        sink: ray.actor.ActorHandle | None,
        *,
        rank: int,
        queue_records: int = DEFAULT_QUEUE_RECORDS,
        max_batch_records: int = DEFAULT_MAX_BATCH_RECORDS,
        max_inflight_batches: int = DEFAULT_MAX_INFLIGHT_BATCHES,
    ) -> None:
        if queue_records < 1 or max_batch_records < 1 or max_inflight_batches < 1:
            raise ValueError(
                "queue_records, max_batch_records and max_inflight_batches must all be >= 1, got "
                f"{queue_records}, {max_batch_records}, {max_inflight_batches}"
            )
        self._sink = sink
        self.rank = rank
        self.queue_records = queue_records
        self.max_batch_records = max_batch_records
        self.max_inflight_batches = max_inflight_batches
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._inflight: dict[ray.ObjectRef, int] = {}  # push -> records in it
        self._columnar = sink is not None and _has_method(sink, "push_rows")
        self.dropped_records = 0
        self.sent_records = 0  # handed to the sink (not necessarily acknowledged yet)
        self.failed_pushes = 0

    @property
    def queued_records(self) -> int:
        return len(self._queue)

    @property
    def inflight_batches(self) -> int:
        return len(self._inflight)

    def add(self, record: dict[str, Any]) -> None:
        if len(self._queue) >= self.queue_records:
            self._queue.popleft()
            self.dropped_records += 1
        self._queue.append(record)

    def extend(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            self.add(record)

    def flush(self) -> int:
        """Push queued records without waiting; returns how many were handed to the sink."""
        if self._sink is None:
            self.dropped_records += len(self._queue)
            self._queue.clear()
            return 0
        self._reap_acknowledged()
        handed = 0
        while self._queue and len(self._inflight) < self.max_inflight_batches:
            n = min(len(self._queue), self.max_batch_records)
            batch = [self._queue.popleft() for _ in range(n)]
            try:
                ref = self._push(batch)
            except Exception as exc:  # a dead actor handle can raise here; never fail training
                self.failed_pushes += 1
                self.dropped_records += n
                logger.warning("metrics push failed (%d records dropped): %s", n, exc)
                continue
            self._inflight[ref] = n
            self.sent_records += n
            handed += n
        return handed

    def _push(self, batch: list[dict[str, Any]]) -> ray.ObjectRef:
        # Keywords: a worker that cannot load the sink's class as it was when the sink started
        # (another tail-ray version) has a handle that takes keywords only.
        if self._columnar:
            rows = rows_of(batch)
            ref: ray.ObjectRef = self._sink.push_rows.remote(  # type: ignore[union-attr]
                rows=rows, dropped_by_worker=self.dropped_records, rank=self.rank
            )
        else:
            ref = self._sink.push.remote(  # type: ignore[union-attr]
                records=batch, dropped_by_worker=self.dropped_records, rank=self.rank
            )
        return ref

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush everything, waiting at most ``timeout_s`` in total for the sink to take it."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.flush()
            remaining_s = deadline - time.monotonic()
            if not self._inflight or remaining_s <= 0:
                break
            refs = list(self._inflight)
            ray.wait(refs, num_returns=len(refs), timeout=min(remaining_s, 0.5))
            self._reap_acknowledged()
            if not self._queue and not self._inflight:
                break
        if self._queue:
            logger.warning("metrics client closed with %d records unsent", len(self._queue))
            self.dropped_records += len(self._queue)
            self._queue.clear()

    def _reap_acknowledged(self) -> None:
        if not self._inflight:
            return
        refs = list(self._inflight)
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in done:
            n = self._inflight.pop(ref)
            try:
                ray.get(ref, timeout=0)
            except Exception as exc:  # the sink died or rejected the batch: count, carry on
                self.failed_pushes += 1
                self.sent_records -= n
                self.dropped_records += n
                logger.warning("metrics sink push of %d records failed: %s", n, exc)


def _has_method(handle: Any, name: str) -> bool:
    """Whether an actor handle offers ``name``: a Python actor's handle lists its class's methods
    (as the actor was made, whatever this process's version of the class) and raises
    AttributeError for any other."""
    try:
        getattr(handle, name)
    except AttributeError:
        return False
    return True
