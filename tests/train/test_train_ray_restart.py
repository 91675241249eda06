"""A user's own loop on a real Ray cluster keeps Tail's controller across a restart: the hook
state goes into the user's ray.train.Checkpoint with tail_ray.train.save_checkpoint, a worker
dies, Ray Train restarts the group from that checkpoint, load_checkpoint brings the state back
(exactly: same world size), and the step records go on from the checkpoint's step."""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path

import pytest
import ray

from tail_ray.metrics.sink import close_sink, find_sink
from tests.ray_cluster import connected_cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS, CHECKPOINT_AT, FAIL_AT = 10, 4, 6
SCRIPT = f"""
import json, tempfile
import ray.train, torch
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch import nn
import tail_ray.train


def loop(config):
    torch.manual_seed(0)
    model = tail_ray.train.prepare_model(nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 4)),
                                         "tail", {{"link_aware": False}})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    session = tail_ray.train.current_session()
    restored = None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            restored = tail_ray.train.load_checkpoint(d)
            model.module.load_state_dict(torch.load(d + "/model.pt"))
    start = session.step
    g = torch.Generator().manual_seed(session.rank)
    for step in range(start, {STEPS}):
        if step == {FAIL_AT} and checkpoint is None and session.rank == 1:
            raise RuntimeError("injected failure")
        x = torch.randn(16, 64, generator=g)
        loss = model(x).square().mean()
        optimizer.zero_grad(); loss.backward(); optimizer.step()
        if step + 1 == {CHECKPOINT_AT}:
            with tempfile.TemporaryDirectory() as tmp:
                if session.rank == 0:
                    torch.save(model.module.state_dict(), tmp + "/model.pt")
                tail_ray.train.save_checkpoint(tmp)
                ray.train.report({{"step": step + 1}}, checkpoint=Checkpoint.from_directory(tmp))
    layer_steps = tail_ray.train.state_dict()["hook"]["compressor"]["layer_steps"]
    if session.rank == 0:  # a worker's print reaches the job's log through the driver
        result = {{"restored": restored, "start": start, "layer_steps": layer_steps}}
        print("RESULT", json.dumps(result), flush=True)


TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=2),
                      run_config=RunConfig(failure_config=FailureConfig(max_failures=1))).fit()
"""


@pytest.fixture(scope="module")
def cluster():  # type: ignore[no-untyped-def]
    with connected_cluster(num_cpus=2, include_dashboard=True) as c:
        yield c


def test_a_restart_resumes_the_controller_from_the_users_checkpoint(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from ray.job_submission import JobSubmissionClient

    (tmp_path / "restart.py").write_text(SCRIPT)
    client = JobSubmissionClient(cluster.dashboard_url)
    job_id = f"restart-{uuid.uuid4().hex[:6]}"
    client.submit_job(
        entrypoint=f"{sys.executable} restart.py",
        submission_id=job_id,
        runtime_env={"working_dir": str(tmp_path), "env_vars": {"RAY_AUTH_MODE": "token"}},
    )
    deadline = time.monotonic() + 300
    while not (status := client.get_job_status(job_id)).is_terminal() and time.monotonic() < deadline:
        time.sleep(1.0)
    logs = client.get_job_logs(job_id)
    assert status.value == "SUCCEEDED", logs[-4000:]
    line = next(x for x in reversed(logs.splitlines()) if "RESULT " in x)
    final = json.loads(line.split("RESULT ", 1)[1])
    assert final["restored"] is True and final["start"] == CHECKPOINT_AT  # exact: same world size
    # The controller counted every step of the run, not only those after the restart.
    assert set(final["layer_steps"].values()) == {STEPS}
    records = ray.get(find_sink(job_id).read.remote(0, 100_000))["records"]
    for rank in (0, 1):
        steps = [r["step"] for r in records if r["type"] == "step" and r["rank"] == rank]
        # First attempt: 0.. up to the failure; after the restart: CHECKPOINT_AT..STEPS-1.
        assert steps[-(STEPS - CHECKPOINT_AT) :] == list(range(CHECKPOINT_AT, STEPS)), (rank, steps)
        assert steps[:CHECKPOINT_AT] == list(range(CHECKPOINT_AT)), (rank, steps)
    close_sink(job_id)
