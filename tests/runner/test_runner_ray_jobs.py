"""Training jobs on a real local Ray cluster (one per module, 2 CPUs, private ports).

One 2-worker job runs once (module fixture); the tests then check what it left: the result,
the sink's records from both ranks, the checkpoint files; a second run of the same job id on
ONE worker resumes from that checkpoint with a new world size (an elastic shrink and the
world-size-1 path in one go); and the same entrypoint goes through the Ray Jobs API.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
import ray
import torch

from tail_ray.metrics.sink import close_sink, find_sink
from tail_ray.runner.checkpoint import TRAIN_STATE_FILE, rank_file
from tail_ray.runner.config import JobConfig
from tail_ray.runner.datasets import make_dataset
from tail_ray.runner.models import make_model
from tail_ray.runner.trainer import FaultInjection, run_job
from tests.ray_cluster import connected_cluster

pytestmark = pytest.mark.ray

REPO_ROOT = Path(__file__).resolve().parents[2]
METHOD = "tail"
STEPS = 20
RESUMED_STEPS = 30
FAIL_AT_STEP = 15  # after the step-10 checkpoint


@pytest.fixture(scope="module")
def cluster():
    with connected_cluster(num_cpus=2, include_dashboard=True) as c:
        yield c


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("ray-results")


def job_config(storage: Path, **overrides) -> JobConfig:
    base = JobConfig.from_yaml(REPO_ROOT / "jobs/configs/smoke.yaml")
    settings = {
        "method": METHOD,
        "steps": STEPS,
        "checkpoint_every_steps": 10,
        "metrics_every_steps": 5,
        "storage_path": str(storage),
        # Both workers share this host, where the link-aware switch would send plain
        # all-reduce (folding the residuals these tests check in the checkpoint).
        "compression.link_aware": "false",
        **overrides,
    }
    return base.with_overrides([f"{k}={v}" for k, v in settings.items()])


def sink_records(job_id: str) -> list[dict]:
    sink = find_sink(job_id)
    assert sink is not None, f"no metrics sink for {job_id}"
    return ray.get(sink.read.remote(0, 100_000))["records"]


def param_names() -> set[str]:
    return {n for n, _ in make_model("digits_cnn", make_dataset("digits")).named_parameters()}


@pytest.fixture(scope="module")
def two_worker_run(cluster, storage):
    job_id = f"runner-test-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    # The last rank dies before step FAIL_AT_STEP; FailureConfig(max_failures=1) restarts the
    # group, which resumes from the step-10 checkpoint and finishes.
    faults = FaultInjection(fail_at_step=FAIL_AT_STEP)
    result = run_job(job_config(storage, max_failures=1), job_id, faults=faults)
    print(f"\n2-worker {METHOD} job, {STEPS} steps: {time.monotonic() - t0:.1f} s; {result.summary}")
    yield result
    close_sink(job_id)


def test_two_worker_job_survives_a_worker_failure_and_reports(two_worker_run):
    r = two_worker_run
    assert r.ok, r.error
    assert r.summary["step"] == STEPS
    assert r.summary["resumed_from_step"] == 10  # restarted from the latest checkpoint
    assert r.summary["world_size"] == 2
    assert 0.0 <= r.summary["val_accuracy"] <= 1.0
    assert r.summary["bytes_sent_per_step"] > 0
    assert r.summary["traffic_ratio"] > 0


def test_sink_holds_layer_and_step_records_from_both_ranks(two_worker_run):
    records = sink_records(two_worker_run.job_id)
    steps = [r for r in records if r["type"] == "step"]
    layers = [r for r in records if r["type"] == "layer"]
    for rank in (0, 1):
        mine = [r["step"] for r in steps if r["rank"] == rank]
        assert set(mine) == set(range(STEPS))
        # Steps before the checkpoint ran once, steps after the failure once (the restart);
        # steps between the checkpoint and the failure may show up twice.
        assert all(mine.count(s) == 1 for s in [*range(10), *range(FAIL_AT_STEP, STEPS)])
        mine_records = [r for r in steps if r["rank"] == rank]
        assert all(r["world_size"] == 2 and r["method"] == METHOD for r in mine_records)
        assert all(r["bytes_sent"] > 0 and r["loss"] > 0 for r in mine_records)
        assert {r["layer"] for r in layers if r["rank"] == rank} == param_names()
    assert all(r["job_id"] == two_worker_run.job_id for r in records)
    assert ray.get(find_sink(two_worker_run.job_id).stats.remote())["closed"]


def test_checkpoint_holds_every_rank_and_the_model(two_worker_run):
    ckpt = Path(two_worker_run.checkpoint_path)
    assert {TRAIN_STATE_FILE, rank_file(0), rank_file(1)} <= {p.name for p in ckpt.iterdir()}
    state = torch.load(ckpt / TRAIN_STATE_FILE, weights_only=False)
    assert state["step"] == STEPS and state["world_size"] == 2
    assert set(state["model"]) == param_names()


def test_checkpoint_restores_the_hook_state_by_layer_name(two_worker_run):
    """Each rank's hook state, saved by the job, loads into a fresh hook built on a fresh model
    (new parameter objects): layers match by name, residuals and controller state come back;
    the resize path keeps the controller and drops the per-worker residuals."""
    from tail_ray.collective import make_hook_state

    ckpt = Path(two_worker_run.checkpoint_path)
    names = param_names()
    for rank in (0, 1):
        saved = torch.load(ckpt / rank_file(rank), weights_only=False)["hook"]
        assert saved["method"] == METHOD
        residuals = saved["compressor"]["residuals"]
        assert residuals and set(residuals) <= names
        assert set(saved["compressor"]["layer_steps"]) == names

        fresh = make_hook_state(make_model("digits_cnn", make_dataset("digits")), METHOD, {})
        fresh.load_state_dict(saved)
        back = fresh.state_dict()["compressor"]
        assert set(back["residuals"]) == set(residuals)
        for name, tensor in residuals.items():
            assert torch.equal(back["residuals"][name], tensor), name
        assert back["layer_steps"] == saved["compressor"]["layer_steps"]

        resized = make_hook_state(make_model("digits_cnn", make_dataset("digits")), METHOD, {})
        resized.load_state_dict(saved, residuals=False)
        kept = resized.state_dict()["compressor"]
        assert not kept["residuals"]
        assert kept["controller"]["plans"].keys() == saved["compressor"]["controller"]["plans"].keys()
    r0, r1 = (torch.load(ckpt / rank_file(r), weights_only=False)["hook"] for r in (0, 1))
    some = next(iter(r0["compressor"]["residuals"]))
    # Residuals are per worker: the two ranks saw different batches.
    assert not torch.equal(r0["compressor"]["residuals"][some], r1["compressor"]["residuals"][some])


def test_resume_on_one_worker_from_the_two_worker_checkpoint(two_worker_run, storage):
    """Same job id -> Ray Train finds the run's checkpoints and the loop resumes at step
    STEPS, now with world size 1 (no DDP wrapper): it must still train and report."""
    job_id = two_worker_run.job_id
    seen = ray.get(find_sink(job_id).read.remote(0, 1))["last_seq"]
    cfg = job_config(storage, steps=RESUMED_STEPS, min_workers=1, max_workers=1)
    r = run_job(cfg, job_id)
    assert r.ok, r.error
    assert r.summary["world_size"] == 1 and r.summary["step"] == RESUMED_STEPS
    new = [rec for rec in ray.get(find_sink(job_id).read.remote(seen, 100_000))["records"]]
    new_steps = [rec for rec in new if rec["type"] == "step"]
    assert sorted(rec["step"] for rec in new_steps) == list(range(STEPS, RESUMED_STEPS))
    assert all(rec["world_size"] == 1 and rec["rank"] == 0 for rec in new_steps)
    assert {rec["layer"] for rec in new if rec["type"] == "layer"} == param_names()


@pytest.mark.slow
def test_entrypoint_through_the_ray_jobs_api(cluster):
    """`python -m jobs.train --config jobs/configs/smoke.yaml` submitted with the Jobs API
    (token auth) to this module's cluster: it succeeds, its submission id is the metrics job
    id, and the sink holds its records. Slowest test here (~40-60 s on 2 shared cores: a job
    driver process, then Ray Train's controller and 2 workers)."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(cluster.dashboard_url)
    submission_id = f"runner-submit-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    client.submit_job(
        entrypoint="python -m jobs.train --config jobs/configs/smoke.yaml --set steps=20 "
        "--set storage_path=/tmp/tail-ray-test-results",
        submission_id=submission_id,
        runtime_env={
            "working_dir": str(REPO_ROOT),
            "excludes": [".git", "**/__pycache__", "*.egg-info"],
            "env_vars": {"RAY_AUTH_MODE": "token"},
        },
    )
    deadline = time.monotonic() + 240
    status = client.get_job_status(submission_id)
    while not status.is_terminal() and time.monotonic() < deadline:
        time.sleep(1.0)
        status = client.get_job_status(submission_id)
    logs = client.get_job_logs(submission_id)
    print(f"\nJobs API smoke job: {status} after {time.monotonic() - t0:.1f} s")
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    summary = json.loads(logs.strip().splitlines()[-1])  # the CLI's last line is its summary
    assert summary["job_id"] == submission_id and summary["ok"] and summary["step"] == 20
    records = sink_records(submission_id)
    assert {r["rank"] for r in records if r["type"] == "step"} == {0, 1}
    close_sink(submission_id)
