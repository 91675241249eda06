"""The service's only door to Ray: the Jobs API (submit, list, stop, logs) and the sink reads.

Which Ray jobs are the service's business (``list_tail_jobs``): the ones it submitted (their
metadata says so), any `python -m jobs.train`, and any job with a metrics sink, i.e. a job
whose code called ``tail_ray.train.prepare_model`` (the sink actor is named after the job's
submission id), however it was submitted.

- Jobs go through ``JobSubmissionClient`` against the job server, with the cluster's token
  in the ``Authorization`` header. The token never appears in what we return or log:
  ``redact`` scrubs it from every error message that leaves this module.
- Sinks are Ray actors, read with ``ray.get`` from a driver this process connects lazily.
- Everything here blocks; the API and the ingester call it from worker threads.
"""

from __future__ import annotations

import itertools
import logging
import os
import shlex
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ray
from ray.job_submission import JobSubmissionClient

from service.errors import JobConflict, JobNotFound, RayUnavailable
from service.schemas import TRAIN_MODULE
from service.settings import Settings
from service.status import JobStatus
from tail_ray.metrics import sink as sink_mod

logger = logging.getLogger(__name__)

JOB_METADATA_KEY = "tail_ray"


@dataclass(frozen=True)
class RayJob:
    """What the service keeps of a Ray job."""

    submission_id: str
    status: JobStatus
    message: str
    entrypoint: str
    start_time_s: float | None
    end_time_s: float | None


def is_train_entrypoint(entrypoint: str) -> bool:
    """True for `python -m jobs.train ...` (any python, any arguments)."""
    try:
        args = shlex.split(entrypoint)
    except ValueError:
        return False
    return any(a == "-m" and b == TRAIN_MODULE for a, b in itertools.pairwise(args))


def name_from_entrypoint(entrypoint: str, default: str) -> str:
    """A job name for a hand-written entrypoint: its `--set name=...`, else the script's stem
    (`python my_train.py` -> my_train) or the module's last part (`-m pkg.train` -> train)."""
    try:
        args = shlex.split(entrypoint)
    except ValueError:
        return default
    for flag, value in itertools.pairwise(args):
        if flag == "--set" and value.startswith("name="):
            return value.removeprefix("name=").strip("\"'")[:64] or default
    for flag, value in itertools.pairwise(args):
        if flag == "-m":
            return value.rsplit(".", 1)[-1][:64] or default
    for arg in args[1:]:
        if arg.endswith(".py"):
            return arg.rsplit("/", 1)[-1].removesuffix(".py")[:64] or default
    return default


class RayGateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._client: JobSubmissionClient | None = None
        self._secret = settings.ray_token()
        self._sinks: dict[str, Any] = {}  # job id -> its sink's actor handle (this driver's)
        # Sinks started by an older tail-ray, whose read has no ``columnar`` parameter.
        self._record_sinks: set[str] = set()
        self._reads: dict[str, tuple[int, int]] = {}  # job id -> (after_seq, limit) in flight

    # ------------------------------------------------------------ helpers
    def redact(self, text: str) -> str:
        if self._secret:
            text = text.replace(self._secret, "***")
        return text

    def _unavailable(self, what: str, exc: BaseException) -> RayUnavailable:
        message = self.redact(f"{what}: {type(exc).__name__}: {exc}")
        logger.warning("%s", message)
        return RayUnavailable(message[:2000])

    def _jobs(self) -> JobSubmissionClient:
        with self._lock:
            if self._client is None:
                headers = {"Authorization": f"Bearer {self._secret}"} if self._secret else None
                try:
                    self._client = JobSubmissionClient(self.settings.ray_dashboard_url, headers=headers)
                except Exception as exc:
                    raise self._unavailable(
                        f"cannot reach the Ray job server at {self.settings.ray_dashboard_url}", exc
                    ) from None
            return self._client

    def _drop_client(self) -> None:
        with self._lock:
            self._client = None

    def _drop_driver(self) -> None:
        """Leave the Ray cluster (the next ``connect`` joins again). Called when the cluster
        stops answering: a Ray driver whose GCS stays unreachable for 60 s (Ray's
        ``gcs_rpc_server_reconnect_timeout_s``) exits the whole process, and a head restarted
        on the same address is a new cluster the old driver cannot rejoin. Leaving early keeps
        the service up through an outage and lets it reconnect by itself afterwards."""
        if not ray.is_initialized():
            return
        with self._lock:
            if not ray.is_initialized() or _gcs_answers(ray.get_runtime_context().gcs_address):
                return  # only the job server is down: the driver is fine where it is
            logger.warning("Ray's GCS is unreachable: leaving the cluster; will rejoin when it answers")
            self._sinks.clear()  # handles of the driver we leave
            try:
                ray.shutdown()
            except Exception as exc:
                logger.warning("leaving the Ray cluster failed: %s", self.redact(str(exc)))

    @contextmanager
    def _jobs_call(
        self,
        what: str,
        *,
        missing: Exception | None = None,
        drop_client: bool = False,
        cluster_gone: bool = False,
    ) -> Iterator[None]:
        """The one error ladder of every Jobs API call. A RayUnavailable passes as it is; Ray's
        "does not exist" becomes ``missing`` (a 404 or 409 for the API); anything else becomes
        RayUnavailable(``what``), redacted. ``drop_client``: a failure forgets the HTTP client
        (the next call builds one afresh). ``cluster_gone``: a failure may mean the cluster went
        away, so the client goes and the driver leaves if the GCS is unreachable too."""
        try:
            yield
        except RayUnavailable:
            if cluster_gone:  # the job server is unreachable: maybe the GCS as well
                self._drop_driver()
            raise
        except Exception as exc:
            if missing is not None and isinstance(exc, RuntimeError) and "does not exist" in str(exc):
                raise missing from None
            if drop_client or cluster_gone:
                self._drop_client()
            if cluster_gone:
                self._drop_driver()
            raise self._unavailable(what, exc) from None

    # ------------------------------------------------------------ jobs API
    def submit(self, submission_id: str, entrypoint: str, runtime_env: dict[str, Any] | None = None) -> None:
        """Hand a job to Ray. ``runtime_env`` (a user's own code: its working_dir, pip, py_modules)
        replaces the default one, the service's working_dir; the env var is always set."""
        if runtime_env is None:
            runtime_env = {}
            if self.settings.job_working_dir is not None:
                runtime_env["working_dir"] = str(self.settings.job_working_dir)
        runtime_env = {**runtime_env, "env_vars": {"RAY_AUTH_MODE": "token"}}
        with self._jobs_call("Ray refused the job submission", drop_client=True):
            self._jobs().submit_job(
                entrypoint=entrypoint,
                submission_id=submission_id,
                runtime_env=runtime_env,
                metadata={JOB_METADATA_KEY: "service"},
                entrypoint_num_cpus=0,
            )

    def list_tail_jobs(self) -> list[RayJob]:
        """Every job on the cluster that is ours to show (see the module doc)."""
        with self._jobs_call("cannot list Ray jobs", cluster_gone=True):
            details = self._jobs().list_jobs()
        try:
            with_sinks = self.sink_job_ids()
        except RayUnavailable:  # the job server answers but the GCS does not (yet): list what we can
            with_sinks = set()
        out = []
        for d in details:
            if d.submission_id and (
                JOB_METADATA_KEY in (d.metadata or {})
                or is_train_entrypoint(d.entrypoint or "")
                or d.submission_id in with_sinks
            ):
                out.append(_ray_job(d))
        return out

    # Each call assigns inside the ladder and returns after it: a @contextmanager could in
    # principle swallow the exception, so a return inside `with` reads as "may fall through".
    def job(self, submission_id: str) -> RayJob:
        with self._jobs_call(
            "cannot read the Ray job", missing=JobNotFound(f"Ray has no job {submission_id!r}")
        ):
            job = _ray_job(self._jobs().get_job_info(submission_id))
        return job

    def stop(self, submission_id: str) -> bool:
        with self._jobs_call(
            "cannot stop the Ray job", missing=JobConflict(f"Ray has no job {submission_id!r} to stop")
        ):
            stopped = self._jobs().stop_job(submission_id)
        return bool(stopped)

    def logs(self, submission_id: str) -> str:
        with self._jobs_call(
            "cannot read the job logs", missing=JobNotFound(f"Ray has no logs for job {submission_id!r}")
        ):
            text = self._jobs().get_job_logs(submission_id)
        return self.redact(text)

    def ping_jobs(self) -> None:
        """Raises RayUnavailable unless the job server answers."""
        with self._jobs_call("Ray job server did not answer", cluster_gone=True):
            self._jobs().list_jobs()

    # ------------------------------------------------------------ sinks (Ray core)
    def connect(self) -> None:
        """Join the cluster as a driver (once per process; reused if already connected)."""
        if ray.is_initialized():
            return
        with self._lock:
            if ray.is_initialized():
                return
            # Ray takes RAY_AUTH_MODE from the environment when it is first imported, so the
            # service must be started with RAY_AUTH_MODE=token (`tail-ray up` does). The token
            # comes from RAY_AUTH_TOKEN or ~/.ray/auth_token; an explicit setting wins.
            if self.settings.ray_auth_token is not None:
                os.environ["RAY_AUTH_TOKEN"] = self.settings.ray_auth_token.get_secret_value()
            try:
                ray.init(
                    address=self.settings.ray_address,
                    namespace="tail_ray_service",
                    log_to_driver=False,
                    configure_logging=False,
                )
            except Exception as exc:
                raise self._unavailable(
                    f"cannot join the Ray cluster at {self.settings.ray_address}", exc
                ) from None

    def request_sink_pages(self, cursors: dict[str, int], limit: int) -> dict[str, ray.ObjectRef | None]:
        """Send each job's sink a read for its next page (job id -> cursor) without waiting: the
        reads are in flight together, and the sink actors serialize their pages while the
        caller stores earlier ones. None for a job with no sink (yet, or any more). Actor
        handles are cached per job (a named-actor lookup is a GCS round trip)."""
        self.connect()
        refs: dict[str, ray.ObjectRef | None] = {}
        try:
            for job_id, after_seq in cursors.items():
                handle = self._sinks.get(job_id) or sink_mod.find_sink(job_id)
                if handle is not None:
                    self._sinks[job_id] = handle
                refs[job_id] = None if handle is None else self._read_page(job_id, handle, after_seq, limit)
        except Exception as exc:
            raise self._unavailable("cannot reach the metrics sinks", exc) from None
        return refs

    def _read_page(self, job_id: str, handle: Any, after_seq: int, limit: int) -> ray.ObjectRef:
        """A columnar page, or records from a sink that predates them. Keyword arguments only:
        a process that cannot load the sink's class as it was when the sink started (another
        tail-ray version: a detached sink outlives service upgrades) gets a handle whose methods
        take keywords only."""
        self._reads[job_id] = (after_seq, limit)
        if job_id not in self._record_sinks:
            try:
                return handle.read.remote(after_seq=after_seq, limit=limit, columnar=True)
            except TypeError:  # the old class loaded here: Ray checks the signature before sending
                self._reading_records(job_id)
        return handle.read.remote(after_seq=after_seq, limit=limit)

    def _reading_records(self, job_id: str) -> None:
        logger.info("job %s: its metrics sink predates columnar pages; reading records", job_id)
        self._record_sinks.add(job_id)

    def answered_sink_pages(self, inflight: dict[str, ray.ObjectRef | None]) -> list[str]:
        """The jobs whose page read has answered, waiting up to ``ray_timeout_s`` for the first
        (a job with no sink answers at once; after the timeout, the oldest read is returned so
        that ``sink_page`` reports it)."""
        done = [job_id for job_id, ref in inflight.items() if ref is None]
        refs = {ref: job_id for job_id, ref in inflight.items() if ref is not None}
        if done or not refs:
            return done or list(inflight)[:1]
        try:
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=self.settings.ray_timeout_s)
            if ready:
                ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        except Exception as exc:
            raise self._unavailable("cannot reach the metrics sinks", exc) from None
        return [refs[ref] for ref in ready] or list(inflight)[:1]

    def sink_page(self, job_id: str, ref: ray.ObjectRef | None) -> dict[str, Any] | None:
        """The page a ``request_sink_pages`` read returned; None when the sink is gone."""
        if ref is None:
            return None
        try:
            try:
                return dict(ray.get(ref, timeout=self.settings.ray_timeout_s))
            except ray.exceptions.RayTaskError as exc:
                if not isinstance(exc.cause, TypeError) or job_id in self._record_sinks:
                    raise
                # A sink from an older tail-ray (its class not loadable here): read records.
                self._reading_records(job_id)
                after_seq, limit = self._reads[job_id]
                ref = self._read_page(job_id, self._sinks[job_id], after_seq, limit)
                return dict(ray.get(ref, timeout=self.settings.ray_timeout_s))
        except ray.exceptions.RayActorError:
            self._forget_sink(job_id)  # the sink was closed (or died) since we looked it up
            return None
        except Exception as exc:
            raise self._unavailable(f"cannot read the metrics sink of job {job_id}", exc) from None

    def sink_job_ids(self) -> set[str]:
        """The job ids that have a metrics sink on the cluster now (one GCS call)."""
        self.connect()
        try:
            return sink_mod.sink_job_ids()
        except Exception as exc:
            raise self._unavailable("cannot list the metrics sinks", exc) from None

    def _forget_sink(self, job_id: str) -> None:
        """Drop what this gateway keeps per sink: a month of jobs must not grow it."""
        self._sinks.pop(job_id, None)
        self._reads.pop(job_id, None)
        self._record_sinks.discard(job_id)

    def close_sink(self, job_id: str) -> None:
        self._forget_sink(job_id)
        self.connect()
        try:
            sink_mod.close_sink(job_id)
        except Exception as exc:
            logger.warning("could not close the sink of job %s: %s", job_id, self.redact(str(exc)))


def _gcs_answers(address: str, timeout_s: float = 2.0) -> bool:
    """True when something accepts a TCP connection at the GCS ``host:port``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _ray_job(d: Any) -> RayJob:
    return RayJob(
        submission_id=str(d.submission_id),
        status=JobStatus.from_ray(d.status),
        message=str(d.message or ""),
        entrypoint=str(d.entrypoint or ""),
        start_time_s=d.start_time / 1000.0 if d.start_time else None,
        end_time_s=d.end_time / 1000.0 if d.end_time else None,
    )
