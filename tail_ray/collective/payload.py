"""Methods qsgd / topk / tail: a pure communicator around a compressor (compress -> exchange -> aggregate).

Per DDP bucket, a compressed step runs the job's collective (``collective`` setting, see
choice.py) through the ``Compressor`` contract (tail_ray/compression/base.py) only:

    allgather     compress ONE payload; all-gather (transport.all_gather_bytes); the
                  compressor decodes every rank's payload and writes the mean into the
                  bucket's gradient views (``Compressor.aggregate``)      exchange.py
    sharded       compress_shards -> all-to-all -> owner aggregates + second stage
                  re-compresses -> all-to-all of the sums -> every rank decodes  sharded.py
    hierarchical  plain mean inside the node, sharded across nodes      hierarchical.py

then records the step's metrics and returns an already-completed future, which is what DDP
waits on. The hook never looks inside a payload, so any compressor, on any backend, plugs in.

Unless plain all-reduce is faster on this link: the link-aware switch (gate.py) times whole
steps in both modes and, while all-reduce wins, sends the step's buckets uncompressed
(asynchronously, like method "none"), with what error feedback owes folded in.

Why synchronous: DDP calls bucket hooks in bucket-index order on every rank, from one
thread. If every collective is issued right here, before returning, every rank issues the
same collectives in the same order whatever the timing. Chaining collectives in future
callbacks (as PyTorch's powerSGD_hook does) lets callback threads of different buckets race,
and gloo then pairs mismatched collectives or hangs. The cost is that this bucket's exchange
does not overlap the rest of backward; the payload is small, which is the point.

Resize: a checkpoint of every rank says what its error feedback still owed the job's mean
(``Exchange.owed_parts``); a job restored on another number of workers sums that over the
old ranks and adds it into the first gradients it sends (``load_resized``), whatever
collective the new job runs.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's
# annotations with dist.GradBucket / Future[Tensor] objects, not strings.

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Self

import torch
import torch.distributed as dist
from torch import nn

from tail_ray.collective.allreduce import CASTS, cast_allreduce
from tail_ray.collective.choice import Collective, resolve
from tail_ray.collective.exchange import MAIN, AllGatherExchange, Exchange
from tail_ray.collective.gate import LinkGate, LinkGateConfig, Mode, split_gate_settings
from tail_ray.collective.hierarchical import HierarchicalExchange
from tail_ray.collective.sharded import ShardedExchange
from tail_ray.collective.shards import MIN_SLICE_NUMEL
from tail_ray.collective.state import Group, HookState, Settings
from tail_ray.collective.topology import NodeLayout
from tail_ray.collective.transport import collective_device
from tail_ray.compression.base import Compressor
from tail_ray.compression.registry import make_compressor
from tail_ray.errors import ConfigError
from tail_ray.methods import Method

log = logging.getLogger(__name__)

# A plain step of a compressing method: fp32 all-reduce, recorded as code "allreduce".
_PLAIN = CASTS[Method.NONE]


class PayloadHookState(HookState):
    """State of qsgd / topk / tail: the compressor, the collective, and the link-aware switch.

    ``collective``: "allgather" | "sharded" | "hierarchical" | "auto" (see choice.py), resolved
    here from the group's size and ``layout`` (the node layout; needed for "hierarchical").
    The switch (``gate``) is not checkpointed: the link is measured again after a restart.
    """

    _TRANSIENT = (*HookState._TRANSIENT, "gate", "_step_mode", "exchange")

    def __init__(
        self,
        method: Method | str,
        model: nn.Module,
        compressor: Compressor,
        *,
        process_group: dist.ProcessGroup | None = None,
        gate: LinkGateConfig | None = None,
        collective: Collective | str = Collective.AUTO,
        layout: NodeLayout | None = None,
        shard_min_numel: int = MIN_SLICE_NUMEL,
    ) -> None:
        super().__init__(method, model, process_group=process_group)
        if not isinstance(compressor, Compressor):
            raise ConfigError(f"compressor must be a Compressor, got {type(compressor).__name__}")
        if not isinstance(shard_min_numel, int) or isinstance(shard_min_numel, bool) or shard_min_numel < 1:
            raise ConfigError(f"shard_min_numel must be an integer >= 1, got {shard_min_numel!r}")
        if layout is not None and not isinstance(layout, NodeLayout):
            raise ConfigError(f"layout must be a NodeLayout, got {type(layout).__name__}")
        self._compressor = compressor
        self.requested_collective = Collective.parse(collective)
        self.layout = layout
        self.shard_min_numel = shard_min_numel
        self.collective = resolve(
            self.requested_collective,
            world_size=self.world_size,
            layout=layout,
            shardable=compressor.shardable,
        )
        self.exchange = self._make_exchange()
        # The link-aware switch: compressed or plain all-reduce, decided per step by measured
        # step time, the same on every rank.
        self.gate_config = gate if gate is not None else LinkGateConfig()
        self.gate = LinkGate(self.gate_config)
        self._step_mode = Mode.COMPRESS
        # What a resized job's old ranks owed the mean, added into the first gradients sent.
        self._carried: dict[str, torch.Tensor] = {}

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
        rest, gate = split_gate_settings(dict(settings or {}))
        # Beside the compressor's settings and the gate's link_*: the collective's two.
        collective = rest.pop("collective", Collective.AUTO)
        shard_min_numel = rest.pop("shard_min_numel", MIN_SLICE_NUMEL)
        compressor = make_compressor(method.value, **rest)
        return cls(
            method,
            model,
            compressor,
            process_group=group,
            gate=gate,
            collective=collective,  # type: ignore[arg-type]
            layout=layout,
            shard_min_numel=shard_min_numel,  # type: ignore[arg-type]
        )

    @property
    def compressor(self) -> Compressor:
        """The compressor every exchange of this state drives (stage one of a sharded one)."""
        return self._compressor

    @compressor.setter
    def compressor(self, compressor: Compressor) -> None:
        # A new compressor means a new exchange around it (a second stage starts afresh).
        self._compressor = compressor
        self.exchange = self._make_exchange()

    def _make_exchange(self) -> Exchange:
        # The layouts are cut from the whole model (its parameters in order), never per bucket.
        layers = list(self.param_numel.items())
        if self.collective == Collective.SHARDED:
            return ShardedExchange(
                self.compressor, self.process_group, model_layers=layers, min_slice_numel=self.shard_min_numel
            )
        if self.collective == Collective.HIERARCHICAL:
            assert self.layout is not None  # resolve() refused hierarchical without one
            return HierarchicalExchange(
                self.compressor,
                self.process_group,
                self.layout,
                model_layers=layers,
                min_slice_numel=self.shard_min_numel,
            )
        return AllGatherExchange(self.compressor, self.process_group)

    def compressors(self) -> dict[str, Compressor]:
        """Every compressor of this state by role: ``MAIN`` and the exchange's own."""
        return {MAIN: self.compressor, **self.exchange.compressors()}

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
        for compressor in self.compressors().values():
            compressor.set_lr(float(lr))

    def apply_linear_optimizer(self, linear: bool) -> None:
        for compressor in self.compressors().values():
            compressor.set_linear_optimizer(bool(linear))

    def state_dict(self) -> dict[str, Any]:
        """The compressor's state; the collective's own compressors (a second stage) by role;
        and, for a resize, what each compressor's residuals are worth to the mean."""
        world = self.world_size
        return {
            **super().state_dict(),
            "compressor": self.compressor.state_dict(),
            "world_size": world,
            "collective": self.exchange.name,
            "stages": {role: c.state_dict() for role, c in self.exchange.compressors().items()},
            "owed": {
                role: {"offsets": offsets, "weight": weight}
                for role, (offsets, weight) in self.exchange.owed_parts(world).items()
            },
        }

    def _load_family_state(self, state: Mapping[str, Any], *, residuals: bool) -> None:
        self.compressor.load_state_dict(state["compressor"], residuals=residuals)
        stages = state.get("stages", {})
        same = state.get("collective", AllGatherExchange.name) == self.exchange.name
        for role, compressor in self.exchange.compressors().items():
            if role in stages and same:
                compressor.load_state_dict(stages[role], residuals=residuals)

    def load_resized(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Restore from the states EVERY rank of a job of another size saved (rank order).

        The controller and counters come from rank 0's (as ``load_state_dict(residuals=False)``).
        The residuals of every old rank and stage are summed, each placed at its offset in its
        layer and weighted by what it owed the old mean (``Exchange.owed_parts``), into one
        tensor per layer: what the old job's mean was still owed. Every new rank adds it to the
        first gradient it sends, so the new mean gets it exactly once; the new collective's
        compressors start with no residuals.
        """
        if not states:
            raise ConfigError("load_resized needs the state of at least one old rank")
        self.load_state_dict(states[0], residuals=False)
        numel = self.param_numel
        owed: dict[str, torch.Tensor] = {}
        for old in states:
            parts = old.get("owed")
            if parts is None:  # written before owed parts existed: mean of stage one only
                parts = {MAIN: {"offsets": {}, "weight": 1.0 / max(len(states), 1)}}
            for role, part in parts.items():
                sd = old["compressor"] if role == MAIN else old.get("stages", {}).get(role)
                if sd is None:
                    continue
                for name, residual in self.compressor.residuals_of(sd).items():
                    if name not in numel:
                        continue
                    start = int(part["offsets"].get(name, 0))
                    flat = residual.to(torch.float32).reshape(-1)
                    if start + flat.numel() > numel[name]:
                        log.warning("resize: residual of %r does not fit its layer; dropped", name)
                        continue
                    into = owed.setdefault(name, torch.zeros(numel[name], dtype=torch.float32))
                    # mul, then add: add_(alpha=) fuses them on AVX2 CPUs only (see fold_scaled)
                    into[start : start + flat.numel()].add_(flat.mul(float(part["weight"])))
        self._carried = {name: t for name, t in owed.items() if bool(t.any())}
        log.info(
            "resize: carrying what %d old ranks owed the mean on %d layers", len(states), len(self._carried)
        )

    @property
    def carried(self) -> dict[str, torch.Tensor]:
        """What a resize still has to add into the next gradients (flat, by layer); empty after."""
        return dict(self._carried)

    def carry_into(self, layers: Mapping[str, torch.Tensor]) -> None:
        """Add what a resized job's old ranks owed the mean into these gradients (once)."""
        if not self._carried:
            return
        for name, g in layers.items():
            owed = self._carried.pop(name, None)
            if owed is not None and owed.numel() == g.numel():
                g.add_(owed.to(device=g.device, dtype=g.dtype).view(g.shape))

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # A fresh gate: the link and this process's clock are measured again. A fresh
        # exchange on the default group (its second stage's residuals do not travel).
        self.gate = LinkGate(self.gate_config)
        self._step_mode = Mode.COMPRESS
        self.exchange = self._make_exchange()


def payload_hook(state: PayloadHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook of qsgd / topk / tail; register with ``register_tail_hook``."""
    layers = state.bucket_layers(bucket)
    state.carry_into(layers)

    if state.mode_for_bucket(bucket.index()) == Mode.ALLREDUCE:
        # The link is faster than the codec (measured: see gate.py). What error feedback still
        # owes rides along, so the switch loses nothing; the all-reduce stays asynchronous.
        state.exchange.fold(layers, state.world_size)
        return cast_allreduce(state, bucket, _PLAIN, "allreduce")

    report = state.exchange.run(layers, bucket.buffer())
    state.metrics.add(
        layers=report.stats,
        stage_two=report.stage_two,
        bytes_sent=report.bytes_sent,
        bytes_received=report.bytes_received,
        compress_s=report.compress_s,
        comm_s=report.comm_s,
        decode_s=report.decode_s,
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
    state.carry_into(layers)
    start = time.perf_counter()
    payload = compressor.compress(layers)
    stats = list(compressor.last_stats)
    compressed = time.perf_counter()
    compressor.aggregate([payload], layers)
    state.metrics.add(layers=stats, compress_s=compressed - start, decode_s=time.perf_counter() - compressed)
