"""Bring your own model, end to end on a real Ray cluster: a model defined only here (in no
registry), trained by a user script whose one tail-ray line is ``tail_ray.train.prepare_model``.

1. Through REST, as `tail-ray submit --working-dir DIR -- python my_train.py` does it: the
   directory is uploaded as a package, the job runs the script in it on 2 workers, and is
   followed to SUCCEEDED; its per-layer metrics carry the script's own layer names.
2. The same script with the real `ray job submit` CLI (RAY_AUTH_MODE=token) against this
   module's head, on 1 worker (no DDP wrapper): the service discovers it (its model made a
   metrics sink), lists it in GET /v1/jobs, ingests its metrics, exports them to Prometheus,
   and the dashboard in headless Chromium shows its layers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from service_support import API_TOKEN, AUTH, LiveServer, chromium_page, make_settings, ray_cluster, wait_for

from service import cli
from service.ray_head import LocalRayHead

pytestmark = [pytest.mark.ray, pytest.mark.browser, pytest.mark.slow]

STEPS = 12
MODEL_LAYERS = {
    "stem.weight", "stem.bias", "mixer.weight", "mixer.bias", "readout.weight", "readout.bias",
}  # fmt: skip
USER_SCRIPT = '''
"""A user's own training script: their model, their loop, one tail-ray line."""
import argparse

import ray.train
import torch
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer
from torch import nn

import tail_ray.train


class ByomNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(32, 160)
        self.mixer = nn.Linear(160, 160)
        self.readout = nn.Linear(160, 3)

    def forward(self, x):
        return self.readout(torch.tanh(self.mixer(torch.tanh(self.stem(x)))))


def loop(config):
    torch.manual_seed(0)
    model = tail_ray.train.prepare_model(ByomNet(), "tail", {"link_aware": False})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(ray.train.get_context().get_world_rank())
    for step in range(config["steps"]):
        x = torch.randn(16, 32, generator=g)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        tail_ray.train.report_loss(loss)
        optimizer.step()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    TorchTrainer(
        loop, train_loop_config={"steps": args.steps}, scaling_config=ScalingConfig(num_workers=args.workers)
    ).fit()
'''


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayHead]:
    with ray_cluster(tmp_path_factory.mktemp("ray"), num_cpus=2) as h:
        yield h


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("user-code")
    (directory / "my_train.py").write_text(USER_SCRIPT)
    (directory / "__pycache__").mkdir()  # left out of the upload
    (directory / "__pycache__" / "junk.pyc").write_bytes(b"\0" * 10)
    return directory


def _follow(api: httpx.Client, job_id: str, timeout_s: float) -> dict:
    def ended() -> dict | None:
        job = api.get(f"/v1/jobs/{job_id}").json()
        return job if job["status"] in ("SUCCEEDED", "FAILED", "STOPPED") else None

    job = wait_for(ended, timeout_s, f"job {job_id} to end", interval_s=1.0)
    if job["status"] != "SUCCEEDED":
        logs = api.get(f"/v1/jobs/{job_id}/logs", headers=AUTH).json()["logs"]
        raise AssertionError(f"{job['status']}: {job['message'][-1500:]}\n{logs[-4000:]}")
    return job


def _drained(api: httpx.Client, job_id: str) -> dict:
    return wait_for(
        lambda: (s := api.get(f"/v1/jobs/{job_id}/metrics/summary").json())["ingest"]["drained"] and s,
        60,
        f"the metrics of {job_id} to drain",
        interval_s=0.5,
    )


def test_own_model_through_rest_with_an_uploaded_working_dir(
    head: LocalRayHead, tmp_path: Path, user_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    settings = make_settings(tmp_path / "db.sqlite", head, job_python=sys.executable)
    with LiveServer(settings) as server:
        api = httpx.Client(base_url=server.url, timeout=30)
        command = ["python", "my_train.py", "--workers", "2", "--steps", str(STEPS)]
        argv = [
            "--url",
            server.url,
            "--token",
            API_TOKEN,
            "submit",
            "--working-dir",
            str(user_dir),
            "--",
            *command,
        ]
        assert cli.main(argv) == 0
        printed = capsys.readouterr().out
        assert "1 files" in printed and "submitted tail-" in printed  # the .pyc stayed home
        job = api.get("/v1/jobs").json()["items"][0]
        assert job["source"] == "api" and job["name"] == "my_train"
        assert job["spec"]["entrypoint"] == {"script": "my_train.py", "module": None, "args": command[2:]}
        _follow(api, job["id"], 300)
        summary = _drained(api, job["id"])
        assert summary["steps"] == STEPS and summary["world_sizes"] == [2]
        assert summary["bytes_sent"] > 0 and summary["ratio"] > 1  # compressed
        layers = api.get(f"/v1/jobs/{job['id']}/metrics/layers").json()
        assert {row["layer"] for row in layers} == MODEL_LAYERS  # the test model's own names
        assert all(row["ranks"] == 2 and row["step"] == STEPS - 1 for row in layers)
        mixer = next(row for row in layers if row["layer"] == "mixer.weight")
        assert mixer["bits"] < 32 and mixer["ratio"] > 1
        steps = api.get(f"/v1/jobs/{job['id']}/metrics/steps").json()["items"]
        assert [p["step"] for p in steps] == list(range(STEPS))
        assert all(p["loss"] is not None and p["loss"] > 0 for p in steps)  # report_loss made it through


def test_own_model_through_ray_job_submit_is_discovered_and_shown(
    head: LocalRayHead, tmp_path: Path, user_dir: Path
) -> None:
    submission_id = f"byom-{uuid.uuid4().hex[:8]}"
    ray_cli = Path(sys.executable).parent / "ray"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": head.ports.dashboard_url}
    submitted = subprocess.run(
        [
            str(ray_cli), "job", "submit", "--address", head.ports.dashboard_url, "--no-wait",
            "--submission-id", submission_id, "--working-dir", str(user_dir), "--",
            sys.executable, "my_train.py", "--workers", "1", "--steps", str(STEPS),
        ],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    with LiveServer(make_settings(tmp_path / "db.sqlite", head)) as server, chromium_page() as page:
        api = httpx.Client(base_url=server.url, timeout=30)

        def listed() -> dict | None:
            return next((j for j in api.get("/v1/jobs").json()["items"] if j["id"] == submission_id), None)

        job = wait_for(listed, 180, "the ray-job-submit job in GET /v1/jobs", interval_s=1.0)
        assert job["source"] == "ray" and job["spec"] is None and job["name"] == "my_train"
        _follow(api, submission_id, 300)
        summary = _drained(api, submission_id)
        assert summary["steps"] == STEPS and summary["world_sizes"] == [1]  # no DDP wrapper
        layers = api.get(f"/v1/jobs/{submission_id}/metrics/layers").json()
        assert {row["layer"] for row in layers} == MODEL_LAYERS

        text = api.get("/metrics").text
        assert f'tail_ray_layer_ratio{{job_id="{submission_id}",layer="mixer.weight"}}' in text
        assert f'tail_ray_job_steps{{job_id="{submission_id}"}} {float(STEPS)}' in text

        page.goto(f"{server.url}/?poll_ms=300#job={submission_id}")
        page.wait_for_function(
            "n => window.tailDashboard.charts.layer.data.labels.length === n",
            arg=len(MODEL_LAYERS),
            timeout=30_000,
        )
        assert set(page.evaluate("() => window.tailDashboard.charts.layer.data.labels")) == MODEL_LAYERS
        page.wait_for_function(
            f"() => document.getElementById('last-step').textContent === '{STEPS - 1}'", timeout=30_000
        )
        rows = page.locator("#jobs-table tbody tr").all_inner_texts()
        assert any(r.startswith("my_train") and "(ray job submit)" in r for r in rows), rows
        assert page.locator("#layer-table tbody tr").count() == len(MODEL_LAYERS)
        assert page.locator("#world-size").inner_text() == "1"
