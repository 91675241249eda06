"""Tell a hook state its optimizer by itself, at the optimizer's first step.

Why: what Tail does depends on whether the optimizer is linear in the gradient (SGD): a
looser budget, and low-rank layers under the default ``lowrank: "auto"``
(TailConfig.lowrank). A hook that is never told keeps the cautious answer, so a plain DDP
script training with SGD that never calls ``state.set_optimizer(opt)`` would send 2-4x more
than it needs to, silently.

How: a global optimizer step pre-hook (torch.optim) sees every optimizer's step. An optimizer
that steps some of the model's parameters is judged once (``linear_in_gradient``); the answer
told to the state is whether every optimizer judged so far is linear (SGD on the head and Adam
on the trunk is not), as tail_ray.train's session judges. Each step is still compressed before
its optimizer steps, so the first step is compressed untold; Tail's first low-rank trial
comes after its warm-up.

The watch steps back for good once anyone else names the optimizer (``state.set_optimizer`` or
``set_linear_optimizer``: the user, or tail_ray.train's session, which judges the same way),
or once the state is garbage-collected. Its global hook cannot leave torch's hook dict from
inside a step (torch iterates that dict: "OrderedDict mutated during iteration"), so a
finished watch only goes quiet, and the next ``watch_optimizer`` removes it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from tail_ray.collective.state import HookState, linear_in_gradient, unwrap


class OptimizerJudge:
    """Which optimizers step a model's parameters, and whether all of those are linear in the
    gradient (``all_linear``): the watch's rule, and tail_ray.train's session's."""

    def __init__(self, model: nn.Module) -> None:
        self._param_ids = frozenset(id(p) for p in unwrap(model).parameters())
        self._judged: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # they step the model
        self._foreign: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.all_linear = True

    def judge(self, optimizer: torch.optim.Optimizer) -> str:
        """Its verdict: "foreign" (steps none of the model's parameters), "new" (steps some,
        judged just now: ``all_linear`` may have changed) or "known" (judged before)."""
        if optimizer in self._judged:
            return "known"
        if optimizer in self._foreign:
            return "foreign"
        if not any(id(p) in self._param_ids for group in optimizer.param_groups for p in group["params"]):
            self._foreign.add(optimizer)
            return "foreign"
        self._judged.add(optimizer)
        self.all_linear = self.all_linear and linear_in_gradient(optimizer)
        return "new"


class OptimizerWatch:
    """The global pre-hook of one hook state (see the module doc)."""

    def __init__(self, state: HookState, model: nn.Module) -> None:
        self._state = weakref.ref(state)
        self._judge = OptimizerJudge(model)
        self.handle: RemovableHandle = register_optimizer_step_pre_hook(self._before_step)

    @property
    def finished(self) -> bool:
        """The state is gone, or someone else speaks for it now."""
        state = self._state()
        return state is None or state.optimizer_named

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        state = self._state()
        if state is not None and not state.optimizer_named and self._judge.judge(optimizer) == "new":
            state.apply_linear_optimizer(self._judge.all_linear)


_WATCHES: list[OptimizerWatch] = []  # this process's watches whose hooks are still registered


def watch_optimizer(state: HookState, model: nn.Module) -> OptimizerWatch:
    """Start watching for the optimizer that steps ``model``'s parameters on behalf of ``state``
    (and remove the hooks of finished watches: never called from inside an optimizer step)."""
    for old in [w for w in _WATCHES if w.finished]:
        old.handle.remove()
        _WATCHES.remove(old)
    watch = OptimizerWatch(state, model)
    _WATCHES.append(watch)
    return watch
