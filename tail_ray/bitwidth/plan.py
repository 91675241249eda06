"""The per-layer plan: which bit-width each layer uses, re-decided only when it may change.

Policies decide, the controller acts: ``BudgetPolicy`` says what error a layer may have
(tau); ``BitController`` estimates nu_b for every candidate b from a sample of the layer and
picks the smallest b with nu_b <= tau (the largest candidate when none fits: accuracy first).
A decision is reused for ``redecide_every_steps`` steps, unless tau moved by more than
``_TAU_MOVE`` x or the layer's (smoothed) gradient norm drifted past ``norm_drift`` since the
decision, or the compressor invalidated it (runaway residual).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tail_ray.bitwidth.policy import BudgetPolicy
from tail_ray.bitwidth.quant_error import relative_errors
from tail_ray.compression.device import LayerArray
from tail_ray.compression.feedback import Residual

_TAU_MOVE = 1.5  # re-decide when tau changed by this factor since the last decision


def pick_bits(nu_by_bits: np.ndarray, candidate_bits: tuple[int, ...], tau: float) -> int:
    """The smallest candidate b with estimated error nu_b <= tau, else the largest candidate."""
    order = sorted(range(len(candidate_bits)), key=lambda j: candidate_bits[j])
    for j in order:
        if nu_by_bits[j] <= tau:
            return candidate_bits[j]
    return candidate_bits[order[-1]]


@dataclass
class LayerPlan:
    bits: int
    rel_error: float  # estimated nu at ``bits`` when decided
    tau: float
    decided_step: int
    norm: float  # smoothed gradient norm at the decision


class BitController:
    def __init__(
        self,
        policy: BudgetPolicy,
        *,
        candidate_bits: tuple[int, ...],
        bucket_size: int,
        sample_numel: int | None,
        redecide_every_steps: int,
        norm_drift: float,
        seed: int,
    ) -> None:
        self.policy = policy
        self.candidate_bits = tuple(candidate_bits)
        self.bucket_size = bucket_size
        self.sample_numel = sample_numel
        self.redecide_every_steps = redecide_every_steps
        self.norm_drift = norm_drift
        self._rng = np.random.default_rng(seed)
        self.plans: dict[str, LayerPlan] = {}
        self.decision_s = 0.0  # wall time spent deciding, for the cost share the benchmark reports
        self.decisions = 0

    def _stale(self, name: str, plan: LayerPlan, step: int, norm: float, tau: float) -> bool:
        if step - plan.decided_step >= self.redecide_every_steps:
            return True
        if plan.norm > 0 and abs(math.log(max(norm, 1e-30) / plan.norm)) > math.log1p(self.norm_drift):
            return True
        return tau > plan.tau * _TAU_MOVE or tau < plan.tau / _TAU_MOVE

    def plan(
        self, name: str, g: LayerArray, residual: Residual | None, step: int, norm: float
    ) -> LayerPlan:
        """The plan for this layer at this step (re-deciding when stale)."""
        self.policy.observe_norm(name, norm, step)
        # Drift is judged on the smoothed norm: small-batch gradient norms swing by 50 % from
        # one step to the next without the error estimate changing.
        smooth = self.policy.smoothed_norm(name)
        norm = smooth if smooth is not None else norm
        tau = self.policy.tau(name, step)
        plan = self.plans.get(name)
        if plan is not None and not self._stale(name, plan, step, norm, tau):
            return plan
        t0 = time.perf_counter()
        # With one candidate (pinned) there is nothing to choose, but the estimate still feeds the stats.
        nu = relative_errors(
            g, residual, self.bucket_size, self.candidate_bits, sample_numel=self.sample_numel, rng=self._rng
        )
        bits = pick_bits(nu, self.candidate_bits, tau)
        rel = float(nu[self.candidate_bits.index(bits)])
        plan = LayerPlan(bits=bits, rel_error=rel, tau=tau, decided_step=step, norm=norm)
        self.plans[name] = plan
        self.decision_s += time.perf_counter() - t0
        self.decisions += 1
        return plan

    def invalidate(self, name: str) -> None:
        """Forget the layer's plan: the next ``plan`` call decides afresh."""
        self.plans.pop(name, None)

    def state_dict(self) -> dict[str, Any]:
        return {
            "plans": {name: asdict(p) for name, p in self.plans.items()},
            "policy": self.policy.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.plans = {
            str(name): LayerPlan(
                bits=int(p["bits"]),
                rel_error=float(p["rel_error"]),
                tau=float(p["tau"]),
                decided_step=int(p["decided_step"]),
                norm=float(p["norm"]),
            )
            for name, p in dict(state["plans"]).items()
            if int(p["bits"]) in self.candidate_bits
        }
        self.policy.load_state_dict(state["policy"])
