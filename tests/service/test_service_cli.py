"""`tail-ray up` for real: a Ray head and the service as subprocesses; Ctrl-C stops exactly them.
The REST commands run in-process against that stack."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from service_support import wait_for

from service import cli
from service.ray_head import HeadPorts, LocalRayHead
from service.settings import REPO_ROOT

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("ending", ["ctrl-c", "service-dies"])
def test_up_serves_the_api_and_stops_what_it_started(
    ending: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    env = dict(os.environ, TAIL_RAY_HOME=str(tmp_path / "home"), RAY_AUTH_MODE="token")
    env.pop("TAIL_RAY_API_TOKEN", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service.cli",
            "up",
            "--port",
            "0",
            "--num-cpus",
            "1",
            "--db",
            str(tmp_path / "db"),
        ],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out: list[str] = []
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            out.append(line)
            if "Ctrl-C to stop" in line:
                break
        text = "".join(out)
        assert "Ctrl-C to stop" in text, text
        url = re.search(r"dashboard\s+(http://127\.0\.0\.1:\d+)/", text).group(1)  # type: ignore[union-attr]
        token = re.search(r"API token\s+(\S+)", text).group(1)  # type: ignore[union-attr]
        pids += [int(p) for p in re.findall(r"(?:service|ray head) (\d+)", text)]
        assert len(pids) == 2 and all(_alive(p) for p in pids)

        assert httpx.get(f"{url}/readyz", timeout=30).status_code == 200
        assert '<canvas id="layer-chart"' in httpx.get(f"{url}/", timeout=10).text
        assert httpx.post(f"{url}/v1/jobs", json={}, timeout=10).status_code == 401

        # The REST commands, pointed at this stack explicitly.
        assert cli.main(["--url", url, "--token", token, "jobs"]) == 0
        assert "0 of 0 jobs" in capsys.readouterr().out
        bad = tmp_path / "bad.yaml"
        bad.write_text("method: magic\nsteps: 0\nshell: rm -rf /\n")
        assert cli.main(["--url", url, "--token", token, "submit", str(bad)]) == cli.EXIT_API
        err = capsys.readouterr().err
        assert (
            "method: Input should be" in err and "steps: Input should be greater" in err and "shell:" in err
        )
        assert cli.main(["--url", url, "--token", "wrong-token-0000000000", "stop", "x"]) == cli.EXIT_API
        assert "HTTP 403" in capsys.readouterr().err

        if ending == "ctrl-c":
            proc.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal delivers
            assert proc.wait(timeout=60) == 0
        else:  # the service crashes: `up` must notice, stop the Ray head too, and fail
            os.kill(pids[0], signal.SIGKILL)
            assert proc.wait(timeout=60) == cli.EXIT_API
            assert f"pid {pids[0]} exited" in proc.stdout.read()
        for pid in pids:
            wait_for(lambda pid=pid: not _alive(pid), 30, f"pid {pid} to exit")
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/healthz", timeout=2)
    finally:
        if proc.poll() is None:  # the test failed midway: end what `up` started, by pid
            for pid in pids:
                if _alive(pid):
                    os.kill(pid, signal.SIGTERM)
            proc.kill()
            proc.wait()


def test_a_head_whose_picked_port_was_taken_starts_on_new_ports(tmp_path: Path) -> None:
    ports = HeadPorts.pick()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        # Someone else grabs the GCS port between our pick and Ray's bind.
        squatter.bind(("127.0.0.1", ports.gcs))
        squatter.listen()
        head = LocalRayHead(ports, num_cpus=1, log_path=tmp_path / "head.log")
        try:
            head.start(attempts=3)
            assert head.ports != ports
            token = (Path.home() / ".ray" / "auth_token").read_text().strip()
            jobs = httpx.get(
                f"{head.ports.dashboard_url}/api/jobs/",
                headers={"Authorization": f"Bearer {token}"},
                timeout=10,
            )
            assert jobs.status_code == 200
            assert head.process is not None and head.process.poll() is None
        finally:
            head.stop()
    assert head.process is not None and head.process.poll() is not None
