"""The per-layer plan: which bit-width each layer uses, re-decided only when it may change.

Policies decide, the controller acts: ``BudgetPolicy`` says what error a layer may have
(tau); ``BitController`` estimates nu_b for every candidate b from a sample of the layer and
picks the smallest b with nu_b <= tau (the largest candidate when none fits: accuracy first).
A decision is reused for ``redecide_every_steps`` steps, unless tau moved by more than
``_TAU_MOVE`` x or the layer's (smoothed) gradient norm drifted past ``norm_drift`` since the
decision, or the compressor invalidated it (runaway residual).

With ``allocation="model"`` the estimates are kept, and the bits come from one whole-model
allocation over every layer's latest estimate (``allocate.allocate_bits``) instead of each
layer's own tau: an estimate is still refreshed by the rules above, and the allocation is
recomputed at most every ``REALLOCATE_EVERY_STEPS`` steps after one was (``ModelAllocator``:
only the re-estimated layers' terms are redone), at once for a layer it does not cover.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from tail_ray.bitwidth.allocate import LayerCurve, ModelAllocator, pick_bits
from tail_ray.bitwidth.bucket_choice import BUCKET_CHOICES, choose_bucket
from tail_ray.bitwidth.policy import BudgetPolicy
from tail_ray.bitwidth.quant_error import relative_errors, warm_estimates
from tail_ray.bitwidth.row_buckets import MIN_ZERO_ROW_SHARE, row_bucket, row_length, zero_row_share
from tail_ray.compression.device import LayerArray
from tail_ray.compression.feedback import Residual
from tail_ray.compression.rounding import kernel_rounding
from tail_ray.errors import ConfigError

_TAU_MOVE = 1.5  # re-decide when tau changed by this factor since the last decision
# allocation="model": re-allocate at most this often. The layers re-estimate on staggered
# steps (about one a step on the char LM), so re-allocating on every step that had one
# re-allocated on most steps, yet only ~15 % of those allocations moved any layer's bits
# (LM, 2 runs: 177 and 160 allocations, 25 and 30 moved bits). In the benchmark's workers
# each call costs ~80 us, not the ~15 us it takes in a loop on its own: the step's numeric
# work has evicted its code and data from the caches. A re-estimate now waits up to 3 steps
# to reach the allocation; a new or invalidated layer (runaway guard) is allocated at once.
# A re-estimate that finds its layer over its share at the allocated bits does not wait
# (BitController._keep_curve).
REALLOCATE_EVERY_STEPS = 4
ROW_CHECK_EVERY_STEPS = 100  # row buckets: how often a layer's zero rows are counted (_row_plan)

__all__ = ["ALLOCATIONS", "BitController", "LayerPlan", "pick_bits"]


@dataclass
class LayerPlan:
    bits: int
    rel_error: float  # estimated nu at ``bits`` when decided
    tau: float
    decided_step: int
    norm: float  # smoothed gradient norm at the decision
    bucket_size: int = 512  # elements per scale (bucket_choice "auto": chosen per layer)


ALLOCATIONS = ("layer", "model")


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
        allocation: str = "layer",
        layer_cap: float = 2.0,
        tau_max: float = 0.5,
        rounding: str = "stochastic",
        bucket_choice: str = "fixed",
        reallocate_every_steps: int | None = None,  # None: REALLOCATE_EVERY_STEPS
        row_buckets: bool = True,
    ) -> None:
        if allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
        if bucket_choice not in BUCKET_CHOICES:
            raise ConfigError(f"bucket_choice must be one of {list(BUCKET_CHOICES)}, got {bucket_choice!r}")
        if bucket_choice == "auto" and allocation == "model":
            # The allocation moves bits after the bucket was chosen for them: the error would not hold.
            raise ConfigError('bucket_choice "auto" needs allocation "layer", not "model"')
        self.bucket_choice = bucket_choice  # "fixed" for sharded exchanges (slices align to one bucket)
        self.shapes: dict[str, tuple[int, ...]] = {}  # name -> shape, filled by the compressor
        self.policy = policy
        # The quantizer's kernel rounding (a ROUNDING_MODES setting, resolved once): the error
        # model follows it. Checked here, not at the first estimate.
        self.rounding = kernel_rounding(rounding)
        # Dithered matrices with an eighth or more of their rows zero: buckets on row edges
        # (row_buckets.py). Nearest and stochastic rounding decode a zero as zero: never.
        self.row_buckets = row_buckets and self.rounding == "dither"
        self.allocation = allocation
        self.layer_cap = layer_cap
        self.tau_max = tau_max
        if reallocate_every_steps is None:
            reallocate_every_steps = REALLOCATE_EVERY_STEPS
        if reallocate_every_steps < 1:
            raise ValueError(f"reallocate_every_steps must be >= 1, got {reallocate_every_steps}")
        self.reallocate_every_steps = reallocate_every_steps
        self.candidate_bits = tuple(candidate_bits)
        self._ascending = sorted(range(len(self.candidate_bits)), key=self.candidate_bits.__getitem__)
        self.bucket_size = bucket_size
        self.sample_numel = sample_numel
        self.redecide_every_steps = redecide_every_steps
        self.norm_drift = norm_drift
        self._rng = np.random.default_rng(seed)
        self.plans: dict[str, LayerPlan] = {}
        self.decision_s = 0.0  # wall time spent deciding, for the cost share the benchmark reports
        self.decisions = 0
        # allocation="model": every layer's latest estimate, and the allocation over them
        # (None: stale, recomputed at the next plan call).
        self.curves: dict[str, LayerCurve] = {}
        self._allocator = ModelAllocator(self.candidate_bits, layer_cap=layer_cap, tau_max=tau_max)
        self._allocated: dict[str, int] = {}
        self._allocated_step = -1
        self._dirty = False  # a curve changed since the allocation was made
        self._urgent = False  # ... and the change raised a layer's error at its bits (_keep_curve)
        # Per allocated layer, (nu at its allocated bits, tau) of the curve the allocation used.
        self._allocated_spend: dict[str, tuple[float, float]] = {}
        self._index = {b: j for j, b in enumerate(self.candidate_bits)}
        # Here, at set-up, not in the first step's decisions (quant_error.warm_estimates).
        warm_estimates()

    def _pick(self, nu: list[float], tau: float) -> int:
        """``pick_bits``'s rule, as the candidate's index, on the order sorted once."""
        for j in self._ascending:
            if nu[j] <= tau:
                return j
        return self._ascending[-1]

    def _stale(self, name: str, plan: LayerPlan, step: int, norm: float, tau: float) -> bool:
        if step - plan.decided_step >= self.redecide_every_steps:
            return True
        if plan.norm > 0 and abs(math.log(max(norm, 1e-30) / plan.norm)) > math.log1p(self.norm_drift):
            return True
        return tau > plan.tau * _TAU_MOVE or tau < plan.tau / _TAU_MOVE

    def plan(self, name: str, g: LayerArray, residual: Residual | None, step: int, norm: float) -> LayerPlan:
        """The plan for this layer at this step (re-deciding when stale)."""
        self.policy.observe_norm(name, norm, step)
        # Drift is judged on the smoothed norm: small-batch gradient norms swing by 50 % from
        # one step to the next without the error estimate changing.
        smooth = self.policy.smoothed_norm(name)
        norm = smooth if smooth is not None else norm
        tau = self.policy.tau(name, step)
        plan = self.plans.get(name)
        if plan is None or self._stale(name, plan, step, norm, tau):
            t0 = time.perf_counter()
            # With one candidate (pinned) there is nothing to choose, but the estimate still feeds the stats.
            nu = relative_errors(
                g,
                residual,
                self.bucket_size,
                self.candidate_bits,
                sample_numel=self.sample_numel,
                rng=self._rng,
                rounding=self.rounding,
            )
            values = nu.tolist()  # Python floats, the same values: cheaper to compare and keep
            j = self._pick(values, tau)
            plan = LayerPlan(
                bits=self.candidate_bits[j],
                rel_error=values[j],
                tau=tau,
                decided_step=step,
                norm=norm,
                bucket_size=self.bucket_size,
            )
            if self.bucket_choice == "auto" and isinstance(g, np.ndarray):
                plan = self._bucket_plan(plan, g, residual)
            elif self.row_buckets and isinstance(g, np.ndarray):
                plan = self._row_plan(name, plan, g)
            self.plans[name] = plan
            if self.allocation == "model":
                self._keep_curve(LayerCurve(name, g.size, tau, tuple(values)))
            self.decision_s += time.perf_counter() - t0
            self.decisions += 1
        if self.allocation == "model":
            plan = self._allocated_plan(name, plan, step)
        return plan

    def _keep_curve(self, curve: LayerCurve) -> None:
        """Keep a layer's new estimate for the allocation. Accuracy first: where it says the
        layer now spends over ``_TAU_MOVE`` x the share of the budget the allocation in force
        was made with, at the bits allocated to it (tau tightened in a critical phase, or its
        error grew, in one re-estimate or over several), the allocation is redone at the next
        plan call of a new step rather than up to ``reallocate_every_steps`` later."""
        then, bits = self._allocated_spend.get(curve.name), self._allocated.get(curve.name)
        if then is not None and bits is not None:
            nu_then, tau_then = then
            # nu / tau > 1.5 x nu_then / tau_then, multiplied out: tau may be 0 (tau_min 0).
            if curve.nu[self._index[bits]] * tau_then > _TAU_MOVE * nu_then * curve.tau:
                self._urgent = True
        self.curves[curve.name] = curve
        self._dirty = True

    def _bucket_plan(self, plan: LayerPlan, g: np.ndarray, residual: Residual | None) -> LayerPlan:
        """The plan at the cheapest bucket size with no more error (bucket_choice.py); the
        Triton path (device arrays) keeps the base bucket."""
        x = g if not isinstance(residual, np.ndarray) else g + residual
        if not np.isfinite(x).all():  # g + e past float32's range: the kernel saturates, keep it plain
            return plan
        pick = choose_bucket(
            x,
            self.bucket_size,
            plan.bits,
            self.candidate_bits,
            sample_numel=self.sample_numel,
            rng=self._rng,
            rounding=self.rounding,
        )
        if pick is None:
            return plan
        return replace(plan, bits=pick.bits, rel_error=pick.rel_error, bucket_size=pick.bucket_size)

    def _row_plan(self, name: str, plan: LayerPlan, g: np.ndarray) -> LayerPlan:
        """The plan with buckets cut on row edges where enough of the layer's rows are all zero
        now, so such rows decode to exactly zero (row_buckets.py). Its error estimate stays the base
        bucket's: a smaller bucket's max is no larger, so no more error than estimated. The
        Triton path (device arrays) keeps the base bucket."""
        row_len = row_length(self.shapes.get(name))
        bucket = row_bucket(row_len, self.bucket_size)
        if bucket is None or row_len is None:
            return plan
        # The rows are read once per window of ROW_CHECK_EVERY_STEPS steps: whether a layer's
        # rows are mostly zero is what kind of layer it is, not this step's news, and reading
        # them at every decision cost the LM ~17 us a step. The verdict in between is the last
        # plan's bucket, which a checkpoint keeps, so a resumed run decides as the first did.
        last = self.plans.get(name)
        if (
            last is not None
            and last.decided_step // ROW_CHECK_EVERY_STEPS == plan.decided_step // ROW_CHECK_EVERY_STEPS
        ):
            rows_zero = last.bucket_size == bucket
        else:
            rows_zero = zero_row_share(g, row_len) >= MIN_ZERO_ROW_SHARE
        return replace(plan, bucket_size=bucket) if rows_zero else plan

    def _allocated_plan(self, name: str, plan: LayerPlan, step: int) -> LayerPlan:
        """The layer's plan with the bits of the current whole-model allocation (another
        layer's new estimate may have moved them since this layer's own decision).

        Re-allocated at most every ``reallocate_every_steps`` steps (re-estimates since count
        from the next allocation), but at once for a layer the current allocation does not
        cover (first seen, or invalidated by the runaway guard)."""
        every = 1 if self._urgent else self.reallocate_every_steps
        # Layers may count steps apart (TailCompressor passes each layer's own call count: one
        # that joined late runs behind): a step before the allocation's is due at once, so a
        # layer behind never waits on one ahead (at worst this allocates on every such call).
        since = step - self._allocated_step
        if self._dirty and (name not in self._allocated or since >= every or since < 0):
            t0 = time.perf_counter()
            self._allocated = self._allocator.allocate(self.curves.values())
            self._allocated_step = step
            self._dirty = self._urgent = False
            index = self._index
            self._allocated_spend = {
                n: (self.curves[n].nu[index[b]], self.curves[n].tau) for n, b in self._allocated.items()
            }
            self.decision_s += time.perf_counter() - t0
        bits = self._allocated.get(name, plan.bits)
        if bits != plan.bits:
            plan = replace(plan, bits=bits, rel_error=self.curves[name].nu[self.candidate_bits.index(bits)])
            self.plans[name] = plan
        return plan

    def fix_bucket(self) -> None:
        """One bucket size for every layer from now on (the sharded exchanges cut layers at
        its multiples): plans restored or decided at another bucket decide again."""
        self.bucket_choice = "fixed"
        self.row_buckets = False
        for name in [n for n, p in self.plans.items() if p.bucket_size != self.bucket_size]:
            self.invalidate(name)

    def invalidate(self, name: str) -> None:
        """Forget the layer's plan: the next ``plan`` call decides afresh."""
        self.plans.pop(name, None)
        # Its allocated bits may be what ran away: not used again until re-allocated.
        self._allocated.pop(name, None)
        if self.curves.pop(name, None) is not None:
            self._dirty = True

    def state_dict(self) -> dict[str, Any]:
        """Plans, the policy's state, the curves, and the sampling RNG (``rng``: numpy's
        bit-generator state, a dict of str and int), so a restored controller draws the same
        samples the saved one would have drawn next."""
        return {
            "plans": {name: asdict(p) for name, p in self.plans.items()},
            "policy": self.policy.state_dict(),
            "curves": {name: asdict(c) for name, c in self.curves.items()},
            # The allocation in force and whether it lags a re-estimate: a resumed run then
            # re-allocates on the step the uninterrupted one would have.
            "allocated": {
                "bits": dict(self._allocated),
                "step": self._allocated_step,
                "dirty": self._dirty,
                "urgent": self._urgent,
                "spend": {n: list(v) for n, v in self._allocated_spend.items()},
                # What it was made under: another setting on resume re-allocates at once.
                "settings": self._allocation_settings(),
            },
            "rng": self._rng.bit_generator.state,
        }

    def _allocation_settings(self) -> dict[str, Any]:
        return {
            "candidate_bits": list(self.candidate_bits),
            "layer_cap": self.layer_cap,
            "tau_max": self.tau_max,
        }

    def _restored_bucket(self, saved: int) -> int:
        """A checkpoint's bucket for a plan: kept under bucket_choice "auto", and a row bucket
        (smaller than the base, under dither) while row buckets are on, so a resumed run sends
        what it would have; otherwise (and for older checkpoints, which have none) the base."""
        if self.bucket_choice == "auto":
            return saved
        return saved if self.row_buckets and saved < self.bucket_size else self.bucket_size

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.plans = {
            str(name): LayerPlan(
                bits=int(p["bits"]),
                rel_error=float(p["rel_error"]),
                tau=float(p["tau"]),
                decided_step=int(p["decided_step"]),
                norm=float(p["norm"]),
                bucket_size=self._restored_bucket(int(p.get("bucket_size", self.bucket_size))),
            )
            for name, p in dict(state["plans"]).items()
            if int(p["bits"]) in self.candidate_bits
        }
        self.policy.load_state_dict(state["policy"])
        # Older checkpoints have no curves: the allocation then starts from the layers as
        # they re-decide.
        self.curves = {
            str(name): LayerCurve(
                str(name), int(c["numel"]), float(c["tau"]), tuple(float(v) for v in c["nu"])
            )
            for name, c in dict(state.get("curves", {})).items()
            if len(c["nu"]) == len(self.candidate_bits)
        }
        self._allocated, self._allocated_step, self._dirty, self._urgent = {}, -1, bool(self.curves), False
        self._allocated_spend = {}
        saved = state.get("allocated")
        # Older checkpoints have none, and one made under other settings does not hold: the
        # allocation is then redone from the curves at once.
        if (
            saved is not None
            and self.curves
            and self.allocation == "model"
            and saved.get("settings") == self._allocation_settings()
        ):
            self._allocated = {
                str(n): int(b) for n, b in dict(saved["bits"]).items() if int(b) in self.candidate_bits
            }
            self._allocated_step = int(saved["step"])
            self._dirty = bool(saved["dirty"])
            self._urgent = bool(saved["urgent"])
            spend = dict(saved["spend"])
            self._allocated_spend = {str(n): (float(v[0]), float(v[1])) for n, v in spend.items()}
        # Checkpoints before the RNG was saved have none: the seeded one goes on (the samples
        # then differ from the saved run's; the decisions stay valid).
        if "rng" in state:
            rng = dict(state["rng"])
            if rng.get("bit_generator") != type(self._rng.bit_generator).__name__:
                raise ConfigError(
                    f"controller state has a {rng.get('bit_generator')!r} sampling RNG, this build "
                    f"uses {type(self._rng.bit_generator).__name__}: load it with the build that saved it"
                )
            self._rng.bit_generator.state = rng
