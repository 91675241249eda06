"""Methods none / fp16 / bf16: PyTorch's own all-reduce hooks, with layer names and metrics around them.

Each wrapper calls PyTorch's hook unchanged and only adds what tail-ray needs: per-layer and
traffic metrics. Each issues exactly one collective per bucket from DDP's calling thread, so
the order is the same on every rank and the collective stays asynchronous (overlapping
backward). The payload family's link-aware switch sends its plain steps through
``cast_allreduce`` too.

Traffic of all-reduce is counted with the ring model (transport.ring_allreduce_bytes):
2*(W-1)/W of the reduced tensor's bytes sent by each rank, and as many received.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's
# annotations with dist.GradBucket / Future[Tensor] objects, not strings.

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from tail_ray.collective.state import Group, HookState, Settings
from tail_ray.collective.topology import NodeLayout
from tail_ray.collective.transport import ring_allreduce_bytes
from tail_ray.compression.stats import LayerStats
from tail_ray.errors import ConfigError
from tail_ray.methods import Method
from tail_ray.settings import NoSettings, settings_from_mapping

TorchHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass(frozen=True)
class Cast:
    """How one all-reduce method sends a bucket: PyTorch's hook, the wire dtype and its name."""

    torch_hook: TorchHook
    dtype: torch.dtype
    code: str  # LayerStats.code of its layers

    @property
    def bits(self) -> int:
        return torch.finfo(self.dtype).bits


CASTS: dict[Method, Cast] = {
    Method.NONE: Cast(default_hooks.allreduce_hook, torch.float32, "fp32"),
    Method.FP16: Cast(default_hooks.fp16_compress_hook, torch.float16, "fp16"),
    Method.BF16: Cast(default_hooks.bf16_compress_hook, torch.bfloat16, "bf16"),
}


class AllReduceState(HookState):
    """State of none / fp16 / bf16: names, group and metrics only (PyTorch's hooks keep none)."""

    def __init__(
        self, method: Method | str, model: nn.Module, *, process_group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__(method, model, process_group=process_group)
        if self.method not in CASTS:
            raise ConfigError(f"method {self.method.value!r} is not an all-reduce method; use {list(CASTS)}")

    @classmethod
    def from_settings(
        cls,
        method: Method,
        model: nn.Module,
        settings: Settings,
        group: Group,
        *,
        layout: NodeLayout | None = None,
    ) -> Self:
        settings_from_mapping(NoSettings, settings, what=f"method {method.value!r}")
        return cls(method, model, process_group=group)

    @property
    def cast(self) -> Cast:
        return CASTS[self.method]


def _cast_error(g: torch.Tensor, dtype: torch.dtype, world_size: int) -> float:
    """Relative squared error of the cast the hook applies to this rank's share (g / W)."""
    if dtype == torch.float32:
        return 0.0
    share = g.detach() / world_size
    norm = float(share.pow(2).sum())
    if norm == 0.0:
        return 0.0
    return float((share.to(dtype).to(share.dtype) - share).pow(2).sum()) / norm


def _cast_stats(name: str, g: torch.Tensor, cast: Cast, rel_error: float, code: str) -> LayerStats:
    n = g.numel()
    return LayerStats(name, n, cast.bits, 1.0, 4 * n, n * cast.bits // 8, rel_error, code)


def _record_comm_time(
    state: HookState, start: float
) -> Callable[[torch.futures.Future[torch.Tensor]], torch.Tensor]:
    def record(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        state.metrics.add(comm_s=time.perf_counter() - start)
        return fut.value()

    return record


def cast_allreduce(
    state: HookState, bucket: dist.GradBucket, cast: Cast, code: str
) -> torch.futures.Future[torch.Tensor]:
    """One asynchronous all-reduce of ``bucket`` sent as ``cast``, with its metrics; ``code``
    names it in the per-layer records (the link-aware switch uses "allreduce" so a plain step
    of a compressing method is told apart from method none)."""
    world_size = state.world_size
    layers = [
        _cast_stats(name, g, cast, _cast_error(g, cast.dtype, world_size), code)
        for name, g in state.bucket_layers(bucket).items()
    ]
    moved = ring_allreduce_bytes(bucket.buffer().numel() * cast.bits // 8, world_size)
    start = time.perf_counter()
    fut = cast.torch_hook(state.group, bucket)
    state.metrics.add(layers=layers, bytes_sent=moved, bytes_received=moved, exchanges=1)
    return fut.then(_record_comm_time(state, start))


def cast_allreduce_hook(state: AllReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """none / fp16 / bf16: PyTorch's own hook, with layer metrics and comm time recorded."""
    return cast_allreduce(state, bucket, state.cast, state.cast.code)


def local_cast_round_trip(state: AllReduceState, grads: list[tuple[str, torch.Tensor]]) -> None:
    """World size 1: the cast and back, in place, with the same metrics (nothing sent)."""
    cast = state.cast
    layers = []
    start = time.perf_counter()
    for name, g in grads:
        err = _cast_error(g, cast.dtype, 1)
        if cast.dtype != torch.float32:
            g.copy_(g.to(cast.dtype).to(g.dtype))
        layers.append(_cast_stats(name, g, cast, err, cast.code))
    state.metrics.add(layers=layers, compress_s=time.perf_counter() - start)
