"""Build and run the Ray Train job for one JobConfig (the driver side).

- Scaling: ``ScalingConfig(num_workers=(min, max))`` when min < max (Ray Train V2 elastic:
  it starts with what it can get, at least min, and grows toward max every
  ``elastic_resize_interval_s``), else a fixed int.
- Failures: ``FailureConfig(max_failures)``; a restart resumes from the latest checkpoint
  (tail_ray.runner.checkpoint), with whatever world size the restart gets.
- Metrics: the driver creates the job's sink (a detached named actor keyed by job id)
  before the workers start, and marks it closed when training ends; it is NOT removed, so
  the control plane can still drain its tail (it calls ``close_sink`` when done).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from tail_ray.metrics.sink import get_or_create_sink
from tail_ray.runner.config import JobConfig
from tail_ray.runner.train_loop import FaultInjection, train_loop_per_worker
from tail_ray.train.ids import generated_job_id, submission_id_from_env

logger = logging.getLogger(__name__)

DEFAULT_STORAGE_PATH = Path.home() / "ray_results" / "tail_ray"
SINK_CLOSE_TIMEOUT_S = 10.0
__all__ = ["FaultInjection", "resolve_job_id", "run_job", "submission_id_from_env", "validate_job"]


def resolve_job_id(cfg: JobConfig, environ: dict[str, str] | None = None) -> str:
    """``cfg.job_id`` if set, else the Ray job's submission id, else a fresh id from the name."""
    return cfg.job_id or submission_id_from_env(environ) or generated_job_id(cfg.name)


def validate_job(cfg: JobConfig) -> None:
    """Fail on the driver, before any worker starts, for compression settings the method
    rejects (inside a worker they would cost every retry). Names and ranges are checked by
    ``JobConfig`` itself."""
    from tail_ray.train.session import check_method_settings

    check_method_settings(cfg.method, cfg.compression)


def scaling_config(cfg: JobConfig) -> ScalingConfig:
    num_workers: int | tuple[int, int] = (
        (cfg.min_workers, cfg.max_workers) if cfg.min_workers < cfg.max_workers else cfg.max_workers
    )
    resources: dict[str, float] = {"CPU": cfg.cpus_per_worker}
    if cfg.gpus_per_worker > 0:
        resources["GPU"] = cfg.gpus_per_worker
    kwargs: dict[str, Any] = {}
    if isinstance(num_workers, tuple):
        kwargs["elastic_resize_monitor_interval_s"] = cfg.elastic_resize_interval_s
    return ScalingConfig(
        # Ray Train v2 takes (min, max) for elastic scaling; the annotation is still v1's.
        num_workers=num_workers,  # type: ignore[arg-type]
        use_gpu=cfg.gpus_per_worker > 0,
        resources_per_worker=resources,
        **kwargs,
    )


def build_trainer(cfg: JobConfig, job_id: str, *, faults: FaultInjection | None = None) -> TorchTrainer:
    """The TorchTrainer for ``cfg``; ``faults`` only in tests of recovery and elasticity."""
    storage = cfg.storage_path or str(DEFAULT_STORAGE_PATH)
    run_config = RunConfig(
        name=job_id,
        storage_path=storage,
        failure_config=FailureConfig(max_failures=cfg.max_failures),
        checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoints_to_keep),
    )
    return TorchTrainer(
        # Ray Train v2 hands rank 0's return value to the driver (Result.return_value); the
        # annotation still says the loop returns None.
        train_loop_per_worker,  # type: ignore[arg-type]
        train_loop_config={
            "job": cfg.to_dict(),
            "job_id": job_id,
            "faults": faults,
        },
        scaling_config=scaling_config(cfg),
        run_config=run_config,
    )


@dataclass(frozen=True)
class JobResult:
    job_id: str
    ok: bool
    summary: dict[str, Any]  # rank 0's return value (final metric, traffic), {} on failure
    checkpoint_path: str | None
    error: str | None
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "ok": self.ok,
            **self.summary,
            "checkpoint_path": self.checkpoint_path,
            "error": self.error,
            "wall_s": round(self.wall_s, 3),
        }


def run_job(
    cfg: JobConfig,
    job_id: str | None = None,
    *,
    faults: FaultInjection | None = None,
) -> JobResult:
    """Run ``cfg`` on the connected Ray cluster (``ray.init`` must have been called)."""
    validate_job(cfg)
    job_id = job_id or resolve_job_id(cfg)
    sink = get_or_create_sink(job_id)
    t0 = time.perf_counter()
    logger.info(
        "job %s: starting %s (method=%s, workers %d..%d)",
        job_id,
        cfg.name,
        cfg.method,
        cfg.min_workers,
        cfg.max_workers,
    )
    try:
        result = build_trainer(cfg, job_id, faults=faults).fit()
        error = None if result.error is None else str(result.error)
    except Exception as exc:  # TrainingFailedError once the retries are spent
        result, error = None, f"{type(exc).__name__}: {exc}"
    finally:
        _mark_closed(sink)
    # return_value: Ray Train v2's Result (rank 0's return); the stubs describe v1's Result.
    summary = dict(result.return_value or {}) if result is not None else {}  # type: ignore[attr-defined]
    checkpoint = result.checkpoint.path if result is not None and result.checkpoint else None
    return JobResult(job_id, error is None, summary, checkpoint, error, time.perf_counter() - t0)


def _mark_closed(sink: ray.actor.ActorHandle) -> None:
    """Tell readers the stream is complete. Waited for (briefly) because the CLI disconnects
    right after, which could drop a call still in flight; a failure here never fails the job."""
    try:
        ray.get(sink.close.remote(), timeout=SINK_CLOSE_TIMEOUT_S)
    except Exception as exc:
        logger.warning("could not mark the metrics sink closed: %s", exc)


def ensure_ray(address: str | None) -> None:
    """Connect to ``address`` (or RAY_ADDRESS / a running local cluster), else start a local Ray."""
    if ray.is_initialized():
        return
    ray.init(address=address, logging_level=logging.WARNING)
