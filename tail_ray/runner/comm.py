"""How the train loop talks to gradient communication: one small adapter over the comm hook.

With world size > 1, ``register_tail_hook`` (tail_ray.collective) installs the chosen method
on the DDP model. With world size 1 there is no DDP wrapper and nothing to exchange; the
hook state is still built and ``compress_gradients_locally`` runs the method's compress /
decode round trip on the local gradients, so a one-worker run trains with the same
gradient noise and reports the same per-layer metrics.

Until tail_ray.collective lands, method "none" falls back to plain DDP all-reduce and reports
the gradient bytes as sent, received and raw (an fp32 all-reduce moves the full tensors).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from tail_ray.compression.stats import LayerStats
from tail_ray.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass
class StepComm:
    """One step's communication metrics, as the hook's ``drain_metrics`` gives them."""

    layers: list[LayerStats] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    raw_bytes: int = 0
    compress_s: float = 0.0
    decode_s: float = 0.0
    comm_s: float = 0.0


def _collective_api() -> tuple[Any, Any] | None:
    try:
        from tail_ray.collective import compress_gradients_locally, register_tail_hook
    except ImportError:
        return None
    return register_tail_hook, compress_gradients_locally


class Comm:
    """Gradient communication for one worker; build with :func:`attach`."""

    def __init__(self, model: nn.Module, method: str, config: Mapping[str, Any], world_size: int) -> None:
        self.method = method
        self.world_size = world_size
        self._model = model
        api = _collective_api()
        self.state: Any = None
        self._local: Any = None
        if api is None:
            if method != "none":
                raise ConfigError(
                    f"method={method!r} needs tail_ray.collective.register_tail_hook, which this "
                    "build does not have; use method=none"
                )
            logger.warning("tail_ray.collective not available: plain DDP all-reduce, no comm hook")
            return
        register, local = api
        if isinstance(model, nn.parallel.DistributedDataParallel):
            self.state = register(model, method=method, config=dict(config))
        else:
            self.state = register(None, method=method, config=dict(config), model=model)
            self._local = local

    def after_backward(self) -> None:
        """World size 1: run the method's local round trip on the gradients."""
        if self._local is not None:
            self._local(self.state, self._model)

    def set_lr(self, lr: float) -> None:
        if self.state is not None:
            self.state.set_lr(lr)

    def drain(self) -> StepComm:
        if self.state is not None:
            m = self.state.drain_metrics()
            return StepComm(
                list(m.layers),
                int(m.bytes_sent),
                int(m.bytes_received),
                int(m.raw_bytes),
                float(m.compress_s),
                float(m.decode_s),
                float(m.comm_s),
            )
        return self._plain_metrics()

    def _plain_metrics(self) -> StepComm:
        layers = []
        for name, p in _named_params(self._model):
            raw = p.numel() * 4
            layers.append(LayerStats(name, p.numel(), 32, 1.0, raw, raw, 0.0, "raw"))
        raw_bytes = sum(s.raw_bytes for s in layers)
        moved = raw_bytes if self.world_size > 1 else 0
        return StepComm(layers, moved, moved, raw_bytes)

    @property
    def hook_state(self) -> Any:
        """The checkpointable hook state (None when running without a hook)."""
        return self.state


def _named_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return [(n, p) for n, p in inner.named_parameters() if p.requires_grad]
