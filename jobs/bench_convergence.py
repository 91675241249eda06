"""Convergence benchmark: every compression method, same seed and steps, W workers (default 2).

    python -m jobs.bench_convergence [--quick] [--json PATH] [--plot PNG] [--tasks digits,lm]
                                     [--methods none,tail] [--world-size W]
                                     [--collective auto|allgather|sharded|hierarchical]

W worker processes joined by plain torch.distributed (gloo on 127.0.0.1, no Ray start-up)
train each (task, method) through the SAME comm hook code the Ray Train jobs use
(tail_ray.collective.register_tail_hook). Tasks, with the settings of jobs/configs:
- digits: digits_cnn on scikit-learn's digits, SGD momentum 0.9, lr 0.05 dropped x0.1 at 75%;
- lm: char_transformer on the standard library's source, AdamW lr 3e-3 dropped x0.1 at 80%;
- gpt2: examples/gpt2_tiny.py's Hugging Face GPT-2 (small config) on standard-library
  docstrings, AdamW lr 3e-3 (needs ``transformers``: the ``examples`` extra);
- resnet18: examples/resnet18_cifar.py's ResNet-18 (11.2M parameters) on digits upscaled to
  CIFAR's 32x32x3, SGD momentum 0.9, lr 0.05 dropped x0.1 at 75%.
The last two are users' own models: their code is the example scripts', imported as they are.

Printed per (task, method): final validation accuracy / loss, bytes sent per worker per step,
traffic reduction against "none" (over the whole run, and over its second half, after the
warm-up phases), wall time per step and its compress / communicate / decode parts (means after
the first steps, which include numba's JIT), and for tail the bits, tau and noise estimate it
ended with. Speeds are reported, never asserted (the machine is shared and noisy).

Traffic: bytes this worker sent (all-gather: its size word and payload, at their exact size,
to each of the W-1 others; sharded: its slices and its compressed sums to the other ranks;
all-reduce: the ring model 2*(W-1)/W of the reduced bytes), see docs/collective.md. The
payload methods run the ``--collective`` given (default: each method's own default, "auto":
all-gather at W = 2, sharded from W = 3 on). Each worker's batch is the task's batch size at every W.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from jobs.output_path import output_file
from jobs.seed_summary import format_summary, parse_seeds, summarize, vs_none
from tail_ray.collective import PayloadHookState, method_spec, register_tail_hook
from tail_ray.collective.choice import Collective
from tail_ray.collective.launch import run_local_group
from tail_ray.compression.tail import TailCompressor, TailConfig
from tail_ray.errors import ConfigError
from tail_ray.runner.datasets import make_dataset
from tail_ray.runner.models import evaluate, loss_fn, make_model
from tail_ray.settings import settings_from_mapping

SEED = 0  # the default data / model seed (--seed)
WORLD_SIZE = 2  # default; --world-size
WARMUP_STEPS_EXCLUDED = 5  # from the time means: the first calls JIT-compile numba kernels


class TaskData(Protocol):
    """A task's data as the benchmark uses it: deterministic batches, the loss, the final metric."""

    def batch(self, step: int, rank: int, world_size: int, batch_size: int) -> Any: ...

    def loss(self, model: nn.Module, *batch: torch.Tensor) -> torch.Tensor: ...

    def evaluate(self, model: nn.Module) -> dict[str, float]: ...


class RegistryData:
    """A dataset of tail_ray.runner's registry as ``TaskData``."""

    def __init__(self, dataset: str, seed: int = SEED) -> None:
        self.seed = seed
        self.ds = make_dataset(dataset, seed=seed)

    def batch(self, step: int, rank: int, world_size: int, batch_size: int) -> Any:
        return self.ds.batch(
            seed=self.seed, step=step, rank=rank, world_size=world_size, batch_size=batch_size
        )

    def loss(self, model: nn.Module, *batch: torch.Tensor) -> torch.Tensor:
        x, y = batch
        return loss_fn(self.ds, model(x), y)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return evaluate(model, self.ds)


def _registry(dataset: str, model: str) -> Callable[[int], tuple[nn.Module, TaskData]]:
    def build(seed: int) -> tuple[nn.Module, TaskData]:
        data = RegistryData(dataset, seed)
        return make_model(model, data.ds, seed=seed), data

    return build


def _example(module_name: str) -> Callable[[int], tuple[nn.Module, TaskData]]:
    def build(seed: int) -> tuple[nn.Module, TaskData]:
        import importlib

        module = importlib.import_module(f"examples.{module_name}")
        return module.build_model(seed), module.Data(seed)

    return build


@dataclass(frozen=True)
class Task:
    name: str
    build: Callable[[int], tuple[nn.Module, TaskData]]  # seed -> model and data
    optimizer: str
    lr: float
    batch_size: int
    lr_drop_at: float
    steps: int
    quick_steps: int
    metric: str  # what "final" means: val_accuracy (higher better) or val_loss (lower better)


LM = _registry("stdlib_chars", "char_transformer")
TASKS = {
    t.name: t
    for t in (
        Task("digits", _registry("digits", "digits_cnn"), "sgd", 0.05, 32, 0.75, 300, 80, "val_accuracy"),
        Task("lm", LM, "adamw", 3e-3, 16, 0.8, 300, 30, "val_loss"),
        Task("gpt2", _example("gpt2_tiny"), "adamw", 3e-3, 16, 0.8, 300, 30, "val_loss"),
        Task("resnet18", _example("resnet18_cifar"), "sgd", 0.05, 32, 0.75, 200, 20, "val_accuracy"),
    )
}

# (label, method, config): the baselines of TAIL.md at their usual settings, and Tail's defaults.
METHODS: list[tuple[str, str, dict[str, Any] | None]] = [
    ("none", "none", None),
    ("fp16", "fp16", None),
    ("bf16", "bf16", None),
    ("powersgd-r2", "powersgd", {"rank": 2}),
    ("qsgd-8", "qsgd", {"bits": 8}),
    ("topk-1%", "topk", {"density": 0.01}),
    ("tail", "tail", None),
]


@dataclass
class RunResult:
    task: str
    label: str
    method: str
    steps: int
    final: dict[str, float]
    final_train_loss: float
    bytes_sent_per_step: float
    bytes_sent_per_step_2nd_half: float  # after warm-up phases: the steady-state traffic
    bytes_received_per_step: float
    raw_bytes_per_step: float
    step_s: float
    compress_s_per_step: float
    comm_s_per_step: float
    decode_s_per_step: float
    tail_bits: dict[str, int] | None = None  # bits -> share of quantized elements (permille)
    tail_tau: dict[str, float] | None = None  # layer -> tau at the end
    tail_noise: dict[str, float] | None = None  # layer -> relative SGD noise estimate
    tail_bits_history: dict[str, list[int]] | None = None  # layer -> bits at every step (32 = raw)
    # layer -> low-rank rank at every step (0: not low-rank; its bits above are the factors')
    tail_lowrank_history: dict[str, list[int]] | None = None
    tail_stage_two_bits: dict[str, int] | None = None  # the second stage's, as tail_bits (rank 0)
    tail_lowrank: dict[str, dict[str, int]] | None = None  # layer -> {"r8": steps sent at rank 8}, 2nd half
    tail_rel_error: list[float | None] | None = None  # mean estimated error, stage one / two (2nd half)
    world_size: int = WORLD_SIZE
    collective: str = "allreduce"  # the collective a payload method ran
    seed: int = SEED
    tail_decision_share: float | None = None  # controller's decision time / compress time (rank 0)
    # The same after the first WARMUP_STEPS_EXCLUDED steps (which load or compile the numba
    # kernels, a one-time cost in both parts): the steady cost of deciding (issue 15's target).
    tail_decision_share_steady: float | None = None
    tail_decision_first_s: float | None = None  # decision time in those first steps (one-time)
    tail_decisions: int | None = None  # estimates made over the run (rank 0)
    # Rank 0's own encoded layers per step, 2nd half: sent - own is each exchange's size word,
    # payload header and checksum (the all-gather sends exact sizes: nothing is padded).
    own_bytes_per_step_2nd_half: float | None = None
    # Rank 0's low-rank trials: count, wall ms (median, mean, max), thread CPU ms (mean, max).
    tail_trials_ms: dict[str, float] | None = None
    # Rank 0's low-rank trials failed for rows P would leave behind, per layer.
    tail_rows_left_behind: dict[str, int] | None = None
    # Every rank's own payload per step, 2nd half (rank order), and the second-half steps in
    # which every rank sent the same layers low-rank at the same ranks (kind and rank agreed).
    own_bytes_by_rank: list[float] | None = None
    lowrank_by_rank: list[dict[str, dict[str, int]]] | None = None
    agreed_steps_2nd_half: int | None = None
    lowrank_choices: list[str] | None = None  # rank 0's per step (``run`` compares and drops them)


def _steady_mean(values: list[float]) -> float:
    return statistics.mean(values[WARMUP_STEPS_EXCLUDED:] or values)


def make_optimizer(task: Task, params: Any) -> torch.optim.Optimizer:
    if task.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=task.lr, weight_decay=0.01)
    return torch.optim.SGD(params, lr=task.lr, momentum=0.9)


def _tail_details(
    state: Any, bits_elems: Counter, compress_s: list[float], decision_s: list[float]
) -> dict[str, Any]:
    """What Tail's controller ended with: bits share, tau and noise per layer, and the share of
    the run's compress time it spent deciding (bench-only peek): over the whole run, and over
    the steps after the first WARMUP_STEPS_EXCLUDED (their kernel loading or compiling is a
    one-time cost, reported on its own)."""
    total = sum(bits_elems.values()) or 1
    shares = {str(b): round(1000 * n / total) for b, n in sorted(bits_elems.items())}
    out: dict[str, Any] = {"tail_bits": shares}
    tail = state.compressor if isinstance(state, PayloadHookState) else None
    if isinstance(tail, TailCompressor):
        policy = tail.controller.policy
        names = sorted(tail.controller.plans)
        out["tail_tau"] = {n: round(policy.tau(n, tail.step), 5) for n in names}
        out["tail_noise"] = {n: round(policy.relative_noise(n) or 0.0, 5) for n in names}
        total_s = sum(compress_s)
        out["tail_decision_share"] = tail.controller.decision_s / total_s if total_s > 0 else 0.0
        steady_s = sum(compress_s[WARMUP_STEPS_EXCLUDED:])
        steady_decision_s = sum(decision_s[WARMUP_STEPS_EXCLUDED:])
        out["tail_decision_share_steady"] = steady_decision_s / steady_s if steady_s > 0 else 0.0
        out["tail_decision_first_s"] = sum(decision_s[:WARMUP_STEPS_EXCLUDED])
        out["tail_decisions"] = tail.controller.decisions
        if tail.lowrank is not None and tail.lowrank.trial_times_s:
            out["tail_trials_ms"] = _trial_times_ms(list(tail.lowrank.trial_times_s))
        if tail.lowrank is not None:
            out["tail_rows_left_behind"] = dict(sorted(tail.lowrank.rows_left_behind.items()))
    return out


def _trial_times_ms(times_s: list[tuple[float, float]]) -> dict[str, float]:
    """Per-trial figures: a share of compress time cannot tell a fat tail from a high median."""
    wall = [1000 * w for w, _ in times_s]
    cpu = [1000 * c for _, c in times_s]
    return {
        "n": len(wall),
        "wall_median": statistics.median(wall),
        "wall_mean": statistics.mean(wall),
        "wall_max": max(wall),
        "cpu_mean": statistics.mean(cpu),
        "cpu_max": max(cpu),
    }


def _train_one(
    rank: int,
    world_size: int,
    task: Task,
    label: str,
    method: str,
    config: Any,
    steps: int,
    collective: str | None,
    seed: int = SEED,
) -> RunResult | dict[str, Any]:
    """Rank 0: the run's result; other ranks: their own figures (``peer`` below), which ``run``
    adds to rank 0's result."""
    model, data = task.build(seed)
    ddp = nn.parallel.DistributedDataParallel(model)
    settings = dict(config or {})
    if method_spec(method).exchanges_payloads:
        # This benchmark measures what compression does to accuracy and traffic. Its two ranks
        # share one host, where the link-aware switch would (rightly) send plain all-reduce.
        settings.setdefault("link_aware", False)
        if collective is not None:
            settings.setdefault("collective", collective)
    state = register_tail_hook(ddp, method, settings or None)
    opt = make_optimizer(task, ddp.parameters())
    state.set_optimizer(opt)  # what tail_ray.train's session does at the first step
    drop_step = int(task.lr_drop_at * steps)
    step_s: list[float] = []
    sent: list[int] = []
    own: list[int] = []  # this rank's encoded layers per step (no size words, headers, checksums)
    received = raw = 0
    compress_s: list[float] = []
    comm_s: list[float] = []
    decode_s: list[float] = []
    bits_elems: Counter = Counter()
    bits_elems_two: Counter = Counter()  # sharded / hierarchical: the second stage's
    errors: tuple[list[float], list[float]] = ([], [])  # estimated relative error, stage one / two
    bits_history: dict[str, list[int]] = {}
    lowrank_history: dict[str, list[int]] = {}
    lowrank_steps: dict[str, Counter] = {}  # layer -> rank -> steps sent low-rank (2nd half)
    choices: list[str] = []  # per 2nd-half step: the layers sent low-rank and their ranks
    decision_s: list[float] = []  # Tail's controller, per step (rank 0's is reported)
    tail = getattr(state, "compressor", None)
    controller = tail.controller if isinstance(tail, TailCompressor) else None
    decided_s = 0.0
    loss_value = float("nan")
    for step in range(steps):
        start = time.perf_counter()
        lr = task.lr * (0.1 if step >= drop_step else 1.0)
        for group in opt.param_groups:
            group["lr"] = lr
        state.set_lr(lr)
        batch = data.batch(step, rank, world_size, task.batch_size)
        opt.zero_grad(set_to_none=True)
        loss = data.loss(ddp, *(batch if isinstance(batch, tuple) else (batch,)))
        loss.backward()
        opt.step()
        step_s.append(time.perf_counter() - start)
        m = state.drain_metrics()
        sent.append(m.bytes_sent)
        own.append(m.encoded_bytes)
        received += m.bytes_received
        raw += m.raw_bytes
        compress_s.append(m.compress_s)
        comm_s.append(m.comm_s)
        decode_s.append(m.decode_s)
        if controller is not None:
            decision_s.append(controller.decision_s - decided_s)
            decided_s = controller.decision_s
        if method == "tail":
            for layer in m.layers:
                bits_history.setdefault(layer.layer, []).append(layer.bits)
                lowrank = layer.code.startswith("lowrank")  # code "lowrank-r<rank>"
                rank_sent = int(layer.code.removeprefix("lowrank-r")) if lowrank else 0
                lowrank_history.setdefault(layer.layer, []).append(rank_sent)
        if method == "tail" and step >= steps // 2:
            choices.append(
                ";".join(sorted(f"{x.layer}={x.code}" for x in m.layers if x.code.startswith("lowrank")))
            )
            for layer in m.layers:
                if layer.code.startswith("lowrank"):  # code "lowrank-r<rank>": not a bit-width
                    lowrank_steps.setdefault(layer.layer, Counter())[layer.code.removeprefix("lowrank-")] += 1
                elif layer.bits <= 8:  # quantized (16: a small layer as float16, 32: raw)
                    bits_elems[layer.bits] += layer.numel
                    errors[0].append(layer.rel_error)
            for layer in m.stage_two:  # the slices this rank re-compressed as an owner
                if layer.bits <= 8:
                    bits_elems_two[layer.bits] += layer.numel
                    errors[1].append(layer.rel_error)
        loss_value = float(loss.detach())
    peer = {
        "own": statistics.mean(own[steps // 2 :]),
        "lowrank": {name: dict(sorted(c.items())) for name, c in lowrank_steps.items()},
        "choices": choices,
    }
    if rank != 0:
        return peer
    collective_run = state.collective if isinstance(state, PayloadHookState) else None
    extra = _tail_details(state, bits_elems, compress_s, decision_s) if method == "tail" else {}
    if method == "tail":
        extra["tail_bits_history"] = bits_history
        extra["tail_lowrank_history"] = lowrank_history
        extra["tail_lowrank"] = {name: dict(sorted(c.items())) for name, c in lowrank_steps.items()}
        if bits_elems_two:
            total = sum(bits_elems_two.values())
            extra["tail_stage_two_bits"] = {
                str(b): round(1000 * n / total) for b, n in sorted(bits_elems_two.items())
            }
        # Finite estimates only: the engine's estimate is occasionally -inf (left to the numerics work).
        finite = [[v for v in e if math.isfinite(v)] for e in errors]
        extra["tail_rel_error"] = [statistics.mean(e) if e else None for e in finite]
    return RunResult(
        task=task.name,
        label=label,
        method=method,
        steps=steps,
        final=data.evaluate(ddp.module),
        final_train_loss=loss_value,
        bytes_sent_per_step=sum(sent) / steps,
        bytes_sent_per_step_2nd_half=statistics.mean(sent[steps // 2 :]),
        own_bytes_per_step_2nd_half=statistics.mean(own[steps // 2 :]),
        bytes_received_per_step=received / steps,
        raw_bytes_per_step=raw / steps,
        step_s=_steady_mean(step_s),
        compress_s_per_step=_steady_mean(compress_s),
        comm_s_per_step=_steady_mean(comm_s),
        decode_s_per_step=_steady_mean(decode_s),
        world_size=world_size,
        collective=str(collective_run) if collective_run is not None else "allreduce",
        seed=seed,
        own_bytes_by_rank=[peer["own"]],
        lowrank_by_rank=[peer["lowrank"]],
        lowrank_choices=choices,
        **extra,
    )


CLOCKS = ("wall", "cpu")


def use_clock(clock: str) -> None:
    """In a worker process: ``cpu`` makes every ``time.perf_counter()`` read the calling
    thread's CPU time (``time.thread_time``), so the workers' compress, deciding and step
    timers count CPU only, not the time a shared host's scheduler took the thread away (comm
    too, but its timer can start and stop on different threads: print_table leaves it out).
    On 2 cores shared by 2 workers a preempted 0.5 ms trial reads 3-4 ms of wall
    time (docs/engine.md, "Stop 48" and "Stop 49"). Each read is then a system call (~0.4 us
    here, ~10 a step): a little slower, not by a tenth of a 40-us decision. Nothing the runs
    decide reads these timers: the benchmark pins ``link_aware`` off (_train_one), the one
    setting that would (its gate weighs compress time against the link's). ``wall``: as is."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    if clock == "cpu":
        time.perf_counter = time.thread_time


def _worker(
    rank: int,
    world_size: int,
    plan: list[tuple[str, str, str, Any, int]],
    out_path: str,
    collective: str | None,
    seed: int = SEED,
    clock: str = "wall",
) -> None:
    use_clock(clock)
    # Same processes for every run: spawning and importing costs seconds on a busy machine.
    results = []
    for task_name, label, method, config, steps in plan:
        res = _train_one(rank, world_size, TASKS[task_name], label, method, config, steps, collective, seed)
        results.append(asdict(res) if isinstance(res, RunResult) else res)
        # Written after every run, so a crash late in the plan keeps what finished; rank r > 0
        # writes its own figures beside rank 0's results.
        Path(out_path if rank == 0 else f"{out_path}.rank{rank}").write_text(json.dumps(results))


def _merge_peers(results: list[dict[str, Any]], peers: list[list[dict[str, Any]]]) -> None:
    """Every rank's own bytes and low-rank steps into rank 0's results (plan order), and the
    second-half steps in which all ranks sent the same layers low-rank at the same ranks."""
    for i, res in enumerate(results):
        choices = [res.pop("lowrank_choices", None) or []]
        for ranks in peers:
            if i < len(ranks):
                res["own_bytes_by_rank"].append(ranks[i]["own"])
                res["lowrank_by_rank"].append(ranks[i]["lowrank"])
                choices.append(ranks[i]["choices"])
        if res["method"] == "tail" and len(choices) > 1:
            res["agreed_steps_2nd_half"] = sum(len(set(step)) == 1 for step in zip(*choices, strict=False))


def run(
    tasks: list[str],
    methods: list[str],
    quick: bool,
    timeout_s: float,
    tail_variants: list[dict[str, Any]] | None = None,
    steps: int | None = None,
    world_size: int = WORLD_SIZE,
    collective: str | None = None,
    seed: int = SEED,
    clock: str = "wall",
) -> list[dict[str, Any]]:
    rows = [(label, method, cfg) for label, method, cfg in METHODS if label in methods or method in methods]
    # Extra Tail rows with explicit settings, for studying the controller (not Tail's defaults).
    rows += [(f"tail*{i + 1}", "tail", variant) for i, variant in enumerate(tail_variants or [])]
    plan = [
        (t, label, method, config, steps or (TASKS[t].quick_steps if quick else TASKS[t].steps))
        for t in tasks
        for label, method, config in rows
    ]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        run_local_group(_worker, world_size, (plan, str(out), collective, seed, clock), timeout_s=timeout_s)
        results: list[dict[str, Any]] = json.loads(out.read_text())
        peers = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(1, world_size)]
        _merge_peers(results, peers)
        for res in results:
            res["clock"] = clock
        return results


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def print_table(results: list[dict[str, Any]]) -> None:
    for task in dict.fromkeys(r["task"] for r in results):
        rows = [r for r in results if r["task"] == task]
        base = next((r for r in rows if r["method"] == "none"), None)
        metric = TASKS[task].metric
        collectives = sorted({r.get("collective", "allreduce") for r in rows} - {"allreduce"})
        print(
            f"\n== {task} ({rows[0]['steps']} steps, {rows[0].get('world_size', WORLD_SIZE)} workers, gloo"
            f"{', payload methods: ' + '/'.join(collectives) if collectives else ''}"
            f", seed {rows[0].get('seed', SEED)})"
        )
        print(
            f"{'method':<12} {metric:>12} {'vs none':>9} {'sent/step':>11} {'reduction':>10} {'2nd half':>9} "
            f"{'step ms':>8} {'comp ms':>8} {'comm ms':>8} {'dec ms':>7}"
        )
        for r in rows:
            value = r["final"][metric]
            delta = ""
            if base is not None:
                unit = "pt" if metric == "val_accuracy" else "%"
                delta = f"{vs_none(value, base['final'][metric], metric):+.2f}{unit}"
            shown = f"{100 * value:.2f}%" if metric == "val_accuracy" else f"{value:.4f}"
            reduction = (
                f"{base['bytes_sent_per_step'] / r['bytes_sent_per_step']:.1f}x"
                if base is not None and r["bytes_sent_per_step"]
                else "-"
            )
            late = (
                f"{base['bytes_sent_per_step_2nd_half'] / r['bytes_sent_per_step_2nd_half']:.1f}x"
                if base is not None and r["bytes_sent_per_step_2nd_half"]
                else "-"
            )
            # Under --clock cpu a plain all-reduce's comm timer starts in the hook and stops in
            # its future's callback, on another thread: a difference of two threads' CPU clocks.
            comm = "-" if r.get("clock") == "cpu" else f"{1000 * r['comm_s_per_step']:.1f}"
            print(
                f"{r['label']:<12} {shown:>12} {delta:>9} {_fmt_bytes(r['bytes_sent_per_step']):>11} "
                f"{reduction:>10} {late:>9} {1000 * r['step_s']:>8.1f} "
                f"{1000 * r['compress_s_per_step']:>8.1f} {comm:>8} "
                f"{1000 * r['decode_s_per_step']:>7.1f}"
            )
        for r in rows:
            if r.get("tail_bits"):
                print(
                    f"[{r['label']}] bits chosen (permille of quantized elements, 2nd half): {r['tail_bits']}"
                )
                if r.get("tail_stage_two_bits"):
                    print(
                        f"[{r['label']}] second stage (rank 0's slices), 2nd half: {r['tail_stage_two_bits']}"
                    )
                if r.get("tail_lowrank"):
                    shown = "; ".join(
                        f"{name} " + ", ".join(f"{rank} x{n}" for rank, n in ranks.items())
                        for name, ranks in r["tail_lowrank"].items()
                    )
                    print(f"[{r['label']}] sent low-rank (steps per rank, 2nd half): {shown}")
                own = r.get("own_bytes_by_rank") or []
                if own:
                    print(
                        f"[{r['label']}] own payload per rank, 2nd half: "
                        + " / ".join(_fmt_bytes(b) for b in own)
                        + f" per step, {_fmt_bytes(r['bytes_sent_per_step_2nd_half'])} sent by rank 0"
                        " (the rest: each exchange's size word, payload header and checksum)"
                    )
                for k, ranks in enumerate(r.get("lowrank_by_rank") or []):
                    if k and ranks:
                        shown = "; ".join(
                            f"{name} " + ", ".join(f"{rk} x{n}" for rk, n in c.items())
                            for name, c in ranks.items()
                        )
                        print(f"[{r['label']}] rank {k} sent low-rank (steps per rank, 2nd half): {shown}")
                if r.get("agreed_steps_2nd_half") is not None:
                    print(
                        f"[{r['label']}] steps in which every rank sent the same layers low-rank at the same"
                        f" ranks, 2nd half: {r['agreed_steps_2nd_half']} of {r['steps'] - r['steps'] // 2}"
                    )
                errs = r.get("tail_rel_error") or []
                if errs:
                    shown = ", ".join(f"stage {i + 1} {e:.3f}" for i, e in enumerate(errs) if e is not None)
                    print(f"[{r['label']}] mean estimated relative error, 2nd half: {shown}")
                if r.get("tail_decision_share") is not None:
                    steady = r.get("tail_decision_share_steady")
                    print(
                        f"  deciding bits: {100 * r['tail_decision_share']:.2f}% of compress time"
                        + (
                            f" (after step {WARMUP_STEPS_EXCLUDED}: {100 * steady:.2f}%; first steps"
                            f" {1000 * r['tail_decision_first_s']:.1f} ms, kernel loading included;"
                            f" {r['tail_decisions']} estimates)"
                            if steady is not None
                            else ""
                        )
                    )
                trials = r.get("tail_trials_ms")
                if trials:
                    print(
                        f"  low-rank trials: {trials['n']:.0f}, wall median {trials['wall_median']:.2f} /"
                        f" mean {trials['wall_mean']:.2f} / max {trials['wall_max']:.2f} ms, thread CPU"
                        f" mean {trials['cpu_mean']:.2f} / max {trials['cpu_max']:.2f} ms (rank 0)"
                    )
                if r.get("tail_rows_left_behind"):
                    shown = ", ".join(f"{name} x{n}" for name, n in r["tail_rows_left_behind"].items())
                    print(f"  low-rank trials failed for rows P would leave behind (rank 0): {shown}")
                taus = r.get("tail_tau") or {}
                noise = r.get("tail_noise") or {}
                for name in taus:
                    print(f"  {name:<40} tau {taus[name]:.4f}  noise {noise.get(name, 0.0):.4f}")


def write_bits_plot(results: list[dict[str, Any]], path: Path, titles: dict[str, str]) -> Path | None:
    """The bits-over-steps heat map (jobs.report's), headless: matplotlib only when asked."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    from jobs import report

    return report.write_bits_plot(results, path, titles)


def bits_over_steps(history: dict[str, list[int]], columns: int) -> tuple[list[int], dict[str, list[int]]]:
    """The steps to show (``columns`` evenly spaced, first and last included) and each
    quantized layer's bits at them; layers never quantized (raw, or small layers as float16,
    at every step) are left out."""
    steps = max((len(v) for v in history.values()), default=0)
    if steps == 0:
        return [], {}
    shown = sorted({round(i * (steps - 1) / max(1, columns - 1)) for i in range(columns)})
    table = {
        name: [bits[min(i, len(bits) - 1)] for i in shown]
        for name, bits in history.items()
        if any(b <= 8 for b in bits)
    }
    return shown, table


def print_bits_over_steps(results: list[dict[str, Any]], columns: int = 12) -> None:
    """Per tail row: each quantized layer's bits at evenly spaced steps, and how often they
    changed (the full series per step is in the JSON, ``tail_bits_history``)."""
    for r in results:
        history = r.get("tail_bits_history")
        if not history:
            continue
        shown, table = bits_over_steps(history, columns)
        ranks = r.get("tail_lowrank_history") or {}
        print(f"\n[{r['task']} / {r['label']}] bits per layer over steps (32 = raw, rN = low-rank at rank N)")
        width = max(len("layer"), *(len(name) for name in table))
        print(f"{'layer':<{width}} " + " ".join(f"{s:>4}" for s in shown) + f" {'changes':>8}")
        for name, row in table.items():
            layer_ranks = ranks.get(name, [])
            kinds = list(zip(history[name], layer_ranks or [0] * len(history[name]), strict=False))
            changes = sum(a != b for a, b in itertools.pairwise(kinds))
            cells = [
                f"r{layer_ranks[step]}" if step < len(layer_ranks) and layer_ranks[step] else str(bits)
                for step, bits in zip(shown, row, strict=True)
            ]
            print(f"{name:<{width}} " + " ".join(f"{c:>4}" for c in cells) + f" {changes:>8}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer steps (about 2 minutes)")
    parser.add_argument("--json", type=output_file, help="also write the results as JSON here")
    parser.add_argument(
        "--plot",
        type=output_file,
        metavar="PNG",
        help="also write a heat map of each tail row's bits per layer over steps (rank 0's) here",
    )
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma list of {sorted(TASKS)}")
    parser.add_argument(
        "--methods",
        default=",".join(label for label, _, _ in METHODS),
        help="comma list of labels or methods",
    )
    parser.add_argument(
        "--steps",
        type=int,
        help="override the steps of every task (a smoke run, or a longer one: the lr drop scales with it)",
    )
    seeding = parser.add_mutually_exclusive_group()
    seeding.add_argument(
        "--seed", type=int, default=SEED, help="data and model seed (Tail's rounding seed is random per run)"
    )
    seeding.add_argument(
        "--seeds",
        metavar="LIST",
        help="run every seed in turn, e.g. 0-4 or 0,2,5, and end with each method's mean and worst "
        "against none over them (jobs/seed_summary.py; needs the none method; not with --seed)",
    )
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="kill the workers past this")
    parser.add_argument(
        "--world-size", type=int, default=WORLD_SIZE, help="worker processes (default %(default)s)"
    )
    parser.add_argument(
        "--collective",
        choices=[c.value for c in Collective],
        help="the payload methods' collective (default: their own default, auto)",
    )
    parser.add_argument(
        "--clock",
        choices=CLOCKS,
        default="wall",
        help="what the workers' timers read: wall time (default), or cpu, each thread's CPU time, "
        "so the ms columns and the decision share leave out time a busy host preempted",
    )
    parser.add_argument(
        "--tail-variant",
        action="append",
        default=[],
        metavar="JSON",
        help="extra tail row with these settings, e.g. '{\"noise_fraction\": 0.25}' (repeatable)",
    )
    args = parser.parse_args(argv)
    try:
        variants = [json.loads(v) for v in args.tail_variant]
    except json.JSONDecodeError as exc:
        parser.error(f"--tail-variant must be a JSON object: {exc}")
    if any(not isinstance(v, dict) for v in variants):
        parser.error("--tail-variant must be a JSON object of TailConfig settings")
    for variant in variants:  # a bad setting says so now, not after the runs before its row
        try:
            settings_from_mapping(TailConfig, variant, what="--tail-variant")
        except ConfigError as exc:
            parser.error(str(exc))
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        parser.error(f"unknown task(s) {unknown}; choose from {sorted(TASKS)}")
    methods = [m for m in args.methods.split(",") if m]
    known = {label for label, _, _ in METHODS} | {method for _, method, _ in METHODS}
    if any(m not in known for m in methods):
        bad = [m for m in methods if m not in known]
        parser.error(f"unknown method(s) {bad}; choose from {sorted(known)}")
    started = time.perf_counter()
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.world_size < 2:
        parser.error("--world-size must be >= 2")
    seeds = [args.seed]
    if args.seeds is not None:
        try:
            seeds = parse_seeds(args.seeds)
        except ValueError as exc:
            parser.error(str(exc))
        if "none" not in methods:
            parser.error("--seeds compares every method with none of the same seed: add none to --methods")
        if args.plot and len(seeds) > 1:
            parser.error("--plot draws one run's bits: use it with --seed")
    by_seed: dict[int, list[dict[str, Any]]] = {}
    for k, seed in enumerate(seeds, start=1):
        if len(seeds) > 1:
            elapsed = time.perf_counter() - started
            print(f"\n#### seed {seed} ({k} of {len(seeds)}), {elapsed:.0f} s in", flush=True)
        results = by_seed[seed] = run(
            tasks,
            methods,
            args.quick,
            args.timeout_s,
            variants,
            args.steps,
            args.world_size,
            args.collective,
            seed,
            args.clock,
        )
        if args.clock == "cpu":
            print(
                "(--clock cpu: the ms columns and the decision share are the workers' thread CPU "
                "time; comm is left out, its timer can start and stop on different threads)"
            )
        for i, variant in enumerate(variants):
            print(f"tail*{i + 1}: tail with {variant}")
        print_table(results)
        print_bits_over_steps(results)
    summaries = summarize(by_seed, {t: TASKS[t].metric for t in tasks}) if len(seeds) > 1 else []
    for line in format_summary(summaries):
        print(line)
    print(f"\ntotal wall time {time.perf_counter() - started:.0f} s")
    if args.json:
        doc: Any = by_seed[seeds[0]]  # one seed: its rows, as before --seeds
        if len(seeds) > 1:
            runs = {str(s): by_seed[s] for s in seeds}
            doc = {"seeds": seeds, "runs": runs, "summary": [asdict(s) for s in summaries]}
        args.json.write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")
    if args.plot:
        titles = {f"tail*{i + 1}": f"tail with {json.dumps(v)}" for i, v in enumerate(variants)}
        if write_bits_plot(results, args.plot, titles) is None:
            print(f"no tail row ran: {args.plot} not written")
        else:
            print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
