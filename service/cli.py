"""`tail-ray`: the commands. Run the stack locally (service/stack.py) and talk to the
service's REST API (service/client.py).

    tail-ray up                  local Ray head + the service on 127.0.0.1, supervised; Ctrl-C,
                                 SIGTERM or SIGHUP stops both
    tail-ray demo                up, then a digits job with "tail" and one with "none", side by side
    tail-ray submit job.yaml     submit a job spec (the fields of POST /v1/jobs, as YAML)
    tail-ray submit --working-dir DIR -- python my_train.py ARGS
                                 upload DIR, run your own script in it
    tail-ray jobs                list jobs
    tail-ray metrics JOB_ID      per-layer table and totals
    tail-ray stop JOB_ID | logs JOB_ID
    tail-ray warmup              compile the codec's numba kernels once, into the shared cache

Every command except `up`/`demo` only speaks HTTP to the service; the URL and API token come
from --url/--token, else TAIL_RAY_URL/TAIL_RAY_API_TOKEN, else the file `up` writes
(~/.tail_ray/cli.json, mode 0600).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from service.client import Api, CliError, home_dir, state_file
from service.job_yaml import load_job_yaml
from service.stack import Stack, StackOptions, StopRequested, running, warm_kernels
from service.status import JobStatus
from service.terminal import Output
from service.upload import entrypoint_from_command, zip_directory

DEFAULT_MAX_WORLD = 8  # tail_ray.warmup's default, named here without importing torch
EXIT_USAGE, EXIT_API = 2, 1
__all__ = ["EXIT_API", "EXIT_USAGE", "CliError", "build_parser", "main"]


def _api(args: argparse.Namespace) -> Api:
    return Api.resolve(args.url, args.token)


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


# ----------------------------------------------------------------------------- API commands
def cmd_submit(args: argparse.Namespace) -> int:
    api = _api(args)
    if args.command_line:
        spec = _custom_spec(api, args)
    elif args.file:
        try:
            spec = load_job_yaml(Path(args.file).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise CliError(f"cannot read {args.file}: {exc}") from None
        if not isinstance(spec, dict):
            raise CliError(f"{args.file} must hold a YAML mapping of job fields (see `GET /docs`)")
    else:
        raise CliError("give a job spec file, or your own command: --working-dir DIR -- python my_train.py")
    job = api.post("/v1/jobs", spec)
    args.out.say(
        f"submitted {job['id']} ({job['name']}, {job['status']}); watch it at {api.url}/#job={job['id']}"
    )
    return 0


def _custom_spec(api: Api, args: argparse.Namespace) -> dict[str, Any]:
    """Upload --working-dir (if given) and describe the command after `--` as a job spec."""
    if args.file:
        raise CliError("give either a job spec file or a command after --, not both")
    working_dir = Path(args.working_dir).expanduser() if args.working_dir else None
    spec: dict[str, Any] = {"entrypoint": entrypoint_from_command(args.command_line, working_dir)}
    if working_dir is not None:
        data, files = zip_directory(working_dir)
        package = api.post_zip("/v1/packages", data)
        args.out.say(
            f"working dir {working_dir}: {files} files, {len(data)} bytes -> package {package['id'][:12]}"
        )
        spec["working_dir"] = package["id"]
    if args.pip:
        spec["pip"] = list(args.pip)
    if args.name:
        spec["name"] = args.name
    return spec


def cmd_jobs(args: argparse.Namespace) -> int:
    page = _api(args).get("/v1/jobs", limit=args.limit)
    rows = []
    for j in page["items"]:
        method = j["spec"].get("method", "(own code)") if j["spec"] else "(by hand)"
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j["created_at"]))
        rows.append([j["id"], j["name"], method, j["status"], created])
    args.out.table(["JOB", "NAME", "METHOD", "STATUS", "CREATED"], rows)
    args.out.say(f"{len(rows)} of {page['total']} jobs")
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
    args.out.table(["LAYER", "STEP", "RANKS", "BITS", "DENSITY", "RATIO", "RAW", "ENCODED", "REL_ERR"], rows)
    args.out.say(
        f"\nsteps {summary['steps']} (last {summary['last_step']}), world sizes {summary['world_sizes']}, "
        f"loss {summary['last_loss']}\ntraffic raw {_bytes(summary['raw_bytes'])}, sent "
        f"{_bytes(summary['bytes_sent'])}, saved {_bytes(summary['traffic_saved_bytes'])} "
        f"({100 * summary['traffic_saved_fraction']:.1f}%), ratio {summary['ratio']:.2f}x"
    )
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    job = _api(args).post(f"/v1/jobs/{args.job_id}/stop")
    args.out.say(f"{job['id']}: {job['status']}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    print(_api(args).get(f"/v1/jobs/{args.job_id}/logs")["logs"], end="", file=args.out.out)  # verbatim
    return 0


# ----------------------------------------------------------------------------- up / demo
def _stack_options(args: argparse.Namespace) -> StackOptions:
    return StackOptions(
        home=home_dir(),
        db_path=Path(args.db or home_dir() / "service.sqlite").expanduser(),
        port=args.port,
        num_cpus=args.num_cpus,
        ray_address=args.ray_address,
        ray_dashboard_url=args.ray_dashboard_url,
        job_python=args.python,
        # The demo's jobs, and any job of up to 8 ranks, find every kernel compiled.
        warmup_max_world=max(DEFAULT_MAX_WORLD, getattr(args, "workers", 0)),
    )


def cmd_warmup(args: argparse.Namespace) -> int:
    if args.max_world < 1:
        raise CliError(f"--max-world must be at least 1, got {args.max_world}")
    warm_kernels(args.max_world, args.out.say)
    return 0


def _banner(stack: Stack) -> str:
    pids = ", ".join(f"{what} {pid}" for what, pid in stack.pids().items())
    # Logs (systemd, docker) keep what is printed: there the token stays in the 0600 file.
    token = stack.token if sys.stdout.isatty() else f"(in {state_file()}; printed only to a terminal)"
    logs = str(stack.options.home)
    if stack.head is not None:
        ray = (
            f"{stack.head.dashboard_url}  (GCS {stack.head.address}, loopback only: a driver joins"
            " with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0)"
        )
        logs += f"; Ray's in {stack.head.temp_dir}/session_latest/logs"
    else:
        ray = f"{stack.options.ray_dashboard_url}  (GCS {stack.options.ray_address})"
    rows = [
        ("dashboard", f"{stack.url}/"),
        ("API docs", f"{stack.url}/docs"),
        ("API token", token),
        ("Ray", ray),
        ("jobs run", stack.job_python()),
        ("database", str(stack.options.db_path)),
        ("logs", logs),
        ("pids", pids),
    ]
    lines = ["tail-ray is up", *(f"  {name:<12} {value}" for name, value in rows)]
    lines.append(f"  (url and token saved to {state_file()} for the other tail-ray commands)")
    return "\n".join(lines)


def cmd_up(args: argparse.Namespace) -> int:
    try:
        with running(_stack_options(args), args.out.say) as stack:
            args.out.say(_banner(stack))
            args.out.say("Ctrl-C (or SIGTERM / SIGHUP) stops the service, then Ray")
            while True:
                stack.watch()
                time.sleep(0.5)
    except StopRequested as stop:
        args.out.say(f"{stop} received: stopped the service and Ray")
    return 0


def _follow(
    out: Output, api: Api, job_id: str, label: str, steps: int, tick: Callable[[], None]
) -> dict[str, Any]:
    """Show the job's progress until it ends; returns the job. ``tick`` supervises the stack."""
    with out.progress(label, steps) as update:
        while True:
            tick()
            job = api.get(f"/v1/jobs/{job_id}")
            last = api.get(f"/v1/jobs/{job_id}/metrics/summary")["last_step"]
            update(0 if last is None else min(steps, last + 1), job["status"])
            if JobStatus.from_ray(job["status"]).is_terminal:
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
    try:
        with running(_stack_options(args), args.out.say) as stack:
            _run_demo(stack, args)
    except StopRequested as stop:
        args.out.say(f"{stop} received: stopped the service and Ray")
        return 130
    return 0


def _run_demo(stack: Stack, args: argparse.Namespace) -> None:
    api = stack.api
    ray = stack.head.dashboard_url if stack.head else args.ray_dashboard_url
    pids = ", ".join(f"{what} {pid}" for what, pid in stack.pids().items())
    out = args.out
    out.say(f"tail-ray is up at {stack.url}/ (Ray {ray}; pids {pids})")
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
        out.say(f"submitted {job['id']} ({method}); watch it at {api.url}/#job={job['id']}")
        job = _follow(out, api, job["id"], method, args.steps, stack.watch)
        summary = api.get(f"/v1/jobs/{job['id']}/metrics/summary")
        result = _result_line(api.get(f"/v1/jobs/{job['id']}/logs")["logs"])
        if job["status"] != "SUCCEEDED":
            out.say(f"  {method}: {job['status']}: {job['message'][-300:]}")
        results[method] = (job, summary, result)
    out.say("")
    out.table(["", *results], _demo_rows(results))


def _demo_rows(results: dict[str, tuple[dict, dict, dict]]) -> list[list[str]]:
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
    return rows


# ----------------------------------------------------------------------------- parser
def _add_stack_options(p: argparse.ArgumentParser) -> None:
    """The options `up` and `demo` share: where the service listens, keeps data, finds Ray."""
    p.add_argument("--port", type=int, default=8000, help="service port on 127.0.0.1 (0: any free one)")
    p.add_argument(
        "--db", help=f"SQLite file (default: {home_dir() / 'service.sqlite'}; TAIL_RAY_HOME moves it)"
    )
    p.add_argument("--num-cpus", type=int, default=os.cpu_count() or 2, help="CPUs the local Ray head offers")
    p.add_argument("--ray-address", help="use this running cluster's GCS (host:port) instead of a local head")
    p.add_argument(
        "--ray-dashboard-url", default="http://127.0.0.1:8265", help="its job server, with --ray-address"
    )
    p.add_argument(
        "--python",
        help="the interpreter jobs run with (default: this one with a local head; with --ray-address,"
        " `python` on the cluster's PATH)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tail-ray",
        description="Tail gradient compression on Ray: run the control plane locally and use its REST API.",
        epilog="Start with `tail-ray demo`. The service's own docs are at <url>/docs once it runs.",
    )
    parser.add_argument("--url", help="service URL (default: TAIL_RAY_URL, else the one `up` saved)")
    parser.add_argument("--token", help="API token (default: TAIL_RAY_API_TOKEN, else the one `up` saved)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser(
        "up",
        help="a local Ray head and the service (restarted if it dies); Ctrl-C, SIGTERM, SIGHUP stop both",
        description="Compile the codec's kernels into the shared cache (as `tail-ray warmup`; seconds once"
        " cached), start a loopback-only Ray head and the service on 127.0.0.1, and supervise them: a"
        " service that dies is restarted (Ray and its jobs keep running). Ctrl-C, SIGTERM or SIGHUP"
        " stops the service, then Ray. One `up` per TAIL_RAY_HOME (default ~/.tail_ray).",
    )
    _add_stack_options(up)
    up.set_defaults(func=cmd_up)
    demo = sub.add_parser("demo", help="up, then digits with 'tail' and with 'none', compared side by side")
    _add_stack_options(demo)
    demo.add_argument("--steps", type=int, default=150, help="training steps per job (default: %(default)s)")
    demo.add_argument("--workers", type=int, default=2, help="workers per job (default: %(default)s)")
    demo.set_defaults(func=cmd_demo)

    submit = sub.add_parser(
        "submit",
        help="submit a job spec (YAML file), or your own script: --working-dir DIR -- python x.py ...",
        description="Submit a job: `tail-ray submit job.yaml` (the fields of POST /v1/jobs as YAML), or your "
        "own code: `tail-ray submit --working-dir DIR -- python my_train.py ARGS` uploads DIR (zipped; "
        "caches, .git and virtual envs left out) and runs the command in it on the cluster. Its model "
        "should go through tail_ray.train.prepare_model, so the service shows its metrics.",
    )
    submit.add_argument("file", nargs="?", help="e.g. a file with `method: tail` and `steps: 100`")
    submit.add_argument("--working-dir", help="directory to upload and run the command in")
    submit.add_argument("--pip", action="append", default=[], metavar="REQ", help="requirement (repeatable)")
    submit.add_argument("--name", help="job name (default: the script's name)")
    submit.set_defaults(func=cmd_submit, command_line=[])
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
    warm = sub.add_parser(
        "warmup",
        help="compile the codec's kernels once into the shared cache (up and demo do it themselves)",
        description="Compile every numba kernel of tail_ray into the cache that every process on this "
        "machine reads ($NUMBA_CACHE_DIR, else ~/.tail_ray/numba-cache), so that no Ray worker spends "
        "its first step compiling. Takes about a minute the first time, seconds afterwards.",
    )
    warm.add_argument(
        "--max-world",
        type=int,
        default=DEFAULT_MAX_WORLD,
        help="compile the rank means up to this many ranks (default: %(default)s)",
    )
    warm.set_defaults(func=cmd_warmup)
    return parser


# Options whose value is opaque: argparse reads `--token -abc` as two options, so a token (one
# the user chose, in TAIL_RAY_API_TOKEN's format) that begins with '-' could not be passed.
_OPAQUE_OPTIONS = ("--token", "--url")


def _glue_values(argv: list[str]) -> list[str]:
    """`--token VALUE` -> `--token=VALUE`, whatever VALUE begins with."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg in _OPAQUE_OPTIONS:
            value = next(it, None)
            out.append(arg if value is None else f"{arg}={value}")
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `submit ... -- python my_train.py --steps 3`: everything after `--` is the job's command.
    command_line: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command_line = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(_glue_values(argv))
    out = args.out = Output()
    if command_line:
        if args.command != "submit":
            out.error(f"`--` and a command go with `submit`, not `{args.command}`")
            return EXIT_USAGE
        args.command_line = command_line
    if getattr(args, "port", None) == 0:
        args.port = None
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except (CliError, OSError, RuntimeError) as exc:  # RuntimeError: a Ray head that would not start
        out.error(str(exc))
        return EXIT_API


if __name__ == "__main__":
    sys.exit(main())
