"""HookState: what every method family's comm-hook state shares (names, group, metrics, checkpoints).

There is one state class per method family, each next to its hook:
``allreduce.AllReduceState`` (none / fp16 / bf16), ``powersgd.PowerSGDHookState`` (powersgd)
and ``payload.PayloadHookState`` (qsgd / topk / tail). ``methods.METHOD_SPECS`` says which
method uses which.

Like PyTorch's ``PowerSGDState`` a state validates in its constructor and drops the process
group when pickled. Unlike it, everything checkpointable is keyed by parameter NAME, never by
DDP bucket index: DDP rebuilds its buckets after the first step, and a resized job gets
different buckets altogether.

Checkpoint layout (``state_dict``), version 2: ``{"version", "method", "local_step"}`` plus the
family's keys. Version 1 (one state class for every method) wrote every family's keys into
every checkpoint; it loads unchanged, each family reading only its own keys.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Self

import torch
import torch.distributed as dist
from torch import nn

from tail_ray.collective.metrics import HookStepMetrics, StepMetricsAccumulator
from tail_ray.collective.topology import NodeLayout
from tail_ray.errors import ConfigError
from tail_ray.methods import Method

STATE_VERSION = 2
READABLE_STATE_VERSIONS = (1, 2)

# A method's settings as the user gave them (the job's ``compression`` block), and the process
# group a hook communicates in (None: the default group).
Settings = Mapping[str, Any] | None
Group = dist.ProcessGroup | None


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (Ray's prepare_model output keeps it in .module)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def linear_in_gradient(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s step is linear in the gradient: torch.optim.SGD (momentum,
    Nesterov, weight decay, maximize: all linear in it), and subclasses that keep its ``step``.
    Anything else (Adam, AdamW, RMSprop, Adagrad, a user's own class, an SGD subclass with its
    own step such as sign-SGD or LARS) counts as adaptive, the cautious answer: its budget stays
    the tighter one (bitwidth/policy.py)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    # torch wraps ``step`` per class (profiling, no_grad); unwrapped, an inherited step is SGD's.
    return inspect.unwrap(type(optimizer).step) is inspect.unwrap(torch.optim.SGD.step)


class HookState:
    """State of one registered hook (see ``register_tail_hook``): the base of every family.

    ``process_group`` None means the default group. ``metrics`` sums what the hook did this
    step (``drain_metrics`` once per optimizer step). ``local_step`` counts world-size-1
    round trips (``compress_gradients_locally``).
    """

    # Attributes that do not survive pickling (a process boundary): rebuilt by __setstate__.
    _TRANSIENT: tuple[str, ...] = ("process_group", "metrics", "param_names")

    def __init__(
        self, method: Method | str, model: nn.Module, *, process_group: dist.ProcessGroup | None = None
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.method = Method.parse(method)
        self.process_group = process_group
        self.metrics = StepMetricsAccumulator()
        self.local_step = 0
        # Whether the optimizer was named (set_optimizer / set_linear_optimizer): the watch
        # (optimizer_watch.py) then steps back.
        self.optimizer_named = False
        self.bind(model)

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
        """A validated state for ``method`` from its settings mapping (the job's ``compression``
        block): each family's factory, which ``MethodSpec.make_state`` calls. ``layout``: this
        rank's node layout, for collectives that use it (payload methods' hierarchical one)."""
        raise NotImplementedError(f"{cls.__name__} is not a method family's state")

    # -- layer names ---------------------------------------------------------------------------

    def bind(self, model: nn.Module) -> None:
        """(Re)build the parameter -> name map from ``model`` (a DDP wrapper or the module itself).

        Needed again after unpickling: parameter identities do not survive a process boundary.
        """
        self.param_names: dict[int, str] = {id(p): n for n, p in unwrap(model).named_parameters()}
        self.param_numel: dict[str, int] = {n: p.numel() for n, p in unwrap(model).named_parameters()}
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

    def bucket_layers(self, bucket: dist.GradBucket) -> dict[str, torch.Tensor]:
        """The bucket's gradients keyed by parameter name, in bucket order (views of its buffer:
        writing them writes what DDP reads back)."""
        return {self.name_of(p): g for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)}

    # -- the group -----------------------------------------------------------------------------

    @property
    def group(self) -> dist.ProcessGroup:
        if self.process_group is not None:
            return self.process_group
        world = dist.group.WORLD
        if world is None:
            raise RuntimeError("torch.distributed is not initialized: no default process group")
        return world

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group) if dist.is_initialized() else 1

    # -- metrics and training signals ----------------------------------------------------------

    def drain_metrics(self) -> HookStepMetrics:
        """This step's metrics since the last drain; resets the sums. Call once per optimizer step."""
        return self.metrics.drain()

    def set_lr(self, lr: float) -> None:
        """The learning rate of the coming step; families with a controller pass it on."""
        return None  # a no-op by default

    def set_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer stepping on what this hook delivers (tail_ray.train's session says it at
        its first step; a plain DDP script may call it once it has built one). Families with a
        controller set their budget by whether it is linear in the gradient (bitwidth/policy.py),
        and Tail's default turns its low-rank layers on only then (TailConfig.lowrank)."""
        self.set_linear_optimizer(linear_in_gradient(optimizer))

    def set_linear_optimizer(self, linear: bool) -> None:
        """``set_optimizer``'s answer, for a trainer that knows it without an optimizer object.
        Named so, it is no longer judged by the watch ``register_tail_hook`` starts."""
        self.optimizer_named = True
        self.apply_linear_optimizer(bool(linear))

    def apply_linear_optimizer(self, linear: bool) -> None:
        """Pass the answer on (families with a controller; the watch calls this one)."""
        return None  # a no-op by default

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state keyed by parameter name (never by bucket index)."""
        return {"version": STATE_VERSION, "method": self.method.value, "local_step": self.local_step}

    def load_state_dict(self, state: Mapping[str, Any], *, residuals: bool = True) -> None:
        """Restore from ``state_dict()`` (this version or an older readable one), matching layers
        by parameter name.

        ``residuals=False`` (for a resized job): error-feedback residuals are per worker and
        start from zero; the rest (Tail's controller, step counters) is still restored.
        """
        if not isinstance(state, Mapping) or "method" not in state:
            raise ConfigError("not a hook-state checkpoint: expected a mapping from state_dict()")
        if state.get("version") not in READABLE_STATE_VERSIONS:
            readable = list(READABLE_STATE_VERSIONS)
            raise ConfigError(f"hook state version {state.get('version')!r}, this build reads {readable}")
        if state["method"] != self.method:
            raise ConfigError(
                f"checkpoint was written by method {state['method']!r} but this hook runs "
                f"{self.method.value!r}; register the hook with the checkpoint's method"
            )
        self.local_step = int(state["local_step"])
        self._load_family_state(state, residuals=residuals)

    def load_resized(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Restore from the states every rank of a job of ANOTHER size saved (rank order): by
        default rank 0's, without per-worker residuals; a family with error feedback carries
        what the old ranks' residuals owed the mean (PayloadHookState)."""
        if not states:
            raise ConfigError("load_resized needs the state of at least one old rank")
        self.load_state_dict(states[0], residuals=False)

    def _load_family_state(self, state: Mapping[str, Any], *, residuals: bool) -> None:
        """The family's part of ``load_state_dict``; nothing for a family without state."""
        return None

    # -- pickling ------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the process group, the metric sums (and their lock) and the
        parameter identities."""
        return {k: v for k, v in self.__dict__.items() if k not in self._TRANSIENT}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.optimizer_named = bool(state.get("optimizer_named", False))  # older pickles: not named
        self.process_group = None  # the default group; set another one after loading if needed
        self.metrics = StepMetricsAccumulator()
        self.param_names = {}  # call bind(model): ids of parameters do not cross processes
