"""PostgreSQL goes away under a running service and comes back: requests that need the
database answer 503 `database_unavailable` (not 500, and within the pool's timeout, not
hanging), /readyz says why, /healthz stays 200, and the service recovers by itself."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from service_support import make_settings, wait_for

from jobs.local_postgres import LocalPostgres
from service.main import create_app
from service.storage import open_storage


@pytest.fixture
def server() -> Iterator[LocalPostgres]:
    with LocalPostgres() as pg:  # its own server: this test stops it
        yield pg


def test_a_database_outage_is_a_503_and_the_service_recovers(server: LocalPostgres) -> None:
    url = server.create_database()
    with open_storage(url) as store:
        store.insert_job(job_id="j1", name="j1", source="api", status="RUNNING", entrypoint="x", spec=None)
    with TestClient(create_app(make_settings(url, None))) as client:
        assert client.get("/v1/jobs").json()["total"] == 1
        server.stop_server()
        t0 = time.monotonic()
        for path in ("/v1/jobs", "/v1/jobs/j1/metrics/summary"):
            resp = client.get(path)
            assert resp.status_code == 503, (path, resp.text)
            assert resp.json()["code"] == "database_unavailable"
        assert time.monotonic() - t0 < 60  # the pool's timeout, not a hang
        ready = client.get("/readyz").json()
        assert ready["status"] == "unavailable" and "not writable" in ready["checks"]["database"]
        assert client.get("/healthz").status_code == 200

        server.start_server()
        wait_for(lambda: client.get("/v1/jobs").status_code == 200, 60, "the service to reconnect")
        assert client.get("/v1/jobs/j1/metrics/summary").json()["job_id"] == "j1"
