"""End-to-end step time over a REAL bandwidth-limited network, every method side by side.

    python -m jobs.bench_network [--quick] [--world-size W] [--links unlimited,1000,loopback] [--json PATH]

W training ranks (default 2) run in W network namespaces, one rank each (jobs/netlab.py): two
are joined by a veth pair, more by a bridge in a namespace of its own, with a `tc` rate limit
on both ends of every veth, so each rank's upload and download are as slow as asked. They
talk gloo through the same DDP comm hook the Ray jobs use. ``loopback`` instead puts every
rank in ONE fresh namespace talking over its loopback (no limit; its counters see only the
benchmark). For each link speed, model and method (same seed, same steps) it reports the
median step time, communication / compression time, bytes on the wire per rank per step
counted by the transport and by the interfaces' own byte counters (mean over ranks), and the
speedup against plain fp32 all-reduce ("none").

Needs root (namespaces). When they cannot be made it says so and exits non-zero: it never
falls back to a fake link. It removes the namespaces on exit, Ctrl-C or failure.
"""

from __future__ import annotations

import argparse
import gc
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

from jobs.output_path import output_file

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
    # Tail through one collective each, always compressing: the collectives side by side.
    "tail-allgather": {"collective": "allgather", "link_aware": False},
    "tail-sharded": {"collective": "sharded", "link_aware": False},
}
MODELS = {"synthetic_mlp": "synthetic", "char_transformer": "stdlib_chars"}
WORKER_TIMEOUT_S = 600


def method_name(label: str) -> str:
    return label.split("-")[0]


def _label_width() -> int:
    return max(len(m) for m in METHODS)


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

    # The ranks share this machine's cores: one thread each keeps them from fighting.
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    world_size = args.world_size
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master_addr}:{args.master_port}",
        rank=args.rank,
        world_size=world_size,
        timeout=__import__("datetime").timedelta(seconds=300),
    )
    dataset = make_dataset(args.dataset, seed=0)
    model = DDP(make_model(args.model, dataset, seed=0))
    state = register_tail_hook(model, method=method_name(args.method), config=json.loads(args.settings))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    rows = []
    total_steps = args.warmup_steps + args.steps
    for step in range(total_steps):
        x, y = dataset.batch(
            seed=0, step=step, rank=args.rank, world_size=world_size, batch_size=args.batch_size
        )
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
                    "encoded_bytes": m.encoded_bytes,
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
    # DDP's reducer and the hook's state hold the group: drop them (and their reference
    # cycles) while the interpreter is whole, so the group really goes here, not at exit.
    del model, state, opt
    gc.collect()
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
    world_size: int = 2
    encoded_bytes_per_step: float = 0.0  # one rank's own compressed gradient (mean over ranks)
    bytes_per_step_interface_max: float = 0.0  # the busiest rank's interface
    plain_step_share: float = 0.0  # timed steps the link-aware switch sent uncompressed
    speedup_vs_none: float = float("nan")


def _free_port() -> int:
    return 29500 + (os.getpid() % 1000)


def run_group(lab: Any, model: str, method: str, args: argparse.Namespace, port: int) -> Result:
    """One (model, method) on ``args.world_size`` ranks, rank r in ``lab.hosts[r]``."""
    from jobs.netlab import NetLabError

    hosts = lab.hosts
    world = len(hosts)
    with tempfile.TemporaryDirectory(prefix="tail-netbench-") as tmp:
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
        procs = []
        for rank, host in enumerate(hosts):
            cmd = [
                *host.exec_prefix(),
                sys.executable,
                "-m",
                "jobs.bench_network",
                "--worker",
                "--rank",
                str(rank),
                "--world-size",
                str(world),
                "--master-addr",
                hosts[0].address,
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
        # Counters per distinct interface (on loopback every rank shares one).
        ifaces = list(dict.fromkeys(hosts))
        counters_start: list[tuple[int, int]] | None = None
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        try:
            while any(p.poll() is None for p in procs):
                if counters_start is None and os.path.exists(outs[0] + ".warm"):
                    counters_start = [h.tx_rx_bytes() for h in ifaces]
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{model}/{method} did not finish in {WORKER_TIMEOUT_S} s")
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        counters_end = [h.tx_rx_bytes() for h in ifaces]
        if any(p.returncode != 0 for p in procs):
            raise NetLabError(f"{model}/{method}: worker exit codes {[p.returncode for p in procs]}")
        per_rank = [json.loads(Path(out).read_text()) for out in outs]
    if counters_start is None:
        counters_start = [(0, 0)] * len(ifaces)
    rows = per_rank[0]
    steps = len(rows)
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    # Bytes each interface sent per timed step; on loopback one counter carries all ranks.
    sent = [(end[0] - start[0]) / steps for start, end in zip(counters_start, counters_end, strict=True)]
    per_rank_iface = [sum(sent) / world] * world if len(ifaces) == 1 else sent
    mean_over_ranks = lambda key: statistics.mean(  # noqa: E731
        statistics.median(r[key] for r in rank_rows) for rank_rows in per_rank
    )
    return Result(
        link=lab_label(lab),
        model=model,
        method=method,
        step_s_median=med("step_s"),
        comm_s_median=med("comm_s"),
        compress_s_median=med("compress_s"),
        decode_s_median=med("decode_s"),
        bytes_per_step_transport=mean_over_ranks("bytes_sent"),
        bytes_per_step_interface=statistics.mean(per_rank_iface),
        raw_bytes_per_step=med("raw_bytes"),
        final_loss=rows[-1]["loss"],
        plain_step_share=sum(bool(r.get("plain")) for r in rows) / len(rows),
        world_size=world,
        encoded_bytes_per_step=mean_over_ranks("encoded_bytes"),
        bytes_per_step_interface_max=max(per_rank_iface),
    )


def lab_label(lab: Any) -> str:
    if getattr(lab, "loopback", False):
        return "loopback"
    return "unlimited" if lab.rate_mbit is None else f"{lab.rate_mbit:g}Mbit"


def print_table(results: list[Result]) -> None:
    w = _label_width()
    header = (
        f"{'link':>10} {'W':>2} {'model':>17} {'method':>{w}} {'step ms':>8} {'comm ms':>8} {'comp ms':>8} "
        f"{'dec ms':>7} {'MB/step':>8} {'iface MB':>8} {'x payload':>9} {'plain':>5} {'speedup':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        # Bytes a rank's interface sent per step over one rank's own compressed gradient.
        per_payload = r.bytes_per_step_interface / r.encoded_bytes_per_step if r.encoded_bytes_per_step else 0
        print(
            f"{r.link:>10} {r.world_size:>2} {r.model:>17} {r.method:>{w}} "
            f"{1e3 * r.step_s_median:8.1f} {1e3 * r.comm_s_median:8.1f} "
            f"{1e3 * r.compress_s_median:8.1f} {1e3 * r.decode_s_median:7.1f} "
            f"{r.bytes_per_step_transport / 1e6:8.3f} {r.bytes_per_step_interface / 1e6:8.3f} "
            f"{per_payload:9.2f} {r.plain_step_share:5.0%} {r.speedup_vs_none:7.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jobs.bench_network",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Needs root for `ip netns` and `tc`.\n"
        "Columns: MB/step and iface MB are bytes ONE rank sent per step (transport's count, and its\n"
        "interface's counter; means over ranks); x payload = iface MB / that rank's own compressed\n"
        "gradient (encoded bytes).\n"
        "Examples: python -m jobs.bench_network --quick --json runs/net.json\n"
        "          python -m jobs.bench_network --world-size 4 --links 1000 "
        "--methods none,tail-allgather,tail-sharded",
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
    parser.add_argument(
        "--world-size",
        type=int,
        default=2,
        help="training ranks, one per network namespace (2: a veth pair; more: a bridge; "
        "default %(default)s)",
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--delay-ms", type=float, default=0.0, help="added one-way delay (needs netem)")
    parser.add_argument("--json", type=output_file, help="write results to this JSON file")
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
        # This rank's results are on disk and its group is gone. Skip interpreter finalization:
        # a c10d/gloo native thread still alive when exit() runs static destructors makes
        # std::terminate abort the process (SIGABRT, "terminate called without an active
        # exception": one 3-rank CI run), failing a run whose results are complete.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    from jobs.netlab import NetLab, NetLabError

    if args.quick:
        args.steps = min(args.steps, 8)
        args.models = "synthetic_mlp"
    if not 2 <= args.world_size <= 26:
        parser.error(f"--world-size must be in 2..26, got {args.world_size}")
    links: list[float | str | None] = []
    for item in (s.strip() for s in args.links.split(",")):
        if item in ("unlimited", "loopback"):
            links.append(None if item == "unlimited" else item)
            continue
        try:
            links.append(float(item))
        except ValueError:
            parser.error(f"--links: {item!r} is not a rate in Mbit/s, 'unlimited' or 'loopback'")
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
        for link in links:
            loopback = link == "loopback"
            rate = None if loopback or link is None else float(link)
            with NetLab(rate, delay_ms=args.delay_ms, hosts=args.world_size, loopback=loopback) as lab:
                for model in models:
                    for method in methods:
                        logger.info(
                            "link %s, %d ranks, model %s, method %s",
                            lab_label(lab),
                            args.world_size,
                            model,
                            method,
                        )
                        port += 1
                        results.append(run_group(lab, model, method, args, port))
    except NetLabError as exc:
        logger.error("cannot run the network benchmark: %s", exc)
        return 2
    base = {(r.link, r.model): r.step_s_median for r in results if r.method == "none"}
    for r in results:
        if (r.link, r.model) in base:
            r.speedup_vs_none = base[(r.link, r.model)] / r.step_s_median
    print_table(results)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "benchmark": "network",
                    "steps": args.steps,
                    "batch_size": args.batch_size,
                    "world_size": args.world_size,
                    "machine": {"cpus": os.cpu_count(), "platform": sys.platform},
                    "results": [asdict(r) for r in results],
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
