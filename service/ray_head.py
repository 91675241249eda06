"""Start and stop a local Ray head that this process owns, by pid.

`ray start --head --block` stays in the foreground and, on SIGTERM, kills the GCS, raylet,
dashboard and workers it started; so one Popen is the whole cluster, and stopping it never
touches anyone else's Ray (we never run `ray stop`, which kills every cluster on the host).
Every port is explicit, because several clusters may share one machine.
"""

from __future__ import annotations

import logging
import os
import random
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


# Ports we pick ourselves come from a band that neither the kernel's ephemeral range
# (32768+, what "bind to port 0" hands out, to us and to every Ray process on the host) nor
# Ray's default worker ports (10002-19999) use, so a picked port is rarely taken before the
# process that needs it binds it.
PICK_PORT_RANGE = (20000, 32000)


def free_port() -> int:
    """A TCP port free on loopback right now (racy by nature; callers bind soon after)."""
    for _ in range(100):
        port = random.randint(*PICK_PORT_RANGE)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
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

    def all_free(self) -> bool:
        """True when nothing is bound to any of these ports right now."""
        for port in (self.gcs, self.dashboard, self.client_server, self.dashboard_agent):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    return False
        return True

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


class HeadDied(RuntimeError):
    """`ray start` exited before its cluster was up."""


class LocalRayHead:
    """A `ray start --head --block` subprocess; ``stop()`` ends exactly that cluster."""

    def __init__(self, ports: HeadPorts, num_cpus: int, log_path: Path | None = None) -> None:
        self.ports = ports
        self.num_cpus = num_cpus
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 90.0, attempts: int = 3) -> None:
        """Start the head; if it dies while starting (a port we picked was taken meanwhile:
        `ray start --block` then kills the whole node), retry on fresh ports."""
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(timeout_s)
                return
            except HeadDied as exc:
                if attempt == attempts:
                    raise
                logger.warning("Ray head died while starting (%s); retrying on new ports", exc)
                self.ports = HeadPorts.pick()

    def _start_once(self, timeout_s: float) -> None:
        # Ports were picked earlier; re-check just before Ray binds them (a port taken in
        # between makes `ray start` spend ~40 s failing), and pick again if one was taken.
        while not self.ports.all_free():
            logger.info("a port picked for the Ray head was taken meanwhile; picking new ones")
            self.ports = HeadPorts.pick()
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
        try:
            # A new session: Ctrl-C in the user's terminal reaches us, not Ray; we stop it by pid.
            self.process = subprocess.Popen(
                cmd, env=ray_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # type: ignore[union-attr]
        try:
            self.wait_ready(timeout_s)
            # `ray start --block` checks its children once a second and kills the node when one
            # died (e.g. a port clash); make sure this one survived that check.
            time.sleep(2.5)
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()  # never leave a half-started head behind
            raise

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the job server answers an authenticated request."""
        deadline = time.monotonic() + timeout_s
        last_error = "not started"
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise HeadDied(
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
