"""The metrics job id of a training process: the same on every rank, and the Ray job's
submission id when there is one, so the service finds the job's metrics under its own id.

Tried in order: an explicit ``job_id``; ``$TAIL_RAY_JOB_ID``; the Ray job's submission id
(the job supervisor hands it to the entrypoint in ``RAY_JOB_CONFIG_JSON_ENV_VAR``; Ray Train
workers, which do not inherit that variable, read it from the job's config through their
core worker); the Ray Train run's name (shared by its workers); torchrun's run id; else one
rank 0 makes and broadcasts over the process group.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Mapping

logger = logging.getLogger(__name__)

JOB_ID_ENV = "TAIL_RAY_JOB_ID"
# Ray's job supervisor passes the job's metadata (its submission id included) to the entrypoint
# process in this variable (ray.dashboard.modules.job.job_supervisor: _get_driver_env_vars).
RAY_JOB_CONFIG_ENV_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"
RAY_JOB_ID_METADATA_KEY = "job_submission_id"
TORCHRUN_RUN_ID_ENV = "TORCHELASTIC_RUN_ID"


def submission_id_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The Ray job's submission id when this process is a Ray Jobs entrypoint, else None."""
    raw = (environ if environ is not None else os.environ).get(RAY_JOB_CONFIG_ENV_VAR)
    if not raw:
        return None
    try:
        value = json.loads(raw).get("metadata", {}).get(RAY_JOB_ID_METADATA_KEY)
    except (ValueError, AttributeError):
        return None
    return str(value) if value else None


def submission_id_from_ray() -> str | None:
    """The submission id from the job config of the Ray job this process works for (a Ray
    Train worker or any actor of a submitted job), else None."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        worker = ray._private.worker.global_worker
        metadata = worker.core_worker.get_job_config().metadata
        value = metadata.get(RAY_JOB_ID_METADATA_KEY)
    except Exception as exc:  # a private API: never fail training over it
        logger.debug("no job config from Ray's core worker: %s", exc)
        return None
    return str(value) if value else None


def ray_train_run_name() -> str | None:
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        import ray.train

        return str(ray.train.get_context().get_experiment_name()) or None
    except Exception:  # not inside a Ray Train worker
        return None


def generated_job_id(prefix: str = "local") -> str:
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def resolve_job_id(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """This process's metrics job id (see the module doc); every rank gets the same one."""
    env = environ if environ is not None else os.environ
    found = (
        explicit
        or env.get(JOB_ID_ENV)
        or submission_id_from_env(env)
        or submission_id_from_ray()
        or ray_train_run_name()
    )
    if found:
        return str(found)
    run_id = env.get(TORCHRUN_RUN_ID_ENV)
    if run_id and run_id != "none":
        return f"torchrun-{run_id}"
    return _agreed_generated_id()


def _agreed_generated_id() -> str:
    """A fresh id from rank 0, broadcast to every rank of the default process group."""
    import torch.distributed as dist

    job_id = generated_job_id()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [job_id]
        dist.broadcast_object_list(box, src=0)
        job_id = str(box[0])
    return job_id
