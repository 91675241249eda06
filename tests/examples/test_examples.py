"""The example scripts as users run them: GPT-2 under torchrun with no Ray at all (metrics in
JSON lines), ResNet-18 and the frozen/unused/accumulation model as Ray jobs on a real cluster
(`JobSubmissionClient`, working_dir examples/, token auth): every optimizer step of both
workers reaches the job's sink under the model's own layer names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import ray

from tail_ray.metrics.sink import close_sink, find_sink
from tests.ray_cluster import connected_cluster

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 4
PINNED = '{"link_aware": false}'  # both workers share this host: keep compression on


def _trainable(module_name: str) -> set[str]:
    import importlib

    model = importlib.import_module(f"examples.{module_name}").build_model(0)
    return {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.slow
def test_gpt2_under_torchrun_without_ray_writes_json_lines(tmp_path: Path) -> None:
    env = {**os.environ, "TAIL_RAY_METRICS_DIR": str(tmp_path), "TAIL_RAY_JOB_ID": "gpt2-torchrun"}
    done = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(EXAMPLES / "gpt2_tiny.py"), "--no-ray", "--steps", str(STEPS), "--compression", PINNED,
        ],
        env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["val_loss"] > 0
    for rank in (0, 1):
        lines = [
            json.loads(x) for x in (tmp_path / f"gpt2-torchrun.rank{rank}.jsonl").read_text().splitlines()
        ]
        steps = [r for r in lines if r["type"] == "step"]
        assert [r["step"] for r in steps] == list(range(STEPS))
        assert all(r["world_size"] == 2 and r["bytes_sent"] > 0 and r["loss"] > 0 for r in steps)
        assert {r["layer"] for r in lines if r["type"] == "layer"} == _trainable("gpt2_tiny")


@pytest.fixture(scope="module")
def cluster():  # type: ignore[no-untyped-def]
    with connected_cluster(num_cpus=2, include_dashboard=True) as c:
        yield c


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "args"),
    [
        ("resnet18_cifar", ["--checkpoint-every", "2", "--batch-size", "8"]),
        ("frozen_accum", ["--accumulate", "2"]),
    ],
)
def test_example_as_a_ray_job(cluster, script: str, args: list[str]) -> None:  # type: ignore[no-untyped-def]
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(cluster.dashboard_url)
    job_id = f"example-{script}-{uuid.uuid4().hex[:6]}"
    client.submit_job(
        entrypoint=f"{sys.executable} {script}.py --workers 2 --steps {STEPS} --compression '{PINNED}' "
        + " ".join(args),
        submission_id=job_id,
        runtime_env={"working_dir": str(EXAMPLES), "env_vars": {"RAY_AUTH_MODE": "token"}},
    )
    deadline = time.monotonic() + 300
    while not (status := client.get_job_status(job_id)).is_terminal() and time.monotonic() < deadline:
        time.sleep(1.0)
    logs = client.get_job_logs(job_id)
    assert status.value == "SUCCEEDED", logs[-4000:]
    assert "val_accuracy" in logs
    sink = find_sink(job_id)  # named after the submission id: what the service looks for
    assert sink is not None
    records = ray.get(sink.read.remote(0, 100_000))["records"]
    for rank in (0, 1):
        steps = [r["step"] for r in records if r["type"] == "step" and r["rank"] == rank]
        assert steps == list(range(STEPS)), (rank, steps)  # one record per optimizer step
    assert {r["layer"] for r in records if r["type"] == "layer"} == _trainable(script)
    close_sink(job_id)
