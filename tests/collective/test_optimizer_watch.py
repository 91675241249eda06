"""The optimizer watch (tail_ray/collective/optimizer_watch.py): a state from register_tail_hook
learns at the first optimizer step whether that optimizer is linear in the gradient, without
``set_optimizer``; a named optimizer, a foreign one and a collected state are left alone."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_pre_hooks

from tail_ray.collective import register_tail_hook
from tail_ray.collective.optimizer_watch import watch_optimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4))


def _step(model: nn.Module, *optimizers: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 64)).square().mean().backward()
    for opt in optimizers:
        opt.step()
        opt.zero_grad()


def _linear(state) -> bool:  # type: ignore[no-untyped-def]
    return bool(state.compressor.controller.policy.linear)


def test_an_sgd_step_tells_the_state_linear_and_the_default_goes_lowrank() -> None:
    model = _model()
    state = register_tail_hook(None, "tail", model=model)
    assert not _linear(state) and state.compressor._chooser() is None  # untold: cautious
    _step(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert _linear(state)
    assert state.compressor._chooser() is not None  # lowrank "auto" in force from now on
    assert not state.optimizer_named  # the watch told it; the user did not


def test_adam_on_part_of_the_model_makes_it_not_linear_and_a_foreign_one_is_ignored() -> None:
    model, other = _model(), _model()
    state = register_tail_hook(None, "tail", model=model)
    _step(other, torch.optim.SGD(other.parameters(), lr=0.1))  # another model's optimizer
    assert not _linear(state)
    sgd = torch.optim.SGD(model[0].parameters(), lr=0.1)
    adam = torch.optim.Adam(model[2].parameters())
    _step(model, sgd)
    assert _linear(state)
    _step(model, adam, sgd)
    assert not _linear(state)  # one adaptive optimizer on the model: the cautious answer


def test_a_named_optimizer_wins_and_the_watch_steps_back() -> None:
    model = _model()
    state = register_tail_hook(None, "tail", model=model)
    state.set_linear_optimizer(False)  # e.g. a linear-looking optimizer the user knows is not
    _step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not _linear(state) and state.optimizer_named


def test_finished_watches_leave_torchs_hooks_when_the_next_one_is_made() -> None:
    model = _model()
    state = register_tail_hook(None, "tail", model=model)
    watch = watch_optimizer(state, model)  # a second watch, to hold its handle
    named = register_tail_hook(None, "tail", model=_model())
    named.set_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    named_watch = watch_optimizer(named, model)
    assert watch.handle.id in _global_optimizer_pre_hooks and not watch.finished
    gone = weakref.ref(state)
    del state
    gc.collect()
    assert gone() is None and watch.finished and named_watch.finished
    _step(model, torch.optim.SGD(model.parameters(), lr=0.1))  # a finished watch is quiet
    watch_optimizer(register_tail_hook(None, "tail", model=_model()), model)
    assert watch.handle.id not in _global_optimizer_pre_hooks
    assert named_watch.handle.id not in _global_optimizer_pre_hooks
