"""Bring your own model and training loop: one call in a Ray Train (or torchrun) loop.

    model = tail_ray.train.prepare_model(model)          # instead of ray.train.torch.prepare_model
    ...                                                  # your loop, unchanged
    tail_ray.train.report_loss(loss)                     # optional: the loss in each step's record

Per-layer and per-step metrics then stream to the job's sink on every optimizer step (the
job id is the Ray job's submission id, so the tail-ray service finds the job). The hook state
goes into your checkpoints with ``save_checkpoint(dir)`` / ``load_checkpoint(dir)`` (or
``state_dict()`` / ``load_state_dict()``). See docs/training.md, "Your own training loop".
"""

import torch

from tail_ray.train.checkpoint import load_checkpoint, load_state_dict, save_checkpoint, state_dict
from tail_ray.train.prepare import current_session, in_ray_train_worker, prepare_model
from tail_ray.train.session import TrainSession, compression_settings, step_records
from tail_ray.train.writers import JsonlWriter, ListWriter, MetricsWriter, RaySinkWriter


def set_lr(lr: float) -> None:
    """The coming step's learning rate, for optimizers whose lr is not in ``param_groups``
    (the lr of ``param_groups[0]`` is read by itself otherwise)."""
    current_session().set_lr(lr)


def report_loss(loss: torch.Tensor | float) -> None:
    """This step's loss (a tensor or a number), before ``optimizer.step()``: it goes into the
    step's record (the dashboard's loss chart). Optional."""
    current_session().report_loss(loss)


def finish(timeout_s: float = 5.0) -> None:
    """Hand the last records over (waits at most ``timeout_s``) and stop hooking. Optional: a
    process that exits normally does it by itself."""
    current_session().close(timeout_s)


__all__ = [
    "JsonlWriter",
    "ListWriter",
    "MetricsWriter",
    "RaySinkWriter",
    "TrainSession",
    "compression_settings",
    "current_session",
    "finish",
    "in_ray_train_worker",
    "load_checkpoint",
    "load_state_dict",
    "prepare_model",
    "report_loss",
    "save_checkpoint",
    "set_lr",
    "state_dict",
    "step_records",
]
