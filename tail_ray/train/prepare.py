"""``prepare_model``: a drop-in for ``ray.train.torch.prepare_model`` that also registers the
Tail comm hook and streams per-layer and per-step metrics to the job's sink.

Where it runs decides what it does:

    context                          device and wrapper                      metrics go to
    Ray Train worker                 ray.train.torch.prepare_model (DDP      the job's Ray sink
                                     when world size > 1)
    process group, world size > 1    cuda:LOCAL_RANK if CUDA, DDP            the Ray sink if connected,
    (torchrun, mp.spawn, ...)                                                else JSON lines
    no group / world size 1          unchanged, no wrapper                   idem

World size 1 has no DDP wrapper (as with Ray): the method's local round trip runs in the
optimizer step instead, so training runs and reports the same per-layer metrics.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tail_ray.collective import make_hook_state, method_spec, register_tail_hook
from tail_ray.collective.topology import NodeLayout
from tail_ray.errors import ConfigError
from tail_ray.methods import Method
from tail_ray.train.ids import resolve_job_id
from tail_ray.train.session import TrainSession, compression_settings
from tail_ray.train.writers import MetricsWriter, open_writer

# How long the closer may wait for the sink to take the last records once training returned.
CLOSE_AFTER_TRAINING_S = 5.0

logger = logging.getLogger(__name__)

_current: TrainSession | None = None


def current_session() -> TrainSession:
    """The session of the last ``prepare_model`` in this process."""
    if _current is None or _current.closed:
        raise ConfigError("no prepared model in this process: call tail_ray.train.prepare_model(model) first")
    return _current


def in_ray_train_worker() -> bool:
    """True inside a function Ray Train runs (never imports ray where it is not loaded yet)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    try:
        import ray.train

        ray.train.get_context()
    except Exception:  # RuntimeError outside a Train worker (its message varies by version)
        return False
    return True


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _node_layout() -> NodeLayout | None:
    """Which workers share this worker's node, as Ray Train placed them (never guessed from
    ranks); None outside Ray Train, where register_tail_hook reads torchrun's variables."""
    if not in_ray_train_worker():
        return None
    import ray.train

    ctx = ray.train.get_context()
    return NodeLayout(
        node_rank=ctx.get_node_rank(),
        local_rank=ctx.get_local_rank(),
        local_world_size=ctx.get_local_world_size(),
    )


def _wrap(model: nn.Module, ddp_kwargs: dict[str, Any]) -> tuple[nn.Module, int, int]:
    """(prepared model, rank, world size) for where this process runs (see the module doc)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model, dist.get_rank(model.process_group), dist.get_world_size(model.process_group)
    if in_ray_train_worker():
        import ray.train
        import ray.train.torch

        ctx = ray.train.get_context()
        prepared = ray.train.torch.prepare_model(model, parallel_strategy_kwargs=ddp_kwargs or None)
        return prepared, ctx.get_world_rank(), ctx.get_world_size()
    group = ddp_kwargs.get("process_group")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        device = _device()
        model = model.to(device)
        device_ids = [device] if device.type == "cuda" else None
        wrapped = nn.parallel.DistributedDataParallel(model, **{"device_ids": device_ids, **ddp_kwargs})
        return wrapped, dist.get_rank(group), dist.get_world_size(group)
    if ddp_kwargs:
        logger.info("world size 1: no DDP wrapper, so the DDP arguments %s are not used", sorted(ddp_kwargs))
    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
    return model, rank, 1


def prepare_model(
    model: nn.Module,
    method: Method | str = Method.TAIL,
    config: Mapping[str, Any] | None = None,
    *,
    job_id: str | None = None,
    metrics: MetricsWriter | str | Path | None = None,
    seed: int = 0,
    flush_every_steps: int = 1,
    **ddp_kwargs: Any,
) -> nn.Module:
    """Move ``model`` to this worker's device, wrap it in DDP (world size > 1), register the
    ``method`` comm hook with ``config`` (its settings, see docs/collective.md) and stream
    metrics on every optimizer step. Returns the model to train, as Ray's prepare_model does.

    ``job_id``: the metrics job id (default: the Ray job's submission id; see
    tail_ray/train/ids.py). ``metrics``: a writer, or a directory for JSON-lines files (default:
    the job's Ray sink when connected to Ray, else ``./tail-ray-metrics``). ``seed``: base of the
    per-rank stochastic-rounding seeds. ``ddp_kwargs`` go to ``DistributedDataParallel``
    (``find_unused_parameters=True``, ``process_group=...``, ...).
    """
    global _current
    if not isinstance(model, nn.Module):
        raise ConfigError(f"prepare_model needs a torch.nn.Module, got {type(model).__name__}")
    spec = method_spec(method)  # an unknown method fails before anything is wrapped
    prepared, rank, world_size = _wrap(model, dict(ddp_kwargs))
    settings = compression_settings(spec.method.value, config, seed=seed, rank=rank)
    if isinstance(prepared, nn.parallel.DistributedDataParallel):
        state = register_tail_hook(
            prepared, spec.method, settings, ddp_kwargs.get("process_group"), layout=_node_layout()
        )
        local = False
    else:
        state = make_hook_state(prepared, spec.method, settings)
        local = True
    job = resolve_job_id(job_id)
    writer = open_writer(metrics, job, rank)
    if _current is not None:
        _current.close()  # a second prepared model in this process replaces the first
    _current = TrainSession(
        prepared,
        state,
        writer,
        job_id=job,
        rank=rank,
        world_size=world_size,
        local=local,
        flush_every_steps=flush_every_steps,
    )
    if threading.current_thread() is not threading.main_thread():
        _close_when_thread_ends(threading.current_thread(), _current)
    if rank == 0:
        logger.info(
            "tail-ray: method %s on %d worker(s); metrics of job %s go to %s",
            spec.method.value,
            world_size,
            job,
            writer.describe(),
        )
    return prepared


def _close_when_thread_ends(train_thread: threading.Thread, session: TrainSession) -> None:
    """Hand the last records over as soon as ``train_thread`` (the one that prepared the model)
    returns. Ray Train V2 runs the training function in a thread and ray.kill()s the worker
    soon after it returns, so atexit never runs there; and a flush during training leaves
    records queued while the sink still owes acknowledgements (training never waits), so
    without this the last steps of a fast loop could be lost. The built-in runner closes its
    session itself first (then this is a no-op)."""

    def close_after() -> None:
        train_thread.join()
        session.close(timeout_s=CLOSE_AFTER_TRAINING_S)

    threading.Thread(target=close_after, name="tail-ray-metrics-close", daemon=True).start()


@atexit.register
def _close_at_exit() -> None:
    # A plain script or torchrun process exits normally: hand the last records over. (A Ray
    # Train worker is killed instead: _close_when_thread_ends covers it.)
    if _current is not None:
        _current.close(timeout_s=2.0)
