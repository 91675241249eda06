"""TailCompressor: error feedback -> automatic per-layer bit-width -> stochastic quantization
-> (sparse / entropy) encoding, in one self-describing payload per call.

Per layer (a named parameter tensor) and call:
- small layers (< ``raw_below_numel`` elements: biases, norms) go raw fp32;
- a layer with any NaN/Inf goes raw fp32 UNCHANGED (no residual added), so DDP and
  GradScaler see exactly what plain DDP would (GradScaler skips the step), and the residual is
  left as it was, unpolluted;
- otherwise the controller (tail_ray.bitwidth) picks bits, and one fused numba pass computes
  g + e, the bucket scales, the stochastic levels and the new residual.
Encoding (dense/sparse choice, entropy coding) is the wire module's job (``encode_payload``).

``decompress`` needs no state. Optional hooks the DDP comm hook calls when present:
``observe_peers`` (between-worker spread -> SGD-noise estimate -> budget) and ``set_lr``.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from tail_ray.bitwidth.plan import BitController
from tail_ray.bitwidth.policy import BudgetPolicy, BudgetSettings
from tail_ray.compression.layers import (
    as_flat_f32,
    raw_record,
    records_to_flat,
    sample_stack,
    warn_nonfinite,
)
from tail_ray.compression.quantize import (
    layer_seed,
    n_buckets,
    quantize_finite,
    sum_squares,
)
from tail_ray.compression.record_compressor import RecordCompressor
from tail_ray.compression.registry import register_compressor
from tail_ray.compression.wire import Kind, LayerRecord
from tail_ray.errors import ConfigError

log = logging.getLogger(__name__)

# Peers' spread is measured on at most this many elements per layer (a strided view): the
# estimate only needs to be right to a factor of ~1.5, and this keeps observe_peers cheap.
_SPREAD_SAMPLE_NUMEL = 16384
# With error feedback at relative error nu the residual settles at ||e||^2 = nu / (1 - nu) ||g||^2
# (1x at tau_max = 0.5); past this many times ||g||^2 the layer is re-decided at once. An
# unstable plan (nu ~ 2 at 2 bits) crosses it within ~3-4 steps.
_RESIDUAL_LIMIT = 8.0


@dataclass(frozen=True)
class TailConfig:
    """Tail's settings. The defaults are meant to be left alone (no per-model tuning).

    candidate_bits: bit-widths the controller may pick per layer; one value pins it.
    bucket_size: elements sharing one max-abs scale (32 bits of scale per bucket).
    raw_below_numel: layers smaller than this go raw fp32 (biases, norms: not worth a
        header). 4096 is the project-wide contract; 1024 would also quantize ~1K-element
        classifier heads (digits_cnn's fc2.weight, a quarter of its payload at 4096: ratio
        ~12.5x -> ~16x in a 300-step 2-worker digits run).
    sample_numel: elements the controller samples to estimate the error (None: exact).
    redecide_every_steps / norm_drift: a layer's bits are re-decided every K steps, or
        sooner when its gradient norm moved by more than ``norm_drift`` (relative).
    noise_fraction: tau = noise_fraction * (relative between-worker gradient spread): a
        worker's compression noise at most a quarter of its SGD noise (the gradient noise
        the average sees grows by <= 25 %, like a <= 20 % smaller batch). Measured: 1.0
        (3 bits) cost the char LM +2.2-2.5 % validation loss, 0.35 +1.4-1.7 %, 0.25 (4 bits)
        +0.2-1.3 %, mean +0.9 % (docs/engine.md).
    tau_default: tau while no spread is known (world size 1, first step).
    tau_min / tau_max: clamp on tau; tau_max < 1 because error feedback diverges at nu >= 1.
    warmup_steps, critical_factor, critical_steps, lr_drop_ratio, norm_jump: the critical
        phases in which tau is multiplied by ``critical_factor`` (see bitwidth/policy.py).
    error_feedback: keep per-layer residuals (off only for ablations).
    seed: base of the stochastic-rounding hash; None draws a random one per instance, so
        workers' rounding noise is independent (as averaging needs).
    """

    candidate_bits: tuple[int, ...] = (2, 3, 4, 5, 6, 8)
    bucket_size: int = 512
    raw_below_numel: int = 4096
    sample_numel: int | None = 4096
    redecide_every_steps: int = 20
    norm_drift: float = 1.0
    noise_fraction: float = 0.25
    tau_default: float = 0.25
    tau_min: float = 1e-3
    tau_max: float = 0.5
    warmup_steps: int = 20
    critical_factor: float = 0.5
    critical_steps: int = 50
    lr_drop_ratio: float = 0.8
    norm_jump: float = 2.0
    error_feedback: bool = True
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
        if self.sample_numel is not None and self.sample_numel < 1:
            raise ConfigError(f"sample_numel must be >= 1 or None (exact), got {self.sample_numel}")
        if self.redecide_every_steps < 1:
            raise ConfigError(f"redecide_every_steps must be >= 1, got {self.redecide_every_steps}")
        for name in ("norm_drift", "noise_fraction", "tau_default", "tau_min", "tau_max"):
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
        if self.warmup_steps < 0 or self.critical_steps < 0:
            raise ConfigError("warmup_steps and critical_steps must be >= 0")

    def budget_settings(self) -> BudgetSettings:
        return BudgetSettings(
            noise_fraction=self.noise_fraction,
            tau_default=self.tau_default,
            tau_min=self.tau_min,
            tau_max=self.tau_max,
            warmup_steps=self.warmup_steps,
            critical_factor=self.critical_factor,
            critical_steps=self.critical_steps,
            lr_drop_ratio=self.lr_drop_ratio,
            norm_jump=self.norm_jump,
        )


class TailCompressor(RecordCompressor):
    """Tail: see the module docstring. Stateful (residuals, controller); decoding is stateless."""

    name = "tail"

    def __init__(self, config: TailConfig | None = None) -> None:
        self.config = config if config is not None else TailConfig()
        self._seed = self.config.seed if self.config.seed is not None else secrets.randbits(32)
        super().__init__()
        self.controller = BitController(
            BudgetPolicy(self.config.budget_settings()),
            candidate_bits=self.config.candidate_bits,
            bucket_size=self.config.bucket_size,
            sample_numel=self.config.sample_numel,
            redecide_every_steps=self.config.redecide_every_steps,
            norm_drift=self.config.norm_drift,
            seed=self._seed,
        )
        # Each layer counts its own calls: the hook compresses a subset of layers per call
        # (one DDP bucket), every layer once per compressed step, so a layer's count is the
        # number of compressed steps (steps the link-aware switch sent plain are not counted).
        self._layer_steps: dict[str, int] = {}
        self._compression_sq: dict[str, float] = {}  # latest compression noise per element
        self._residual_sq: dict[str, float] = {}  # ||e||^2 of each layer's current residual

    @property
    def step(self) -> int:
        """Steps seen so far (the most calls any layer has had)."""
        return max(self._layer_steps.values(), default=0)

    # --- sending -------------------------------------------------------------------------
    def compress_records(self, grads: Mapping[str, torch.Tensor]) -> list[LayerRecord]:
        """The engine's part of ``compress`` (everything but the wire's encoding)."""
        cfg = self.config
        records: list[LayerRecord] = []
        errors: list[float] = []
        nnzs: list[int | None] = []
        for name, tensor in grads.items():
            g = as_flat_f32(tensor)
            step = self._layer_steps.get(name, 0)
            self._layer_steps[name] = step + 1
            if g.size < max(cfg.raw_below_numel, 1):
                records.append(raw_record(name, g))
                errors.append(0.0)
                nnzs.append(None)
                continue
            sumsq = float(sum_squares(g))
            if not math.isfinite(sumsq):
                warn_nonfinite(name)
                records.append(raw_record(name, g))
                errors.append(0.0)
                nnzs.append(None)
                continue
            residual = self.feedback.buffer(name, g.size) if cfg.error_feedback else None
            # ||e||^2 of the residual carried in (the kernel measured it when it wrote it): for
            # the runaway guard and for observe_peers' account of what compression put into
            # the decoded gradients.
            e_sq = self._residual_sq.get(name, 0.0) if residual is not None else 0.0
            # Error feedback is only stable while nu < 1; a residual this far above the larger
            # of this step's and the typical (long-average) ||g||^2 means the last (sampled)
            # estimate was wrong for this layer: decide again now, on g + e.
            typical = self.controller.policy.typical_norm(name) or 0.0
            if e_sq > _RESIDUAL_LIMIT * max(sumsq, typical * typical):
                self.controller.invalidate(name)
            plan = self.controller.plan(name, g, residual, step, math.sqrt(sumsq))
            levels = np.empty(g.size, dtype=np.int8)
            scales = np.empty(n_buckets(g.size, cfg.bucket_size), dtype=np.float32)
            seed = layer_seed(self._seed, step, name)
            # Compression's part of this worker's decoded gradient: the residual carried in plus
            # the rounding noise nu ||g + e||^2 (cross term ~0), per element.
            self._compression_sq[name] = (e_sq + plan.rel_error * (sumsq + e_sq)) / g.size
            nnz, err_sq = quantize_finite(g, residual, plan.bits, cfg.bucket_size, seed, levels, scales)
            if residual is not None:
                self._residual_sq[name] = err_sq
            records.append(
                LayerRecord(
                    name=name,
                    numel=int(g.size),
                    kind=Kind.QUANT,
                    bits=plan.bits,
                    bucket_size=cfg.bucket_size,
                    scales=scales,
                    levels=levels,
                )
            )
            errors.append(plan.rel_error)
            nnzs.append(int(nnz))
        self._pending = list(zip(errors, nnzs, strict=True))
        return records

    # --- receiving -----------------------------------------------------------------------
    def decoded_last(self) -> dict[str, torch.Tensor] | None:
        """What ``decompress`` would return for the payload of the last ``compress`` call, without
        entropy-decoding it (the levels and scales are still here; the coding is lossless, so
        the result is bit-identical). The hook uses it for its own rank's payload. Raw layers
        are copied (they alias the caller's gradient, which the hook overwrites). None before
        the first ``compress``; each call's records are handed out once.
        """
        records, self._last_records = self._last_records, None
        if records is None:
            return None
        out = records_to_flat(records)
        for rec in records:
            if rec.kind != Kind.QUANT:
                out[rec.name] = out[rec.name].clone()
        return out

    # --- signals from the hook / trainer ---------------------------------------------------
    def set_lr(self, lr: float) -> None:
        """Called each step before backward; an lr drop or rise tightens the budget."""
        self.controller.policy.set_lr(float(lr), self.step)

    def observe_peers(self, decoded_by_rank: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Between-worker spread of one bucket's decoded gradients -> relative SGD noise per layer.

        spread = (1/(W-1)) sum_i ||d_i - mean||^2 per element, on a strided sample, minus what
        compression put into the d_i (the residual carried in + rounding noise, measured on
        this worker's own last compress as a proxy for every worker's), over the workers'
        mean ||d_i||^2 less that same compression part: the relative SGD noise (see
        BudgetPolicy.relative_noise).
        """
        self._observe_sampled(
            decoded_by_rank,
            lambda ts, stride: torch.stack([t.reshape(-1)[::stride] for t in ts]).double(),
            lambda t: t.numel(),
        )

    def observe_peer_records(self, records_by_rank: Sequence[Mapping[str, LayerRecord]]) -> None:
        """``observe_peers`` on records (decoded payloads before dequantization): the same
        statistics, from the same strided sample, but only the sampled elements are dequantized."""
        self._observe_sampled(records_by_rank, sample_stack, lambda rec: rec.numel)

    def _observe_sampled(
        self,
        by_rank: Sequence[Mapping[str, Any]],
        stack_of: Callable[[list[Any], int], torch.Tensor],
        numel_of: Callable[[Any], int],
    ) -> None:
        world = len(by_rank)
        if world < 2:
            return
        policy = self.controller.policy
        for name in by_rank[0]:
            numel = numel_of(by_rank[0][name])
            if numel < max(self.config.raw_below_numel, 1):
                continue
            stride = max(1, numel // _SPREAD_SAMPLE_NUMEL)
            try:
                # (world, n_sample) float64: every rank's layer at the same strided positions.
                stack = stack_of([d[name] for d in by_rank], stride)
            except (KeyError, RuntimeError):
                log.debug("observe_peers: layer %r missing or mis-sized on some rank; skipped", name)
                continue
            n_sample = stack.shape[1]
            spread = float((stack - stack.mean(dim=0)).pow(2).sum()) / (world - 1) / n_sample
            mean_sq = float(stack.pow(2).sum(dim=1).mean()) / n_sample
            # Nothing compressed here yet: all of the spread is taken as SGD noise.
            compression = self._compression_sq.get(name, 0.0)
            # The gradient power from all workers (decoded minus compression), not just this
            # one's: late in training single misclassified samples make one worker's gradient
            # 1000x another's for a step.
            policy.observe_spread(name, spread, compression, mean_sq - compression)

    def fold_residuals(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Add each layer's residual into its gradient (in place) and clear it: the hook calls
        this for a step it sends by plain all-reduce (see tail_ray/collective/gate.py)."""
        super().fold_residuals(grads)
        for name in grads:
            self._residual_sq.pop(name, None)

    # --- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Controller state and residuals, keyed by layer name."""
        return {
            "format": 1,
            "config": asdict(self.config),
            "layer_steps": dict(self._layer_steps),
            "controller": self.controller.state_dict(),
            "residuals": {name: torch.from_numpy(e.copy()) for name, e in self.feedback.state_dict().items()},
        }

    def load_state_dict(self, state: Mapping[str, Any], *, residuals: bool = True) -> None:
        """Restore controller state, and residuals unless ``residuals=False``.

        Residuals are per worker. On a restart with the SAME workers, restore them. On a
        resize (different world size) pass ``residuals=False``: every worker starts from a
        zero residual. That drops at most one step's quantization error per layer (bounded
        by tau * ||g||^2), whereas giving rank 0's residual to every new worker would apply
        it W times over. A residual whose size no longer matches its layer is reset to zero.
        """
        if int(state["format"]) != 1:
            raise ConfigError(f"unsupported TailCompressor state format {state['format']!r}")
        self._layer_steps = {str(k): int(v) for k, v in dict(state["layer_steps"]).items()}
        self.controller.load_state_dict(state["controller"])
        if residuals:
            self.feedback.load_state_dict(
                {
                    str(k): np.asarray(torch.as_tensor(v).detach().cpu(), dtype=np.float32)
                    for k, v in state["residuals"].items()
                }
            )
            self._residual_sq = {
                name: float(sum_squares(e)) for name, e in self.feedback.state_dict().items()
            }
        else:
            self.feedback.reset()
            self._residual_sq = {}


@register_compressor("tail")
def _make_tail(**settings: Any) -> TailCompressor:
    if "candidate_bits" in settings:
        settings["candidate_bits"] = tuple(settings["candidate_bits"])
    try:
        return TailCompressor(TailConfig(**settings))
    except TypeError as exc:
        raise ConfigError(f"bad settings for compressor 'tail': {exc}") from None
