"""`tail-ray up` for real, as a user starts it: by its full path, with an empty HOME and a PATH
that lacks the virtual environment (issue 10, findings 1 and 4), then supervised through a
kill -9 of its service mid-job (issue 17, finding 1), refusing a second `up` on the same HOME
(finding 2), exposing nothing beyond loopback and keeping its files owner-only (findings 5
and 6), and stopping everything it started on SIGTERM, SIGHUP and Ctrl-C (issue 10, finding 5)
and even when it is killed itself. Processes are checked by the pids `up` started and their
descendants, never by name. The REST commands run in-process against that stack."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from service_support import wait_for

from service import cli
from service.ray_head import HeadPorts, LocalRayHead, ray_token, short_temp_dir
from service.settings import REPO_ROOT

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TAIL_RAY = Path(sys.executable).parent / "tail-ray"  # the console script, by its full path
BARE_PATH = "/usr/bin:/bin"  # no virtual environment on it
# Long enough to still be training when the drill looks at its workers and kills the service:
# 30 steps were ~1 s of training on a faster machine, and passed only on Ray's teardown time.
JOB_STEPS = 300
READY_LINE = "Ctrl-C (or SIGTERM / SIGHUP) stops the service, then Ray"


class Up:
    """A `tail-ray up` subprocess; its output is collected by a thread so the pipe never fills."""

    def __init__(self, home: Path, num_cpus: int, args: tuple[str, ...] = (), **env_extra: str) -> None:
        self.home = home
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("TAIL_RAY_", "RAY_")) and k != "NUMBA_CACHE_DIR"
        }
        env.update(HOME=str(home), PATH=BARE_PATH, RAY_AUTH_MODE="token", **env_extra)
        self.env = env
        cmd = [str(TAIL_RAY), "up", "--port", "0", "--num-cpus", str(num_cpus), *args]
        self.proc = subprocess.Popen(
            cmd, cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.descendants: list[psutil.Process] = []

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_up(self, timeout_s: float = 180) -> None:
        wait_for(
            lambda: READY_LINE in self.output or self.proc.poll() is not None,
            timeout_s,
            "`tail-ray up` to be up",
        )
        assert READY_LINE in self.output, self.output
        self.snapshot()

    @property
    def state(self) -> dict:
        return json.loads((self.home / ".tail_ray" / "cli.json").read_text())

    def pids(self) -> dict[str, int]:
        found = re.findall(r"(up|service|ray head) (\d+)", self.output.split("pids", 1)[1].splitlines()[0])
        return {what: int(pid) for what, pid in found}

    def snapshot(self) -> list[psutil.Process]:
        """Every process `up` started, and theirs, as of now (psutil.Process remembers each
        one's start time, so a recycled pid is never taken for it)."""
        procs = psutil.Process(self.proc.pid).children(recursive=True)
        known = {p.pid for p in self.descendants}
        self.descendants += [p for p in procs if p.pid not in known]
        return procs

    def survivors(self) -> list[psutil.Process]:
        alive = []
        for p in self.descendants:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        return alive

    def end(self) -> None:
        """Test teardown: whatever happened, nothing of this stack outlives the test."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for p in self.survivors():
            p.kill()


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    assert not any(h.iterdir())  # empty: no ~/.ray, no ~/.tail_ray
    return h


@pytest.fixture(scope="module")
def shared_kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One numba cache for this module's `up`s (NUMBA_CACHE_DIR): the first fills it (about a
    minute on 2 cores), the others load it. The HOMEs stay empty; the crash test runs without
    it, from a truly empty HOME."""
    return tmp_path_factory.mktemp("numba-cache")


@pytest.fixture
def up_factory(home: Path, shared_kernel_cache: Path) -> Iterator:
    started: list[Up] = []

    def start(
        num_cpus: int = 1, args: tuple[str, ...] = (), own_kernel_cache: bool = False, **env_extra: str
    ) -> Up:
        if not own_kernel_cache:
            env_extra.setdefault("NUMBA_CACHE_DIR", str(shared_kernel_cache))
        up = Up(home, num_cpus, args, **env_extra)
        started.append(up)
        return up

    yield start
    for up in started:
        up.end()


def _listening_sockets(procs: list[psutil.Process]) -> list[tuple[str, int, str]]:
    out = []
    for p in procs:
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.append((c.laddr.ip, c.laddr.port, p.name()))
        except psutil.NoSuchProcess:
            pass
    return out


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_up_keeps_training_through_a_service_crash_and_exposes_nothing(
    up_factory, home: Path, capsys: pytest.CaptureFixture
) -> None:
    up = up_factory(num_cpus=2, own_kernel_cache=True)
    up.wait_up(timeout_s=300)  # it compiles every kernel first: its HOME has no cache
    state = up.state
    url, token = state["url"], state["token"]
    pids = up.pids()
    assert set(pids) == {"up", "service", "ray head"} and pids["up"] == up.proc.pid

    # --- owner-only files, and a Ray token made by `up` itself (the HOME was empty)
    tail_home = home / ".tail_ray"
    assert _mode(tail_home) == 0o700
    for name in ("cli.json", "up.pid", "service.log", "ray-head.log", "service.sqlite"):
        assert _mode(tail_home / name) == 0o600, name
    ray_token_file = home / ".ray" / "auth_token"
    assert _mode(ray_token_file) == 0o600

    # --- a second `up` on the same HOME is refused, names the first, and leaves cli.json alone
    before = (tail_home / "cli.json").read_bytes()
    second = subprocess.run(
        [str(TAIL_RAY), "up", "--port", "0"],
        cwd=home,
        env=up.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == cli.EXIT_API
    assert f"already running for {tail_home}: pid {up.proc.pid}" in second.stderr, second.stderr
    assert (tail_home / "cli.json").read_bytes() == before

    # --- the REST commands against this stack
    assert httpx.post(f"{url}/v1/jobs", json={}, timeout=10).status_code == 401
    assert cli.main(["--url", url, "--token", token, "jobs"]) == 0
    assert "0 of 0 jobs" in capsys.readouterr().out
    bad = home / "bad.yaml"
    bad.write_text("method: magic\nsteps: 0\nshell: rm -rf /\n")
    assert cli.main(["--url", url, "--token", token, "submit", str(bad)]) == cli.EXIT_API
    err = capsys.readouterr().err
    assert "method: Input should be" in err and "steps: Input should be greater" in err and "shell:" in err
    assert cli.main(["--url", url, "--token", "wrong-token-0000000000", "stop", "x"]) == cli.EXIT_API
    assert "HTTP 403" in capsys.readouterr().err

    # --- a REST job, run by the interpreter `up` runs under although PATH lacks it
    auth = {"Authorization": f"Bearer {token}"}
    api = httpx.Client(base_url=url, timeout=30, headers=auth)
    spec = {
        "name": "up-crash", "method": "tail", "min_workers": 2, "max_workers": 2, "steps": JOB_STEPS,
        "checkpoint_every_steps": JOB_STEPS, "max_failures": 0, "compression": {"link_aware": False},
    }  # fmt: skip
    created = api.post("/v1/jobs", json=spec)
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    # The service's own interpreter: `tail-ray up` runs under whatever its console script names
    # (python or python3.11, as pip wrote the shebang), the same binary as the test's.
    exe, rest = created.json()["entrypoint"].split(" ", 1)
    assert os.path.realpath(exe) == os.path.realpath(sys.executable), exe
    assert rest.startswith("-m jobs.train "), rest

    def training() -> bool:
        job = api.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] not in ("FAILED", "STOPPED"), api.get(f"/v1/jobs/{job_id}/logs").json()["logs"]
        return api.get(f"/v1/jobs/{job_id}/metrics/summary").json()["steps"] > 0

    wait_for(training, 240, "the job's first stored step", interval_s=0.5)

    # --- while it trains: every socket the stack listens on is on loopback
    listening = _listening_sockets(up.snapshot())
    assert listening, "found no listening socket at all: the check below would mean nothing"
    beyond = [s for s in listening if not _is_loopback(s[0])]
    # The one exception, not Ray's: PyTorch's c10d TCPStore, the rendezvous store rank 0 of a
    # job's process group runs while the job trains, binds every interface and torch offers
    # no bind address (Ray Train creates it with init_method env://). See docs/operations.md.
    torch_store = [s for s in beyond if s[2] == "ray::RayTrainWorker"]
    assert len(torch_store) <= 1 and beyond == torch_store, f"listening beyond loopback: {beyond}"
    # --- ... and every worker reads the kernel cache `up` filled first (its own HOME's: nothing
    # set NUMBA_CACHE_DIR for it), named to it by the Ray head `up` started
    assert "kernels ready in" in up.output and f"cached in {tail_home / 'numba-cache'}" in up.output
    workers = [p for p in up.snapshot() if p.name() == "ray::RayTrainWorker"]
    assert workers, "found no training worker to check"
    for p in [psutil.Process(pids["ray head"]), *workers]:
        assert p.environ().get("NUMBA_CACHE_DIR") == str(tail_home / "numba-cache"), p
    ports = {port for _, port, _ in listening}
    service_port = int(url.rsplit(":", 1)[1])
    assert service_port in ports and len(ports) >= 8, listening  # service + GCS, raylet, agents, ...

    # --- kill -9 of the service mid-job: `up` restarts it, Ray and the job never notice
    os.kill(pids["service"], signal.SIGKILL)
    wait_for(lambda: "service restarted" in up.output, 60, "`up` to restart the service")
    assert f"the service (pid {pids['service']}) exited with code -9" in up.output
    assert psutil.pid_exists(pids["ray head"]) and up.proc.poll() is None

    def finished_and_drained() -> bool:
        job = api.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] not in ("FAILED", "STOPPED"), job["message"][-2000:]
        summary = api.get(f"/v1/jobs/{job_id}/metrics/summary").json()
        return job["status"] == "SUCCEEDED" and summary["ingest"]["drained"]

    wait_for(finished_and_drained, 300, "the job to succeed and its metrics to drain", interval_s=1)
    db = sqlite3.connect(tail_home / "service.sqlite")
    steps = dict(
        db.execute(
            "SELECT rank, GROUP_CONCAT(step) FROM (SELECT DISTINCT rank, step FROM step_metrics"
            " WHERE job_id = ? ORDER BY rank, step) GROUP BY rank",
            (job_id,),
        ).fetchall()
    )
    expected = ",".join(str(s) for s in range(JOB_STEPS))
    assert steps == {0: expected, 1: expected}, steps  # contiguous on every rank: nothing lost
    seqs = [
        r[0]
        for r in db.execute(
            "SELECT seq FROM step_metrics WHERE job_id = ?1 UNION ALL SELECT seq FROM layer_metrics"
            " WHERE job_id = ?1 ORDER BY 1",
            (job_id,),
        )
    ]
    assert seqs == list(range(1, len(seqs) + 1))  # every record the workers sent, once
    db.close()

    # --- SIGTERM (systemd, docker stop, Kubernetes): the service, then Ray, all of it
    up.snapshot()
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=120) == 0
    assert "SIGTERM received: stopped the service and Ray" in up.output
    wait_for(lambda: not up.survivors(), 60, "every process of the stack to exit")
    assert not (tail_home / "cli.json").exists()
    # Neither token was ever printed (the output is no terminal).
    assert token not in up.output and ray_token_file.read_text().strip() not in up.output


@pytest.mark.parametrize("how", ["SIGHUP", "SIGINT", "SIGKILL-of-up"])
def test_up_stops_everything_it_started(how: str, up_factory, home: Path) -> None:
    up = up_factory(num_cpus=1)
    up.wait_up()
    pids = up.pids()
    assert len(up.descendants) >= 5  # the head's GCS, raylet, dashboard, agents; the service
    up.snapshot()
    if how == "SIGKILL-of-up":
        # `up` cannot catch this one: the kernel signals its children (service/lifeline.py).
        up.proc.kill()
        up.proc.wait(timeout=30)
    else:
        up.proc.send_signal(getattr(signal, how))
        assert up.proc.wait(timeout=120) == 0
        assert f"{how} received: stopped the service and Ray" in up.output
    wait_for(lambda: not up.survivors(), 60, f"every process of the stack to exit after {how}")
    # Both were watched (after a kill -9 of `up` they are reparented and, in a container whose
    # init reaps nothing, may stay zombies: exited, which is what counts).
    assert {pids["service"], pids["ray head"]} <= {p.pid for p in up.descendants}
    # The HOME is free again: a new `up` takes the lock (and stops at once).
    again = up_factory(num_cpus=1)
    again.wait_up()
    again.proc.send_signal(signal.SIGTERM)
    assert again.proc.wait(timeout=120) == 0


def test_up_on_a_running_cluster_leaves_it_running(up_factory, tmp_path: Path) -> None:
    """`up --ray-address`: a cluster `up` did not start is not its to stop (nor to make a token
    for: the cluster's own comes in RAY_AUTH_TOKEN), and `--python` names the interpreter its
    jobs run with."""
    temp = short_temp_dir()
    head = LocalRayHead(num_cpus=1, log_path=tmp_path / "head.log", temp_dir=temp).start()
    try:
        token = ray_token()
        assert token
        up = up_factory(
            num_cpus=1,
            args=("--ray-address", head.address, "--ray-dashboard-url", head.dashboard_url,
                  "--python", "/opt/cluster/bin/python3"),
            RAY_AUTH_TOKEN=token,
        )  # fmt: skip
        up.wait_up()
        assert re.search(r"jobs run\s+/opt/cluster/bin/python3$", up.output, re.MULTILINE), up.output
        assert set(up.pids()) == {"up", "service"}
        assert not (up.home / ".ray").exists()  # no token made for someone else's cluster
        assert "compiling tail_ray's kernels" not in up.output  # its workers are not on this machine
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=120) == 0
        wait_for(lambda: not up.survivors(), 60, "the service to exit")
        assert head.process is not None and head.process.poll() is None  # the cluster runs on
        assert httpx.get(f"{head.dashboard_url}/api/version", headers={"Authorization": f"Bearer {token}"},
                         timeout=10).status_code == 200  # fmt: skip
    finally:
        head.stop()
        shutil.rmtree(temp, ignore_errors=True)


def test_a_head_whose_picked_port_was_taken_starts_on_new_ports(tmp_path: Path) -> None:
    import socket

    ports = HeadPorts.pick()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        # Someone else grabs the GCS port between our pick and Ray's bind.
        squatter.bind(("127.0.0.1", ports.gcs))
        squatter.listen()
        head = LocalRayHead(ports, num_cpus=1, log_path=tmp_path / "head.log")
        try:
            head.start(attempts=3)
            assert head.ports != ports
            jobs = httpx.get(
                f"{head.ports.dashboard_url}/api/jobs/",
                headers={"Authorization": f"Bearer {ray_token()}"},
                timeout=10,
            )
            assert jobs.status_code == 200
            assert head.process is not None and head.process.poll() is None
        finally:
            head.stop()
    assert head.process is not None and head.process.poll() is not None


def test_up_help_names_the_signals_and_the_interpreter_option() -> None:
    text = subprocess.run(
        [str(TAIL_RAY), "up", "--help"], capture_output=True, text=True, timeout=60, check=True, cwd=REPO_ROOT
    ).stdout
    assert "SIGTERM" in text and "SIGHUP" in text and "--python" in text
