"""The public entry points: method name -> hook state + DDP comm hook, all read from the method table.

    state = register_tail_hook(ddp_model, method="tail", config={...})
    ...  # each step: loss.backward(); optimizer.step(); metrics = state.drain_metrics()

With one worker there is no DDP wrapper (Ray's prepare_model returns the bare module):

    state = make_hook_state(model, method="tail", config={...})
    ...  # each step: loss.backward(); compress_gradients_locally(state, model); optimizer.step()
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tail_ray.collective.methods import Hook, method_spec
from tail_ray.collective.optimizer_watch import watch_optimizer
from tail_ray.collective.state import HookState, unwrap
from tail_ray.collective.topology import NodeLayout
from tail_ray.errors import ConfigError
from tail_ray.methods import Method


def make_hook_state(
    model: nn.Module,
    method: Method | str = Method.TAIL,
    config: Mapping[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
    *,
    layout: NodeLayout | None = None,
) -> HookState:
    """Build (and validate) the state for ``method`` without registering anything."""
    spec = method_spec(method)
    if config is not None and not isinstance(config, Mapping):
        raise ConfigError(
            f"config must be a mapping of settings for {spec.method.value!r}, got {type(config).__name__}"
        )
    state = spec.make_state(model, config, process_group, layout=layout)
    return state


def hook_for(method: Method | str) -> Hook:
    """The DDP comm hook of ``method`` (its state comes from ``make_hook_state``)."""
    return method_spec(method).hook


def register_tail_hook(
    ddp_model: nn.parallel.DistributedDataParallel | None,
    method: Method | str = Method.TAIL,
    config: Mapping[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
    *,
    model: nn.Module | None = None,
    layout: NodeLayout | None = None,
) -> HookState:
    """Register the comm hook of ``method`` on ``ddp_model``; return its state.

    ``method``: "none" (fp32 all-reduce), "fp16", "bf16" (PyTorch's cast hooks), "powersgd"
    (PyTorch's PowerSGD; config: rank, start_powerSGD_iter, ...), "qsgd", "topk", "tail"
    (config: the compressor's settings, see ``make_compressor``). ``process_group`` None
    means the default group.

    qsgd / topk / tail also take, in ``config``, the collective: ``collective`` ("auto"
    (default), "allgather", "sharded", "hierarchical"; see tail_ray/collective/choice.py) and
    ``shard_min_numel`` (smallest slice of a layer the sharded collectives cut), and the
    link-aware switch's settings:
    ``link_aware`` (default true: a step goes by plain all-reduce while that is measured to be
    faster, see tail_ray/collective/gate.py) and ``link_trial_steps``,
    ``link_recheck_every_steps``, ``link_max_recheck_every_steps``, ``link_warmup_steps``,
    ``link_abort_ratio``.

    ``layout``: this rank's node layout (node rank, local rank, local world size) as the
    launcher placed it: needed by ``collective="hierarchical"`` and used by "auto". Without
    one, ``NodeLayout.from_env()`` reads torchrun's variables when they are set.

    World size 1 (no DDP wrapper): ``register_tail_hook(None, method, config, model=module)``
    registers no comm hook and returns the state for ``compress_gradients_locally`` (as
    ``make_hook_state(module, method, config)`` does).

    Either way the state learns the optimizer at its first step (optimizer_watch.py: SGD gets
    Tail's looser budget and low-rank layers), unless ``state.set_optimizer`` says it first.
    """
    if layout is None:
        layout = NodeLayout.from_env()
    if ddp_model is None and model is not None:
        state = make_hook_state(model, method, config, process_group, layout=layout)
        watch_optimizer(state, model)
        return state
    if not isinstance(ddp_model, nn.parallel.DistributedDataParallel):
        raise ConfigError(
            f"register_tail_hook needs a DistributedDataParallel model, got {type(ddp_model).__name__}; "
            "with one worker use make_hook_state + compress_gradients_locally"
        )
    state = make_hook_state(ddp_model, method, config, process_group, layout=layout)
    ddp_model.register_comm_hook(state, hook_for(state.method))
    watch_optimizer(state, ddp_model)  # tells it the optimizer at its first step, unless you do
    return state


def compress_gradients_locally(state: HookState, model: nn.Module) -> None:
    """World size 1: run the method's compress -> decompress round trip on ``model``'s grads in place.

    Call between ``backward()`` and ``optimizer.step()``. Same semantics (quantization noise,
    error feedback, low-rank approximation) and the same per-layer metrics as with DDP;
    bytes sent and received stay 0 as nothing is communicated.
    """
    grads = [(n, p.grad) for n, p in unwrap(model).named_parameters() if p.grad is not None]
    if not grads:
        return
    with torch.no_grad():
        method_spec(state.method).local_round_trip(state, grads)
    state.local_step += 1
