"""`tail-ray`: run the stack locally and talk to the service's REST API.

    tail-ray up                  local Ray head + the service on 127.0.0.1; Ctrl-C stops both
    tail-ray demo                up, then a digits job with "tail" and one with "none", side by side
    tail-ray submit job.yaml     submit a job spec (the fields of POST /v1/jobs, as YAML)
    tail-ray jobs                list jobs
    tail-ray metrics JOB_ID      per-layer table and totals
    tail-ray stop JOB_ID | logs JOB_ID

Every command except `up`/`demo` only speaks HTTP to the service; the URL and API token come
from --url/--token, else TAIL_RAY_URL/TAIL_RAY_API_TOKEN, else the file `up` writes
(~/.tail_ray/cli.json, mode 0600).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from service.job_yaml import load_job_yaml
from service.ray_head import HeadPorts, LocalRayHead, free_port, ray_env

HOME = Path(os.environ.get("TAIL_RAY_HOME", str(Path.home() / ".tail_ray"))).expanduser()
STATE_FILE = HOME / "cli.json"
REPO_ROOT = Path(__file__).resolve().parents[1]
TERMINAL = {"STOPPED", "SUCCEEDED", "FAILED"}
EXIT_USAGE, EXIT_API = 2, 1


class CliError(Exception):
    """A message for the user; main() prints it and exits non-zero."""


# ----------------------------------------------------------------------------- REST client
@dataclass
class Api:
    url: str
    token: str | None
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)  # what `up` started

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            resp = httpx.request(method, self.url + path, headers=self._headers(), timeout=30.0, **kwargs)
        except httpx.HTTPError as exc:
            raise CliError(
                f"cannot reach the service at {self.url} ({exc}); is `tail-ray up` running?"
            ) from None
        if resp.status_code == 422:
            detail = resp.json().get("detail")
            if isinstance(detail, list):
                lines = [f"  {'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in detail]
                raise CliError("the service rejected the job spec:\n" + "\n".join(lines))
        if resp.status_code >= 400:
            try:
                message = resp.json().get("detail", resp.text)
            except ValueError:
                message = resp.text
            raise CliError(f"{method} {path} -> HTTP {resp.status_code}: {message}")
        return resp.json()

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params or None)

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, json=body)


def _api(args: argparse.Namespace) -> Api:
    state: dict[str, str] = {}
    with contextlib.suppress(OSError, ValueError):
        state = json.loads(STATE_FILE.read_text())
    url = args.url or os.environ.get("TAIL_RAY_URL") or state.get("url") or "http://127.0.0.1:8000"
    token = args.token or os.environ.get("TAIL_RAY_API_TOKEN") or state.get("token")
    return Api(url.rstrip("/"), token)


# ----------------------------------------------------------------------------- formatting
def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- API commands
def cmd_submit(args: argparse.Namespace) -> int:
    try:
        spec = load_job_yaml(Path(args.file).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CliError(f"cannot read {args.file}: {exc}") from None
    if not isinstance(spec, dict):
        raise CliError(f"{args.file} must hold a YAML mapping of job fields (see `GET /docs`)")
    job = _api(args).post("/v1/jobs", spec)
    print(f"submitted {job['id']} ({job['name']}, {job['status']})")
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    page = _api(args).get("/v1/jobs", limit=args.limit)
    rows = []
    for j in page["items"]:
        method = j["spec"]["method"] if j["spec"] else "(by hand)"
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j["created_at"]))
        rows.append([j["id"], j["name"], method, j["status"], created])
    print(_table(["JOB", "NAME", "METHOD", "STATUS", "CREATED"], rows))
    print(f"{len(rows)} of {page['total']} jobs")
    return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    api = _api(args)
    base = f"/v1/jobs/{args.job_id}/metrics"
    layers = api.get(f"{base}/layers")
    summary = api.get(f"{base}/summary")
    rows = [
        [
            row["layer"], row["step"], row["ranks"], _num(row["bits"], 1), _num(row["density"], 3),
            _num(row["ratio"], 2), _bytes(row["raw_bytes"]), _bytes(row["encoded_bytes"]),
            _num(row["rel_error"], 4),
        ]
        for row in layers
    ]  # fmt: skip
    print(_table(["LAYER", "STEP", "RANKS", "BITS", "DENSITY", "RATIO", "RAW", "ENCODED", "REL_ERR"], rows))
    print(
        f"\nsteps {summary['steps']} (last {summary['last_step']}), world sizes {summary['world_sizes']}, "
        f"loss {summary['last_loss']}\ntraffic raw {_bytes(summary['raw_bytes'])}, sent "
        f"{_bytes(summary['bytes_sent'])}, saved {_bytes(summary['traffic_saved_bytes'])} "
        f"({100 * summary['traffic_saved_fraction']:.1f}%), ratio {summary['ratio']:.2f}x"
    )
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    job = _api(args).post(f"/v1/jobs/{args.job_id}/stop")
    print(f"{job['id']}: {job['status']}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    print(_api(args).get(f"/v1/jobs/{args.job_id}/logs")["logs"], end="")
    return 0


# ----------------------------------------------------------------------------- up / demo
@contextlib.contextmanager
def running_stack(args: argparse.Namespace) -> Iterator[Api]:
    """A Ray head (unless --ray-address) and the service, both ours, stopped on exit by pid."""
    HOME.mkdir(parents=True, exist_ok=True)
    token = os.environ.get("TAIL_RAY_API_TOKEN") or secrets.token_urlsafe(24)
    head: LocalRayHead | None = None
    service: subprocess.Popen[bytes] | None = None
    try:
        if args.ray_address:
            gcs, dashboard = args.ray_address, args.ray_dashboard_url
        else:
            head = LocalRayHead(HeadPorts.pick(), num_cpus=args.num_cpus, log_path=HOME / "ray-head.log")
            print(f"starting a local Ray head (log: {head.log_path}) ...", flush=True)
            head.start()
            gcs, dashboard = head.ports.gcs_address, head.ports.dashboard_url
        port = args.port or free_port()
        env = ray_env()
        env.update(
            {
                "TAIL_RAY_API_TOKEN": token,
                "TAIL_RAY_RAY_ADDRESS": gcs,
                "TAIL_RAY_RAY_DASHBOARD_URL": dashboard,
                "TAIL_RAY_DB_PATH": str(Path(args.db).expanduser()),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
            }
        )
        cmd = [sys.executable, "-m", "uvicorn", "--factory", "service.main:create_app"]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        with open(HOME / "service.log", "ab") as log:
            service = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        api = Api(f"http://127.0.0.1:{port}", token)
        _wait_ready(api, service)
        STATE_FILE.touch(mode=0o600)
        STATE_FILE.chmod(0o600)  # it holds the API token; touch() keeps an older file's mode
        STATE_FILE.write_text(json.dumps({"url": api.url, "token": token}))
        print(
            f"tail-ray is up\n  dashboard    {api.url}/\n  API docs     {api.url}/docs\n"
            f"  Ray          {dashboard}\n  API token    {token}\n  database     {args.db}\n"
            f"  pids         service {service.pid}"
            + (f", ray head {head.process.pid}" if head is not None and head.process is not None else "")
            + f"\n  (url and token saved to {STATE_FILE} for the other tail-ray commands)",
            flush=True,
        )
        api.children = [p for p in (service, head.process if head else None) if p is not None]
        yield api
    finally:
        if service is not None and service.poll() is None:
            service.send_signal(signal.SIGTERM)
            try:
                service.wait(timeout=20)
            except subprocess.TimeoutExpired:
                service.kill()
                service.wait()
        if head is not None:
            head.stop()


def _wait_ready(api: Api, service: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if service.poll() is not None:
            raise CliError(f"the service exited with code {service.returncode}; see {HOME / 'service.log'}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(api.url + "/readyz", timeout=10).status_code == 200:
                return
        time.sleep(0.5)
    raise CliError(
        f"the service at {api.url} was not ready after {timeout_s:.0f}s; see {HOME / 'service.log'}"
    )


def cmd_up(args: argparse.Namespace) -> int:
    with running_stack(args) as api:
        print("Ctrl-C to stop", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while all(child.poll() is None for child in api.children):
                time.sleep(1)
            dead = [c for c in api.children if c.poll() is not None]
            raise CliError(
                f"pid {dead[0].pid} exited with code {dead[0].returncode}; stopping the rest (logs in {HOME})"
            )
    print("stopped")
    return 0


def _follow(api: Api, job_id: str, label: str, steps: int) -> dict[str, Any]:
    """Draw a progress bar until the job ends; returns the job."""
    width = 30
    while True:
        job = api.get(f"/v1/jobs/{job_id}")
        last = api.get(f"/v1/jobs/{job_id}/metrics/summary")["last_step"]
        done = 0 if last is None else min(steps, last + 1)
        bar = "#" * (width * done // steps) + "-" * (width - width * done // steps)
        print(f"\r{label:>5} [{bar}] {done:>4}/{steps} {job['status']:<10}", end="", flush=True)
        if job["status"] in TERMINAL:
            print()
            return dict(job)
        time.sleep(1.0)


def _result_line(logs: str) -> dict[str, Any]:
    """The last JSON object `python -m jobs.train` prints on stdout (final metrics)."""
    for line in reversed(logs.splitlines()):
        line = line.strip()
        if line.startswith("{") and '"job_id"' in line:
            with contextlib.suppress(ValueError):
                return dict(json.loads(line))
    return {}


def cmd_demo(args: argparse.Namespace) -> int:
    with running_stack(args) as api:
        results = {}
        for method in ("tail", "none"):
            spec = {
                "name": f"demo-digits-{method}", "model": "digits_cnn", "dataset": "digits", "method": method,
                "min_workers": args.workers, "max_workers": args.workers, "steps": args.steps,
                "batch_size": 32, "lr": 0.05, "checkpoint_every_steps": args.steps, "max_failures": 0,
            }  # fmt: skip
            if method == "tail":
                # The demo shows what compression does. Its workers share this host, where the
                # link-aware switch would (rightly) pick plain all-reduce: pin compression on.
                spec["compression"] = {"link_aware": False}
            job = api.post("/v1/jobs", spec)
            print(f"submitted {job['id']} ({method}); watch it at {api.url}/#job={job['id']}")
            job = _follow(api, job["id"], method, args.steps)
            summary = api.get(f"/v1/jobs/{job['id']}/metrics/summary")
            result = _result_line(api.get(f"/v1/jobs/{job['id']}/logs")["logs"])
            if job["status"] != "SUCCEEDED":
                print(f"  {method}: {job['status']}: {job['message'][-300:]}")
            results[method] = (job, summary, result)
        print()
        print(_demo_table(results))
    return 0


def _demo_table(results: dict[str, tuple[dict, dict, dict]]) -> str:
    def acc(r: dict) -> str:
        return f"{r['val_accuracy']:.3f}" if "val_accuracy" in r else "-"

    def cell(summary: dict, key: str) -> str:
        return _bytes(summary[key]) if summary["steps"] else "-"

    rows = [
        ["status"] + [job["status"] for job, _, _ in results.values()],
        ["val accuracy"] + [acc(r) for _, _, r in results.values()],
        ["final loss"]
        + [f"{s['last_loss']:.4f}" if s["last_loss"] is not None else "-" for _, s, _ in results.values()],
        ["traffic raw"] + [cell(s, "raw_bytes") for _, s, _ in results.values()],
        ["traffic sent"] + [cell(s, "bytes_sent") for _, s, _ in results.values()],
        ["ratio (raw/sent)"] + [f"{s['ratio']:.2f}x" if s["steps"] else "-" for _, s, _ in results.values()],
        ["mean layer ratio"]
        + [f"{s['mean_layer_ratio']:.2f}x" if s["mean_layer_ratio"] else "-" for _, s, _ in results.values()],
        ["wall time"] + [f"{r['wall_s']:.1f} s" if "wall_s" in r else "-" for _, _, r in results.values()],
    ]
    return _table(["", *results], rows)


# ----------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tail-ray",
        description="Tail gradient compression on Ray: run the control plane locally and use its REST API.",
        epilog="Start with `tail-ray demo`. The service's own docs are at <url>/docs once it runs.",
    )
    parser.add_argument("--url", help="service URL (default: TAIL_RAY_URL, else the one `up` saved)")
    parser.add_argument("--token", help="API token (default: TAIL_RAY_API_TOKEN, else the one `up` saved)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def stack_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--port", type=int, default=8000, help="service port on 127.0.0.1 (0: any free one)")
        p.add_argument(
            "--db", default=str(HOME / "service.sqlite"), help="SQLite file (default: %(default)s)"
        )
        p.add_argument(
            "--num-cpus", type=int, default=os.cpu_count() or 2, help="CPUs the local Ray head offers"
        )
        p.add_argument(
            "--ray-address", help="use this running cluster's GCS (host:port) instead of a local head"
        )
        p.add_argument(
            "--ray-dashboard-url", default="http://127.0.0.1:8265", help="its job server, with --ray-address"
        )

    up = sub.add_parser("up", help="start a local Ray head and the service; Ctrl-C stops both")
    stack_options(up)
    up.set_defaults(func=cmd_up)
    demo = sub.add_parser("demo", help="up, then digits with 'tail' and with 'none', compared side by side")
    stack_options(demo)
    demo.add_argument("--steps", type=int, default=150, help="training steps per job (default: %(default)s)")
    demo.add_argument("--workers", type=int, default=2, help="workers per job (default: %(default)s)")
    demo.set_defaults(func=cmd_demo)

    submit = sub.add_parser("submit", help="submit a job spec from a YAML file (the fields of POST /v1/jobs)")
    submit.add_argument("file", help="e.g. a file with `method: tail` and `steps: 100`")
    submit.set_defaults(func=cmd_submit)
    jobs = sub.add_parser("jobs", help="list jobs, newest first")
    jobs.add_argument("--limit", type=int, default=50)
    jobs.set_defaults(func=cmd_jobs)
    metrics = sub.add_parser("metrics", help="a job's per-layer table and traffic totals")
    metrics.add_argument("job_id")
    metrics.set_defaults(func=cmd_metrics)
    stop = sub.add_parser("stop", help="stop a running job")
    stop.add_argument("job_id")
    stop.set_defaults(func=cmd_stop)
    logs = sub.add_parser("logs", help="print a job's driver log")
    logs.add_argument("job_id")
    logs.set_defaults(func=cmd_logs)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "port", None) == 0:
        args.port = None
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except CliError as exc:
        print(f"tail-ray: {exc}", file=sys.stderr)
        return EXIT_API
    except RuntimeError as exc:  # a Ray head that would not start
        print(f"tail-ray: {exc}", file=sys.stderr)
        return EXIT_API


if __name__ == "__main__":
    sys.exit(main())
