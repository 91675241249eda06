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
    HookState,
    HookStepMetrics,
    compress_gradients_locally,
    make_hook_state,
    method_spec,
    register_tail_hook,
)


def compression_settings(method: str, config: Mapping[str, Any], *, seed: int, rank: int) -> dict[str, Any]:
    """The method's settings, with a stochastic-rounding seed derived from (job seed, rank)
    unless the user set one: different on every worker (their rounding noise must be
    independent), the same across runs of one config.

    Only methods whose settings take a ``seed`` get one (``MethodSpec.seeded``: tail, qsgd).
    Without it each compressor draws a random base seed, so a run could not be reproduced,
    nor replayed exactly from a checkpoint."""
    settings = dict(config)
    if method_spec(method).seeded and "seed" not in settings:
        settings["seed"] = (seed * 1_000_003 + rank * 7919 + 17) & 0xFFFF_FFFF
    return settings


class Comm:
    """Gradient communication for one worker."""

    def __init__(
        self, model: nn.Module, method: str, config: Mapping[str, Any], *, seed: int = 0, rank: int = 0
    ) -> None:
        self.method = method
        self._model = model
        settings = compression_settings(method, config, seed=seed, rank=rank)
        self.state: HookState
        if isinstance(model, nn.parallel.DistributedDataParallel):
            self._local = False
            self.state = register_tail_hook(model, method=method, config=settings)
        else:
            self._local = True
            self.state = make_hook_state(model, method, settings)

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
