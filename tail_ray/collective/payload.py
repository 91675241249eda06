"""Methods qsgd / topk / tail: a pure communicator around a compressor (compress -> exchange -> aggregate).

Per DDP bucket:
    compress   the bucket's gradients, keyed by parameter name, into ONE payload
    exchange   payloads of different sizes between ranks (transport.all_gather_bytes)
    aggregate  the compressor decodes every rank's payload, observes them, and writes the
               mean into the bucket's gradient views (``Compressor.aggregate``)
    record     the step's metrics
and return an already-completed future, which is what DDP waits on. The hook never looks
inside a payload: everything it asks of the compressor is the ``Compressor`` contract
(tail_ray/compression/base.py), so any compressor, on any backend, plugs in here.

Unless plain all-reduce is faster on this link: the link-aware switch (gate.py) times whole
steps in both modes and, while all-reduce wins, sends the step's buckets uncompressed
(asynchronously, like method "none"), with the error-feedback residuals folded in.

Why synchronous: DDP calls bucket hooks in bucket-index order on every rank, from one
thread. If every collective is issued right here, before returning, every rank issues the
same collectives in the same order whatever the timing. Chaining collectives in future
callbacks (as PyTorch's powerSGD_hook does) lets callback threads of different buckets race,
and gloo then pairs mismatched collectives or hangs. The cost is that this bucket's exchange
does not overlap the rest of backward; the payload is small, which is the point.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's
# annotations with dist.GradBucket / Future[Tensor] objects, not strings.

import time
from collections.abc import Mapping, Sequence
from typing import Any, Self

import torch
import torch.distributed as dist
from torch import nn

from tail_ray.collective.allreduce import CASTS, cast_allreduce
from tail_ray.collective.gate import LinkGate, LinkGateConfig, Mode, split_gate_settings
from tail_ray.collective.state import Group, HookState, Settings
from tail_ray.collective.transport import all_gather_bytes, collective_device
from tail_ray.compression.base import Compressor
from tail_ray.compression.registry import make_compressor
from tail_ray.errors import ConfigError
from tail_ray.methods import Method

# A plain step of a compressing method: fp32 all-reduce, recorded as code "allreduce".
_PLAIN = CASTS[Method.NONE]


class PayloadHookState(HookState):
    """State of qsgd / topk / tail: the compressor, and the link-aware switch.

    The switch (``gate``) is not checkpointed: the link is measured again after a restart.
    """

    _TRANSIENT = (*HookState._TRANSIENT, "gate", "_step_mode")

    def __init__(
        self,
        method: Method | str,
        model: nn.Module,
        compressor: Compressor,
        *,
        process_group: dist.ProcessGroup | None = None,
        gate: LinkGateConfig | None = None,
    ) -> None:
        super().__init__(method, model, process_group=process_group)
        if not isinstance(compressor, Compressor):
            raise ConfigError(f"compressor must be a Compressor, got {type(compressor).__name__}")
        self.compressor = compressor
        # The link-aware switch: compressed or plain all-reduce, decided per step by measured
        # step time, the same on every rank.
        self.gate_config = gate if gate is not None else LinkGateConfig()
        self.gate = LinkGate(self.gate_config)
        self._step_mode = Mode.COMPRESS

    @classmethod
    def from_settings(cls, method: Method, model: nn.Module, settings: Settings, group: Group) -> Self:
        compressor_settings, gate = split_gate_settings(dict(settings or {}))
        compressor = make_compressor(method.value, **compressor_settings)
        return cls(method, model, compressor, process_group=group, gate=gate)

    # -- the link-aware switch -------------------------------------------------------------------

    def mode_for_bucket(self, bucket_index: int) -> Mode:
        """The mode of this bucket's exchange. Bucket 0 starts a step: the gate picks the mode
        for the whole step (every bucket of a step goes the same way, on every rank)."""
        if bucket_index == 0:
            self._step_mode = self.gate.begin_step(time.perf_counter(), self._agree_max)
        return self._step_mode

    def _agree_max(self, values: Sequence[float]) -> list[float]:
        """Element-wise max over the ranks (the slowest rank's view), so all ranks decide alike."""
        t = torch.tensor(list(values), dtype=torch.float64, device=collective_device(self.process_group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        return [float(v) for v in t.tolist()]

    # -- training signals and checkpoints ----------------------------------------------------------

    def set_lr(self, lr: float) -> None:
        self.compressor.set_lr(float(lr))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "compressor": self.compressor.state_dict()}

    def _load_family_state(self, state: Mapping[str, Any], *, residuals: bool) -> None:
        self.compressor.load_state_dict(state["compressor"], residuals=residuals)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # A fresh gate: the link and this process's clock are measured again.
        self.gate = LinkGate(self.gate_config)
        self._step_mode = Mode.COMPRESS


def payload_hook(state: PayloadHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook of qsgd / topk / tail; register with ``register_tail_hook``."""
    compressor = state.compressor
    layers = state.bucket_layers(bucket)

    if state.mode_for_bucket(bucket.index()) == Mode.ALLREDUCE:
        # The link is faster than the codec (measured: see gate.py). What error feedback still
        # owes rides along, so the switch loses nothing; the all-reduce stays asynchronous.
        compressor.fold_residuals(layers)
        return cast_allreduce(state, bucket, _PLAIN, "allreduce")

    start = time.perf_counter()
    payload = compressor.compress(layers)
    stats = list(compressor.last_stats)
    compressed = time.perf_counter()

    payloads, traffic = all_gather_bytes(payload, state.process_group, device=bucket.buffer().device)
    exchanged = time.perf_counter()

    compressor.aggregate(payloads, layers, own=dist.get_rank(state.process_group))
    aggregated = time.perf_counter()

    state.metrics.add(
        layers=stats,
        bytes_sent=traffic.bytes_sent,
        bytes_received=traffic.bytes_received,
        compress_s=compressed - start,
        comm_s=exchanged - compressed,
        decode_s=aggregated - exchanged,
        exchanges=1,
    )
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def local_payload_round_trip(state: PayloadHookState, grads: list[tuple[str, torch.Tensor]]) -> None:
    """World size 1: compress -> aggregate of the one payload, in place; the same semantics
    and metrics, no exchange. The payload is decoded as a peer's would be (``own`` not given)."""
    compressor = state.compressor
    layers = dict(grads)
    start = time.perf_counter()
    payload = compressor.compress(layers)
    stats = list(compressor.last_stats)
    compressed = time.perf_counter()
    compressor.aggregate([payload], layers)
    state.metrics.add(layers=stats, compress_s=compressed - start, decode_s=time.perf_counter() - compressed)
