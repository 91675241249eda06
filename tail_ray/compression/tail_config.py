"""TailConfig: Tail's settings (TailCompressor in tail.py; the defaults are meant to be left alone)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tail_ray.bitwidth.bucket_choice import BUCKET_CHOICES
from tail_ray.bitwidth.lowrank_agree import AGREE_RULES
from tail_ray.bitwidth.lowrank_choice import LOWRANK_MODES, LOWRANK_TARGETS, LowRankSettings
from tail_ray.bitwidth.plan import ALLOCATIONS
from tail_ray.bitwidth.policy import BudgetSettings
from tail_ray.compression.rounding import ROUNDING_MODES, kernel_rounding
from tail_ray.errors import ConfigError

# TailConfig.allocation: "auto" resolves to one of plan.ALLOCATIONS (TailConfig.allocation_for).
ALLOCATION_SETTINGS = ("auto", *ALLOCATIONS)

# Under rounding "dither", a layer's first this many steps go at the largest candidate bits:
# Adam's second moment is close to a plain average over a few hundred steps, so the noise of
# the first, largest gradients stays in it for the whole run (measured on the LM: +0.61 %
# against +1.10 % with the budget's own bits from step 0; docs/engine.md).
DITHER_START_STEPS = 5
# Their bits. 6 sends 2 % less over the LM's 300 steps, but was 0.30 points of loss worse over
# 10 paired seeds (s.e. 0.33): not shown to be no worse, so 8 stays (docs/engine.md, "Stop 43").
DITHER_START_BITS = 8


@dataclass(frozen=True)
class TailConfig:
    """Tail's settings. The defaults are meant to be left alone (no per-model tuning).

    candidate_bits: bit-widths the controller may pick per layer; one value pins it.
    bucket_size: elements sharing one max-abs scale (32 bits of scale per bucket).
    bucket_choice: "fixed" (every layer at bucket_size) or "auto" (per layer the cheapest
        bucket at no more estimated error: bitwidth/bucket_choice.py; docs/engine.md, "Bucket
        size per layer").
    row_buckets: under dither, a matrix layer with an eighth or more of its rows all zero
        (an embedding's absent tokens; not a dense layer's few dead units) has its buckets cut
        on row edges, so those rows decode to exactly zero instead of +-half a step of noise
        that Adam would turn into full-size steps (bitwidth/row_buckets.py; docs/engine.md,
        "Stop 50"). Off only for ablations.
    raw_below_numel: layers smaller than this (biases, norms) skip the controller, low-rank
        and the SGD-noise reading: too few elements to sample from. 1024 since issue 15's
        default change (was 4096: digits' 1,280-element fc2 went raw, 17 % of its payload;
        docs/engine.md, "Payload anatomy and raw_below_numel").
    small_layer_bits: how those small layers are sent: 16 (the default) as IEEE float16
        with error feedback (what float16 drops, ~2^-12 of each value, is resent), 2..8
        quantized at those bits with error feedback, or 32 raw float32 (the Tail before).
        float16 measured 12.6x vs 11.9x on the LM and 32.5x vs 28.0x on digits at no worse
        accuracy; 8 bits sends 1.07x less again on the LM at +0.38 points (s.e. 0.32, 15
        seeds): opt-in (docs/engine.md, "Small layers as float16").
    sample_numel: elements the controller samples to estimate the error (None: exact).
    redecide_every_steps / norm_drift: a layer's bits are re-decided every K steps, or
        sooner when its smoothed gradient norm moved by more than ``norm_drift`` (relative;
        4.0: by 5x). The error estimate is scale-free, so a norm swing alone rarely moves
        the bits: at 2x (1.0, the default before stop 49) 66 of 72 norm-triggered decisions
        on digits kept them, and digits' deciding cost 3.0-3.3 % of its compress CPU time
        on average (32 of 40 seeds over 3 %); at 5x 2.5-2.6 %, every seed under 3 %, at the
        same accuracy (docs/engine.md, "Stop 49").
    noise_fraction: tau = noise_fraction * (relative between-worker gradient spread): a
        worker's compression noise at most a quarter of its SGD noise (the gradient noise
        the average sees grows by <= 25 %, like a <= 20 % smaller batch). Measured: 1.0
        (3 bits) cost the char LM +2.2-2.5 % validation loss, 0.35 +1.4-1.7 %, 0.25 (4 bits)
        +0.2-1.3 %, mean +0.9 % (docs/engine.md).
    linear_noise_fraction: the noise fraction once the trainer says the optimizer is linear
        in the gradient (torch.optim.SGD, with or without momentum: tail_ray.train's session
        and register_tail_hook's state tell it). Error feedback keeps such an optimizer's
        steps exact on average, where Adam's steps shrink (bitwidth/policy.py); set it equal to
        noise_fraction for one budget whatever the optimizer (docs/engine.md, "The budget
        follows the optimizer").
    tau_default: tau while no spread is known (world size 1, first step).
    tau_min / tau_max: clamp on tau; tau_max < 1 because error feedback diverges at nu >= 1.
    warmup_steps, critical_factor, critical_steps, lr_drop_ratio, norm_jump: the critical
        phases in which tau is multiplied by ``critical_factor`` (see bitwidth/policy.py).
    allocation: "auto" (the default: "model" where the layers are dithered, "layer" where
        they round to nearest or stochastically, or pick their bucket per layer;
        ``allocation_for``), "model" (one budget over the whole model, the numel-weighted
        mean of nu / tau stays <= 1 at the fewest bytes; see bitwidth/allocate.py) or "layer"
        (each layer the smallest b with nu_b <= its tau). One budget over the model with
        dither, since issue 15: LM 15.4x (every seed 15.0-16.0x) against 14.5x at a paired
        +0.12 points (s.e. 0.17), digits within 0.28 points of none on every seed. With
        nearest rounding it was no better on the LM (paired +0.40 points, s.e. 0.48; 8 of 10
        seeds over 1 %), and with stochastic rounding worse on every seed, so those keep the
        per-layer rule (docs/engine.md).
    layer_cap: with allocation "model", no layer's nu may exceed layer_cap x its own tau.
    error_feedback: keep per-layer residuals (off only for ablations).
    lowrank: "auto" (the default), "on" or "off" (every large layer quantized). Under "on",
        matrix-shaped layers may be sent as low-rank factors P Q^T instead, chosen per layer by
        measured residual and bytes (bitwidth/lowrank_choice.py). Where it cannot apply the
        layer is quantized: the sharded exchanges, CUDA gradients on the Triton path, and
        without error feedback (a low-rank step leaves most of a gradient to it). On by
        default since issue 15: digits 21.8-27.3x vs 8.8-9.4x at accuracy paired run by run
        with the old default's (docs/engine.md, "Low-rank by default"). "auto" is "on" while
        the optimizer is known to be linear in the gradient (SGD: optimizer_watch.py) and
        "off" otherwise: what a rank leaves reaches an adaptive optimizer late (error
        feedback), and Adam's per-element step minds that. LM (Adam), 10 seeds: off +0.52 %
        of none against on's +0.87 %, paired -0.36 points (s.e. 0.17), at 14.8x vs 15.6x
        (docs/engine.md, "Low-rank follows the optimizer"). YAML's bare off / on work.
    lowrank_ranks / lowrank_bits: the ranks a layer may take, and the factors' bits.
    lowrank_target: what low-rank's measured residual is held to: "bits" (the residual the
        quantizer leaves at the bits the budget picked: the same error, fewer bytes),
        "budget" (the residual the budget tau itself allows, a looser bound) or "auto" (the
        default: "budget" where the quantizer rounds to nearest, whose residual at the picked
        bits is about half what the budget priced, "bits" where it rounds stochastically;
        ``lowrank_target_for``). Each pairing is the one measured (docs/engine.md, "Nearest
        rounding by default").
    lowrank_agree: how every rank's next low-rank choice follows from all ranks' wants (the
        same kind and rank per layer on every rank: bitwidth/lowrank_agree.py): "half" (low-rank
        iff at least half the ranks want it; "any" on 2 ranks), "any" (iff some rank wants it)
        or "all" (iff every rank does); at the largest wanted rank. "all" measured 14.4-25.6x
        on digits where "any" gave 21.9-27.3x, when the all-gather padded every payload to
        the longest (docs/engine.md, "Agreed low-rank choice").
    rounding: "auto" (the default: "dither", on both backends, also in the sharded
        exchanges, slice by slice), "dither" (subtractive dither, an unbiased error of exactly
        step^2 / 12 per element that no error feedback carries; the payload carries a 4-byte
        seed per layer), "stochastic" (unbiased) or "nearest" (halves away from zero: ~half
        the error at the same bits, biased per step, error feedback carries the bias on).
        Dither and nearest send the same levels on both backends, bit for bit. Dither by
        default since issue 15: on the LM 14.5x at +0.60 % of none against nearest's 12.2x
        at +1.74 % (paired -1.14 points, 10 seeds),
        digits unchanged (docs/engine.md, "Subtractive dither by default"); nearest was the
        default before (12.0x vs 9.5x on the LM against stochastic: "Nearest rounding by
        default").
    dither_noise_fraction: the noise fraction (in place of ``noise_fraction``) when rounding
        is "dither" and the optimizer is not linear: dither's error is memoryless, so none of
        it piles up in a residual; 0.5 measured best on the LM with AdamW (docs/engine.md).
    dither_start_steps: a dithered layer's first this many steps go at ``dither_start_bits``
        (Adam's second moment remembers its first steps' noise for the whole run).
    dither_start_bits: the bits of those steps: the largest candidate not above it (the
        smallest candidate if all are above: pinned bits stay pinned).
    seed: base of the stochastic-rounding hash; None draws a random one per instance, so
        workers' rounding noise is independent (as averaging needs).
    """

    candidate_bits: tuple[int, ...] = (2, 3, 4, 5, 6, 8)
    bucket_size: int = 512
    raw_below_numel: int = 1024
    small_layer_bits: int = 16
    sample_numel: int | None = 4096
    redecide_every_steps: int = 20
    norm_drift: float = 4.0
    noise_fraction: float = 0.25
    linear_noise_fraction: float = 0.5
    tau_default: float = 0.25
    tau_min: float = 1e-3
    tau_max: float = 0.5
    warmup_steps: int = 20
    critical_factor: float = 0.5
    critical_steps: int = 50
    lr_drop_ratio: float = 0.8
    norm_jump: float = 2.0
    allocation: str = "auto"
    layer_cap: float = 2.0
    error_feedback: bool = True
    lowrank: str = "auto"
    lowrank_ranks: tuple[int, ...] = (1, 2, 4, 8, 16)
    lowrank_bits: int = 8
    lowrank_target: str = "auto"
    lowrank_agree: str = "half"
    rounding: str = "auto"
    dither_noise_fraction: float = 0.5
    dither_start_steps: int = DITHER_START_STEPS
    dither_start_bits: int = DITHER_START_BITS
    bucket_choice: str = "fixed"
    row_buckets: bool = True
    seed: int | None = field(default=None)

    def __post_init__(self) -> None:
        bits = tuple(int(b) for b in self.candidate_bits)
        if not bits or any(not 2 <= b <= 8 for b in bits) or len(set(bits)) != len(bits):
            raise ConfigError(
                f"candidate_bits must be distinct integers in 2..8, got {self.candidate_bits!r}"
            )
        object.__setattr__(self, "candidate_bits", tuple(sorted(bits)))
        if not 1 <= self.bucket_size <= 1 << 20:
            raise ConfigError(f"bucket_size must be in 1..{1 << 20}, got {self.bucket_size}")
        if self.raw_below_numel < 0:
            raise ConfigError(f"raw_below_numel must be >= 0, got {self.raw_below_numel}")
        small = self.small_layer_bits
        if (
            isinstance(small, bool)
            or not isinstance(small, int | float)
            or small not in (*range(2, 9), 16, 32)
        ):
            raise ConfigError(f"small_layer_bits must be in 2..8, 16 (fp16) or 32 (raw fp32), got {small!r}")
        object.__setattr__(self, "small_layer_bits", int(small))  # YAML / --set may give 8.0
        if self.sample_numel is not None and self.sample_numel < 1:
            raise ConfigError(f"sample_numel must be >= 1 or None (exact), got {self.sample_numel}")
        if self.redecide_every_steps < 1:
            raise ConfigError(f"redecide_every_steps must be >= 1, got {self.redecide_every_steps}")
        fractions = (
            "noise_fraction",
            "linear_noise_fraction",
            "dither_noise_fraction",
            "tau_default",
            "tau_min",
            "tau_max",
        )
        for name in ("norm_drift", *fractions):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} must be a positive finite number, got {v!r}")
        if self.tau_min > self.tau_max:
            raise ConfigError(f"tau_min ({self.tau_min}) must not exceed tau_max ({self.tau_max})")
        if self.error_feedback and self.tau_max >= 1:
            # e' = (g + e) - Q(g + e) has ||e'||^2 = nu (||g||^2 + ||e||^2): the residual only
            # stays bounded (at nu / (1 - nu) ||g||^2) when nu < 1.
            raise ConfigError(
                f"tau_max must be < 1 with error feedback (the residual diverges), got {self.tau_max}"
            )
        if not 0 < self.critical_factor <= 1:
            raise ConfigError(f"critical_factor must be in (0, 1], got {self.critical_factor}")
        if not 0 < self.lr_drop_ratio < 1:
            raise ConfigError(f"lr_drop_ratio must be in (0, 1), got {self.lr_drop_ratio}")
        if self.norm_jump <= 1:
            raise ConfigError(f"norm_jump must be > 1, got {self.norm_jump}")
        if self.allocation not in ALLOCATION_SETTINGS:
            raise ConfigError(
                f"allocation must be one of {list(ALLOCATION_SETTINGS)}, got {self.allocation!r}"
            )
        if not (
            isinstance(self.layer_cap, int | float) and math.isfinite(self.layer_cap) and self.layer_cap >= 1
        ):
            raise ConfigError(f"layer_cap must be a finite number >= 1, got {self.layer_cap!r}")
        if self.warmup_steps < 0 or self.critical_steps < 0:
            raise ConfigError("warmup_steps and critical_steps must be >= 0")
        self._check_dither_start()
        if isinstance(self.lowrank, bool):  # YAML 1.1 (PyYAML) reads a spec's `lowrank: off` as False
            object.__setattr__(self, "lowrank", "on" if self.lowrank else "off")
        choices = (
            ("lowrank", LOWRANK_MODES),
            ("lowrank_target", LOWRANK_TARGETS),
            ("lowrank_agree", AGREE_RULES),
            ("bucket_choice", BUCKET_CHOICES),
            ("rounding", ROUNDING_MODES),
        )
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        if self.bucket_choice == "auto" and self.allocation == "model":
            # Said here, when a job's settings are read, not when its first step compresses.
            raise ConfigError('bucket_choice "auto" needs allocation "layer" or "auto", not "model"')
        factor_bits = self.lowrank_bits
        if not (isinstance(factor_bits, int | float) and float(factor_bits).is_integer()):
            raise ConfigError(f"lowrank_bits must be an integer in 2..8, got {factor_bits!r}")
        object.__setattr__(self, "lowrank_bits", int(factor_bits))  # YAML / --set may give 8.0
        object.__setattr__(self, "lowrank_ranks", self.lowrank_settings().ranks)

    def _check_dither_start(self) -> None:
        """ConfigError unless dither_start_steps is an integer >= 0, dither_start_bits one in
        2..8 and row_buckets (the other dither-only setting) a bool."""
        if not isinstance(self.row_buckets, bool):
            raise ConfigError(f"row_buckets must be true or false, got {self.row_buckets!r}")
        start = self.dither_start_steps
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ConfigError(f"dither_start_steps must be an integer >= 0, got {start!r}")
        start_bits = self.dither_start_bits
        if isinstance(start_bits, bool) or not isinstance(start_bits, int) or not 2 <= start_bits <= 8:
            raise ConfigError(f"dither_start_bits must be an integer in 2..8, got {start_bits!r}")

    def start_bits(self) -> int:
        """The bits of a dithered layer's first ``dither_start_steps`` steps: the largest
        candidate not above ``dither_start_bits``, else the smallest candidate."""
        below = [b for b in self.candidate_bits if b <= self.dither_start_bits]
        return max(below) if below else min(self.candidate_bits)

    def allocation_for(self) -> str:
        """The allocation in force (plan.ALLOCATIONS): ``allocation``, with "auto" resolved by
        the quantizer's kernel rounding: "model" under dither, "layer" otherwise and with
        ``bucket_choice`` "auto" (a bucket chosen per layer holds that layer's own error; the
        allocation would move its bits after)."""
        if self.allocation != "auto":
            return self.allocation
        kernel = kernel_rounding(self.rounding)
        return "model" if kernel == "dither" and self.bucket_choice != "auto" else "layer"

    def lowrank_target_for(self) -> str:
        """The low-rank target in force: ``lowrank_target``, with "auto" resolved by the
        quantizer's rounding (nearest under "auto"): "bits" where the quantizer's error is the
        one its budget priced (stochastic, dither), "budget" where it is about half (nearest)."""
        if self.lowrank_target != "auto":
            return self.lowrank_target
        return "bits" if kernel_rounding(self.rounding) in ("stochastic", "dither") else "budget"

    def lowrank_settings(self) -> LowRankSettings:
        return LowRankSettings(
            ranks=tuple(self.lowrank_ranks),
            bits=self.lowrank_bits,
            trial_every_steps=self.redecide_every_steps,
            start_step=self.warmup_steps,
        )

    def budget_settings(self) -> BudgetSettings:
        """The budget's settings; under dither ``dither_noise_fraction`` in place of
        ``noise_fraction``."""
        dither = kernel_rounding(self.rounding) == "dither"
        return BudgetSettings(
            noise_fraction=self.dither_noise_fraction if dither else self.noise_fraction,
            linear_noise_fraction=self.linear_noise_fraction,
            tau_default=self.tau_default,
            tau_min=self.tau_min,
            tau_max=self.tau_max,
            warmup_steps=self.warmup_steps,
            critical_factor=self.critical_factor,
            critical_steps=self.critical_steps,
            lr_drop_ratio=self.lr_drop_ratio,
            norm_jump=self.norm_jump,
        )
