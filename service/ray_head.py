"""The one launcher of local Ray nodes: `tail-ray up`/`demo`, the test fixtures and the load
test all start their Ray head here, by pid, on ports of their own, with a token.

`ray start --head --block` stays in the foreground and, on SIGTERM, stops the GCS, raylet,
dashboard and workers it started; it runs in a session (process group) of its own, so one
``killpg`` reaches the whole node, and stopping it never touches anyone else's Ray (we never
run `ray stop`, which kills every cluster on the host). Every port is explicit, because several
clusters may share one machine.

Token (Ray 2.60 turns token auth on for local clusters): ``ensure_ray_token`` makes one when
none exists, with Ray's own generator, exactly as ``ray.init()`` and ``ray get-auth-token
--generate`` do, and never prints it.

Loopback only: ``--node-ip-address=127.0.0.1`` alone is not enough, because `ray start`
"resolves" a loopback node IP to the machine's routable address, and the GCS, raylet, agents
and metrics endpoints then bind to it or to every interface. Ray keeps a single-node cluster on
loopback only where it thinks multi-node clusters are unsupported (macOS, Windows), and
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` selects that mode on Linux too: the node IP stays
127.0.0.1 and every Ray process binds to it. Ray reads that switch when it is imported, and in
every process: a driver that joins such a head needs it too (else it "resolves" the head's
127.0.0.1 address to the routable one and never connects), and such a head takes no other
nodes. So it is opt-in: `tail-ray up` uses it (and hands it to the service and, through the
raylet's environment, to every job); test clusters, which pytest joins as a driver, do not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)

# Ports we pick ourselves come from a band that neither the kernel's ephemeral range
# (32768+, what "bind to port 0" hands out, to us and to every Ray process on the host) nor
# Ray's default worker ports (10002-19999) use, so a picked port is rarely taken before the
# process that needs it binds it.
PICK_PORT_RANGE = (20000, 32000)
# Worker ports: a slice of Ray's own default worker range, so they never meet a picked port.
WORKER_PORT_RANGE = (10002, 19999)
WORKER_PORTS_PER_NODE = 400
START_TIMEOUT_S = 90.0
STOP_GRACE_S = 20.0  # then SIGKILL to the node's process group
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


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


def _distinct_free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


@dataclass(frozen=True)
class HeadPorts:
    """Every port one Ray head binds (besides its workers' range)."""

    gcs: int
    dashboard: int
    client_server: int
    dashboard_agent: int  # the agent's HTTP port
    dashboard_agent_grpc: int
    runtime_env_agent: int
    metrics_export: int
    node_manager: int
    object_manager: int
    autoscaler_metrics: int  # Ray's fixed default (44217) would clash between clusters
    dashboard_metrics: int  # likewise (44227)
    min_worker: int

    @classmethod
    def pick(cls) -> HeadPorts:
        names = [f.name for f in fields(cls) if f.name != "min_worker"]
        slots = (WORKER_PORT_RANGE[1] - WORKER_PORT_RANGE[0]) // WORKER_PORTS_PER_NODE
        min_worker = WORKER_PORT_RANGE[0] + random.randrange(slots) * WORKER_PORTS_PER_NODE
        return cls(**dict(zip(names, _distinct_free_ports(len(names)), strict=True)), min_worker=min_worker)

    @property
    def max_worker(self) -> int:
        return self.min_worker + WORKER_PORTS_PER_NODE - 1

    def listen_ports(self) -> list[int]:
        return [getattr(self, f.name) for f in fields(self) if f.name != "min_worker"]

    def all_free(self) -> bool:
        """True when nothing is bound to any of these ports right now."""
        for port in self.listen_ports():
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    return False
        return True

    def node_args(self) -> list[str]:
        """The `ray start` flags for the ports every node binds, head or not."""
        return [
            f"--dashboard-agent-listen-port={self.dashboard_agent}",
            f"--dashboard-agent-grpc-port={self.dashboard_agent_grpc}",
            f"--runtime-env-agent-port={self.runtime_env_agent}",
            f"--metrics-export-port={self.metrics_export}",
            f"--node-manager-port={self.node_manager}",
            f"--object-manager-port={self.object_manager}",
            f"--min-worker-port={self.min_worker}",
            f"--max-worker-port={self.max_worker}",
        ]

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard}"


# ----------------------------------------------------------------------------- the token
def ray_token() -> str | None:
    """The token Ray's own clients use, in Ray's order: RAY_AUTH_TOKEN, the file named by
    RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token."""
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if token:
        return token
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return read_token_file(Path(path).expanduser() if path else default_token_path())


def default_token_path() -> Path:
    """Where Ray keeps its token (HOME is read now, not at import: tests and `up` may set it)."""
    return Path.home() / ".ray" / "auth_token"


def ensure_ray_token() -> bool:
    """Make Ray's token when none exists; returns True when one was made. Never prints it.

    Ray's own path: the same ``AuthenticationTokenLoader`` check and ``generate_and_save_token``
    that ``ray.init()`` runs for a new local cluster (and ``ray get-auth-token --generate``
    runs): 256 random bits, hex, written to ~/.ray/auth_token. Ray writes that file with a
    plain ``open(path, "w")``, so its mode is whatever the umask gives (0644 under the usual
    022: readable by every user of the machine). We call it under umask 077, so the file is
    0600 and a ~/.ray it creates is 0700: the same token, by the same code, readable by its
    owner only.
    """
    from ray._private.authentication.authentication_token_setup import generate_and_save_token
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]

    loader = AuthenticationTokenLoader.instance()
    if loader.has_token(ignore_auth_mode=True):
        return False
    old_umask = os.umask(0o077)
    try:
        generate_and_save_token()
    finally:
        os.umask(old_umask)
    loader.reset_cache()
    path = default_token_path()
    path.chmod(0o600)  # a file that existed empty keeps its old mode through open("w")
    logger.info("made a Ray token in %s (mode 0600)", path)
    return True


def ray_env(loopback_only: bool = False) -> dict[str, str]:
    """The environment for every Ray process we start: token auth said out loud, and the
    interpreter that started us first on PATH, so a job's `python` is this one whatever the
    user's PATH says."""
    env = dict(os.environ)
    env["RAY_AUTH_MODE"] = "token"
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # On SIGTERM a head otherwise waits up to 30 s "draining" for Serve; we run no Serve.
    env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bin_dir, *[p for p in env.get("PATH", "").split(os.pathsep) if p]])
    if loopback_only:
        env[LOOPBACK_ENV] = "0"
        # Jobs' gloo process groups: listen and connect on loopback, not on whatever address
        # the host name resolves to (all ranks share this one node).
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


# ----------------------------------------------------------------------------- the node
class HeadDied(RuntimeError):
    """`ray start` exited before its cluster was up."""


class LocalRayHead:
    """A `ray start --head --block` subprocess in its own session; ``stop()`` ends exactly
    that node (and the nodes ``add_worker_node`` joined to it)."""

    def __init__(
        self,
        ports: HeadPorts | None = None,
        num_cpus: int = 1,
        log_path: Path | None = None,
        *,
        loopback_only: bool = False,
        temp_dir: Path | None = None,
        include_dashboard: bool = True,
        object_store_bytes: int | None = None,
        die_with_parent: bool = False,
        stop_grace_s: float = STOP_GRACE_S,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``env``: variables added to the node's environment, which its raylet hands on to every
        worker and job driver (e.g. the shared kernel cache, NUMBA_CACHE_DIR)."""
        self.ports = ports or HeadPorts.pick()
        self.num_cpus = num_cpus
        self.log_path = log_path
        self.loopback_only = loopback_only
        self.temp_dir = temp_dir
        self.include_dashboard = include_dashboard
        self.object_store_bytes = object_store_bytes
        self.die_with_parent = die_with_parent
        self.stop_grace_s = stop_grace_s
        self.extra_env = dict(env or {})
        self.process: subprocess.Popen[bytes] | None = None
        self.node_processes: list[subprocess.Popen[bytes]] = []

    @property
    def address(self) -> str:
        return self.ports.gcs_address

    @property
    def dashboard_url(self) -> str:
        return self.ports.dashboard_url

    def env(self) -> dict[str, str]:
        env = ray_env(self.loopback_only)
        env.update(self.extra_env)
        env["AUTOSCALER_METRIC_PORT"] = str(self.ports.autoscaler_metrics)
        env["DASHBOARD_METRIC_PORT"] = str(self.ports.dashboard_metrics)
        # Pins this node's processes (and the Ray Train actors it hosts, whose state-API
        # clients otherwise follow the machine-wide /tmp/ray address file to someone else's
        # cluster) to this cluster.
        env["RAY_ADDRESS"] = self.address
        return env

    def start(self, timeout_s: float = START_TIMEOUT_S, attempts: int = 3) -> LocalRayHead:
        """Start the head; if it dies while starting (a port we picked was taken meanwhile:
        `ray start --block` then kills the whole node), retry on fresh ports."""
        ensure_ray_token()
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(timeout_s)
                return self
            except HeadDied as exc:
                if attempt == attempts:
                    raise
                logger.warning("Ray head died while starting (%s); retrying on new ports", exc)
                self.ports = HeadPorts.pick()
        return self

    def command(self) -> list[str]:
        p = self.ports
        cmd = [
            *ray_cli(), "start", "--head", "--block", "--disable-usage-stats",
            "--node-ip-address=127.0.0.1",
            f"--port={p.gcs}",
            f"--num-cpus={self.num_cpus}", "--num-gpus=0",
            f"--include-dashboard={'true' if self.include_dashboard else 'false'}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={p.dashboard}",
            f"--ray-client-server-port={p.client_server}",
            *p.node_args(),
        ]  # fmt: skip
        if self.temp_dir is not None:
            cmd.append(f"--temp-dir={self.temp_dir}")
        if self.object_store_bytes is not None:
            cmd.append(f"--object-store-memory={self.object_store_bytes}")
        return cmd

    def _start_once(self, timeout_s: float) -> None:
        # Ports were picked earlier; re-check just before Ray binds them (a port taken in
        # between makes `ray start` spend ~40 s failing), and pick again if one was taken.
        while not self.ports.all_free():
            logger.info("a port picked for the Ray head was taken meanwhile; picking new ones")
            self.ports = HeadPorts.pick()
        cmd = self.command()
        if self.die_with_parent:
            cmd = lifeline(cmd)
        self.process = _popen_logged(cmd, self.env(), self.log_path)
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
        """Block until the GCS accepts connections and (with a dashboard) the job server
        answers an authenticated request."""
        deadline = time.monotonic() + timeout_s
        last_error = "not started"
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise HeadDied(
                    f"`ray start` exited with code {self.process.returncode};"
                    f" see {self.log_path or 'its output'}"
                )
            if not _port_open(self.ports.gcs):
                last_error = "GCS port closed"
            elif not self.include_dashboard:
                return
            else:
                # A node given its own token (RAY_AUTH_TOKEN in ``env``) checks with that one.
                token = self.extra_env.get("RAY_AUTH_TOKEN") or ray_token()
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                try:
                    resp = httpx.get(f"{self.dashboard_url}/api/jobs/", headers=headers, timeout=2.0)
                    if resp.status_code == 200:
                        return
                    last_error = f"HTTP {resp.status_code}"
                except httpx.HTTPError as exc:
                    last_error = type(exc).__name__
            time.sleep(0.5)
        raise RuntimeError(f"Ray head at {self.address} not ready after {timeout_s}s ({last_error})")

    def add_worker_node(self, num_cpus: int = 1, log_path: Path | None = None) -> subprocess.Popen[bytes]:
        """Join one more node (same machine, own ports) to this cluster: what an elastic job
        sees when a machine joins. Stopped with the head."""
        if self.loopback_only:
            raise RuntimeError("a loopback-only head takes no other nodes; start it with loopback_only=False")
        p = HeadPorts.pick()
        cmd = [
            *ray_cli(), "start", "--block", "--disable-usage-stats",
            f"--address={self.address}",
            f"--num-cpus={num_cpus}", "--num-gpus=0",
            "--node-ip-address=127.0.0.1",
            *p.node_args(),
        ]  # fmt: skip
        if self.object_store_bytes is not None:
            cmd.append(f"--object-store-memory={self.object_store_bytes // 2}")
        proc = _popen_logged(cmd, self.env(), log_path)
        self.node_processes.append(proc)
        return proc

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM to each node's process group (start_new_session: only processes we started
        are in it), a grace, then SIGKILL whatever is left of that group. Ray's workers exit
        when their raylet goes."""
        grace = self.stop_grace_s if grace_s is None else grace_s
        procs = [*self.node_processes, self.process]
        self.node_processes = []
        for proc in procs:
            if proc is not None:
                stop_process_group(proc, grace)

    def kill(self) -> None:
        """SIGKILL every node's group now (a second Ctrl-C)."""
        for proc in [*self.node_processes, self.process]:
            if proc is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)


def ray_cli() -> list[str]:
    """`ray` as run by this very interpreter: a PATH without our venv must not find another."""
    return [sys.executable, "-m", "ray.scripts.scripts"]


def lifeline(cmd: list[str]) -> list[str]:
    """``cmd`` wrapped so the kernel sends it SIGTERM if we die without stopping it (kill -9
    of `tail-ray up`): see service/lifeline.py."""
    return [sys.executable, "-m", "service.lifeline", str(os.getpid()), "--", *cmd]


def _popen_logged(cmd: list[str], env: dict[str, str], log_path: Path | None) -> subprocess.Popen[bytes]:
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    try:
        # A new session: Ctrl-C in the user's terminal reaches us, not Ray; we stop it by pid.
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        if out is not subprocess.DEVNULL:
            out.close()  # type: ignore[union-attr]


def stop_process_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the process group ``proc`` leads, wait up to ``grace_s``, then SIGKILL what is
    left of the group."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        logger.warning("pid %d ignored SIGTERM for %.0fs; killing its process group", proc.pid, grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def read_token_file(path: Path) -> str | None:
    try:
        token = path.read_text().strip()
    except OSError:
        return None
    return token or None


def short_temp_dir(prefix: str = "rt-") -> Path:
    """A temp dir right under /tmp: Ray's AF_UNIX socket paths live in it and must stay short."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
