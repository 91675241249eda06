"""End to end on a real local Ray cluster: submit a real 2-worker training job over REST, watch
per-layer metrics from both workers arrive, stop the service mid-job, start it again, and check
that nothing ingested was lost or doubled and that the rest of the job was read after."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from service_support import API_TOKEN, AUTH, LiveServer, make_settings, ray_cluster, wait_for

from service import cli
from service.main import create_app
from service.ray_head import LocalRayHead
from service.storage import Storage

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = 150
MODEL_LAYERS = {
    "conv1.weight",
    "conv1.bias",
    "conv2.weight",
    "conv2.bias",
    "fc1.weight",
    "fc1.bias",
    "fc2.weight",
    "fc2.bias",
}


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayHead]:
    with ray_cluster(tmp_path_factory.mktemp("ray"), num_cpus=2) as h:
        yield h


def test_real_job_metrics_survive_a_service_restart(
    head: LocalRayHead, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    db = tmp_path / "db.sqlite"
    spec = {
        "name": "e2e-digits", "method": "none", "min_workers": 2, "max_workers": 2, "steps": STEPS,
        "batch_size": 16, "checkpoint_every_steps": STEPS, "metrics_every_steps": 1, "max_failures": 0,
    }  # fmt: skip
    with TestClient(create_app(make_settings(db, head))) as client:
        created = client.post("/v1/jobs", json=spec, headers=AUTH)
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]

        def two_ranks() -> bool:
            layers = client.get(f"/v1/jobs/{job_id}/metrics/layers").json()
            status = client.get(f"/v1/jobs/{job_id}").json()["status"]
            assert status != "FAILED", client.get(f"/v1/jobs/{job_id}/logs").json()["logs"][-3000:]
            return bool(layers) and all(row["ranks"] == 2 for row in layers)

        wait_for(two_ranks, 180, "per-layer records from 2 workers", interval_s=0.5)
    # The service is down now; the job keeps training and its sink keeps buffering.
    store = Storage(db)
    before = store.seqs(job_id)
    assert before and before == list(range(1, len(before) + 1))

    with LiveServer(make_settings(db, head)) as server:
        api = httpx.Client(base_url=server.url, timeout=30)

        def finished_and_drained() -> bool:
            job = api.get(f"/v1/jobs/{job_id}").json()
            assert job["status"] not in ("FAILED", "STOPPED"), job["message"][-2000:]
            return api.get(f"/v1/jobs/{job_id}/metrics/summary").json()["ingest"]["drained"]

        wait_for(finished_and_drained, 240, "the job to finish and its metrics to drain", interval_s=0.5)
        after = store.seqs(job_id)
        assert after[: len(before)] == before  # everything ingested before the restart is still there
        assert after == list(range(1, len(after) + 1))  # ... and nothing is missing or doubled
        assert len(after) > len(before)

        summary = api.get(f"/v1/jobs/{job_id}/metrics/summary").json()
        assert summary["ingest"]["missed"] == 0 and summary["ingest"]["cursor_seq"] == len(after)
        assert summary["steps"] == STEPS and summary["world_sizes"] == [2]
        assert summary["ratio"] == pytest.approx(1.0)  # method "none" sends the raw gradients
        layers = api.get(f"/v1/jobs/{job_id}/metrics/layers").json()
        assert {row["layer"] for row in layers} == MODEL_LAYERS
        assert {(row["step"], row["ranks"]) for row in layers} == {(STEPS - 1, 2)}
        steps = api.get(f"/v1/jobs/{job_id}/metrics/steps", params={"limit": 5000}).json()["items"]
        assert [p["step"] for p in steps] == list(range(STEPS))
        assert all(p["ranks"] == 2 and p["bytes_sent"] == p["raw_bytes"] > 0 for p in steps)
        assert cli._result_line(api.get(f"/v1/jobs/{job_id}/logs").json()["logs"])["ok"] is True

        # The CLI reads the same through the REST API.
        assert cli.main(["--url", server.url, "--token", API_TOKEN, "jobs"]) == 0
        listing = capsys.readouterr().out
        assert job_id in listing and "SUCCEEDED" in listing
        assert cli.main(["--url", server.url, "--token", API_TOKEN, "metrics", job_id]) == 0
        table = capsys.readouterr().out
        assert all(layer in table for layer in MODEL_LAYERS) and "ratio 1.00x" in table
