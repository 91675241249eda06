"""The error budget tau: how much relative quantization error a layer may have right now.

Rule (no per-model knob): keep each worker's compression noise a fixed fraction of the noise
SGD already has. After an all-gather every worker holds every worker's gradient, so the
spread between them is a free per-layer estimate of the mini-batch noise:

    r = (1/(W-1)) sum_i ||d_i - mean d||^2 / mean_i ||d_i||^2      (relative SGD noise)
    tau = clip(noise_fraction * r * phase_factor, tau_min, tau_max)

(d_i are the decoded peers' gradients; the compression noise they already carry is
subtracted from r, so compression does not feed its own budget.) Without peers (world size
1, or before the first all-gather) tau is ``tau_default``.

"Accuracy first along training": ``phase_factor`` is ``critical_factor`` (< 1, tighter) in
critical phases and 1 when steady:
- warm-up: the first ``warmup_steps`` steps, and any step whose learning rate rose (an lr
  warm-up schedule is running);
- right after a learning-rate drop (lr < ``lr_drop_ratio`` * previous lr);
- a layer whose gradient norm jumps by more than ``norm_jump`` x against its running average.
A critical phase lasts ``critical_steps`` steps after its last trigger, then the factor ramps
linearly back to 1 over another ``critical_steps`` steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

_NOISE_EMA = 0.2  # weight of the newest spread measurement (noisy with W = 2)
_NORM_EMA = 0.1  # weight of the newest norm in the running log-norm average


class Phase(StrEnum):
    WARMUP = "warmup"
    LR_DROP = "lr_drop"
    NORM_JUMP = "norm_jump"
    RECOVERING = "recovering"
    STEADY = "steady"

    @property
    def is_critical(self) -> bool:
        return self in (Phase.WARMUP, Phase.LR_DROP, Phase.NORM_JUMP)


@dataclass(frozen=True)
class BudgetSettings:
    noise_fraction: float
    tau_default: float
    tau_min: float
    tau_max: float
    warmup_steps: int
    critical_factor: float
    critical_steps: int
    lr_drop_ratio: float
    norm_jump: float


class BudgetPolicy:
    """Decides tau per layer; holds only small per-layer running averages."""

    def __init__(self, settings: BudgetSettings) -> None:
        self.s = settings
        self._lr: float | None = None
        self._global_critical_until = -1  # last step of the latest global critical phase
        self._global_phase = Phase.STEADY
        self._noise: dict[str, float] = {}
        self._log_norm: dict[str, float] = {}
        self._layer_critical_until: dict[str, int] = {}

    # --- signals -------------------------------------------------------------------------
    def set_lr(self, lr: float, step: int) -> None:
        if not math.isfinite(lr) or lr < 0:
            return
        prev = self._lr
        self._lr = lr
        if prev is None:
            return
        if lr > prev * (1 + 1e-9):
            self._global_critical_until = step + self.s.critical_steps
            self._global_phase = Phase.WARMUP
        elif lr < prev * self.s.lr_drop_ratio:
            self._global_critical_until = step + self.s.critical_steps
            self._global_phase = Phase.LR_DROP

    def observe_noise(self, name: str, rel_noise: float) -> None:
        if not math.isfinite(rel_noise) or rel_noise < 0:
            return
        old = self._noise.get(name)
        self._noise[name] = rel_noise if old is None else (1 - _NOISE_EMA) * old + _NOISE_EMA * rel_noise

    def observe_norm(self, name: str, norm: float, step: int) -> bool:
        """Track the layer's gradient norm; True when it just jumped (a critical event)."""
        if not math.isfinite(norm) or norm <= 0:
            return False
        log_n = math.log(norm)
        avg = self._log_norm.get(name)
        if avg is None:
            self._log_norm[name] = log_n
            return False
        jumped = abs(log_n - avg) > math.log(self.s.norm_jump)
        self._log_norm[name] = (1 - _NORM_EMA) * avg + _NORM_EMA * log_n
        if jumped:
            self._layer_critical_until[name] = step + self.s.critical_steps
        return jumped

    # --- decisions -----------------------------------------------------------------------
    def relative_noise(self, name: str) -> float | None:
        return self._noise.get(name)

    def _last_critical_step(self, name: str) -> int:
        """The last step of the latest critical phase touching ``name`` (-1: none yet)."""
        return max(
            self._global_critical_until, self._layer_critical_until.get(name, -1), self.s.warmup_steps - 1
        )

    def phase(self, name: str, step: int) -> Phase:
        if step < self.s.warmup_steps:
            return Phase.WARMUP
        if step <= self._global_critical_until:
            return self._global_phase
        if step <= self._layer_critical_until.get(name, -1):
            return Phase.NORM_JUMP
        last = self._last_critical_step(name)
        if last >= 0 and step <= last + self.s.critical_steps:
            return Phase.RECOVERING
        return Phase.STEADY

    def phase_factor(self, name: str, step: int) -> float:
        phase = self.phase(name, step)
        if phase.is_critical:
            return self.s.critical_factor
        if phase == Phase.RECOVERING:
            last = self._last_critical_step(name)
            frac = (step - last) / max(1, self.s.critical_steps)
            return self.s.critical_factor + (1 - self.s.critical_factor) * min(1.0, max(0.0, frac))
        return 1.0

    def tau(self, name: str, step: int) -> float:
        noise = self._noise.get(name)
        base = self.s.tau_default if noise is None else self.s.noise_fraction * noise
        return min(self.s.tau_max, max(self.s.tau_min, base * self.phase_factor(name, step)))

    # --- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "lr": self._lr,
            "global_critical_until": self._global_critical_until,
            "global_phase": self._global_phase.value,
            "noise": dict(self._noise),
            "log_norm": dict(self._log_norm),
            "layer_critical_until": dict(self._layer_critical_until),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._lr = None if state["lr"] is None else float(state["lr"])
        self._global_critical_until = int(state["global_critical_until"])
        self._global_phase = Phase(state["global_phase"])
        self._noise = {str(k): float(v) for k, v in dict(state["noise"]).items()}
        self._log_norm = {str(k): float(v) for k, v in dict(state["log_norm"]).items()}
        self._layer_critical_until = {str(k): int(v) for k, v in dict(state["layer_critical_until"]).items()}
