"""The local stack `tail-ray up` and `demo` run: a Ray head (unless --ray-address names a
cluster) and the service, started, supervised and stopped here.

- **Supervision that keeps training alive.** The service is a client of Ray: when it dies
  (kill -9, OOM, a bug), it is restarted with backoff (1, 2, 4 ... 30 s; reset after a minute of
  uptime) and Ray, its jobs and their metrics sinks never notice; the restarted service resumes
  every job's ingest from its stored cursor. Only the Ray head dying ends the stack.
- **Stopping.** SIGTERM (systemd, docker stop, Kubernetes), SIGHUP (the terminal closed) and
  Ctrl-C stop the service, then the Ray head, each by its process group, with a grace then
  SIGKILL; a second signal kills both at once. Both also run under ``service.lifeline``, so even
  a kill -9 of `up` takes them down with it.
- **One stack per HOME.** A lock (``up.pid``: an flock, plus the pids and start times of `up`
  and what it started) refuses a second `up` on the same ~/.tail_ray and names the running one,
  or the processes a killed one left behind.
- **cli.json is written only once the new stack is really up** (the service is ready on the
  port this `up` bound), so other commands never get a token for a service that is not ours.
- **Warm kernels first.** Before a local head starts, the codec's numba kernels are compiled
  once into the shared cache (tail_ray/warmup.py; seconds when already cached), and the head
  is started with NUMBA_CACHE_DIR naming that cache, so every worker and job loads them instead
  of compiling its own (~30 s of CPU each). Not for a remote cluster: its workers have theirs.
- **Least exposure.** The head is loopback-only (service/ray_head.py); the service port is
  bound to 127.0.0.1 by `up` itself and handed to each service process (``--fd``), so no other
  process can answer on it; ~/.tail_ray is 0700 and everything `up` and its children create
  there is 0600 (umask 077).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.client import Api, CliError, state_file, write_private
from service.ray_head import LocalRayHead, lifeline, ray_env, stop_process_group

REPO_ROOT = Path(__file__).resolve().parents[1]
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
SERVICE_READY_TIMEOUT_S = 90.0
SERVICE_STOP_GRACE_S = 15.0
HEAD_STOP_GRACE_S = 30.0
RESTART_BACKOFF_S = (1.0, 30.0)  # first delay, cap; doubles per crash in a row
HEALTHY_UPTIME_S = 60.0  # a service that ran this long starts the backoff over


class StopRequested(BaseException):
    """A stop signal arrived (raised in the main thread, like KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StackFailed(CliError):
    """The stack cannot go on (the Ray head died)."""


@dataclass(frozen=True)
class StackOptions:
    home: Path
    db_path: Path
    port: int | None  # None: any free port
    num_cpus: int
    ray_address: str | None = None  # a running cluster's GCS instead of a local head
    ray_dashboard_url: str = "http://127.0.0.1:8265"
    job_python: str | None = None  # None: this interpreter with a local head, else "python"
    warmup_max_world: int | None = 8  # warm the rank means up to this many ranks; None: no warmup


# ----------------------------------------------------------------------------- home and lock
def secure_home(home: Path) -> None:
    """~/.tail_ray 0700, every file in it 0600 (also those an older version left 0644)."""
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    home.chmod(0o700)
    for path in home.iterdir():
        if path.is_file() and not path.is_symlink():
            path.chmod(0o600)


def ray_temp_dir(home: Path) -> Path:
    """Ray's temp dir for this HOME's stack: its own, because Ray keeps the machine's "current
    cluster" address in it and a job driver joins whatever that names (RAY_ADDRESS=auto): under
    the shared /tmp/ray, a job could join a cluster someone else started later. Short, and
    under /tmp: Ray's AF_UNIX socket paths live in it. Refused when another user owns it."""
    digest = hashlib.sha1(str(home.resolve()).encode()).hexdigest()[:8]
    path = Path(tempfile.gettempdir()) / f"tail-ray-{os.getuid()}-{digest}"
    path.mkdir(mode=0o700, exist_ok=True)
    if path.stat().st_uid != os.getuid():
        raise CliError(f"{path} belongs to another user; remove it or set TMPDIR")
    return path


def process_start_id(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (Linux), so a recycled pid is not taken for the
    process we recorded; None when ``pid`` does not run."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return "?"
        return "?"  # no /proc: alive, identity unchecked
    fields = stat.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 and fields[0] != "Z" else None


def _alive(record: dict[str, Any]) -> bool:
    start = process_start_id(int(record["pid"]))
    return start is not None and start in (record.get("start"), "?")


class StackLock:
    """``<home>/up.pid``: held with flock by the running `up` (the kernel drops it when that
    process dies, however it dies), and holding JSON that names it and its children."""

    def __init__(self, home: Path) -> None:
        self.path = home / "up.pid"
        self._fd: int | None = None
        self.record: dict[str, Any] = {}

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.fchmod(fd, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = self._read(fd)
            os.close(fd)
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(other.get("started_at", 0)))
            raise CliError(
                f"tail-ray up is already running for {self.path.parent}: pid {other.get('pid', '?')}"
                f" (service {other.get('url') or 'starting'}, since {since}). Use that one, or stop it"
                f" first: kill -TERM {other.get('pid', '<pid>')} (or Ctrl-C in its terminal)."
            ) from None
        left = [c for c in self._read(fd).get("children", []) if _alive(c)]
        if left:
            os.close(fd)
            names = ", ".join(f"{c['what']} pid {c['pid']}" for c in left)
            kills = " ".join(f"-{c['pid']}" for c in left)
            raise CliError(
                f"an earlier tail-ray up for {self.path.parent} ended without stopping what it started:"
                f" {names} still running. Stop them (kill -TERM {kills}), then run up again."
            )
        self._fd = fd
        self.record = {"pid": os.getpid(), "start": process_start_id(os.getpid()), "started_at": time.time()}
        self.record["children"] = []
        self._write()

    def add_child(self, what: str, pid: int) -> None:
        self.record["children"] = [c for c in self.record["children"] if c["what"] != what]
        self.record["children"].append({"what": what, "pid": pid, "start": process_start_id(pid)})
        self._write()

    def set_url(self, url: str) -> None:
        self.record["url"] = url
        self._write()

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        os.close(self._fd)  # drops the flock
        self._fd = None

    def _write(self) -> None:
        assert self._fd is not None
        data = json.dumps(self.record).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    @staticmethod
    def _read(fd: int) -> dict[str, Any]:
        with contextlib.suppress(OSError, ValueError):
            data = os.pread(fd, 1 << 16, 0)
            record = json.loads(data) if data else {}
            if isinstance(record, dict):
                return record
        return {}


# ----------------------------------------------------------------------------- kernels
def warm_kernels(max_world: int, out: Callable[[str], None]) -> Path:
    """Compile (or load) every kernel of tail_ray into the shared cache, saying each stage;
    returns the cache directory (what NUMBA_CACHE_DIR must name for another process to use it)."""
    # Imports torch and numba: only for the commands that compile something.
    from tail_ray.kernel_cache import cache_dir
    from tail_ray.warmup import warmup

    def progress(stage: str, i: int, n: int, seconds: float) -> None:
        out(f"  [{i}/{n}] {stage}: {seconds:.1f} s")

    out("compiling tail_ray's kernels (about a minute the first time, seconds once cached) ...")
    report = warmup(max_world=max_world, progress=progress)
    out(f"kernels ready in {report.total_s:.1f} s; cached in {report.cache_dir}")
    return cache_dir()


# ----------------------------------------------------------------------------- the stack
class Stack:
    """Start with ``start()``, call ``watch()`` every second or so, end with ``stop()``."""

    def __init__(self, options: StackOptions, out: Callable[[str], None]) -> None:
        self.options = options
        self.out = out
        self.token = os.environ.get("TAIL_RAY_API_TOKEN") or _new_token()
        self.lock = StackLock(options.home)
        self.head: LocalRayHead | None = None
        self.service: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self._sock: socket.socket | None = None
        self._service_started = 0.0
        self._crashes = 0
        self._restart_at: float | None = None
        self.restarts = 0

    # ------------------------------------------------------------ addresses
    @property
    def url(self) -> str:
        assert self._sock is not None
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    @property
    def api(self) -> Api:
        return Api(self.url, self.token)

    @property
    def log_path(self) -> Path:
        return self.options.home / "service.log"

    def job_python(self) -> str:
        if self.options.job_python:
            return self.options.job_python
        return sys.executable if self.head is not None else "python"

    # ------------------------------------------------------------ start
    def start(self) -> None:
        secure_home(self.options.home)
        self.lock.acquire()
        head_env: dict[str, str] = {}
        if self.options.ray_address is None and self.options.warmup_max_world is not None:
            # After the lock (a second `up` is refused at once), before the umask below (the
            # cache keeps numba's own file modes), before the head (its workers read the cache).
            head_env["NUMBA_CACHE_DIR"] = str(warm_kernels(self.options.warmup_max_world, self.out))
        # Everything `up` and its children create (database, logs, Ray's session files) is
        # the user's alone.
        os.umask(0o077)
        if self.options.ray_address is None:
            self.head = LocalRayHead(
                num_cpus=self.options.num_cpus,
                log_path=self.options.home / "ray-head.log",
                temp_dir=ray_temp_dir(self.options.home),
                loopback_only=True,
                die_with_parent=True,
                stop_grace_s=HEAD_STOP_GRACE_S,
                env=head_env,
            )
            self.out(f"starting a local Ray head (log: {self.head.log_path}) ...")
            self.head.start()
            assert self.head.process is not None
            self.lock.add_child("ray head", self.head.process.pid)
        self._sock = _bind_loopback(self.options.port)
        self.lock.set_url(self.url)
        self._start_service()
        self._wait_ready()
        write_private(state_file(), json.dumps({"url": self.url, "token": self.token, "pid": os.getpid()}))

    def _service_env(self) -> dict[str, str]:
        env = ray_env(loopback_only=self.head is not None)
        if self.head is not None:
            gcs, dashboard = self.head.address, self.head.dashboard_url
        else:
            gcs, dashboard = str(self.options.ray_address), self.options.ray_dashboard_url
        env.update(
            {
                "TAIL_RAY_API_TOKEN": self.token,
                "TAIL_RAY_RAY_ADDRESS": gcs,
                "TAIL_RAY_RAY_DASHBOARD_URL": dashboard,
                "TAIL_RAY_DB_PATH": str(self.options.db_path),
                "TAIL_RAY_JOB_PYTHON": self.job_python(),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
            }
        )
        return env

    def _start_service(self) -> None:
        assert self._sock is not None
        fd = self._sock.fileno()
        cmd = lifeline([sys.executable, "-m", "service.serve", "--fd", str(fd), "--log-level", "warning"])
        with open(self.log_path, "ab") as log:
            self.service = subprocess.Popen(
                cmd,
                env=self._service_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(fd,),
                start_new_session=True,  # Ctrl-C reaches `up`, which stops the service itself
                cwd=REPO_ROOT,
            )
        self._service_started = time.monotonic()
        self.lock.add_child("service", self.service.pid)

    def _wait_ready(self) -> None:
        """Until /readyz says 200 on our port: only our service accepts on it."""
        deadline = time.monotonic() + SERVICE_READY_TIMEOUT_S
        api = self.api
        while time.monotonic() < deadline:
            self.check_head()
            assert self.service is not None
            if self.service.poll() is not None:
                raise CliError(f"the service exited with code {self.service.returncode}; see {self.log_path}")
            if api.ready(timeout_s=5.0):
                return
            time.sleep(0.5)
        raise CliError(
            f"the service at {self.url} was not ready after {SERVICE_READY_TIMEOUT_S:.0f}s;"
            f" see {self.log_path}"
        )

    # ------------------------------------------------------------ supervise
    def check_head(self) -> None:
        head = self.head
        if head is not None and head.process is not None and head.process.poll() is not None:
            raise StackFailed(
                f"the Ray head (pid {head.process.pid}) exited with code {head.process.returncode};"
                f" stopping the service (see {head.log_path} and {head.temp_dir}/session_latest/logs)"
            )

    def watch(self) -> None:
        """One supervision step: fail if the head died; restart a dead service (with backoff)."""
        self.check_head()
        service = self.service
        if service is None or service.poll() is None:
            return
        now = time.monotonic()
        if self._restart_at is None:
            uptime_s = now - self._service_started
            self._crashes = 1 if uptime_s >= HEALTHY_UPTIME_S else self._crashes + 1
            first, cap = RESTART_BACKOFF_S
            delay_s = min(cap, first * 2 ** (self._crashes - 1))
            self._restart_at = now + delay_s
            self.out(
                f"the service (pid {service.pid}) exited with code {service.returncode} after"
                f" {uptime_s:.0f}s; restarting it in {delay_s:.0f}s. Ray and its jobs keep running"
                f" (log: {self.log_path})"
            )
        elif now >= self._restart_at:
            self._restart_at = None
            self._start_service()
            self.restarts += 1
            assert self.service is not None
            self.out(f"service restarted (pid {self.service.pid}, restart #{self.restarts})")

    # ------------------------------------------------------------ stop
    def stop(self) -> None:
        """The service first (it is a client of Ray), then the head; each by process group."""
        self.stopping = True
        try:
            if self.service is not None:
                stop_process_group(self.service, SERVICE_STOP_GRACE_S)
            if self.head is not None:
                self.head.stop()
        finally:
            if self._sock is not None:
                self._sock.close()
            with contextlib.suppress(OSError):
                saved = json.loads(state_file().read_text())
                if saved.get("pid") == os.getpid():
                    state_file().unlink()
            self.lock.release()

    def kill(self) -> None:
        """SIGKILL both process groups now (a second stop signal)."""
        for proc in (self.service, self.head.process if self.head else None):
            if proc is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        if self.head is not None:
            self.head.kill()

    def pids(self) -> dict[str, int]:
        out = {"up": os.getpid()}
        if self.service is not None:
            out["service"] = self.service.pid
        if self.head is not None and self.head.process is not None:
            out["ray head"] = self.head.process.pid
        return out


def _new_token() -> str:
    """256 random bits as hex, as Ray's own token. Never base64: one urlsafe token in 64 begins
    with '-', and `tail-ray --token -abc...` then reads as an unknown option (a fresh-clone CI
    run failed on exactly that)."""
    import secrets

    return secrets.token_hex(32)


def _bind_loopback(port: int | None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port or 0))
    except OSError as exc:
        sock.close()
        raise CliError(
            f"cannot listen on 127.0.0.1:{port} ({exc.strerror}); another program uses it: pick another"
            " port with --port (0: any free one)"
        ) from None
    sock.listen(512)
    return sock


@contextlib.contextmanager
def running(options: StackOptions, out: Callable[[str], None]) -> Iterator[Stack]:
    """A started stack, stopped on exit, on SIGTERM/SIGHUP/SIGINT (``StopRequested`` is raised
    in the main thread), or at once on a second signal while stopping."""
    stack = Stack(options, out)

    def on_signal(signum: int, frame: Any) -> None:
        if stack.stopping:
            stack.kill()
            return
        stack.stopping = True
        raise StopRequested(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        try:
            stack.start()
            yield stack
        finally:
            stack.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
