"""A private, real Ray head node for one test module: `ray start --head --block` in a child
process with explicit free ports and its own temp dir, torn down by its process handle.

Why not ``ray.init()``: several engineers run clusters on this machine at once. A plain
``ray.init()`` may attach to someone else's ``ray start`` cluster; ``ray.cluster_utils`` writes
(and on shutdown deletes) the shared /tmp/ray address file; and the dashboard agent's default
port (52365) collides between clusters, which breaks the Jobs API. A ``--block`` head with
every port chosen here and ``--temp-dir`` of its own touches nobody else's cluster, and
stopping it is a signal to the one process we started (it takes its children down with it).
``ray stop`` is never used: it would kill every cluster on the machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

START_TIMEOUT_S = 90.0
STOP_GRACE_S = 5.0  # then SIGKILL: `ray start --block` can take 30 s to stop gracefully


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment ago (bound together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def auth_env() -> dict[str, str]:
    """The environment every process we start gets: token auth said explicitly (Ray 2.60)."""
    return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}


@dataclass
class LocalRayCluster:
    num_cpus: int = 2
    include_dashboard: bool = True
    gcs_port: int = 0
    dashboard_port: int = 0
    temp_dir: str = ""
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _node_procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)
    _log_path: str = ""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def start(self) -> LocalRayCluster:
        ports = free_ports(10)
        self.gcs_port, self.dashboard_port = ports[0], ports[1]
        # AF_UNIX socket paths must stay short, so a short temp dir right under /tmp.
        self.temp_dir = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
        self._log_path = os.path.join(self.temp_dir, "ray-start.log")
        worker_lo = _worker_port_base(ports[8])
        cmd = [
            "ray", "start", "--head", "--block", "--disable-usage-stats",
            f"--num-cpus={self.num_cpus}", "--num-gpus=0",
            "--node-ip-address=127.0.0.1",
            f"--port={self.gcs_port}",
            f"--temp-dir={self.temp_dir}",
            f"--include-dashboard={'true' if self.include_dashboard else 'false'}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            f"--dashboard-agent-listen-port={ports[2]}",
            f"--dashboard-agent-grpc-port={ports[3]}",
            f"--runtime-env-agent-port={ports[4]}",
            f"--metrics-export-port={ports[5]}",
            f"--node-manager-port={ports[6]}",
            f"--object-manager-port={ports[7]}",
            f"--ray-client-server-port={ports[9]}",
            f"--min-worker-port={worker_lo}",
            f"--max-worker-port={worker_lo + 400}",
            "--object-store-memory=200000000",
        ]  # fmt: skip
        log = open(self._log_path, "wb")  # noqa: SIM115 (kept open for the child's lifetime)
        # RAY_ADDRESS pins every process of this node (and the Ray Train actors it hosts, whose
        # state-API clients otherwise follow the machine-wide /tmp/ray address file to someone
        # else's cluster) to this cluster.
        env = {**auth_env(), "RAY_ADDRESS": self.address}
        self._proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self._wait_ready()
        return self

    def add_worker_node(self, num_cpus: int = 1) -> None:
        """Join one more node (same machine, own ports) to this cluster: what an elastic job
        sees when a machine joins. Stopped with the head."""
        ports = free_ports(7)
        worker_lo = _worker_port_base(ports[6])
        cmd = [
            "ray", "start", "--block", "--disable-usage-stats",
            f"--address={self.address}",
            f"--num-cpus={num_cpus}", "--num-gpus=0",
            "--node-ip-address=127.0.0.1",
            f"--dashboard-agent-listen-port={ports[0]}",
            f"--dashboard-agent-grpc-port={ports[1]}",
            f"--runtime-env-agent-port={ports[2]}",
            f"--metrics-export-port={ports[3]}",
            f"--node-manager-port={ports[4]}",
            f"--object-manager-port={ports[5]}",
            f"--min-worker-port={worker_lo}",
            f"--max-worker-port={worker_lo + 400}",
            "--object-store-memory=100000000",
        ]  # fmt: skip
        log = open(os.path.join(self.temp_dir, f"ray-node-{len(self._node_procs)}.log"), "wb")  # noqa: SIM115
        env = {**auth_env(), "RAY_ADDRESS": self.address}
        self._node_procs.append(
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self._proc.returncode}:\n{self.log_tail()}")
            if _port_open(self.gcs_port) and (not self.include_dashboard or self._jobs_api_up()):
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"Ray head not ready after {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def _jobs_api_up(self) -> bool:
        import httpx

        from_file = Path.home() / ".ray" / "auth_token"
        headers = {"Authorization": f"Bearer {from_file.read_text().strip()}"} if from_file.exists() else {}
        try:
            r = httpx.get(f"{self.dashboard_url}/api/version", headers=headers, timeout=2.0)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            return Path(self._log_path).read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop every node we started: SIGTERM to the process group each `ray start` leads
        (start_new_session: only processes we started are in it), a short grace, then SIGKILL
        whatever is left of that group. Ray's own workers (own process groups, children of
        our raylets) exit when their raylet goes."""
        procs = [*self._node_procs, self._proc]
        self._node_procs, self._proc = [], None
        for proc in procs:
            _stop_group(proc)
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def _stop_group(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM the process group `proc` leads, a short grace, then SIGKILL what is left."""
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _worker_port_base(seed: int) -> int:
    """A 400-port range for one node's workers, below Linux's ephemeral range (32768+) that
    free_ports draws from, so the two never overlap."""
    return 20000 + (seed % 30) * 410


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def connected_cluster(num_cpus: int = 2, include_dashboard: bool = True):  # type: ignore[no-untyped-def]
    """Start a private head, connect this process to it, and tear both down afterwards."""
    import ray

    os.environ["RAY_AUTH_MODE"] = "token"
    cluster = LocalRayCluster(num_cpus=num_cpus, include_dashboard=include_dashboard).start()
    old_address = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = cluster.address
    try:
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=True)
        yield cluster
    finally:
        ray.shutdown()
        cluster.stop()
        if old_address is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = old_address
