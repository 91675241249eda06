"""End-to-end step time over a REAL bandwidth-limited link, every method side by side.

    python -m jobs.bench_network [--quick] [--links unlimited,1000,100] [--json PATH]

Two training ranks run in two network namespaces joined by a veth pair with a `tc` rate
limit (jobs/netlab.py), talking gloo across that link through the same DDP comm hook the Ray
jobs use. For each link speed, model and method (same seed, same steps) it reports the median
step time, communication / compression time, bytes on the wire per step counted by the
transport and cross-checked against the interface's own byte counters, and the speedup
against plain fp32 all-reduce ("none").

Needs root (namespaces). When they cannot be made it says so and exits non-zero: it never
falls back to a fake link. It removes the namespaces on exit, Ctrl-C or failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("bench_network")

METHODS: dict[str, dict[str, Any]] = {
    "none": {},
    "fp16": {},
    "powersgd": {"rank": 2},
    # The peers run through the same hook, pinned to compress: their rows show their codecs.
    "qsgd-8": {"bits": 8, "link_aware": False},
    "topk-1%": {"density": 0.01, "link_aware": False},
    # Tail as shipped: the link-aware switch picks plain all-reduce where that is faster.
    "tail": {},
    # Tail with the switch off: what the codec costs when it is always on.
    "tail-always": {"link_aware": False},
}
MODELS = {"synthetic_mlp": "synthetic", "char_transformer": "stdlib_chars"}
WORKER_TIMEOUT_S = 600


def method_name(label: str) -> str:
    return label.split("-")[0]


# --------------------------------------------------------------------------------------------
# Worker: one training rank inside one namespace.
# --------------------------------------------------------------------------------------------
def run_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tail_ray.collective import register_tail_hook
    from tail_ray.runner.datasets import make_dataset
    from tail_ray.runner.models import loss_fn, make_model

    # Two ranks share this machine's cores: one thread each keeps them from fighting.
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master_addr}:{args.master_port}",
        rank=args.rank,
        world_size=2,
        timeout=__import__("datetime").timedelta(seconds=300),
    )
    dataset = make_dataset(args.dataset, seed=0)
    model = DDP(make_model(args.model, dataset, seed=0))
    state = register_tail_hook(model, method=method_name(args.method), config=json.loads(args.settings))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    rows = []
    total_steps = args.warmup_steps + args.steps
    for step in range(total_steps):
        x, y = dataset.batch(seed=0, step=step, rank=args.rank, world_size=2, batch_size=args.batch_size)
        dist.barrier()  # every rank starts the step together: step time is the slowest rank's
        t0 = time.perf_counter()
        loss = loss_fn(dataset, model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step_s = time.perf_counter() - t0
        m = state.drain_metrics()
        if step >= args.warmup_steps:
            rows.append(
                {
                    "step_s": step_s,
                    "comm_s": m.comm_s,
                    "compress_s": m.compress_s,
                    "decode_s": m.decode_s,
                    "bytes_sent": m.bytes_sent,
                    "bytes_received": m.bytes_received,
                    "raw_bytes": m.raw_bytes,
                    # The link-aware switch sent this step by plain all-reduce.
                    "plain": bool(m.layers) and all(layer.code == "allreduce" for layer in m.layers),
                    "loss": loss.item(),
                }
            )
        if step == args.warmup_steps - 1:
            dist.barrier()
            Path(args.out + ".warm").write_text("1")  # orchestrator snapshots counters now
            dist.barrier()
    dist.barrier()
    Path(args.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Orchestrator.
# --------------------------------------------------------------------------------------------
@dataclass
class Result:
    link: str
    model: str
    method: str
    step_s_median: float
    comm_s_median: float
    compress_s_median: float
    decode_s_median: float
    bytes_per_step_transport: float
    bytes_per_step_interface: float
    raw_bytes_per_step: float
    final_loss: float
    plain_step_share: float = 0.0  # timed steps the link-aware switch sent uncompressed
    speedup_vs_none: float = float("nan")


def _free_port() -> int:
    return 29500 + (os.getpid() % 1000)


def run_pair(lab: Any, model: str, method: str, args: argparse.Namespace, port: int) -> Result:
    from jobs.netlab import NetLabError

    a, b = lab.hosts
    with tempfile.TemporaryDirectory(prefix="tail-netbench-") as tmp:
        outs = [os.path.join(tmp, f"rank{r}.json") for r in (0, 1)]
        procs = []
        for rank, host in enumerate((a, b)):
            cmd = [
                *host.exec_prefix(),
                sys.executable,
                "-m",
                "jobs.bench_network",
                "--worker",
                "--rank",
                str(rank),
                "--master-addr",
                a.address,
                "--master-port",
                str(port),
                "--ifname",
                host.ifname,
                "--model",
                model,
                "--dataset",
                MODELS[model],
                "--method",
                method,
                "--settings",
                json.dumps(METHODS[method]),
                "--steps",
                str(args.steps),
                "--warmup-steps",
                str(args.warmup_steps),
                "--batch-size",
                str(args.batch_size),
                "--out",
                outs[rank],
            ]
            env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen(cmd, env=env))
        counters_start = None
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        try:
            while any(p.poll() is None for p in procs):
                if counters_start is None and os.path.exists(outs[0] + ".warm"):
                    counters_start = a.tx_rx_bytes()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{model}/{method} did not finish in {WORKER_TIMEOUT_S} s")
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        counters_end = a.tx_rx_bytes()
        if any(p.returncode != 0 for p in procs):
            raise NetLabError(f"{model}/{method}: worker exit codes {[p.returncode for p in procs]}")
        rows = json.loads(Path(outs[0]).read_text())
    if counters_start is None:
        counters_start = (0, 0)
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    iface = (counters_end[0] - counters_start[0]) / len(rows)
    return Result(
        link=lab_label(lab.rate_mbit),
        model=model,
        method=method,
        step_s_median=med("step_s"),
        comm_s_median=med("comm_s"),
        compress_s_median=med("compress_s"),
        decode_s_median=med("decode_s"),
        bytes_per_step_transport=med("bytes_sent"),
        bytes_per_step_interface=iface,
        raw_bytes_per_step=med("raw_bytes"),
        final_loss=rows[-1]["loss"],
        plain_step_share=sum(bool(r.get("plain")) for r in rows) / len(rows),
    )


def lab_label(rate_mbit: float | None) -> str:
    return "unlimited" if rate_mbit is None else f"{rate_mbit:g}Mbit"


def print_table(results: list[Result]) -> None:
    header = (
        f"{'link':>10} {'model':>17} {'method':>9} {'step ms':>8} {'comm ms':>8} {'comp ms':>8} "
        f"{'dec ms':>7} {'MB/step':>8} {'iface MB':>8} {'plain':>5} {'speedup':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.link:>10} {r.model:>17} {r.method:>9} "
            f"{1e3 * r.step_s_median:8.1f} {1e3 * r.comm_s_median:8.1f} "
            f"{1e3 * r.compress_s_median:8.1f} {1e3 * r.decode_s_median:7.1f} "
            f"{r.bytes_per_step_transport / 1e6:8.3f} {r.bytes_per_step_interface / 1e6:8.3f} "
            f"{r.plain_step_share:5.0%} {r.speedup_vs_none:7.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jobs.bench_network",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Needs root for `ip netns` and `tc`.\n"
        "Example: python -m jobs.bench_network --quick --json runs/net.json",
    )
    parser.add_argument("--quick", action="store_true", help="fewer steps, one model (synthetic_mlp)")
    parser.add_argument(
        "--links",
        default="unlimited,1000,100",
        help="comma list of link rates in Mbit/s, or 'unlimited' (default: %(default)s)",
    )
    parser.add_argument("--models", default=",".join(MODELS), help="comma list (default: %(default)s)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma list (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run (default: %(default)s)")
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=45,
        help="untimed steps first (default %(default)s): they cover Tail's link-aware start-up "
        "trial (5 warm-up + 5 compressed + 5 plain steps) and, after a near tie, its first "
        "re-check (25 steps later), so the timed steps show the settled mode",
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--delay-ms", type=float, default=0.0, help="added one-way delay (needs netem)")
    parser.add_argument("--json", help="write results to this JSON file")
    # Worker-side arguments (internal).
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--rank", "--master-port"):
        parser.add_argument(name, type=int, help=argparse.SUPPRESS)
    for name in ("--master-addr", "--ifname", "--model", "--dataset", "--method", "--settings", "--out"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.worker:
        run_worker(args)
        return 0

    from jobs.netlab import NetLab, NetLabError

    if args.quick:
        args.steps = min(args.steps, 8)
        args.models = "synthetic_mlp"
    links = [None if s.strip() == "unlimited" else float(s) for s in args.links.split(",")]
    models = [m.strip() for m in args.models.split(",")]
    methods = [m.strip() for m in args.methods.split(",")]
    for m in models:
        if m not in MODELS:
            parser.error(f"unknown model {m!r}; choose from {list(MODELS)}")
    for m in methods:
        if m not in METHODS:
            parser.error(f"unknown method {m!r}; choose from {list(METHODS)}")

    results: list[Result] = []
    port = _free_port()
    try:
        for rate in links:
            with NetLab(rate, delay_ms=args.delay_ms) as lab:
                for model in models:
                    for method in methods:
                        logger.info("link %s model %s method %s", lab_label(rate), model, method)
                        port += 1
                        results.append(run_pair(lab, model, method, args, port))
    except NetLabError as exc:
        logger.error("cannot run the network benchmark: %s", exc)
        return 2
    base = {(r.link, r.model): r.step_s_median for r in results if r.method == "none"}
    for r in results:
        if (r.link, r.model) in base:
            r.speedup_vs_none = base[(r.link, r.model)] / r.step_s_median
    print_table(results)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "benchmark": "network",
                    "steps": args.steps,
                    "batch_size": args.batch_size,
                    "machine": {"cpus": os.cpu_count(), "platform": sys.platform},
                    "results": [asdict(r) for r in results],
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
