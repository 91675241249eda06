"""Ingest writes on threads of their own, so that reading sink pages and storing them overlap.

The ingester's drain used to read a round of pages (one per job), store the round in one
transaction, and only then take the next round's pages: while the database committed, the
ingest process waited, and while the process deserialized pages, the database idled.
Here the drain hands each page to ``submit`` and goes on reading; writer threads store what
is queued, one transaction per batch of pages (at most one page per job in a transaction, so
its cursor check is the cheap one), and ``wait`` returns when all of it is stored.

- **Order per job.** A job always goes to the same writer (assigned on its first page), and
  a writer stores its queue in order: a job's pages are stored in the order they were read.
- **Several writers** (``writers`` > 1; PostgreSQL's default is 2): jobs are spread over
  them, each with its own connection and transactions, so the server works on two commits
  while this process prepares more. SQLite has one writer lock, so it gets one writer.
- **A failed write never lets a later page skip records.** A page is stored only after every
  earlier page of its job: after a failure the writers drop everything still queued (each
  job's cursor stays at its last stored page, and the next drain pass reads from there),
  ``submit`` raises the error, and ``wait`` raises it once everything queued has settled.
- **Bounded memory.** Each writer holds at most ``max_pending_pages`` queued and as many taken;
  ``submit`` blocks beyond that, so a slow database slows the reads instead of filling memory.
- **Closing** stores what was submitted, then stops the threads; a ``submit`` after it raises.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from service.storage import IngestBatch, Storage

logger = logging.getLogger(__name__)

MAX_PENDING_PAGES = 32  # per writer: 32 pages of 5,000 records is ~10-20 MB of columns

OnStored = Callable[[str, int], None]  # (job id, records stored), called on the writer thread


@dataclass(frozen=True)
class _Page:
    job_id: str
    batch: IngestBatch


_STOP = _Page("", IngestBatch([], 0))  # tells a writer thread to exit


class IngestPipeline:
    def __init__(
        self,
        storage: Storage,
        writers: int,
        on_stored: OnStored | None = None,
        max_pending_pages: int = MAX_PENDING_PAGES,
    ) -> None:
        if writers < 1:
            raise ValueError(f"writers must be >= 1, got {writers}")
        self.storage = storage
        self.on_stored = on_stored
        self._lock = threading.Lock()
        # Orders submit() against close(): no page is queued behind a writer's stop. A writer
        # never takes it, so a submit blocked on a full queue cannot deadlock with one.
        self._submit_lock = threading.Lock()
        self._closed = False
        self._error: BaseException | None = None  # the first failed write since the last wait()
        self._writer_of: dict[str, int] = {}  # job id -> writer index, kept for the job's life
        self._queues: list[queue.Queue[_Page]] = [queue.Queue(max_pending_pages) for _ in range(writers)]
        self._max_held = max_pending_pages
        self._threads = [
            threading.Thread(target=self._run, args=(q,), name=f"ingest-writer-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        for t in self._threads:
            t.start()

    @property
    def writers(self) -> int:
        return len(self._queues)

    def submit(self, job_id: str, batch: IngestBatch) -> None:
        """Queue one page of a job (after the job's earlier pages); raises a failed write's error
        instead of queueing behind it."""
        self._raise_failure()
        with self._lock:
            index = self._writer_of.get(job_id)
            if index is None:
                # The writer with the fewest jobs: a pass's jobs spread evenly.
                counts = [0] * self.writers
                for i in self._writer_of.values():
                    counts[i] += 1
                index = self._writer_of[job_id] = counts.index(min(counts))
        with self._submit_lock:
            if self._closed:
                raise RuntimeError("the ingest pipeline is closed")
            self._queues[index].put(_Page(job_id, batch))

    def forget(self, job_id: str) -> None:
        """A drained job's writer slot is free (its pages are all stored: call after ``wait``)."""
        with self._lock:
            self._writer_of.pop(job_id, None)

    def wait(self) -> None:
        """Return once every submitted page is stored (or dropped after a failure); raise the
        first failure since the last ``wait``, which clears it."""
        for q in self._queues:
            q.join()
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Store what is queued, then stop the writer threads (a failure is logged, not raised)."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
            for q in self._queues:
                q.put(_STOP)
        for t in self._threads:
            t.join()

    def _raise_failure(self) -> None:
        with self._lock:
            error = self._error
        if error is not None:
            raise error

    def _run(self, q: queue.Queue[_Page]) -> None:
        held: list[_Page] = []  # taken from the queue, in order, not stored yet
        while True:
            if not held:
                held.append(q.get())
            while len(held) < self._max_held:  # what is queued now, bounded: back-pressure
                try:
                    held.append(q.get_nowait())
                except queue.Empty:
                    break
            # One page per job per transaction, in queue order: a job's next page (and anything
            # after a stop) waits for the next transaction.
            batch: list[_Page] = []
            later: list[_Page] = []
            waiting: set[str] = set()  # jobs with a page in this transaction or in `later`
            stopping = False
            for page in held:
                stopping = stopping or page is _STOP
                if stopping or page.job_id in waiting:
                    later.append(page)
                else:
                    batch.append(page)
                waiting.add(page.job_id)
            held = later
            if batch:
                self._store(batch)
                for _ in batch:
                    q.task_done()
            if held and held[0] is _STOP:
                for _ in held:
                    q.task_done()
                return

    def _store(self, batch: list[_Page]) -> None:
        with self._lock:
            failed = self._error is not None
        if failed:
            return  # a failed write came first: these pages would store after records it lost
        try:
            stored = self.storage.ingest_many([(p.job_id, p.batch) for p in batch])
        except BaseException as exc:
            logger.warning("ingest write of %d page(s) failed: %s", len(batch), exc)
            with self._lock:
                if self._error is None:
                    self._error = exc
            return
        if self.on_stored is not None:
            try:
                for page, n in zip(batch, stored, strict=True):
                    self.on_stored(page.job_id, n)
            except Exception:  # a counter must not end the thread: wait() would never return
                logger.exception("ingest pipeline: on_stored failed")
