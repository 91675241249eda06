"""The method table: for every ``Method``, its hook state, DDP comm hook, local round trip and settings.

One entry per method, three families:

    family       methods            state class          hook                 world size 1
    all-reduce   none, fp16, bf16   AllReduceState       cast_allreduce_hook  local_cast_round_trip
    powersgd     powersgd           PowerSGDHookState    powersgd_hook        local_powersgd_round_trip
    payload      qsgd, topk, tail   PayloadHookState     payload_hook         local_payload_round_trip

register.py builds states and registers hooks from this table only; the runner (seeded
settings), jobs and the docs read it too. A new method is one entry here (and one name in
``tail_ray.methods.Method``); an import-time check keeps the two complete.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tail_ray.collective.allreduce import AllReduceState, cast_allreduce_hook, local_cast_round_trip
from tail_ray.collective.payload import PayloadHookState, local_payload_round_trip, payload_hook
from tail_ray.collective.powersgd import (
    PowerSGDHookState,
    PowerSGDSettings,
    local_powersgd_round_trip,
    powersgd_hook,
)
from tail_ray.collective.state import Group, HookState, Settings
from tail_ray.collective.topology import NodeLayout
from tail_ray.compression.registry import compressor_entry
from tail_ray.methods import Method
from tail_ray.settings import NoSettings, setting_names

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
LocalRoundTrip = Callable[[Any, list[tuple[str, torch.Tensor]]], None]


@dataclass(frozen=True)
class MethodSpec:
    """What running one method takes. ``settings`` is the frozen dataclass its ``config`` keys
    build (payload methods also take the link-aware switch's ``link_*`` keys)."""

    method: Method
    summary: str  # one line: what runs (docs, --help)
    state: type[HookState]  # the family's state class; its from_settings builds one
    hook: Hook
    local_round_trip: LocalRoundTrip
    settings: type[Any]

    def make_state(
        self, model: nn.Module, settings: Settings, group: Group, *, layout: NodeLayout | None = None
    ) -> HookState:
        """A validated state for this method (the state factory)."""
        return self.state.from_settings(self.method, model, settings, group, layout=layout)

    @property
    def exchanges_payloads(self) -> bool:
        """True for the payload family (compressor + all-gather + the link-aware switch)."""
        return issubclass(self.state, PayloadHookState)

    @property
    def seeded(self) -> bool:
        """Whether the method's settings take a stochastic-rounding ``seed``."""
        return "seed" in setting_names(self.settings)


def _all_reduce(method: Method, summary: str) -> MethodSpec:
    return MethodSpec(method, summary, AllReduceState, cast_allreduce_hook, local_cast_round_trip, NoSettings)


def _payload(method: Method, summary: str) -> MethodSpec:
    return MethodSpec(
        method,
        summary,
        PayloadHookState,
        payload_hook,
        local_payload_round_trip,
        compressor_entry(method.value).settings,
    )


METHOD_SPECS: Mapping[Method, MethodSpec] = {
    spec.method: spec
    for spec in (
        _all_reduce(Method.NONE, "PyTorch allreduce_hook: fp32 all-reduce, = plain DDP"),
        _all_reduce(Method.FP16, "PyTorch fp16_compress_hook"),
        _all_reduce(Method.BF16, "PyTorch bf16_compress_hook"),
        MethodSpec(
            Method.POWERSGD,
            "PyTorch PowerSGDState + powerSGD_hook, serialised",
            PowerSGDHookState,
            powersgd_hook,
            local_powersgd_round_trip,
            PowerSGDSettings,
        ),
        _payload(Method.QSGD, "fixed-bit stochastic quantization, compressed collective"),
        _payload(Method.TOPK, "top-k sparsification with error feedback, compressed collective"),
        _payload(
            Method.TAIL, "Tail: automatic bits per layer, sparse + entropy coding, compressed collective"
        ),
    )
}

_missing = [m.value for m in Method if m not in METHOD_SPECS]
if _missing:  # a Method without a spec would fail only when a job picks it: fail at import instead
    raise ImportError(f"tail_ray.collective.methods: no MethodSpec for {_missing}")


def method_spec(method: Method | str) -> MethodSpec:
    """The spec of ``method``; an unknown name is a ``ConfigError`` listing the methods."""
    return METHOD_SPECS[Method.parse(method)]
