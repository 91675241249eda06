"""The comm hook's state: method, compressor, layer names, and per-step metric accumulators.

Like PyTorch's ``PowerSGDState`` it validates in its constructor and drops the process
group when pickled. Unlike it, everything checkpointable is keyed by parameter NAME, never
by DDP bucket index: DDP rebuilds its buckets after the first step, and a resized job gets
different buckets altogether.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tail_ray.collective.gate import LinkGate, LinkGateConfig, Mode
from tail_ray.compression.base import Compressor
from tail_ray.compression.stats import LayerStats
from tail_ray.errors import ConfigError

logger = logging.getLogger(__name__)

STATE_VERSION = 1

ALLREDUCE_METHODS = ("none", "fp16", "bf16")
POWERSGD_METHOD = "powersgd"
COMPRESSOR_METHODS = ("qsgd", "topk", "tail")
METHODS = (*ALLREDUCE_METHODS, POWERSGD_METHOD, *COMPRESSOR_METHODS)


@dataclass(frozen=True)
class HookStepMetrics:
    """What the hook did during one optimizer step on this rank.

    ``layers``: one record per layer (parameter) communicated this step. ``bytes_sent`` /
    ``bytes_received``: bytes this rank handed to / got from the collectives (see
    docs/collective.md for how all-gather and all-reduce traffic is counted). ``raw_bytes``:
    fp32 size of every gradient communicated. Times are wall seconds summed over buckets.
    """

    layers: list[LayerStats] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    raw_bytes: int = 0
    compress_s: float = 0.0
    decode_s: float = 0.0
    comm_s: float = 0.0
    exchanges: int = 0  # bucket exchanges (one per DDP bucket per step; 0 with world size 1)

    @property
    def encoded_bytes(self) -> int:
        """This rank's own encoded gradient bytes (before padding and size words)."""
        return sum(layer.encoded_bytes for layer in self.layers)

    @property
    def ratio(self) -> float:
        """Traffic reduction against sending fp32 gradients as they are."""
        return self.raw_bytes / self.bytes_sent if self.bytes_sent else float("inf")


class _Accumulator:
    """Per-step sums. Async all-reduce callbacks add comm time from another thread: hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.layers: list[LayerStats] = []
        self.bytes_sent = 0
        self.bytes_received = 0
        self.raw_bytes = 0
        self.compress_s = 0.0
        self.decode_s = 0.0
        self.comm_s = 0.0
        self.exchanges = 0

    def add(
        self,
        *,
        layers: Iterable[LayerStats] = (),
        bytes_sent: int = 0,
        bytes_received: int = 0,
        compress_s: float = 0.0,
        decode_s: float = 0.0,
        comm_s: float = 0.0,
        exchanges: int = 0,
    ) -> None:
        layers = list(layers)
        with self._lock:
            self.layers.extend(layers)
            self.raw_bytes += sum(layer.raw_bytes for layer in layers)
            self.bytes_sent += bytes_sent
            self.bytes_received += bytes_received
            self.compress_s += compress_s
            self.decode_s += decode_s
            self.comm_s += comm_s
            self.exchanges += exchanges

    def drain(self) -> HookStepMetrics:
        with self._lock:
            out = HookStepMetrics(
                layers=self.layers,
                bytes_sent=self.bytes_sent,
                bytes_received=self.bytes_received,
                raw_bytes=self.raw_bytes,
                compress_s=self.compress_s,
                decode_s=self.decode_s,
                comm_s=self.comm_s,
                exchanges=self.exchanges,
            )
            self._reset()
        return out


def _unwrap(model: nn.Module) -> nn.Module:
    # DistributedDataParallel (and Ray's prepare_model output) keep the user model in .module.
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


class TailHookState:
    """State of one registered hook (see ``register_tail_hook``).

    ``compressor`` is set for the methods that all-gather payloads (qsgd, topk, tail);
    ``powersgd`` holds PyTorch's ``PowerSGDState`` for method "powersgd"; all-reduce
    methods (none, fp16, bf16) keep neither. ``process_group`` None means the default group.
    """

    def __init__(
        self,
        method: str,
        model: nn.Module,
        *,
        settings: Mapping[str, Any] | None = None,
        compressor: Compressor | None = None,
        powersgd: Any = None,
        process_group: dist.ProcessGroup | None = None,
        gate: LinkGateConfig | None = None,
    ) -> None:
        if method not in METHODS:
            raise ConfigError(f"unknown compression method {method!r}; choose one of {list(METHODS)}")
        if (compressor is not None) != (method in COMPRESSOR_METHODS):
            raise ConfigError(
                f"method {method!r} {'needs' if method in COMPRESSOR_METHODS else 'takes no'} compressor; "
                "build the state with register_tail_hook / make_hook_state"
            )
        if (powersgd is not None) != (method == POWERSGD_METHOD):
            raise ConfigError(f"method {method!r}: a PowerSGDState is needed exactly for 'powersgd'")
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.method = method
        self.settings: dict[str, Any] = dict(settings or {})
        self.compressor = compressor
        self.powersgd = powersgd
        self.process_group = process_group
        # The link-aware switch (payload compressors only): compressed or plain all-reduce,
        # decided per step by measured step time. Not checkpointed: the link is re-measured.
        self.gate_config = gate if gate is not None else LinkGateConfig()
        self.gate = LinkGate(self.gate_config) if compressor is not None else None
        self._step_mode = Mode.COMPRESS
        self._metrics = _Accumulator()
        # Local (world size 1) PowerSGD memory, keyed by parameter name.
        self.local_powersgd_q: dict[str, torch.Tensor] = {}
        self.local_powersgd_error: dict[str, torch.Tensor] = {}
        self.local_step = 0
        self.bind(model)

    # -- layer names ---------------------------------------------------------------------------

    def bind(self, model: nn.Module) -> None:
        """(Re)build the parameter -> name map from ``model`` (a DDP wrapper or the module itself).

        Needed again after unpickling: parameter identities do not survive a process boundary.
        """
        module = _unwrap(model)
        self.param_names: dict[int, str] = {id(p): n for n, p in module.named_parameters()}
        if not self.param_names:
            raise ConfigError("the model has no parameters to communicate")

    def name_of(self, param: torch.Tensor) -> str:
        try:
            return self.param_names[id(param)]
        except KeyError:
            raise ConfigError(
                "a bucket holds a parameter the hook state does not know; build the state from the "
                "same model DDP wraps (or call state.bind(model) after unpickling)"
            ) from None

    # -- the group -----------------------------------------------------------------------------

    @property
    def group(self) -> dist.ProcessGroup:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group) if dist.is_initialized() else 1

    # -- the link-aware switch -----------------------------------------------------------------

    def mode_for_bucket(self, bucket_index: int) -> Mode:
        """The mode of this bucket's exchange. Bucket 0 starts a step: the gate picks the mode
        for the whole step (every bucket of a step goes the same way, on every rank)."""
        if self.gate is None:
            return Mode.COMPRESS
        if bucket_index == 0:
            self._step_mode = self.gate.begin_step(time.perf_counter(), self._agree_max)
        return self._step_mode

    def _agree_max(self, values: Sequence[float]) -> list[float]:
        """Element-wise max over the ranks (the slowest rank's view), so all ranks decide alike."""
        from tail_ray.collective.transport import collective_device

        t = torch.tensor(list(values), dtype=torch.float64, device=collective_device(self.process_group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        return [float(v) for v in t.tolist()]

    # -- metrics -------------------------------------------------------------------------------

    def record(self, **kwargs: Any) -> None:
        """Add one bucket's (or one local round trip's) metrics to this step's sums."""
        self._metrics.add(**kwargs)

    def drain_metrics(self) -> HookStepMetrics:
        """This step's metrics since the last drain; resets the sums. Call once per optimizer step."""
        return self._metrics.drain()

    # -- training signals ----------------------------------------------------------------------

    def set_lr(self, lr: float) -> None:
        """Tell the compressor the learning rate (the controller tightens its budget after a drop)."""
        forward = getattr(self.compressor, "set_lr", None)
        if callable(forward):
            forward(float(lr))

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state keyed by parameter name (never by bucket index).

        For "powersgd" only the step counter is kept: PyTorch keys PowerSGD's error-feedback
        and warm-start memory by bucket index, which a rebuilt or resized job does not share,
        so after a restore they start from zero (as at PowerSGD's own start).
        """
        out: dict[str, Any] = {"version": STATE_VERSION, "method": self.method}
        if self.compressor is not None:
            out["compressor"] = self.compressor.state_dict()
        if self.powersgd is not None:
            out["powersgd_iter"] = int(self.powersgd.iter)
        out["local_step"] = self.local_step
        out["local_powersgd_error"] = {k: v.clone() for k, v in self.local_powersgd_error.items()}
        out["local_powersgd_q"] = {k: v.clone() for k, v in self.local_powersgd_q.items()}
        return out

    def load_state_dict(self, state: Mapping[str, Any], *, residuals: bool = True) -> None:
        """Restore from ``state_dict()``, matching layers by parameter name.

        ``residuals=False`` (for a resized job): error-feedback residuals are per worker and
        start from zero; the controller's per-layer state is still restored.
        """
        if not isinstance(state, Mapping) or "method" not in state:
            raise ConfigError("not a TailHookState checkpoint: expected a mapping from state_dict()")
        if state.get("version") != STATE_VERSION:
            raise ConfigError(
                f"hook state version {state.get('version')!r}, this build reads {STATE_VERSION}"
            )
        if state["method"] != self.method:
            raise ConfigError(
                f"checkpoint was written by method {state['method']!r} but this hook runs "
                f"{self.method!r}; register the hook with the checkpoint's method"
            )
        if self.compressor is not None:
            if residuals:
                self.compressor.load_state_dict(state["compressor"])
            else:
                # A compressor that can keep its other state (Tail's controller) while dropping
                # residuals says so with a `residuals` keyword; qsgd/topk keep only residuals.
                loader = self.compressor.load_state_dict
                if "residuals" in inspect.signature(loader).parameters:
                    loader(state["compressor"], residuals=False)  # type: ignore[call-arg]
        if self.powersgd is not None:
            self.powersgd.iter = int(state["powersgd_iter"])
        self.local_step = int(state["local_step"])
        if not residuals:
            self.local_powersgd_error, self.local_powersgd_q = {}, {}
            return
        self.local_powersgd_error = {k: v.clone() for k, v in state["local_powersgd_error"].items()}
        self.local_powersgd_q = {k: v.clone() for k, v in state["local_powersgd_q"].items()}

    # -- pickling ------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the process group, the lock and the parameter identities.

        The PowerSGDState is flattened to its slots by hand: its own ``__setstate__`` asks for
        the default process group, which a process that only reads a checkpoint lacks.
        """
        out = {
            k: v
            for k, v in self.__dict__.items()
            if k not in ("process_group", "_metrics", "param_names", "gate")
        }
        if self.powersgd is not None:
            out["powersgd"] = {
                slot: getattr(self.powersgd, slot)
                for slot in type(self.powersgd).__slots__
                if slot != "process_group"
            }
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.process_group = None  # the default group; set another one after loading if needed
        self._metrics = _Accumulator()
        # A fresh gate: the link and this process's clock are measured again.
        self.gate_config = state.get("gate_config", LinkGateConfig())
        self.gate = LinkGate(self.gate_config) if self.compressor is not None else None
        self._step_mode = Mode.COMPRESS
        self.param_names = {}  # call bind(model): ids of parameters do not cross processes
        if isinstance(self.powersgd, dict):
            from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

            ps = object.__new__(PowerSGDState)
            ps.process_group = None  # powerSGD_hook falls back to the default group
            for slot, value in self.powersgd.items():
                setattr(ps, slot, value)
            self.powersgd = ps
