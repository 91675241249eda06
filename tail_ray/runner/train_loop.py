"""The per-worker training loop that Ray Train runs on every worker.

One loop for every model, dataset and compression method: deterministic batches from
(seed, step, rank, world size), SGD with momentum (or AdamW) with one lr drop, the comm
hook, metric records pushed to the job's sink, and a checkpoint every N steps that a restart
or resize resumes from. Rank 0 evaluates at the end and returns the run's summary (Ray
Train hands rank 0's return value to the driver as ``Result.return_value``).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import ray.train
import ray.train.torch
import torch

from tail_ray.collective import HookStepMetrics
from tail_ray.collective.topology import NodeLayout
from tail_ray.compression.stats import LayerStats
from tail_ray.metrics.client import MetricsClient
from tail_ray.metrics.records import LayerMetric, StepMetric
from tail_ray.metrics.sink import get_or_create_sink
from tail_ray.runner.checkpoint import load_checkpoint, save_checkpoint, seed_everything, unwrap
from tail_ray.runner.comm import Comm
from tail_ray.runner.config import JobConfig
from tail_ray.runner.datasets import make_dataset
from tail_ray.runner.models import evaluate, loss_fn, make_model

logger = logging.getLogger(__name__)

METRICS_CLOSE_TIMEOUT_S = 5.0
STAGE_TWO_SUFFIX = "@stage2"  # layer name suffix of a sharded collective's second-stage records


def make_optimizer(cfg: JobConfig, params: Any) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def step_records(
    cfg: JobConfig,
    job_id: str,
    *,
    step: int,
    rank: int,
    world_size: int,
    comm: HookStepMetrics,
    step_s: float,
    loss: float,
) -> list[dict[str, Any]]:
    """The records one worker sends for one step: one per layer, then the step record."""

    def layer_rows(stats: Sequence[LayerStats], suffix: str = "") -> list[dict[str, Any]]:
        return [
            LayerMetric(
                job_id=job_id,
                step=step,
                rank=rank,
                layer=f"{s.layer}{suffix}",
                numel=s.numel,
                bits=s.bits,
                density=s.density,
                raw_bytes=s.raw_bytes,
                encoded_bytes=s.encoded_bytes,
                ratio=s.ratio,
                rel_error=s.rel_error,
                code=s.code,
            ).to_dict()
            for s in stats
        ]

    # The second stage of a sharded collective, for the layer slices this worker owns: its own
    # rows (layer "<name>@stage2"), so the dashboard shows both stages' bits and error.
    out = layer_rows(comm.layers) + layer_rows(comm.stage_two, STAGE_TWO_SUFFIX)
    out.append(
        StepMetric(
            job_id=job_id,
            step=step,
            rank=rank,
            world_size=world_size,
            bytes_sent=comm.bytes_sent,
            bytes_received=comm.bytes_received,
            raw_bytes=comm.raw_bytes,
            compress_s=comm.compress_s,
            decode_s=comm.decode_s,
            comm_s=comm.comm_s,
            step_s=step_s,
            loss=loss,
            method=cfg.method,
            wall_time_s=time.time(),
        ).to_dict()
    )
    return out


def train_loop_per_worker(loop_config: dict[str, Any]) -> dict[str, Any] | None:
    """Ray Train's ``train_loop_per_worker``; ``loop_config`` = {"job": JobConfig dict, "job_id": str}."""
    cfg = JobConfig.from_mapping(loop_config["job"])
    job_id: str = loop_config["job_id"]
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))

    dataset = make_dataset(cfg.dataset, cfg.seed)
    model = ray.train.torch.prepare_model(make_model(cfg.model, dataset, cfg.seed))
    optimizer = make_optimizer(cfg, model.parameters())
    # Which workers share a node, as Ray Train placed them (never guessed from ranks).
    layout = NodeLayout(
        node_rank=ctx.get_node_rank(),
        local_rank=ctx.get_local_rank(),
        local_world_size=ctx.get_local_world_size(),
    )
    comm = Comm(model, cfg.method, cfg.compression, seed=cfg.seed, rank=rank, layout=layout)

    start_step, totals = 0, {"bytes_sent": 0.0, "bytes_received": 0.0, "raw_bytes": 0.0, "steps": 0.0}
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as ckpt_dir:
            restored = load_checkpoint(
                ckpt_dir,
                rank=rank,
                world_size=world_size,
                seed=cfg.seed,
                model=model,
                optimizer=optimizer,
                hook=comm.state,
            )
        start_step, totals = restored.step, {**totals, **restored.totals}
    else:
        seed_everything(cfg.seed, 0, rank)

    metrics = MetricsClient(get_or_create_sink(job_id), rank=rank, queue_records=cfg.metrics_queue_records)
    if rank == 0:
        logger.info(
            "job %s: %s on %s, method=%s, world_size=%d, steps %d..%d",
            job_id,
            cfg.model,
            cfg.dataset,
            cfg.method,
            world_size,
            start_step,
            cfg.steps,
        )

    model.train()
    loss_value = float("nan")
    # Fault injection for recovery tests (never set by the CLI or a config): the last rank of a
    # run that did not start from a checkpoint dies before this step.
    fail_at_step = loop_config.get("inject_failure_at_step")
    step_delay_s = float(loop_config.get("inject_step_delay_s") or 0.0)
    resumed_from_step = start_step
    for step in range(start_step, cfg.steps):
        if fail_at_step == step and checkpoint is None and rank == world_size - 1:
            raise RuntimeError(f"injected failure at step {step} on rank {rank}")
        if step_delay_s > 0:
            time.sleep(step_delay_s)
        t0 = time.perf_counter()
        lr = cfg.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        comm.set_lr(lr)
        x, y = dataset.batch(
            seed=cfg.seed, step=step, rank=rank, world_size=world_size, batch_size=cfg.batch_size
        )
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(dataset, model(x), y)
        loss.backward()
        comm.after_backward()
        optimizer.step()
        step_comm = comm.drain()
        step_s = time.perf_counter() - t0
        loss_value = float(loss.detach())

        totals["bytes_sent"] += step_comm.bytes_sent
        totals["bytes_received"] += step_comm.bytes_received
        totals["raw_bytes"] += step_comm.raw_bytes
        totals["steps"] += 1
        metrics.extend(
            step_records(
                cfg,
                job_id,
                step=step,
                rank=rank,
                world_size=world_size,
                comm=step_comm,
                step_s=step_s,
                loss=loss_value,
            )
        )
        done = step + 1
        if done % cfg.metrics_every_steps == 0:
            metrics.flush()
        if rank == 0 and (done % 20 == 0 or done == cfg.steps):
            logger.info("step %d/%d loss %.4f lr %.4g", done, cfg.steps, loss_value, lr)
        if done % cfg.checkpoint_every_steps == 0 and done < cfg.steps:
            _report(cfg, rank, world_size, done, model, optimizer, comm, totals, {"loss": loss_value})

    final: dict[str, Any] = {"step": cfg.steps, "loss": loss_value}
    if rank == 0:
        # The bare module: a DDP forward broadcasts buffers (e.g. the LM's causal mask) from
        # rank 0, a collective the other ranks, already waiting in report(), never join.
        final.update(evaluate(unwrap(model), dataset))
    _report(cfg, rank, world_size, cfg.steps, model, optimizer, comm, totals, final)
    metrics.close(timeout_s=METRICS_CLOSE_TIMEOUT_S)
    if rank != 0:
        return None
    sent_per_step = totals["bytes_sent"] / max(totals["steps"], 1.0)
    raw_per_step = totals["raw_bytes"] / max(totals["steps"], 1.0)
    return {
        **final,
        "world_size": world_size,
        "resumed_from_step": resumed_from_step,
        "bytes_sent_per_step": sent_per_step,
        "raw_bytes_per_step": raw_per_step,
        "traffic_ratio": raw_per_step / sent_per_step if sent_per_step else None,
        "metrics_dropped": metrics.dropped_records,
    }


def _report(
    cfg: JobConfig,
    rank: int,
    world_size: int,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    comm: Comm,
    totals: dict[str, float],
    metrics: dict[str, Any],
) -> None:
    """Checkpoint ``step`` steps done. Every rank writes its own files (Ray merges them) and
    calls report, which is a barrier across ranks."""
    with tempfile.TemporaryDirectory(prefix="tail-ckpt-") as tmp:
        save_checkpoint(
            tmp,
            rank=rank,
            world_size=world_size,
            step=step,
            model=model,
            optimizer=optimizer,
            hook=comm.state,
            totals=totals,
        )
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(tmp),
            checkpoint_dir_name=f"checkpoint_step{step:08d}",
        )
