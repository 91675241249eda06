"""Elastic scale-up on a real Ray cluster: a (1, 2)-worker job starts on a one-CPU cluster
with one worker; a second node joins; Ray Train resizes the group to two workers, which
resume from the latest checkpoint with the new world size (controller state kept, what the
residuals owed carried into the first step). The job is a real `python -m jobs.train` Ray
job, stopped once the resized group has trained (its step budget is deliberately far away)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import ray

from tail_ray.metrics.sink import close_sink, find_sink
from tests.ray_cluster import connected_cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT_EVERY = 20
DEADLINE_S = 240.0


@pytest.fixture(scope="module")
def cluster():
    with connected_cluster(num_cpus=1, include_dashboard=True) as c:
        yield c


def step_records(job_id: str) -> list[dict]:
    sink = find_sink(job_id)
    if sink is None:
        return []
    return [r for r in ray.get(sink.read.remote(0, 1_000_000))["records"] if r["type"] == "step"]


def wait_for(predicate, what: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}")


def test_job_grows_from_one_to_two_workers_when_a_node_joins(cluster, tmp_path):
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(cluster.dashboard_url)
    job_id = f"runner-elastic-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    deadline = t0 + DEADLINE_S
    client.submit_job(
        entrypoint=" ".join(
            [
                "python -m jobs.train --config jobs/configs/smoke.yaml",
                "--set min_workers=1 --set max_workers=2 --set elastic_resize_interval_s=2",
                f"--set steps=1000000 --set checkpoint_every_steps={CHECKPOINT_EVERY}",
                f"--set metrics_every_steps=5 --set max_failures=2 --set storage_path={tmp_path}",
            ]
        ),
        submission_id=job_id,
        runtime_env={
            "working_dir": str(REPO_ROOT),
            "excludes": [".git", "**/__pycache__", "*.egg-info"],
            "env_vars": {"RAY_AUTH_MODE": "token"},
        },
    )
    try:
        wait_for(
            lambda: any(r["step"] >= CHECKPOINT_EVERY for r in step_records(job_id)),
            "the one-worker group to pass its first checkpoint",
            deadline,
        )
        grown_at = time.monotonic()
        cluster.add_worker_node(num_cpus=1)
        wait_for(
            lambda: {r["rank"] for r in step_records(job_id) if r["world_size"] == 2} == {0, 1},
            "records from a two-worker group",
            deadline,
        )
        print(
            f"\nelastic: 1 worker for {grown_at - t0:.1f} s, resized to 2 within "
            f"{time.monotonic() - grown_at:.1f} s of the node joining"
        )
    finally:
        client.stop_job(job_id)
        stop_deadline = time.monotonic() + 60
        wait_for(lambda: client.get_job_status(job_id).is_terminal(), "the job to stop", stop_deadline)

    records = step_records(job_id)
    one = [r["step"] for r in records if r["world_size"] == 1]
    two = [r["step"] for r in records if r["world_size"] == 2]
    assert one and all(r["rank"] == 0 for r in records if r["world_size"] == 1)
    first_two = min(two)
    # The two-worker group resumed from a checkpoint the one-worker group wrote.
    assert first_two % CHECKPOINT_EVERY == 0
    assert CHECKPOINT_EVERY <= first_two <= max(one) + 1
    close_sink(job_id)
