"""Error-feedback memory (GRACE's "memory" role): one residual and its squared norm per layer NAME.

The residual e is what earlier steps meant to send but the quantizer dropped. Each step
sends Q(g + e) and keeps e <- (g + e) - Q(g + e), so nothing is lost, only delayed. Keys are
parameter names, never DDP bucket indices (DDP rebuilds its buckets after the first step).

A compressor is handed one of these (or None: no error feedback) and never keeps residuals of
its own. Three ways to use it:
- generic: ``compensated = mem.compensate(name, g)`` ... ``mem.update(name, compensated, decoded)``;
- keep: ``mem.keep(name, residual)`` adopts a freshly computed residual (the top-k compressor);
- fused: ``mem.buffer(name, numel)`` hands out the residual array itself, which a numba kernel
  turns into g + e and then into the new residual in one pass, without temporaries; the kernel
  measures ||e'||^2 on the way and reports it with ``mem.measured(name, norm_sq)``.

``norm_sq(name)`` is ||e||^2 of the residual carried into the next step (Tail's runaway guard
and its noise accounting read it); a norm nobody measured is computed when first asked for.
On resize/restart the residuals are per worker: see ``load_state_dict`` of the compressors.

Where a residual lives follows its gradient: ``device_buffer(name, numel, device)`` hands out
a float32 torch tensor on that device (the Triton backend's CUDA residual, rewritten in place
by its kernel), ``buffer(name, numel)`` a numpy array; a residual asked for on the other side
is moved there once (a checkpoint restored on the host, a backend switch).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from tail_ray.compression.fixedsum import sum_squares
from tail_ray.compression.grid import F32_MAX

Residual = np.ndarray | torch.Tensor


def _host(e: Residual) -> np.ndarray:
    return e.detach().to("cpu").numpy() if isinstance(e, torch.Tensor) else e


class ErrorFeedback:
    def __init__(self) -> None:
        self._residuals: dict[str, Residual] = {}
        self._norms_sq: dict[str, float] = {}  # ||e||^2 where known; computed on demand otherwise

    def __contains__(self, name: str) -> bool:
        return name in self._residuals

    def names(self) -> list[str]:
        return list(self._residuals)

    def buffer(self, name: str, numel: int) -> np.ndarray:
        """The residual of ``name`` as a host array (zeros the first time, or when the layer's
        size changed)."""
        e = self._residuals.get(name)
        if isinstance(e, torch.Tensor):
            e = self._residuals[name] = _host(e)
        if e is None or e.size != numel:
            e = np.zeros(numel, dtype=np.float32)
            self._residuals[name] = e
            self._norms_sq[name] = 0.0
        return e

    def device_buffer(self, name: str, numel: int, device: torch.device) -> torch.Tensor:
        """The residual of ``name`` as a float32 tensor on ``device`` (moved there once)."""
        e = self._residuals.get(name)
        if e is not None and (e.size if isinstance(e, np.ndarray) else e.numel()) != numel:
            e = None
        if e is None:
            t = torch.zeros(numel, dtype=torch.float32, device=device)
            self._norms_sq[name] = 0.0
        elif isinstance(e, np.ndarray):
            t = torch.from_numpy(e).to(device)
        elif e.device != device:
            t = e.to(device)
        else:
            return e
        self._residuals[name] = t
        return t

    def measured(self, name: str, norm_sq: float) -> None:
        """A fused kernel rewrote ``buffer(name, ...)`` and measured its ||e||^2 on the way."""
        self._norms_sq[name] = float(norm_sq)

    def norm_sq(self, name: str) -> float:
        """||e||^2 of the residual of ``name``; 0 for a layer without one."""
        e = self._residuals.get(name)
        if e is None:
            return 0.0
        known = self._norms_sq.get(name)
        if known is None:
            known = self._norms_sq[name] = float(sum_squares(_host(e)))
        return known

    def compensate(self, name: str, grad: np.ndarray) -> np.ndarray:
        """g + e as a new float32 array (the caller's gradient is never modified), saturated at
        float32's max as the quantizer's fused kernel does: a huge finite g stays finite."""
        out = grad.astype(np.float32, copy=True)
        with np.errstate(over="ignore"):
            np.add(out, self.buffer(name, grad.size), out=out)
        return np.clip(out, -F32_MAX, F32_MAX, out=out)

    def update(self, name: str, compensated: np.ndarray, decoded: np.ndarray) -> None:
        """e <- compensated - decoded: what this step failed to send."""
        e = self.buffer(name, compensated.size)
        np.subtract(compensated, decoded, out=e)
        self._norms_sq.pop(name, None)

    def keep(self, name: str, residual: np.ndarray) -> None:
        """Adopt ``residual`` (float32, flat; not copied) as the residual of ``name``."""
        self._residuals[name] = residual
        self._norms_sq.pop(name, None)

    def fold_into(self, grads: Mapping[str, torch.Tensor]) -> None:
        """g <- g + e in place and forget e, for layers sent WITHOUT compression this step.

        When the hook sends a step by plain all-reduce (the link-aware switch), what earlier
        steps still owed is delivered with it, so nothing is lost across the switch.
        """
        for name, g in grads.items():
            e = self._residuals.pop(name, None)
            self._norms_sq.pop(name, None)
            if e is not None and (e.size if isinstance(e, np.ndarray) else e.numel()) == g.numel():
                et = torch.from_numpy(e) if isinstance(e, np.ndarray) else e
                flat = g.view(-1).add_(et.to(device=g.device, dtype=g.dtype))
                if flat.is_floating_point():  # saturate: a huge finite g + e must not become inf
                    big = torch.finfo(flat.dtype).max
                    flat.clamp_(-big, big)

    def reset(self, name: str | None = None) -> None:
        if name is None:
            self._residuals.clear()
            self._norms_sq.clear()
        else:
            self._residuals.pop(name, None)
            self._norms_sq.pop(name, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The residuals as CPU tensors (copies), keyed by layer name: a compressor's
        ``state_dict()["residuals"]``."""
        return {name: torch.from_numpy(_host(e).copy()) for name, e in self._residuals.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor | np.ndarray]) -> None:
        """Restore ``state_dict()`` (tensors or arrays); norms are measured again."""
        self._residuals = {
            str(name): torch.as_tensor(e).detach().to("cpu", torch.float32).reshape(-1).numpy().copy()
            for name, e in state.items()
        }
        self._norms_sq = {name: float(sum_squares(e)) for name, e in self._residuals.items()}
