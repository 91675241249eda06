"""One switch, one place: method name -> hook state + DDP comm hook.

    state = register_tail_hook(ddp_model, method="tail", config={...})
    ...  # each step: loss.backward(); optimizer.step(); metrics = state.drain_metrics()

With one worker there is no DDP wrapper (Ray's prepare_model returns the bare module):

    state = make_hook_state(model, method="tail", config={...})
    ...  # each step: loss.backward(); compress_gradients_locally(state, model); optimizer.step()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tail_ray.collective.builtin import (
    allreduce_peer_hook,
    check_no_settings,
    local_cast_round_trip,
    local_powersgd_round_trip,
    make_powersgd_state,
    powersgd_peer_hook,
)
from tail_ray.collective.gate import split_gate_settings
from tail_ray.collective.hook import local_round_trip, tail_hook
from tail_ray.collective.state import (
    ALLREDUCE_METHODS,
    COMPRESSOR_METHODS,
    METHODS,
    POWERSGD_METHOD,
    TailHookState,
)
from tail_ray.compression.registry import make_compressor
from tail_ray.errors import ConfigError

Hook = Callable[[TailHookState, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def _check_config(method: str, config: Mapping[str, Any] | None) -> dict[str, Any]:
    if not isinstance(method, str) or method not in METHODS:
        raise ConfigError(f"unknown compression method {method!r}; choose one of {list(METHODS)}")
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise ConfigError(f"config must be a mapping of settings for {method!r}, got {type(config).__name__}")
    return dict(config)


def make_hook_state(
    model: nn.Module,
    method: str = "tail",
    config: Mapping[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> TailHookState:
    """Build (and validate) the state for ``method`` without registering anything."""
    settings = _check_config(method, config)
    if method in ALLREDUCE_METHODS:
        check_no_settings(method, settings)
        return TailHookState(method, model, process_group=process_group)
    if method == POWERSGD_METHOD:
        ps = make_powersgd_state(settings, process_group)
        return TailHookState(method, model, settings=settings, powersgd=ps, process_group=process_group)
    compressor_settings, gate = split_gate_settings(settings)
    compressor = make_compressor(method, **compressor_settings)
    return TailHookState(
        method, model, settings=settings, compressor=compressor, process_group=process_group, gate=gate
    )


def hook_for(method: str) -> Hook:
    if method in ALLREDUCE_METHODS:
        return allreduce_peer_hook
    if method == POWERSGD_METHOD:
        return powersgd_peer_hook
    if method in COMPRESSOR_METHODS:
        return tail_hook
    raise ConfigError(f"unknown compression method {method!r}; choose one of {list(METHODS)}")


def register_tail_hook(
    ddp_model: nn.parallel.DistributedDataParallel | None,
    method: str = "tail",
    config: Mapping[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
    *,
    model: nn.Module | None = None,
) -> TailHookState:
    """Register the comm hook of ``method`` on ``ddp_model``; return its state.

    ``method``: "none" (fp32 all-reduce), "fp16", "bf16" (PyTorch's cast hooks), "powersgd"
    (PyTorch's PowerSGD; config: rank, start_powerSGD_iter, ...), "qsgd", "topk", "tail"
    (config passed to ``make_compressor``). ``process_group`` None means the default group.

    qsgd / topk / tail also take the link-aware switch's settings in ``config``:
    ``link_aware`` (default true: a step goes by plain all-reduce while that is measured to be
    faster, see tail_ray/collective/gate.py) and ``link_trial_steps``,
    ``link_recheck_every_steps``, ``link_max_recheck_every_steps``, ``link_warmup_steps``,
    ``link_abort_ratio``.

    World size 1 (no DDP wrapper): ``register_tail_hook(None, method, config, model=module)``
    registers nothing and returns the state for ``compress_gradients_locally`` (the same as
    ``make_hook_state(module, method, config)``).
    """
    if ddp_model is None and model is not None:
        return make_hook_state(model, method, config, process_group)
    if not isinstance(ddp_model, nn.parallel.DistributedDataParallel):
        raise ConfigError(
            f"register_tail_hook needs a DistributedDataParallel model, got {type(ddp_model).__name__}; "
            "with one worker use make_hook_state + compress_gradients_locally"
        )
    state = make_hook_state(ddp_model, method, config, process_group)
    ddp_model.register_comm_hook(state, hook_for(method))
    return state


def compress_gradients_locally(state: TailHookState, model: nn.Module) -> None:
    """World size 1: run the method's compress -> decompress round trip on ``model``'s grads in place.

    Call between ``backward()`` and ``optimizer.step()``. Same semantics (quantization noise,
    error feedback, low-rank approximation) and the same per-layer metrics as with DDP;
    bytes sent and received stay 0 as nothing is communicated.
    """
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    grads = [(n, p.grad) for n, p in module.named_parameters() if p.grad is not None]
    if not grads:
        return
    with torch.no_grad():
        if state.method in ALLREDUCE_METHODS:
            local_cast_round_trip(state, grads)
        elif state.method == POWERSGD_METHOD:
            local_powersgd_round_trip(state, grads)
        else:
            local_round_trip(state, grads)
    state.local_step += 1
