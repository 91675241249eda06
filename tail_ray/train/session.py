"""One training process's Tail session: the comm hook on the user's model, the optimizer-step
hooks that turn every step into metric records, the learning rate the controller sees, and
the hook state that goes into the user's checkpoints.

``prepare_model`` (tail_ray/train/prepare.py) builds the session; from then on it runs off
three hooks, so the user's loop needs no further call:

- a forward pre-hook on the model reads the learning rate of the optimizer stepping it
  (``param_groups[0]["lr"]``) and passes changes to the controller before the backward that
  compresses: a scheduler's drop is seen at the step it takes effect (``set_lr`` overrides);
- torch's global optimizer step pre-hook, for the optimizer holding the model's parameters
  (its class is told to the hook state: SGD gets a looser budget than Adam, bitwidth/policy.py):
  with world size 1 (no DDP wrapper, nothing to exchange) it runs the method's local round
  trip on the gradients, so a one-worker run has the same compression noise and metrics;
- the matching post-hook drains what the comm hook did during the step and hands one
  ``LayerMetric`` per layer and one ``StepMetric`` to the writer (the job's Ray sink, or a
  JSON-lines file outside Ray), flushed every ``flush_every_steps`` without waiting.

Only the first optimizer seen stepping the model's parameters counts (a second one covering
the same model would otherwise split every step in two); if it is garbage-collected, the next
one seen takes its place. Every one of them has a say in the budget, though: the looser one
(SGD's) holds only while all of them are linear in the gradient. With gradient accumulation
(``no_sync``) a step is an optimizer step: the hook communicates once per step, and so do the
records.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from tail_ray.collective import (
    HookState,
    HookStepMetrics,
    compress_gradients_locally,
    make_hook_state,
    method_spec,
)
from tail_ray.collective.optimizer_watch import OptimizerJudge
from tail_ray.errors import ConfigError
from tail_ray.metrics.records import LayerMetric, StepMetric
from tail_ray.train.writers import CLOSE_TIMEOUT_S, MetricsWriter

logger = logging.getLogger(__name__)

STAGE_TWO_SUFFIX = "@stage2"  # layer name suffix of a sharded collective's second-stage records

SESSION_STATE_VERSION = 1


def compression_settings(
    method: str, config: Mapping[str, Any] | None, *, seed: int, rank: int
) -> dict[str, Any]:
    """The method's settings, with a rounding seed derived from (seed, rank): different on
    every worker (their rounding noise must be independent: averaging it down is what the
    budget counts on), the same across runs, so a run can be reproduced and replayed exactly
    from a checkpoint. A seed the user set is rank 0's, and the other ranks derive theirs from
    it (one seed on every rank would send every rank the same dither). Only methods whose
    settings take a ``seed`` get one (``MethodSpec.seeded``: tail, qsgd)."""
    settings = dict(config or {})
    if method_spec(method).seeded:
        if "seed" not in settings:
            settings["seed"] = (seed * 1_000_003 + rank * 7919 + 17) & 0xFFFF_FFFF
        elif rank and settings["seed"] is not None:
            settings["seed"] = (int(settings["seed"]) * 1_000_003 + rank * 7919 + 17) & 0xFFFF_FFFF
    return settings


def check_method_settings(method: str, config: Mapping[str, Any] | None) -> None:
    """Raise ``ConfigError`` for settings ``method`` rejects (unknown keys, values out of range),
    by building its hook state on a tiny module: the checks a worker would make, made first."""
    try:
        make_hook_state(nn.Linear(4, 4), method, compression_settings(method, config, seed=0, rank=0))
    except ConfigError as exc:
        raise ConfigError(f"compression settings for method={method!r}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"compression settings {dict(config or {})} for method={method!r}: {exc}") from None


@dataclass
class Totals:
    """What this rank's hook did over the run (kept across checkpoints)."""

    steps: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    raw_bytes: int = 0

    def add(self, m: HookStepMetrics) -> None:
        self.steps += 1
        self.bytes_sent += m.bytes_sent
        self.bytes_received += m.bytes_received
        self.raw_bytes += m.raw_bytes


def step_records(
    m: HookStepMetrics,
    *,
    job_id: str,
    step: int,
    rank: int,
    world_size: int,
    method: str,
    step_s: float,
    loss: float,
) -> list[dict[str, Any]]:
    """The records one rank sends for one step: one per layer, then one per layer slice this
    rank re-compressed as a sharded collective's owner (its second stage: layer
    "<name>@stage2", so the dashboard shows both stages' bits and error), then the step record."""
    layers = [*m.layers, *(replace(s, layer=f"{s.layer}{STAGE_TWO_SUFFIX}") for s in m.stage_two)]
    out = [LayerMetric.from_stats(s, job_id=job_id, step=step, rank=rank).to_dict() for s in layers]
    out.append(
        StepMetric(
            job_id=job_id,
            step=step,
            rank=rank,
            world_size=world_size,
            bytes_sent=m.bytes_sent,
            bytes_received=m.bytes_received,
            raw_bytes=m.raw_bytes,
            compress_s=m.compress_s,
            decode_s=m.decode_s,
            comm_s=m.comm_s,
            step_s=step_s,
            loss=loss,
            method=method,
            wall_time_s=time.time(),
        ).to_dict()
    )
    return out


class TrainSession:
    """The hook, the step hooks and the metrics of one prepared model (see the module doc)."""

    def __init__(
        self,
        model: nn.Module,
        state: HookState,
        writer: MetricsWriter,
        *,
        job_id: str,
        rank: int,
        world_size: int,
        local: bool,
        flush_every_steps: int = 1,
    ) -> None:
        if flush_every_steps < 1:
            raise ConfigError(f"flush_every_steps must be >= 1, got {flush_every_steps}")
        self.model = model
        self.state = state
        self.writer = writer
        self.job_id = job_id
        self.rank = rank
        self.world_size = world_size
        self.local = local  # world size 1: the local round trip instead of a comm hook
        self.flush_every_steps = flush_every_steps
        self.step = 0  # the step the next record gets (optimizer steps done, over restarts)
        self.totals = Totals()
        self.closed = False
        self._optimizer: weakref.ref[torch.optim.Optimizer] | None = None
        self._judge = OptimizerJudge(model)  # which optimizers step the model; all linear?
        self._manual_lr = False
        self._lr: float | None = None
        self._loss: torch.Tensor | float | None = None
        self._last_step_end = time.perf_counter()
        self._handles: list[RemovableHandle] = [
            register_optimizer_step_pre_hook(self._before_step),
            register_optimizer_step_post_hook(self._after_step),
            model.register_forward_pre_hook(self._before_forward),
        ]

    @property
    def method(self) -> str:
        return self.state.method.value

    # -- what the user may call (through tail_ray.train) ------------------------------------------

    def set_lr(self, lr: float) -> None:
        """Tell the controller the coming step's learning rate; from then on the optimizer's
        own lr is no longer read (for optimizers whose lr is not in ``param_groups``)."""
        self._manual_lr = True
        self._pass_lr(lr)

    def report_loss(self, loss: torch.Tensor | float) -> None:
        """The loss of the step under way (call before ``optimizer.step()``); it goes into that
        step's record. A tensor is read (``.item()``) only when the record is made."""
        self._loss = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable: the hook's state (controller, residuals: keyed by parameter name),
        the step counter and the traffic totals, and who wrote them (rank, world size)."""
        return {
            "version": SESSION_STATE_VERSION,
            "hook": self.state.state_dict(),
            "step": self.step,
            "totals": asdict(self.totals),
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def load_state_dict(self, saved: Mapping[str, Any], *, residuals: bool | None = None) -> bool:
        """Restore from ``state_dict()``. ``residuals`` None: kept only when the same rank of a
        group of the same size wrote them (error-feedback residuals belong to the gradient
        stream one worker saw; after a resize they restart at zero, the controller's per-layer
        state is kept). Returns whether the residuals were restored."""
        if not isinstance(saved, Mapping) or saved.get("version") != SESSION_STATE_VERSION:
            raise ConfigError(
                "not a tail_ray.train state (expected what tail_ray.train.state_dict() returned, "
                f"version {SESSION_STATE_VERSION})"
            )
        if residuals is None:
            residuals = saved.get("rank") == self.rank and saved.get("world_size") == self.world_size
        self.state.load_state_dict(saved["hook"], residuals=residuals)
        self.step = int(saved["step"])
        self.totals = Totals(**{k: int(v) for k, v in dict(saved.get("totals", {})).items()})
        return residuals

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop hooking and hand the last records over (waiting at most ``timeout_s``)."""
        if self.closed:
            return
        self.closed = True
        for handle in self._handles:
            handle.remove()
        self.writer.close(timeout_s)

    # -- the hooks -----------------------------------------------------------------------------------

    def _owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """True for the optimizer whose steps are this model's steps (see the module doc)."""
        bound = self._optimizer() if self._optimizer is not None else None
        if bound is optimizer:
            return True
        verdict = self._judge.judge(optimizer)
        if verdict == "foreign":
            return False
        if verdict == "new":
            # The budget is the model's, so it is the looser one only while every optimizer
            # stepping the model's parameters is linear (an Adam on part of it keeps the cautious
            # one). The first step runs in Tail's warm-up: the budget is in place before it matters.
            self.state.set_linear_optimizer(self._judge.all_linear)
        if bound is not None:
            return False
        self._optimizer = weakref.ref(optimizer)
        return True

    def _pass_lr(self, lr: Any) -> None:
        value = float(lr)  # a tensor lr (capturable optimizers) too
        if value != self._lr:
            self._lr = value
            self.state.set_lr(value)

    def _read_lr(self) -> None:
        bound = self._optimizer() if self._optimizer is not None else None
        if bound is not None and not self._manual_lr and bound.param_groups:
            self._pass_lr(bound.param_groups[0]["lr"])

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self._read_lr()

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.closed or not self._owns(optimizer):
            return
        self._read_lr()
        if self.local:
            compress_gradients_locally(self.state, self.model)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.closed or not self._owns(optimizer):
            return
        now = time.perf_counter()
        m = self.state.drain_metrics()
        loss = float(self._loss) if self._loss is not None else float("nan")
        self.writer.extend(
            step_records(
                m,
                job_id=self.job_id,
                step=self.step,
                rank=self.rank,
                world_size=self.world_size,
                method=self.method,
                step_s=now - self._last_step_end,
                loss=loss,
            )
        )
        self.totals.add(m)
        self._loss = None
        self._last_step_end = now
        self.step += 1
        if self.step % self.flush_every_steps == 0:
            self.writer.flush()
