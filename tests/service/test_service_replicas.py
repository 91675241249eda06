"""Two replicas of the service on one PostgreSQL: both serve reads, exactly one ingests (an
advisory lock), and when the ingesting one is killed mid-ingest (SIGKILL, no clean shutdown)
the other takes over from the stored cursor: no record lost or stored twice. And within one
replica: its ingest process, killed, is restarted from the stored cursor, and dies with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
from service_support import API_TOKEN, LAYERS, ray_cluster, step_records, wait_for

from jobs.local_postgres import LocalPostgres
from service.ray_head import LocalRayHead, free_port
from service.storage import open_storage
from tail_ray.metrics.sink import get_or_create_sink

pytestmark = pytest.mark.ray
REPO_ROOT = Path(__file__).resolve().parents[2]
JOB_ID = "replicated-job"


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayHead]:
    with ray_cluster(tmp_path_factory.mktemp("ray")) as h:
        yield h


class Replica:
    """One service process (uvicorn), as one pod of the two-replica Deployment."""

    def __init__(self, name: str, url: str, head: LocalRayHead, log_dir: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "TAIL_RAY_API_TOKEN": API_TOKEN,
            "TAIL_RAY_DATABASE_URL": url,
            "TAIL_RAY_RAY_ADDRESS": head.ports.gcs_address,
            "TAIL_RAY_RAY_DASHBOARD_URL": head.ports.dashboard_url,
            "TAIL_RAY_INGEST_INTERVAL_S": "0.1",
            "TAIL_RAY_INGEST_BATCH_RECORDS": "45",  # many small transactions: a kill lands mid-ingest
            "TAIL_RAY_SYNC_INTERVAL_S": "300",
        }
        cmd = [sys.executable, "-m", "uvicorn", "--factory", "service.main:create_app", "--host", "127.0.0.1",
               "--port", str(self.port), "--log-level", "warning"]  # fmt: skip
        self.log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115  # closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(self._up, 90, f"replica {name} to serve")

    def _up(self) -> bool:
        assert self.proc.poll() is None, f"replica exited with {self.proc.returncode}"
        try:
            return httpx.get(f"{self.base}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _gauge(self, name: str) -> float:
        for line in httpx.get(f"{self.base}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} missing from /metrics")

    def is_leader(self) -> bool:
        return self._gauge("tail_ray_ingest_leader") == 1.0

    def stored_here(self) -> int:
        """Records this replica's own ingester stored."""
        return int(self._gauge("tail_ray_ingest_stored_records_total"))

    def cursor(self) -> int:
        summary = httpx.get(f"{self.base}/v1/jobs/{JOB_ID}/metrics/summary", timeout=10).json()
        return int(summary["ingest"]["cursor_seq"])

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


def test_killing_the_ingesting_replica_loses_and_doubles_nothing(
    head: LocalRayHead, postgres_server: LocalPostgres, tmp_path: Path
) -> None:
    url = postgres_server.create_database()
    with open_storage(url) as store:
        store.insert_job(job_id=JOB_ID, name="replicated", source="ray", status="RUNNING",
                         entrypoint="python -m jobs.train", spec=None)  # fmt: skip
    sink = get_or_create_sink(JOB_ID)
    pushed: list[int] = []
    stop_pushing = threading.Event()

    def train() -> None:  # a job's workers: one step every 20 ms while the replicas come and go
        step = 0
        while not stop_pushing.is_set():
            pushed.append(int(ray.get(sink.push.remote(step_records(JOB_ID, step)))))
            step += 1
            time.sleep(0.02)

    replicas = [Replica(name, url, head, tmp_path) for name in ("a", "b")]
    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    try:
        leaders = wait_for(lambda: [r for r in replicas if r.is_leader()] or None, 30, "a leader")
        assert len(leaders) == 1, "both replicas ingest"
        leader = leaders[0]
        (standby,) = [r for r in replicas if r is not leader]
        wait_for(lambda: leader.cursor() > 500, 60, "the leader to ingest")
        assert standby.cursor() > 0  # the standby serves reads from the same database
        assert standby.stored_here() == 0 and leader.stored_here() > 0  # ... and ingests nothing
        leader.stop(signal.SIGKILL)  # mid-ingest: pages of 45 records commit every few milliseconds
        killed_at = standby.cursor()
        wait_for(standby.is_leader, 30, "the standby to take over the ingester lease")
        wait_for(lambda: standby.cursor() > killed_at + 500, 60, "the new leader to ingest")
        assert standby.stored_here() > 0
        stop_pushing.set()
        trainer.join(timeout=30)
        last = pushed[-1]
        wait_for(lambda: standby.cursor() == last, 60, "the new leader to drain the sink")
        with open_storage(url) as store:
            seqs = store.seqs(JOB_ID)
            summary = store.summary(JOB_ID)
        assert seqs == list(range(1, last + 1))  # every record exactly once
        steps = len(pushed)
        assert summary["steps"] == steps and summary["last_step"] == steps - 1
        per_step = step_records(JOB_ID, 0)
        assert summary["raw_bytes"] == steps * sum(r["raw_bytes"] for r in per_step if r["type"] == "step")
        assert summary["layers"] == len(LAYERS)
    finally:
        stop_pushing.set()
        for r in replicas:
            r.stop()


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _ingest_child(replica: Replica) -> int | None:
    """The pid of the replica's ingest process (service/ingest_process.py), if it runs now."""
    for pid in _children(replica.proc.pid):
        try:
            if "service.ingest_process" in Path(f"/proc/{pid}/cmdline").read_text():
                return pid
        except OSError:
            continue
    return None


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False


def test_a_killed_ingest_process_is_restarted_and_dies_with_its_service(
    head: LocalRayHead, tmp_path: Path
) -> None:
    """The ingester runs in a child process: SIGKILL it mid-ingest and the service starts a new
    one that resumes from the stored cursor (every record once); SIGKILL the service and the
    kernel stops the child too (the lifeline), so no orphan keeps the database."""
    url = f"sqlite://{tmp_path / 'service.sqlite'}"
    job_id = "ingest-child-job"
    with open_storage(url) as store:
        store.insert_job(job_id=job_id, name="child", source="ray", status="RUNNING",
                         entrypoint="python -m jobs.train", spec=None)  # fmt: skip
    sink = get_or_create_sink(job_id)
    pushed = [int(ray.get(sink.push.remote(step_records(job_id, step)))) for step in range(200)]
    replica = Replica("child", url, head, tmp_path)
    try:
        first = wait_for(lambda: _ingest_child(replica), 30, "the ingest process")
        # ingest_niceness (the child sets it once it has read its settings): on a busy machine
        # the service's reads run first.
        wait_for(lambda: Path(f"/proc/{first}/stat").read_text().rsplit(")", 1)[1].split()[16] == "10",
                 30, "the ingest process to lower its priority")  # fmt: skip

        def cursor() -> int:
            summary = httpx.get(f"{replica.base}/v1/jobs/{job_id}/metrics/summary", timeout=10).json()
            return int(summary["ingest"]["cursor_seq"])

        wait_for(lambda: cursor() > 200, 60, "ingest to start")
        os.kill(first, signal.SIGKILL)  # mid-ingest: pages of 45 records
        second = wait_for(lambda: (pid := _ingest_child(replica)) not in (None, first) and pid, 30,
                          "a new ingest process")  # fmt: skip
        pushed += [int(ray.get(sink.push.remote(step_records(job_id, step)))) for step in range(200, 220)]
        last = pushed[-1]
        wait_for(lambda: cursor() == last, 60, "the new ingest process to drain the sink")
        assert replica.is_leader() and replica.stored_here() > 0
        with open_storage(url) as store:
            assert store.seqs(job_id) == list(range(1, last + 1))  # every record exactly once
            assert store.summary(job_id)["steps"] == 220
        replica.stop(signal.SIGKILL)
        wait_for(lambda: not _alive(second), 30, "the orphaned ingest process to stop")
    finally:
        replica.stop()


@ray.remote(num_cpus=0)
class _SinkOfAnOlderRelease:
    """A metrics sink as tail-ray released it before columnar pages: ``read`` has no
    ``columnar`` parameter (detached sinks outlive service upgrades)."""

    def __init__(self, records: list[dict]) -> None:
        self.records = records

    def read(self, after_seq: int = 0, limit: int = 10_000) -> dict:
        out = [r for r in self.records if r["seq"] > after_seq][:limit]
        return {
            "job_id": "old-sink-job", "records": out, "next_seq": out[-1]["seq"] if out else after_seq,
            "last_seq": len(self.records), "missed": 0, "dropped_in_sink": 0, "dropped_by_workers": 0,
            "closed": False,
        }  # fmt: skip


def _is_dead(actor: ray.actor.ActorHandle) -> bool:
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=10)
    except ray.exceptions.RayActorError:
        return True
    return False


def test_a_sink_of_an_older_release_is_read_as_records(head: LocalRayHead, tmp_path: Path) -> None:
    from service_support import make_settings

    from service.ingester import Ingester
    from service.ray_client import RayGateway
    from tail_ray.metrics.sink import SINK_NAMESPACE, sink_actor_name

    job_id = "old-sink-job"
    records = [
        {"seq": i + 1, **r} for i, r in enumerate(r for s in range(30) for r in step_records(job_id, s))
    ]
    old = _SinkOfAnOlderRelease.options(  # type: ignore[attr-defined]
        name=sink_actor_name(job_id), namespace=SINK_NAMESPACE, lifetime="detached"
    ).remote(records)
    settings = make_settings(tmp_path / "service.sqlite", head, ingest_batch_records=100)
    with open_storage(settings.storage_url) as store:
        store.insert_job(job_id=job_id, name="old", source="ray", status="RUNNING", entrypoint="x", spec=None)
        gateway = RayGateway(settings)
        ingester = Ingester(settings, store, gateway)
        try:
            assert ingester.lease.try_acquire()
            assert ingester.drain() == len(records)
            assert store.seqs(job_id) == list(range(1, len(records) + 1))
            assert store.summary(job_id)["steps"] == 30
            assert job_id in gateway._record_sinks
            ray.kill(old)  # the sink goes: the gateway keeps nothing of it (a month of jobs)
            # ray.kill is asynchronous: a read sent at once can still be answered by the live
            # actor (CI saw it), so wait until this driver's handle knows the actor is dead.
            wait_for(lambda: _is_dead(old), 30, "the killed sink to be dead")
            ingester.drain()
            assert job_id not in gateway._sinks and job_id not in gateway._reads
            assert job_id not in gateway._record_sinks
        finally:
            ingester.close()
            ray.kill(old)
