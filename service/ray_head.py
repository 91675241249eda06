"""Start and stop a local Ray head that this process owns, by pid.

`ray start --head --block` stays in the foreground and, on SIGTERM, kills the GCS, raylet,
dashboard and workers it started; so one Popen is the whole cluster, and stopping it never
touches anyone else's Ray (we never run `ray stop`, which kills every cluster on the host).
Every port is explicit, because several clusters may share one machine.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)

DEFAULT_AUTH_TOKEN_PATH = Path.home() / ".ray" / "auth_token"


def free_port() -> int:
    """A TCP port free on loopback right now (racy by nature; callers bind soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class HeadPorts:
    gcs: int
    dashboard: int
    client_server: int
    dashboard_agent: int

    @classmethod
    def pick(cls) -> HeadPorts:
        return cls(free_port(), free_port(), free_port(), free_port())

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard}"


def ray_env() -> dict[str, str]:
    """The environment for every Ray process we start: token auth said out loud."""
    env = dict(os.environ)
    env["RAY_AUTH_MODE"] = "token"
    # On SIGTERM a head otherwise waits up to 30 s "draining" for Serve; we run no Serve.
    env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
    return env


class LocalRayHead:
    """A `ray start --head --block` subprocess; ``stop()`` ends exactly that cluster."""

    def __init__(self, ports: HeadPorts, num_cpus: int, log_path: Path | None = None) -> None:
        self.ports = ports
        self.num_cpus = num_cpus
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 90.0) -> None:
        ray_bin = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
        cmd = [
            ray_bin,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={self.ports.gcs}",
            f"--dashboard-port={self.ports.dashboard}",
            "--dashboard-host=127.0.0.1",
            f"--ray-client-server-port={self.ports.client_server}",
            f"--dashboard-agent-listen-port={self.ports.dashboard_agent}",
            f"--num-cpus={self.num_cpus}",
            "--include-dashboard=true",
            "--disable-usage-stats",
        ]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        # A new session: Ctrl-C in the user's terminal reaches us, not Ray; we stop it by pid.
        self.process = subprocess.Popen(
            cmd, env=ray_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the job server answers an authenticated request."""
        deadline = time.monotonic() + timeout_s
        last_error = "not started"
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"`ray start` exited with code {self.process.returncode};"
                    f" see {self.log_path or 'its output'}"
                )
            token = read_token_file(DEFAULT_AUTH_TOKEN_PATH)
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            try:
                resp = httpx.get(f"{self.ports.dashboard_url}/api/jobs/", headers=headers, timeout=2.0)
                if resp.status_code == 200:
                    return
                last_error = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                last_error = type(exc).__name__
            time.sleep(0.5)
        raise RuntimeError(
            f"Ray job server at {self.ports.dashboard_url} not ready after {timeout_s}s ({last_error})"
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("ray head pid %d ignored SIGTERM for %.0fs; killing it", proc.pid, timeout_s)
            proc.kill()
            proc.wait(timeout=10)


def read_token_file(path: Path) -> str | None:
    try:
        token = path.read_text().strip()
    except OSError:
        return None
    return token or None
