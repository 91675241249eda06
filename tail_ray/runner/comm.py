"""How the train loop talks to gradient communication: one small adapter over the comm hook.

With world size > 1, ``register_tail_hook`` (tail_ray.collective) installs the chosen method
on the DDP model. With world size 1 there is no DDP wrapper and nothing to exchange; the
hook state is still built and ``compress_gradients_locally`` runs the method's compress ->
decode round trip on the local gradients, so a one-worker run (e.g. an elastic job shrunk to
one worker) trains with the same gradient noise and reports the same per-layer metrics
(bytes sent and received are 0 there).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from tail_ray.collective import (
    HookStepMetrics,
    TailHookState,
    compress_gradients_locally,
    make_hook_state,
    register_tail_hook,
)


class Comm:
    """Gradient communication for one worker."""

    def __init__(self, model: nn.Module, method: str, config: Mapping[str, Any]) -> None:
        self.method = method
        self._model = model
        self._local = not isinstance(model, nn.parallel.DistributedDataParallel)
        if self._local:
            self.state: TailHookState = make_hook_state(model, method, dict(config))
        else:
            self.state = register_tail_hook(model, method=method, config=dict(config))

    def after_backward(self) -> None:
        """Between backward and the optimizer step: world size 1 runs the local round trip
        (with DDP the hook already ran inside backward)."""
        if self._local:
            compress_gradients_locally(self.state, self._model)

    def set_lr(self, lr: float) -> None:
        self.state.set_lr(lr)

    def drain(self) -> HookStepMetrics:
        """This step's communication metrics; call once after each optimizer step."""
        return self.state.drain_metrics()
