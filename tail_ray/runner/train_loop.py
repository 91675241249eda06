"""The per-worker training loop that Ray Train runs on every worker for `jobs.train`.

It is a user loop like any other: the model goes through ``tail_ray.train.prepare_model``,
so the hook, the learning rate the controller sees and the metric records take the one path
user code takes (tail_ray/train/). What it adds: deterministic batches from (seed, step, rank,
world size), SGD with momentum (or AdamW) with one lr drop, a checkpoint every N steps that a
restart or resize resumes from, and rank 0's evaluation and summary at the end (Ray Train
hands rank 0's return value to the driver as ``Result.return_value``).

Three parts: ``setup_worker`` (build, then restore from Ray Train's checkpoint), ``train_step``
and ``finish_worker`` (evaluate, last checkpoint, summary). Fault injection for the recovery
and elasticity tests comes in as a ``FaultInjection`` object, never from a config.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import ray.train
import torch

from tail_ray.runner.checkpoint import load_checkpoint, save_checkpoint, seed_everything, unwrap
from tail_ray.runner.config import JobConfig
from tail_ray.runner.datasets import Dataset, make_dataset
from tail_ray.runner.models import evaluate, loss_fn, make_model
from tail_ray.train import RaySinkWriter, TrainSession, prepare_model
from tail_ray.train.prepare import current_session
from tail_ray.train.session import Totals

logger = logging.getLogger(__name__)

METRICS_CLOSE_TIMEOUT_S = 5.0
LOG_EVERY_STEPS = 20


@dataclass(frozen=True)
class FaultInjection:
    """Faults for recovery tests (never set by the CLI or a config).

    ``fail_at_step``: the last rank of a run that did not start from a checkpoint raises
    before this step. ``step_delay_s``: every step sleeps this long, so a short job stays
    alive while a test adds nodes or kills workers.
    """

    fail_at_step: int | None = None
    step_delay_s: float = 0.0

    def before_step(self, step: int, *, rank: int, world_size: int, resumed: bool) -> None:
        if self.fail_at_step == step and not resumed and rank == world_size - 1:
            raise RuntimeError(f"injected failure at step {step} on rank {rank}")
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)


@dataclass
class Worker:
    """One worker's run: what ``setup_worker`` built and restored."""

    cfg: JobConfig
    job_id: str
    rank: int
    world_size: int
    dataset: Dataset
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    session: TrainSession
    start_step: int  # the first step this worker group runs
    resumed: bool  # started from a checkpoint


def make_optimizer(cfg: JobConfig, params: Any) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def setup_worker(cfg: JobConfig, job_id: str) -> Worker:
    """Dataset, model (prepared: device, DDP, hook, metrics), optimizer; then the latest
    checkpoint Ray Train has for this run, if any."""
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))
    dataset = make_dataset(cfg.dataset, cfg.seed)
    model = prepare_model(
        make_model(cfg.model, dataset, cfg.seed),
        cfg.method,
        cfg.compression,
        job_id=job_id,
        metrics=RaySinkWriter(job_id, rank, queue_records=cfg.metrics_queue_records),
        seed=cfg.seed,
        flush_every_steps=cfg.metrics_every_steps,
    )
    optimizer = make_optimizer(cfg, model.parameters())
    session = current_session()
    worker = Worker(cfg, job_id, rank, world_size, dataset, model, optimizer, session, 0, False)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        seed_everything(cfg.seed, 0, rank)
    else:
        with checkpoint.as_directory() as ckpt_dir:
            restored = load_checkpoint(
                ckpt_dir,
                rank=rank,
                world_size=world_size,
                seed=cfg.seed,
                model=model,
                optimizer=optimizer,
                hook=session.state,
            )
        session.step = restored.step
        session.totals = Totals(**{k: int(v) for k, v in restored.totals.items()})
        worker.start_step, worker.resumed = restored.step, True
    if rank == 0:
        logger.info(
            "job %s: %s on %s, method=%s, world_size=%d, steps %d..%d",
            job_id, cfg.model, cfg.dataset, cfg.method, world_size, worker.start_step, cfg.steps,
        )  # fmt: skip
    return worker


def train_step(w: Worker, step: int) -> float:
    """One optimizer step; its records go out from the optimizer's step hook. Returns the loss."""
    for group in w.optimizer.param_groups:
        group["lr"] = w.cfg.lr_at(step)  # read by the session before the backward
    x, y = w.dataset.batch(
        seed=w.cfg.seed, step=step, rank=w.rank, world_size=w.world_size, batch_size=w.cfg.batch_size
    )
    w.optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(w.dataset, w.model(x), y)
    loss.backward()
    w.session.report_loss(loss)
    w.optimizer.step()
    return float(loss.detach())


def report_checkpoint(w: Worker, step: int, metrics: dict[str, Any]) -> None:
    """Checkpoint ``step`` steps done. Every rank writes its own files (Ray merges them) and
    calls report, which is a barrier across ranks."""
    with tempfile.TemporaryDirectory(prefix="tail-ckpt-") as tmp:
        save_checkpoint(
            tmp,
            rank=w.rank,
            world_size=w.world_size,
            step=step,
            model=w.model,
            optimizer=w.optimizer,
            hook=w.session.state,
            totals=vars(w.session.totals),
        )
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(tmp),
            checkpoint_dir_name=f"checkpoint_step{step:08d}",
        )


def finish_worker(w: Worker, loss: float) -> dict[str, Any] | None:
    """Rank 0 evaluates; every rank reports the final checkpoint and hands its last records
    over; rank 0 returns the run's summary."""
    cfg = w.cfg
    final: dict[str, Any] = {"step": cfg.steps, "loss": loss}
    if w.rank == 0:
        # The bare module: a DDP forward broadcasts buffers (e.g. the LM's causal mask) from
        # rank 0, a collective the other ranks, already waiting in report(), never join.
        final.update(evaluate(unwrap(w.model), w.dataset))
    report_checkpoint(w, cfg.steps, final)
    dropped = w.session.writer.dropped_records
    w.session.close(timeout_s=METRICS_CLOSE_TIMEOUT_S)
    if w.rank != 0:
        return None
    totals = w.session.totals
    sent_per_step = totals.bytes_sent / max(totals.steps, 1)
    raw_per_step = totals.raw_bytes / max(totals.steps, 1)
    return {
        **final,
        "world_size": w.world_size,
        "resumed_from_step": w.start_step,
        "bytes_sent_per_step": sent_per_step,
        "raw_bytes_per_step": raw_per_step,
        "traffic_ratio": raw_per_step / sent_per_step if sent_per_step else None,
        "metrics_dropped": max(dropped, w.session.writer.dropped_records),
    }


def train_loop_per_worker(loop_config: dict[str, Any]) -> dict[str, Any] | None:
    """Ray Train's ``train_loop_per_worker``; ``loop_config`` = {"job": JobConfig dict, "job_id":
    str, "faults": FaultInjection or None}."""
    cfg = JobConfig.from_mapping(loop_config["job"])
    faults: FaultInjection = loop_config.get("faults") or FaultInjection()
    w = setup_worker(cfg, loop_config["job_id"])
    w.model.train()
    loss = float("nan")
    for step in range(w.start_step, cfg.steps):
        faults.before_step(step, rank=w.rank, world_size=w.world_size, resumed=w.resumed)
        loss = train_step(w, step)
        done = step + 1
        if w.rank == 0 and (done % LOG_EVERY_STEPS == 0 or done == cfg.steps):
            logger.info("step %d/%d loss %.4f lr %.4g", done, cfg.steps, loss, cfg.lr_at(step))
        if done % cfg.checkpoint_every_steps == 0 and done < cfg.steps:
            report_checkpoint(w, done, {"loss": loss})
    return finish_worker(w, loss)
