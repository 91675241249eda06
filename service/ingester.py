"""Background work: keep the job table in step with Ray, and drain every job's metrics sink.

Two duties, one loop (``run_forever``), each step a plain blocking method the tests can call:

- ``sync_jobs``: list Ray's jobs; add the ones submitted by hand (`ray job submit -- python
  -m jobs.train ...`, or any script whose model went through ``tail_ray.train.prepare_model``:
  its job has a metrics sink), copy status changes of the ones we know, and reconcile the rest: a job
  we hold as not ended that Ray has not known for ``lost_after_s`` is marked FAILED, with a
  message saying it was lost and when (its cluster was restarted or replaced). A job we asked
  to stop reads STOPPING until Ray says it ended. Runs on start and every ``sync_interval_s``.
- ``drain``: for each job not yet drained, read its sink from the stored cursor in pages of
  ``ingest_batch_records`` (reads in flight while earlier pages are stored) and persist each
  page with its new cursor in one transaction (``Storage.ingest_many``, on the writer threads
  of ingest_pipeline.py while the next pages are read). A restart resumes from the stored
  cursor: nothing lost, nothing doubled, and whatever the sink buffered meanwhile is read now.
- ``retain``: every ``retention_interval_s``, thin old records per job (``Storage.apply_retention``).

Only one ingester works on a database at a time: each pass first takes (or confirms) the
storage's leader lease (SQLite: a file lock; PostgreSQL: an advisory lock), so several
replicas on one PostgreSQL serve reads while exactly one of them ingests; when it dies its
lock is freed and the next pass of another replica takes over from the stored cursors.

A job is drained when Ray says it ended more than ``drain_grace_s`` ago (late fire-and-forget
pushes have landed) and a read found nothing new; then its sink is closed to free the actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass

from service.errors import JobNotFound, RayUnavailable
from service.ingest_pipeline import IngestPipeline
from service.ray_client import RayGateway, RayJob, name_from_entrypoint
from service.settings import Settings
from service.status import JobStatus
from service.storage import IngestBatch, JobRow, Storage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class IngestStatus:
    """What /metrics and /readyz show of the ingester, wherever it runs (a thread here, or the
    child process of ingest_process.py, which reports it on a pipe)."""

    leader: bool  # holds the lease: the one ingester of this database
    stored_records: int  # by this ingester since it started
    last_error: str | None  # the last pass's failure (Ray unreachable, ...); None when it worked


@dataclass
class _JobDrain:
    """One job's progress through a drain pass."""

    job: JobRow
    cursor: int
    read: int = 0
    saw_sink: bool = False


class Ingester:
    def __init__(self, settings: Settings, storage: Storage, ray_gateway: RayGateway) -> None:
        self.settings = settings
        self.storage = storage
        self.ray = ray_gateway
        self.last_error: str | None = None
        self.lease = storage.leader_lease()
        self.stored_records = 0  # by this process (a replica that is not the leader stores none)
        self._stored_lock = threading.Lock()  # writer threads add to stored_records
        self._pipeline: IngestPipeline | None = None  # made by the first drain
        self._last_sync = 0.0
        self._last_retention = 0.0
        self._unknown_since: dict[str, float] = {}  # job id -> monotonic time Ray first lacked it

    @property
    def is_leader(self) -> bool:
        return self.lease.held

    def status(self) -> IngestStatus:
        return IngestStatus(self.is_leader, self.stored_records, self.last_error)

    def close(self) -> None:
        """Store what was read, stop the writer threads, and give up the leader lease (another
        replica's next pass takes over)."""
        if self._pipeline is not None:
            self._pipeline.close()
        self.lease.release()

    @property
    def pipeline(self) -> IngestPipeline:
        if self._pipeline is None:
            writers = self.settings.ingest_writers or self.storage.ingest_writers
            self._pipeline = IngestPipeline(self.storage, writers, on_stored=self._count_stored)
        return self._pipeline

    def _count_stored(self, job_id: str, records: int) -> None:
        with self._stored_lock:
            self.stored_records += records

    # ------------------------------------------------------------ job table
    def sync_jobs(self) -> int:
        """Copy Ray's view of train jobs into storage; returns how many jobs were new."""
        added = 0
        ray_jobs = self.ray.list_tail_jobs()
        for job in ray_jobs:
            row = self.storage.get_job(job.submission_id)
            if row is None:
                added += self.storage.insert_job(
                    job_id=job.submission_id,
                    name=name_from_entrypoint(job.entrypoint, job.submission_id),
                    source="ray",
                    status=job.status,
                    entrypoint=job.entrypoint,
                    spec=None,
                    created_at=job.start_time_s,
                    message=job.message,
                )
                self.storage.update_job_status(
                    job.submission_id, job.status, None, job.start_time_s, job.end_time_s
                )
            elif row.status == JobStatus.STOPPING and not job.status.is_terminal:
                continue  # asked to stop; Ray has not finished stopping it yet
            elif (row.status, row.message, row.ended_at) != (job.status, job.message, job.end_time_s):
                self.storage.update_job_status(
                    job.submission_id, job.status, job.message, job.start_time_s, job.end_time_s
                )
        if added:
            logger.info("found %d job(s) submitted outside the service", added)
        self.reconcile_lost({job.submission_id for job in ray_jobs})
        return added

    def reconcile_lost(self, known_to_ray: set[str]) -> list[str]:
        """Mark FAILED every job we hold as not ended that Ray has lacked for ``lost_after_s``;
        returns their ids. The grace covers a job inserted a moment before its submission
        reached Ray. Ray is asked once more for each before it is declared lost."""
        now = time.monotonic()
        grace_s = self.settings.lost_after_s
        lost = []
        for job_id in self.storage.job_ids(terminal=False):
            if job_id in known_to_ray:
                self._unknown_since.pop(job_id, None)
                continue
            since = self._unknown_since.setdefault(job_id, now)
            row = self.storage.get_job(job_id)
            if row is None or now - since < grace_s or time.time() - row.created_at < grace_s:
                continue
            try:
                job = self.ray.job(job_id)
            except JobNotFound:
                self.mark_lost(job_id, row.status)
                lost.append(job_id)
            else:
                self._copy_status(job)
            self._unknown_since.pop(job_id, None)
        return lost

    def mark_lost(self, job_id: str, last_status: str) -> None:
        checked = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())
        message = (
            f"lost: Ray has no record of this job (checked {checked}; it was {last_status} here). "
            "The Ray cluster it ran on was restarted or replaced; the metrics stored until then "
            "are kept, and whatever its metrics sink still holds is read."
        )
        self.storage.update_job_status(job_id, JobStatus.FAILED, message, None, time.time())
        logger.warning("job %s: %s", job_id, message)

    def _copy_status(self, job: RayJob) -> None:
        self.storage.update_job_status(
            job.submission_id, job.status, job.message, job.start_time_s, job.end_time_s
        )

    # ------------------------------------------------------------ metrics
    def drain(self) -> int:
        """Read every undrained job's sink up to its end; returns records read.

        Every job's first read is sent at once. Each round takes every page that has come back
        (waiting for at least one), sends the next read of each job whose page was full, and
        hands the pages to the writer threads (ingest_pipeline.py), which store them while
        the next round is read: the sink actors serialize pages, this thread deserializes
        them and the database commits earlier ones, all at once. Returns once all of it is
        stored; a failed write is raised (its jobs' cursors stay at their last stored page)."""
        limit = self.settings.ingest_batch_records
        jobs = {job.id: _JobDrain(job, cursor) for job, cursor in self.storage.undrained_jobs()}
        pipeline = self.pipeline
        try:
            inflight = self.ray.request_sink_pages({job_id: d.cursor for job_id, d in jobs.items()}, limit)
            while inflight and self.lease.held:  # a leader that lost its lease stops at the next round
                for job_id in self.ray.answered_sink_pages(inflight):
                    page = self.ray.sink_page(job_id, inflight.pop(job_id))
                    if page is not None and _page_records(page) >= limit:
                        inflight.update(self.ray.request_sink_pages({job_id: int(page["next_seq"])}, limit))
                    if page is not None:
                        self._submit(jobs[job_id], page)
        except BaseException:
            with contextlib.suppress(Exception):
                pipeline.wait()  # settle what was submitted; the first error is the one to raise
            raise
        pipeline.wait()
        if not self.lease.held:
            return sum(d.read for d in jobs.values())  # another replica ingests now; it decides drains
        for d in jobs.values():
            self._maybe_drained(d)
        return sum(d.read for d in jobs.values())

    def _submit(self, d: _JobDrain, page: dict) -> None:
        """Hand one sink page to the writers (stored after the job's earlier pages)."""
        d.saw_sink = True
        batch = IngestBatch(
            records=page["records"],
            columns=page if "count" in page else None,
            next_seq=int(page["next_seq"]),
            missed=int(page["missed"]),
            dropped_in_sink=int(page["dropped_in_sink"]),
            dropped_by_workers=int(page["dropped_by_workers"]),
        )
        if batch.missed:
            logger.warning("job %s: the sink dropped %d records before we read them", d.job.id, batch.missed)
        d.read += _page_records(page)
        self.pipeline.submit(d.job.id, batch)

    def _maybe_drained(self, d: _JobDrain) -> None:
        """A job is drained when it ended ``drain_grace_s`` ago and this pass read nothing new."""
        ended_at = d.job.ended_at
        settled = ended_at is not None and time.time() - ended_at >= self.settings.drain_grace_s
        if d.job.is_terminal and settled and d.read == 0:
            self.storage.mark_drained(d.job.id)
            self.pipeline.forget(d.job.id)
            if d.saw_sink and self.settings.close_drained_sinks:
                self.ray.close_sink(d.job.id)
            logger.info("job %s: metrics drained", d.job.id)

    def retain(self) -> int:
        """Thin every job's old records to the retention policy; returns records deleted."""
        policy = self.settings.retention
        deleted = 0
        for job_id in self.storage.job_ids():
            while True:  # each call thins a bounded window of steps
                n = self.storage.apply_retention(job_id, policy)
                deleted += n
                if n == 0:
                    break
        if deleted:
            logger.info("retention: thinned %d old metric records", deleted)
        return deleted

    # ------------------------------------------------------------ loop
    def run_once(self) -> int:
        if not self.lease.try_acquire():
            return 0  # another process or replica is the ingester; this one serves reads
        now = time.monotonic()
        try:
            if now - self._last_sync >= self.settings.sync_interval_s:
                self._last_sync = now
                self.sync_jobs()
            stored = self.drain()
        except RayUnavailable as exc:
            self.last_error = str(exc)
            return 0
        self.last_error = None
        if now - self._last_retention >= self.settings.retention_interval_s:
            self._last_retention = now
            self.retain()
        return stored

    async def run_forever(self, stop: asyncio.Event) -> None:
        # Every pass runs in a worker thread: the event loop only waits for it.
        try:
            while not stop.is_set():
                try:
                    await asyncio.to_thread(self.run_once)
                except Exception:  # keep ingesting whatever one bad pass did
                    logger.exception("ingest pass failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=self.settings.ingest_interval_s)
        finally:
            self.close()


def _page_records(page: dict) -> int:
    """Records in a sink page: columnar pages (``read(columnar=True)``) say how many; a sink from an
    older tail-ray sends only ``records``."""
    return int(page["count"]) if "count" in page else len(page["records"])
