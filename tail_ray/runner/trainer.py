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

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from tail_ray.metrics.sink import get_or_create_sink
from tail_ray.runner.config import JobConfig
from tail_ray.runner.datasets import dataset_names
from tail_ray.runner.models import model_names
from tail_ray.runner.train_loop import train_loop_per_worker

logger = logging.getLogger(__name__)

DEFAULT_STORAGE_PATH = Path.home() / "ray_results" / "tail_ray"
# Ray's job supervisor passes the job's metadata (incl. its submission id) to the entrypoint
# process in this variable (ray.dashboard.modules.job: JobSupervisor._get_driver_env_vars).
RAY_JOB_CONFIG_ENV_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"
RAY_JOB_ID_METADATA_KEY = "job_submission_id"
SINK_CLOSE_TIMEOUT_S = 10.0


def submission_id_from_env(environ: dict[str, str] | None = None) -> str | None:
    """The Ray job's submission id when this process is a Ray Jobs entrypoint, else None."""
    raw = (environ if environ is not None else os.environ).get(RAY_JOB_CONFIG_ENV_VAR)
    if not raw:
        return None
    try:
        value = json.loads(raw).get("metadata", {}).get(RAY_JOB_ID_METADATA_KEY)
    except (ValueError, AttributeError):
        return None
    return str(value) if value else None


def resolve_job_id(cfg: JobConfig, environ: dict[str, str] | None = None) -> str:
    """``cfg.job_id`` if set, else the Ray job's submission id, else a fresh id from the name."""
    if cfg.job_id:
        return cfg.job_id
    generated = f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    return submission_id_from_env(environ) or generated


def validate_job(cfg: JobConfig) -> None:
    """Fail on the driver, before any worker starts, for names the registries do not know and
    compression settings the method rejects (inside a worker they would cost every retry)."""
    from torch import nn

    from tail_ray.collective import make_hook_state
    from tail_ray.errors import ConfigError
    from tail_ray.runner.comm import compression_settings

    if cfg.model not in model_names():
        raise ConfigError(f"unknown model {cfg.model!r}; choose one of {model_names()}")
    if cfg.dataset not in dataset_names():
        raise ConfigError(f"unknown dataset {cfg.dataset!r}; choose one of {dataset_names()}")
    settings = compression_settings(cfg.method, cfg.compression, seed=cfg.seed, rank=0)
    try:
        make_hook_state(nn.Linear(4, 4), cfg.method, settings)
    except ConfigError as exc:
        raise ConfigError(f"compression settings for method={cfg.method!r}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"compression settings {dict(cfg.compression)} for method={cfg.method!r}: {exc}"
        ) from None


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


def build_trainer(
    cfg: JobConfig,
    job_id: str,
    *,
    inject_failure_at_step: int | None = None,
    inject_step_delay_s: float = 0.0,
) -> TorchTrainer:
    """The TorchTrainer for ``cfg``. ``inject_failure_at_step`` (tests of recovery only): the
    last rank raises before that step on a run not resumed from a checkpoint.
    ``inject_step_delay_s`` (elasticity tests only): every step sleeps this long, so a short
    job stays alive while a test adds nodes or kills workers."""
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
            "inject_failure_at_step": inject_failure_at_step,
            "inject_step_delay_s": inject_step_delay_s,
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
    inject_failure_at_step: int | None = None,
    inject_step_delay_s: float = 0.0,
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
        result = build_trainer(
            cfg,
            job_id,
            inject_failure_at_step=inject_failure_at_step,
            inject_step_delay_s=inject_step_delay_s,
        ).fit()
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
