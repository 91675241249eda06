"""The control plane under faults, on one real Ray head (one per module, stopped by pid):

- a sink that overflows before the ingester reads it: the drops are counted and visible in
  the API (summary and Prometheus), and what survived is stored exactly once;
- the Ray head goes away under a running service (a uvicorn subprocess): `/readyz` turns 503
  and the job routes answer a clear 503; the head comes back on the same ports: the service
  recovers by itself, without a restart;
- the service's own output (its logs), its responses and the dashboard page never contain the
  API token or the Ray token.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
from fastapi.testclient import TestClient
from service_support import make_settings, step_records, wait_for

from service.main import create_app
from service.ray_head import HeadPorts, LocalRayHead, free_port, read_token_file
from service.settings import REPO_ROOT
from service.storage import open_storage
from tail_ray.metrics.sink import get_or_create_sink

pytestmark = pytest.mark.ray

SINK_CAPACITY = 50


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayHead]:
    h = LocalRayHead(HeadPorts.pick(), num_cpus=1, log_path=tmp_path_factory.mktemp("ray") / "head.log")
    h.start()
    try:
        yield h
    finally:
        h.stop()


def _insert_running_job(db: Path, job_id: str) -> None:
    with open_storage(db) as store:
        store.insert_job(
            job_id=job_id,
            name=job_id,
            source="ray",
            status="RUNNING",
            entrypoint="python -m jobs.train",
            spec=None,
        )


def test_sink_overflow_is_counted_and_visible_in_the_api(head: LocalRayHead, tmp_path: Path) -> None:
    """The sink's ring holds SINK_CAPACITY records; 4 steps x 2 ranks x 5 records = 40 fit,
    10 steps = 100 do not: the 50 oldest are dropped before anyone reads them."""
    db = tmp_path / "db.sqlite"
    job_id = "overflow-job"
    _insert_running_job(db, job_id)
    ray.init(address=head.ports.gcs_address, log_to_driver=False, configure_logging=False)
    try:
        sink = get_or_create_sink(job_id, capacity_records=SINK_CAPACITY)
        pushed = 0
        for step in range(10):
            recs = step_records(job_id, step)
            ray.get(sink.push.remote(recs))
            pushed += len(recs)
        dropped = pushed - SINK_CAPACITY
        assert dropped == 50
        with TestClient(create_app(make_settings(db, head))) as client:
            base = f"/v1/jobs/{job_id}/metrics"
            wait_for(
                lambda: client.get(f"{base}/summary").json()["ingest"]["cursor_seq"] == pushed, 20, "ingest"
            )
            ingest = client.get(f"{base}/summary").json()["ingest"]
            assert ingest["missed"] == dropped  # asked for from seq 1, the first 50 were gone
            assert ingest["dropped_in_sink"] == dropped
            assert ingest["records"] == SINK_CAPACITY
            with open_storage(db) as store:
                assert store.seqs(job_id) == list(range(dropped + 1, pushed + 1))
            assert f'tail_ray_job_missed_records_total{{job_id="{job_id}"}} {float(dropped)}' in (
                client.get("/metrics").text
            )
    finally:
        ray.shutdown()


def _start_service(env: dict[str, str], port: int, log_path: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "uvicorn", "--factory", "service.main:create_app",
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "info",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _get(f"{url}/healthz") == 200 or proc.poll() is not None, 60, "service up")
    except AssertionError:
        proc.kill()
        raise
    assert proc.poll() is None, log_path.read_text()[-3000:]
    return proc


def _get(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5.0).status_code
    except httpx.HTTPError:
        return None


@pytest.mark.slow
def test_ray_head_outage_gives_503_then_recovers_and_tokens_never_leak(
    head: LocalRayHead, tmp_path: Path
) -> None:
    api_token = secrets.token_urlsafe(24)
    ray_token = read_token_file(Path.home() / ".ray" / "auth_token")
    assert ray_token, "token auth: Ray wrote ~/.ray/auth_token when the head started"
    db = tmp_path / "db.sqlite"
    _insert_running_job(db, "outage-job")
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "TAIL_RAY_API_TOKEN": api_token,
        "TAIL_RAY_RAY_AUTH_TOKEN": ray_token,
        "TAIL_RAY_DB_PATH": str(db),
        "TAIL_RAY_RAY_ADDRESS": head.ports.gcs_address,
        "TAIL_RAY_RAY_DASHBOARD_URL": head.ports.dashboard_url,
        "TAIL_RAY_INGEST_INTERVAL_S": "0.5",
        "TAIL_RAY_SYNC_INTERVAL_S": "1",
        "TAIL_RAY_RAY_TIMEOUT_S": "5",
        # outage-job is a stand-in Ray never had: keep the reconciler from marking it lost
        # before the outage this test is about.
        "TAIL_RAY_LOST_AFTER_S": "3600",
    }
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "service.log"
    service = _start_service(env, port, log_path)
    auth = {"Authorization": f"Bearer {api_token}"}
    bodies: list[str] = []
    try:
        with httpx.Client(base_url=url, timeout=30.0) as client:
            assert wait_for(lambda: client.get("/readyz").status_code == 200, 60, "ready with Ray up")
            # Bad tokens on a mutating route: 401 without, 403 with a wrong one.
            assert client.post("/v1/jobs", json={}).status_code == 401
            wrong = client.post("/v1/jobs", json={}, headers={"Authorization": f"Bearer {api_token[::-1]}"})
            assert wrong.status_code == 403
            bodies.append(wrong.text)

            head.stop()  # the whole Ray cluster goes away (by pid)
            t0 = time.monotonic()
            ready = wait_for(
                lambda: (r := client.get("/readyz")).status_code == 503 and r, 60, "readyz to say not ready"
            )
            outage_detect_s = time.monotonic() - t0
            assert ready.json()["checks"]["database"] == "ok" and ready.json()["checks"]["ray"] != "ok"
            created = client.post("/v1/jobs", json={"name": "during-outage"}, headers=auth)
            assert created.status_code == 503, created.text
            assert created.json()["code"] == "ray_unavailable" and created.json()["detail"]
            stop = client.post("/v1/jobs/outage-job/stop", headers=auth)
            assert stop.status_code == 503 and stop.json()["code"] == "ray_unavailable"
            logs = client.get("/v1/jobs/outage-job/logs", headers=auth)
            assert logs.status_code == 503 and logs.json()["code"] == "ray_unavailable"
            assert client.get("/v1/jobs").status_code == 200  # reads from the database still work
            assert client.get("/healthz").status_code == 200
            bodies += [ready.text, created.text, stop.text, logs.text]
            time.sleep(3)  # let the ingester hit the outage a few times too

            # Same ports (the service was configured with them), a fresh cluster.
            ports = head.ports
            wait_for(ports.all_free, 60, "the old head's ports to be released")
            head.start()
            assert head.ports == ports, "the head came back on other ports"
            t0 = time.monotonic()
            wait_for(lambda: client.get("/readyz").status_code == 200, 90, "readyz to recover")
            recover_s = time.monotonic() - t0
            assert service.poll() is None, "the service died during the outage"
            listed = client.get("/v1/jobs")
            page = client.get("/")
            bodies += [listed.text, page.text, client.get("/static/app.js").text, client.get("/metrics").text]
            bodies.append(client.get("/openapi.json").text)
            print(f"\nRay outage: readyz 503 after {outage_detect_s:.1f} s; ready again {recover_s:.1f} s "
                  "after the head restarted")  # fmt: skip
    finally:
        service.send_signal(signal.SIGTERM)
        try:
            service.wait(timeout=30)
        except subprocess.TimeoutExpired:
            service.kill()
    log_text = log_path.read_text(errors="replace")
    assert "/v1/jobs" in log_text  # the access log was captured: the grep below means something
    assert "ray_unavailable" in log_text or "Ray" in log_text
    for secret in (api_token, ray_token):
        assert secret not in log_text
        assert all(secret not in body for body in bodies)
