"""The error budget tau: how much relative quantization error a layer may have right now.

Rule (no per-model knob): keep each worker's compression noise a fixed fraction of the noise
SGD already has. After an all-gather every worker holds every worker's gradient, so the
spread between them is a free per-layer estimate of the mini-batch noise:

    spread = (1/(W-1)) sum_i ||d_i - mean d||^2   (between-worker variance)
    r = (spread - what compression put into the d_i) / ||g||^2
    tau = clip(noise_fraction * r * phase_factor, tau_min, tau_max)

with ``noise_fraction`` = 1/4 by default: compression may add at most a quarter of the noise
SGD already has (r <= 1 by construction, so tau <= 1/4 outside critical phases; 1/2 for the
linear optimizers below).

Once the trainer says the optimizer is linear in the gradient (plain or momentum SGD:
``set_linear``), ``linear_noise_fraction`` (1/2 by default) takes its place. With error
feedback, what such an optimizer does with the compressed gradients telescopes: the sum of
its steps is the true sum less lr times the residual still held back, so the noise only
delays part of the step. An adaptive optimizer (Adam: m / sqrt(v)) adds the noise's square to
v and shortens every step instead, so it keeps the tighter fraction, and so does a trainer
that never says (docs/engine.md, "The budget follows the optimizer").

(d_i are the decoded peers' gradients; see ``relative_noise`` for the correction, so
compression does not feed its own budget.) Without peers (world size
1, or before the first all-gather) tau is ``tau_default``.

"Accuracy first along training": ``phase_factor`` is ``critical_factor`` (< 1, tighter) in
critical phases and 1 when steady:
- warm-up: the first ``warmup_steps`` steps, and any step whose learning rate rose (an lr
  warm-up schedule is running);
- right after a learning-rate drop (lr < ``lr_drop_ratio`` * previous lr);
- a layer whose gradient norm moves by more than ``norm_jump`` x (short vs long running
  average; for ``critical_steps // 5`` steps).
A critical phase lasts ``critical_steps`` steps after its last trigger, then the factor ramps
linearly back to 1 over another ``critical_steps`` steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

_NOISE_EMA = 0.1  # weight of the newest spread measurement (noisy with W = 2)
# Norm jumps compare a short (~3 steps) with a long (~20 steps) running average of the log
# gradient norm: single-step spikes of small-batch gradients do not count, sustained moves do.
_NORM_SHORT_EMA = 0.3
_NORM_LONG_EMA = 0.05
_NORM_MIN_OBS = 10  # observations before a jump can be declared


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
    linear_noise_fraction: float
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
        self._noise_sums: dict[str, tuple[float, ...]] = {}  # running (spread, mean_sq, nu)
        self._log_norm: dict[str, tuple[float, float, float]] = {}  # (short, long, count)
        self._layer_critical_until: dict[str, int] = {}
        self._linear = False  # whether the optimizer is known to be linear in the gradient
        self._told = False  # whether this process was told (set_linear): then a checkpoint's is stale

    # --- signals -------------------------------------------------------------------------
    def set_linear(self, linear: bool) -> None:
        """Whether the optimizer stepping on these gradients is linear in them (module doc)."""
        self._linear = bool(linear)
        self._told = True

    @property
    def linear(self) -> bool:
        return self._linear

    @property
    def noise_fraction(self) -> float:
        """The fraction of SGD noise compression may add now (module doc)."""
        return self.s.linear_noise_fraction if self._linear else self.s.noise_fraction

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

    def observe_spread(self, name: str, spread: float, compression: float, grad_sq: float) -> None:
        """One all-gather's measurement for a layer, all per element and per worker:

        spread: the between-worker variance of the decoded gradients;
        compression: the part of it compression explains (see ``relative_noise``);
        grad_sq: this worker's mean squared gradient.
        Running averages are kept separately: a ratio of averages is far steadier than an
        average of ratios with two workers.
        """
        vals = (spread, compression, grad_sq)
        if not all(math.isfinite(v) and v >= 0 for v in vals) or grad_sq <= 0:
            return
        old = self._noise_sums.get(name)
        self._noise_sums[name] = (
            vals
            if old is None
            else tuple((1 - _NOISE_EMA) * o + _NOISE_EMA * v for o, v in zip(old, vals, strict=True))
        )

    def observe_norm(self, name: str, norm: float, step: int) -> bool:
        """Track the layer's gradient norm; True when it just jumped (a critical event).

        A jump: the short running average of log-norm left the long one by more than
        ``norm_jump`` x. The layer is then critical for ``critical_steps // 5`` steps (a norm
        move is local and short-lived, unlike an lr drop).
        """
        if not math.isfinite(norm) or norm <= 0:
            return False
        log_n = math.log(norm)
        st = self._log_norm.get(name)
        if st is None:
            self._log_norm[name] = (log_n, log_n, 1.0)
            return False
        short = (1 - _NORM_SHORT_EMA) * st[0] + _NORM_SHORT_EMA * log_n
        long_ = (1 - _NORM_LONG_EMA) * st[1] + _NORM_LONG_EMA * log_n
        count = st[2] + 1
        self._log_norm[name] = (short, long_, count)
        jumped = count >= _NORM_MIN_OBS and abs(short - long_) > math.log(self.s.norm_jump)
        if jumped:
            self._layer_critical_until[name] = step + max(1, self.s.critical_steps // 5)
        return jumped

    def smoothed_norm(self, name: str) -> float | None:
        """Short running average of the layer's gradient norm (~3 steps), None if unseen."""
        st = self._log_norm.get(name)
        return None if st is None else math.exp(st[0])

    def typical_norm(self, name: str) -> float | None:
        """Long running average of the layer's gradient norm (~20 steps), None if unseen."""
        st = self._log_norm.get(name)
        return None if st is None else math.exp(st[1])

    # --- decisions -----------------------------------------------------------------------
    def relative_noise(self, name: str) -> float | None:
        """r, the relative SGD noise of one worker's gradient, or None before any all-gather.

        The decoded gradients d_i = Q(g_i + e_i) differ between workers by SGD noise AND by
        what compression put there: the residual e_i each worker added (independent across
        workers) and this step's rounding noise nu ||g_i + e_i||^2. The caller measures
        the latter from its own residual and nu; r = (spread - compression) / ||g||^2,
        floored at 0.
        """
        sums = self._noise_sums.get(name)
        if sums is None:
            return None
        spread, compression, grad_sq = sums
        return max(0.0, (spread - compression) / grad_sq)

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
        noise = self.relative_noise(name)
        base = self.s.tau_default if noise is None else self.noise_fraction * noise
        return min(self.s.tau_max, max(self.s.tau_min, base * self.phase_factor(name, step)))

    # --- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "lr": self._lr,
            "global_critical_until": self._global_critical_until,
            "global_phase": self._global_phase.value,
            "noise_sums": {k: list(v) for k, v in self._noise_sums.items()},
            "log_norm": {k: list(v) for k, v in self._log_norm.items()},
            "layer_critical_until": dict(self._layer_critical_until),
            "linear": self._linear,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._lr = None if state["lr"] is None else float(state["lr"])
        self._global_critical_until = int(state["global_critical_until"])
        self._global_phase = Phase(state["global_phase"])
        self._noise_sums = {str(k): tuple(float(x) for x in v) for k, v in dict(state["noise_sums"]).items()}
        self._log_norm = {
            str(k): (float(v[0]), float(v[1]), float(v[2])) for k, v in dict(state["log_norm"]).items()
        }
        self._layer_critical_until = {str(k): int(v) for k, v in dict(state["layer_critical_until"]).items()}
        # The optimizer is this run's, not the checkpoint's: once the trainer has said which it
        # is (a checkpoint loaded after the first step, an SGD run resuming from an Adam one),
        # its answer stays. Before that, the saved answer; checkpoints from before it: not known.
        if not self._told:
            self._linear = bool(state.get("linear", False))
