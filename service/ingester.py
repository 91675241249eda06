"""Background work: keep the job table in step with Ray, and drain every job's metrics sink.

Two duties, one loop (``run_forever``), each step a plain blocking method the tests can call:

- ``sync_jobs``: list Ray's jobs; add the ones submitted by hand (`ray job submit -- python
  -m jobs.train ...`, or any script whose model went through ``tail_ray.train.prepare_model``:
  its job has a metrics sink), copy status changes of the ones we know, and reconcile the rest: a job
  we hold as not ended that Ray has not known for ``lost_after_s`` is marked FAILED, with a
  message saying it was lost and when (its cluster was restarted or replaced). A job we asked
  to stop reads STOPPING until Ray says it ended. Runs on start and every ``sync_interval_s``.
- ``drain``: for each job not yet drained, read its sink from the stored cursor in pages of
  ``ingest_batch_records`` and persist each page with its new cursor in one transaction
  (``Storage.ingest``). A restart resumes from the stored cursor: nothing lost, nothing
  doubled, and whatever the sink buffered while we were down is read now.

A job is drained when Ray says it ended more than ``drain_grace_s`` ago (late fire-and-forget
pushes have landed) and a read found nothing new; then its sink is closed to free the actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from service.errors import JobNotFound, RayUnavailable
from service.ray_client import RayGateway, RayJob, name_from_entrypoint
from service.settings import Settings
from service.status import JobStatus
from service.storage import IngestBatch, Storage

logger = logging.getLogger(__name__)


class Ingester:
    def __init__(self, settings: Settings, storage: Storage, ray_gateway: RayGateway) -> None:
        self.settings = settings
        self.storage = storage
        self.ray = ray_gateway
        self.last_error: str | None = None
        self._last_sync = 0.0
        self._unknown_since: dict[str, float] = {}  # job id -> monotonic time Ray first lacked it

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
        """Read every undrained job's sink up to its end; returns records stored."""
        stored = 0
        for job, cursor in self.storage.undrained_jobs():
            stored += self.drain_job(job.id, cursor, job.is_terminal, job.ended_at)
        return stored

    def drain_job(self, job_id: str, cursor: int, terminal: bool, ended_at: float | None) -> int:
        limit = self.settings.ingest_batch_records
        stored, saw_sink = 0, False
        while True:
            page = self.ray.read_sink(job_id, cursor, limit)
            if page is None:
                break
            saw_sink = True
            records = page["records"]
            self.storage.ingest(
                job_id,
                IngestBatch(
                    records=records,
                    next_seq=int(page["next_seq"]),
                    missed=int(page["missed"]),
                    dropped_in_sink=int(page["dropped_in_sink"]),
                    dropped_by_workers=int(page["dropped_by_workers"]),
                ),
            )
            if page["missed"]:
                logger.warning(
                    "job %s: the sink dropped %d records before we read them", job_id, page["missed"]
                )
            stored += len(records)
            cursor = int(page["next_seq"])
            if len(records) < limit:
                break
        settled = ended_at is not None and time.time() - ended_at >= self.settings.drain_grace_s
        if terminal and settled and stored == 0:
            self.storage.mark_drained(job_id)
            if saw_sink and self.settings.close_drained_sinks:
                self.ray.close_sink(job_id)
            logger.info("job %s: metrics drained", job_id)
        return stored

    # ------------------------------------------------------------ loop
    def run_once(self) -> int:
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
        return stored

    async def run_forever(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.to_thread(self.run_once)
            except Exception:  # keep ingesting whatever one bad pass did
                logger.exception("ingest pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.settings.ingest_interval_s)
