"""TailCompressor: error feedback -> automatic per-layer bit-width -> stochastic quantization -> coding.

One self-describing payload per call. Per layer (a named parameter tensor):
- small and non-finite layers go raw fp32 (RecordCompressor's policy: a non-finite layer is
  sent UNCHANGED and its residual left as it was, so DDP and GradScaler see what plain DDP
  would);
- otherwise the controller (tail_ray.bitwidth) picks bits, and one fused numba pass computes
  g + e, the bucket scales, the stochastic levels and the new residual.
Encoding (dense/sparse choice, entropy coding) is the wire module's job (``encode_payload``).

``decompress`` needs no state. Through the compressor contract the collective also calls
``observe_peers`` (from ``aggregate``: between-worker spread -> SGD-noise estimate -> budget)
and ``set_lr`` (an lr drop tightens the budget).
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any

import numpy as np
import torch

from tail_ray.bitwidth.lowrank_agree import RankAgreement
from tail_ray.bitwidth.lowrank_choice import LowRankChooser
from tail_ray.bitwidth.plan import BitController, LayerPlan
from tail_ray.bitwidth.policy import BudgetPolicy
from tail_ray.compression.device import LayerArray
from tail_ray.compression.dither import dither_error_sq
from tail_ray.compression.feedback import ErrorFeedback
from tail_ray.compression.grid import F32_MAX
from tail_ray.compression.lowrank import compensated_of, matrix_shape, max_rank, send_lowrank
from tail_ray.compression.peer_reports import encode_report, merge_reports
from tail_ray.compression.peer_spread import PeerSums, sampled_layers
from tail_ray.compression.quantize import layer_seed, sum_squares
from tail_ray.compression.record_compressor import CompressedLayer, RecordCompressor, warn_nonfinite
from tail_ray.compression.records import LayerRecord, LowRankRecord, QuantRecord, RawRecord
from tail_ray.compression.tail_config import TailConfig
from tail_ray.errors import ConfigError

__all__ = ["TailCompressor", "TailConfig"]

log = logging.getLogger(__name__)

# Peers' spread is measured on at most this many elements per layer (a strided view): the
# estimate only needs to be right to a factor of ~1.5, and this keeps observe_peers cheap. On
# the char LM's layers a 4,096-element sample's relative spread is within 2-6 % (sd) of a
# 16,384-element one's, with no bias past 1 %, while the reading itself moves 10-37 % from one
# step to the next (W = 2): the budget's running average cannot tell them apart (stop 40).
_SPREAD_SAMPLE_NUMEL = 4096
# With error feedback at relative error nu the residual settles at ||e||^2 = nu / (1 - nu) ||g||^2
# (1x at tau_max = 0.5); past this many times ||g||^2 the layer is re-decided at once. An
# unstable plan (nu ~ 2 at 2 bits) crosses it within ~3-4 steps.
_RESIDUAL_LIMIT = 8.0


class TailCompressor(RecordCompressor):
    """Tail: see the module docstring. Stateful (residuals, controller); decoding is stateless."""

    name = "tail"
    device_backend = True  # CUDA gradients: the Triton kernels (see RecordCompressor)

    def __init__(self, config: TailConfig | None = None, *, feedback: ErrorFeedback | None = None) -> None:
        self.config = config if config is not None else TailConfig()
        super().__init__(self.config, feedback=feedback)
        self._seed = self.config.seed if self.config.seed is not None else secrets.randbits(32)
        self.controller = BitController(
            BudgetPolicy(self.config.budget_settings()),
            candidate_bits=self.config.candidate_bits,
            bucket_size=self.config.bucket_size,
            sample_numel=self.config.sample_numel,
            redecide_every_steps=self.config.redecide_every_steps,
            norm_drift=self.config.norm_drift,
            seed=self._seed,
            allocation=self.config.allocation_for(),
            layer_cap=self.config.layer_cap,
            tau_max=self.config.tau_max,
            rounding=self.config.rounding,
            bucket_choice=self.config.bucket_choice,
            row_buckets=self.config.row_buckets,
        )
        # Each layer counts its own calls: the hook compresses a subset of layers per call
        # (one DDP bucket), every layer once per compressed step, so a layer's count is the
        # number of compressed steps (steps the link-aware switch sent plain are not counted).
        self._layer_steps: dict[str, int] = {}
        self._compression_sq: dict[str, float] = {}  # latest compression noise per element
        # Budgets of the second stages made from this compressor (second_stage): they are told
        # the SGD noise of the MEAN, measured here on the shard this rank owns.
        self._mean_budgets: list[BudgetPolicy] = []
        self._slice_starts: dict[str, list[int]] = {}  # compress_shards: each layer's slice starts
        # What observe_peers measured since the last compress (spread, compression, grad_sq,
        # numel per layer): reported to the ranks that did not see those payloads.
        self._measured: dict[str, tuple[float, float, float, float]] = {}
        # Low-rank as a second way to send a matrix layer (None: off). Off for the sharded
        # exchanges (a product of factors has no element slices) and second stages.
        self.lowrank: LowRankChooser | None = None
        # What every rank sends, agreed from every rank's wants (bitwidth/lowrank_agree.py).
        self.agreement = RankAgreement(self.config.lowrank_agree)
        # Without error feedback every layer is quantized: a low-rank step leaves most of a
        # gradient to the residual (an ablation's TailConfig(error_feedback=False) stays valid).
        if self.config.lowrank != "off" and self.config.error_feedback:
            self.lowrank = LowRankChooser(
                self.config.lowrank_settings(),
                bucket_size=self.config.bucket_size,
                seed=self._seed,
                target=self.config.lowrank_target_for(),
            )
        self._shapes = self.controller.shapes  # one dict: low-rank and the row buckets read it

    @property
    def step(self) -> int:
        """Steps seen so far (the most calls any layer has had)."""
        return max(self._layer_steps.values(), default=0)

    @property
    def shard_alignment(self) -> int:
        """Slices are cut between quantizer buckets."""
        return self.config.bucket_size

    # --- sending -------------------------------------------------------------------------
    def begin_call(self, grads: Mapping[str, torch.Tensor]) -> None:
        self._measured.clear()  # a new step of these layers: measurements start afresh
        for name in grads:  # every layer counts, raw ones too
            self._layer_steps[name] = self._layer_steps.get(name, 0) + 1
        for name, t in grads.items():  # matrix shapes: low-rank's, and the controller's row buckets
            self._shapes[name] = tuple(t.shape)

    def compress(self, grads: Mapping[str, torch.Tensor]) -> bytes:
        payload = super().compress(grads)
        if self.lowrank is not None:
            for st in self._last_stats:  # the wire's bytes per layer: what low-rank must beat
                if st.code != "raw":
                    self.lowrank.observe_bytes(st.layer, st.encoded_bytes, st.code.startswith("lowrank"))
        return payload

    def compress_shards(
        self,
        grads: Mapping[str, torch.Tensor],
        shards: Sequence[Mapping[str, slice]],
        *,
        own_shard: int | None = None,
    ) -> list[bytes]:
        self.lowrank = None  # slices: quantized, at one bucket
        self.controller.fix_bucket()
        # Dithered slice by slice, each from its own seed: its owner decodes it alone (quantize_layer).
        cuts: dict[str, set[int]] = {}
        for shard in shards:
            for name, part in shard.items():
                cuts.setdefault(name, {0}).add(part.indices(grads[name].numel())[0])
        self._slice_starts = {name: sorted(starts) for name, starts in cuts.items()}
        try:
            return super().compress_shards(grads, shards, own_shard=own_shard)
        finally:
            self._slice_starts = {}

    def _lowrank_layer(
        self, name: str, g: LayerArray, sum_sq: float, nu_quant: float, step: int
    ) -> CompressedLayer | None:
        """The layer as low-rank factors when the chooser says so (None: quantize it)."""
        chooser, feedback = self.lowrank, self.feedback
        if chooser is None or feedback is None:
            return None
        shape = matrix_shape(self._shapes.get(name, ()))
        if shape is None or shape[0] * shape[1] != g.size or max_rank(*shape) < chooser.settings.ranks[0]:
            return None
        spent = chooser.decision_s
        # M = g + e where the layer is: numpy, or on its device (a CUDA layer: lowrank_device.py)
        compensated = compensated_of(feedback, name, g) if chooser.needs_trial(name, step) else None
        want = chooser.choose(name, shape, compensated, nu_quant, step)
        self.controller.decision_s += chooser.decision_s - spent
        # Sent: the rank every rank agreed on from the last exchange's wants (this rank's own
        # want before any exchange); quantized if it is not a rank this layer can take.
        rank = self.agreement.rank(name, want)
        if rank not in chooser.settings.ranks or rank > max_rank(*shape):
            self.agreement.sent_q.pop(name, None)
            return None
        if compensated is None:
            compensated = compensated_of(feedback, name, g)
        # Warm start: the Q this rank last sent, when the agreed rank is not this rank's own
        # choice; else the chooser's own (fitted only now, when it is sent: lowrank_choice).
        sent_q = self.agreement.sent_q.get(name)
        own_rank = chooser.rank_of(name)
        base = sent_q if sent_q is not None and own_rank != rank else chooser.warm_start(name)
        q_warm = chooser.fit_warm(base, shape[1], rank)
        # Exact error feedback: the residual is M minus what every receiver reconstructs.
        rec, q_next, e_sq, m_sq = send_lowrank(
            feedback,
            name,
            compensated,
            shape,
            q_warm,
            bits=chooser.settings.bits,
            bucket_size=self.config.bucket_size,
            seed=layer_seed(self._seed, step, name),
        )
        spent = chooser.decision_s
        if want:  # else sent at a rank only others wanted ("any"): this chooser stays quantized
            chooser.observe_lowrank(
                name, q_next, e_sq=e_sq, g_sq=sum_sq, m_sq=m_sq, nu_quant=nu_quant, step=step
            )
        self.controller.decision_s += chooser.decision_s - spent
        if self.agreement.agreed is not None:
            self.agreement.sent_q[name] = q_next
        rec = replace(rec, want=chooser.rank_of(name))  # what it wants after this step
        return CompressedLayer(rec, e_sq / m_sq if m_sq > 0 else 0.0)

    def compress_small(self, name: str, g: np.ndarray) -> CompressedLayer:
        """A layer below raw_below_numel (biases, norms), with no controller (too few elements
        to sample an error or a spread from): as float16 at ``small_layer_bits`` 16, quantized
        in one fused pass at 2..8, both with error feedback (what they drop is resent), or raw
        fp32 at 32 bits or when not finite."""
        bits = self.config.small_layer_bits
        if bits == 32:
            return super().compress_small(name, g)
        sum_sq = float(sum_squares(g))
        if not math.isfinite(sum_sq):
            warn_nonfinite(name)
            return super().compress_small(name, g)
        if bits == 16:
            return self._small_fp16(name, g)
        step = self._layer_steps[name] - 1
        seed = layer_seed(self._seed, step, name)
        # With error feedback, as documented for small_layer_bits: nearest where the large
        # layers are dithered (too few elements for dither's noise to average out).
        rounding = "nearest" if self.controller.rounding == "dither" else self.controller.rounding
        record, nnz = self.quantize_layer(name, g, bits, self.config.bucket_size, seed, rounding)
        return CompressedLayer(record, 0.0, nnz)

    def _small_fp16(self, name: str, g: np.ndarray) -> CompressedLayer:
        """g + e as float16 (IEEE round-to-nearest-even: the same bits on every CPU), the
        rounding left in e; fp32 (e emptied) where a value is past float16's range."""
        feedback = self.feedback
        e = feedback.buffer(name, g.size) if feedback is not None else None
        x = g if e is None else g + e
        with np.errstate(over="ignore"):
            half = x.astype(np.float16)
        finite = bool(np.isfinite(half).all())
        sent = half.astype(np.float32) if finite else np.clip(x, -F32_MAX, F32_MAX).astype(np.float32)
        if feedback is not None and e is not None:
            if finite:  # float16's rounding stays, to be sent on later steps
                np.subtract(x, sent, out=e)
                feedback.measured(name, float(sum_squares(e)))
            else:  # sent as float32: nothing left behind
                e.fill(0.0)
                feedback.measured(name, 0.0)
        return CompressedLayer(RawRecord(name, sent, fp16=finite), 0.0, None)

    def compress_layer(self, name: str, g: LayerArray, sum_sq: float) -> CompressedLayer:
        step = self._layer_steps[name] - 1  # this call's 0-based step of the layer
        dither = self.controller.rounding == "dither"
        # A dithered layer keeps no residual: only one left by low-rank (or a checkpoint of
        # another rounding) is still there, to be sent once.
        carried = self.feedback is not None and name in self.feedback
        residual = self.residual_of(name, g) if carried or not dither else None
        # ||e||^2 of the residual carried in (the kernel measured it when it wrote it): for the runaway
        # guard and for observe_peers' account of what compression put into the decoded gradients.
        e_sq = self.feedback.norm_sq(name) if self.feedback is not None else 0.0
        # Error feedback is only stable while nu < 1; a residual this far above the larger of this
        # step's and the typical (long-average) ||g||^2 means the last (sampled) estimate was wrong
        # for this layer: decide again now, on g + e.
        typical = self.controller.policy.typical_norm(name) or 0.0
        if e_sq > _RESIDUAL_LIMIT * max(sum_sq, typical * typical):
            self.controller.invalidate(name)
        plan = self.controller.plan(name, g, residual, step, math.sqrt(sum_sq))
        if (chooser := self._chooser()) is not None:
            nu_allowed = plan.rel_error if chooser.target == "bits" else plan.tau
            lowrank = self._lowrank_layer(name, g, sum_sq, nu_allowed, step)
            if lowrank is not None:
                return lowrank
        if dither:
            return self._dither_layer(name, g, (sum_sq, e_sq), plan, step)
        seed = layer_seed(self._seed, step, name)
        # Compression's part of this worker's decoded gradient, per element: the residual carried in
        # plus the rounding noise nu ||g + e||^2 (cross term ~0) of the plan's bucket and bits.
        self._compression_sq[name] = (e_sq + plan.rel_error * (sum_sq + e_sq)) / g.size
        # The rounding the controller's error model priced (resolved once, from config.rounding).
        record, nnz = self.quantize_layer(
            name, g, plan.bits, plan.bucket_size, seed, self.controller.rounding
        )
        return CompressedLayer(self._with_want(record), plan.rel_error, nnz)

    def _dither_layer(
        self, name: str, g: LayerArray, sums_sq: tuple[float, float], plan: LayerPlan, step: int
    ) -> CompressedLayer:
        """g (plus any residual left, sent once) dithered at the plan's bits, or at the start
        bits (``TailConfig.start_bits``) in the layer's first steps; its error is known exactly
        from the scales.
        ``sums_sq``: ||g||^2 and the ||e||^2 of the residual carried in."""
        g_sq, e_sq = sums_sq
        bits = self.config.start_bits() if step < self.config.dither_start_steps else plan.bits
        seed = layer_seed(self._seed, step, name)
        cuts = self._slice_starts.get(name)
        record, nnz = self.quantize_layer(name, g, bits, plan.bucket_size, seed, "dither", cuts=cuts)
        err_sq = dither_error_sq(record.scales, bits, plan.bucket_size, record.numel)
        # Compression's part of the decoded gradient: the residual sent with it (if any) and
        # the dither noise (cross term ~0), as the nearest path counts it.
        self._compression_sq[name] = (e_sq + err_sq) / record.numel
        x_sq = g_sq + e_sq
        return CompressedLayer(self._with_want(record), err_sq / x_sq if x_sq > 0 else 0.0, nnz)

    def _with_want(self, record: QuantRecord) -> QuantRecord:
        """The record with the rank this rank's low-rank chooser wants for the layer."""
        rank = chooser.rank_of(record.name) if (chooser := self._chooser()) is not None else 0
        return replace(record, want=rank) if rank else record

    def _chooser(self) -> LowRankChooser | None:
        """The low-rank chooser in force: under "auto" only while the optimizer is known to be
        linear in the gradient (``set_linear_optimizer``; why: TailConfig.lowrank)."""
        return self.lowrank if self.config.lowrank == "on" or self.controller.policy.linear else None

    def second_stage(self) -> TailCompressor:
        """A Tail compressor for the mean an owner re-compresses, with its own residuals and a
        budget relative to the mean's own SGD noise: the mean of W workers has 1/W of one
        worker's SGD noise, so its second-stage error is held to ``noise_fraction`` of that
        (see ``observe_peers``), the same rule as the first stage's, applied to what is sent."""
        stage = self.spawn()
        assert isinstance(stage, TailCompressor)
        stage.lowrank = None  # it re-compresses slices, at one bucket
        stage.controller.fix_bucket()
        self._mean_budgets.append(stage.controller.policy)
        stage.set_linear_optimizer(self.controller.policy.linear)
        return stage

    # --- signals from the collective / trainer ---------------------------------------------
    def set_lr(self, lr: float) -> None:
        """Called each step before backward; an lr drop or rise tightens the budget."""
        self.controller.policy.set_lr(float(lr), self.step)

    def set_linear_optimizer(self, linear: bool) -> None:
        """The budget's noise fraction follows the optimizer (bitwidth/policy.py), in both stages."""
        for budget in (self.controller.policy, *self._mean_budgets):
            budget.set_linear(linear)

    def spread_strides(self, records_by_rank: Sequence[Mapping[str, LayerRecord]]) -> dict[str, int]:
        """The layers ``observe_peers`` reads the spread of, at what stride: every layer past
        raw_below_numel that no rank sent low-rank, sampled at most _SPREAD_SAMPLE_NUMEL times."""
        if len(records_by_rank) < 2:
            return {}
        strides = {}
        for name, first in records_by_rank[0].items():
            if first.numel < max(self.config.raw_below_numel, 1):
                continue
            if any(isinstance(d.get(name), LowRankRecord) for d in records_by_rank):
                # A low-rank layer's workers differ by their subspaces as much as by their
                # batches: no SGD-noise reading; its budget keeps the last one measured.
                continue
            strides[name] = max(1, first.numel // _SPREAD_SAMPLE_NUMEL)
        return strides

    def observe_peers(
        self, records_by_rank: Sequence[Mapping[str, LayerRecord]], sums: Mapping[str, PeerSums] | None = None
    ) -> None:
        """Between-worker spread of one exchange's decoded records -> relative SGD noise per layer.

        spread = (1/(W-1)) sum_i ||d_i - mean||^2 per element, on a strided sample (only the sampled elements
        are dequantized), minus what compression put into the d_i (the residual carried in + rounding noise,
        measured on this worker's own last compress as a proxy for every worker's), over the workers' mean
        ||d_i||^2 less that same compression part: the relative SGD noise (BudgetPolicy.relative_noise).
        ``sums``: ``spread_strides``' sums, read by ``aggregate``'s mean pass (None: sampled here).
        """
        if self.lowrank is not None:
            self.agreement.observe(records_by_rank)  # the next step's low-rank choices
        if sums is None:  # every rank's layer at the same strided positions (peer_spread.py)
            sums = sampled_layers(records_by_rank, self.spread_strides(records_by_rank))
        for name, first in records_by_rank[0].items():  # in the records' order, as before
            got = sums.get(name)
            if got is not None:
                self._observe_sums(name, got, first.numel)

    def _observe_sums(self, name: str, sums: PeerSums, numel: int) -> None:
        """One layer's spread sums -> its budget's noise reading (and the second stages')."""
        world, n_sample = sums.world, sums.n
        spread = sums.spread / (world - 1) / n_sample
        mean_sq = sums.power / world / n_sample
        # Nothing compressed here yet: all of the spread is taken as SGD noise.
        compression = self._compression_sq.get(name, 0.0)
        # The gradient power from all workers (decoded minus compression), not just this
        # one's: late in training single misclassified samples make one worker's gradient
        # 1000x another's for a step.
        self._observe(name, spread, compression, mean_sq - compression)
        self._measured[name] = (spread, compression, mean_sq - compression, float(numel))
        if self._mean_budgets:
            # The second stage compresses the mean m of these W decoded gradients. Its SGD
            # noise per element is (spread - compression) / W; its signal, ||m||^2 less the
            # compression noise the mean still carries (compression / W).
            m_sq = sums.mean / n_sample
            sgd = max(0.0, spread - compression) / world
            for budget in self._mean_budgets:
                budget.observe_spread(name, sgd, 0.0, m_sq - compression / world)

    def _observe(self, name: str, spread: float, compression: float, grad_sq: float) -> None:
        self.controller.policy.observe_spread(name, spread, compression, grad_sq)

    def peer_report(self, names: Sequence[str]) -> bytes:
        """This rank's measurements of ``names`` for the ranks that own none (peer_reports.py)."""
        return encode_report(self._measured, names)

    def observe_reports(self, reports: Sequence[tuple[Sequence[str], bytes]]) -> None:
        """Other owners' measurements, one observation per layer this rank did not measure,
        so the running average moves once per step as after an all-gather."""
        for name, (spread, compression, grad_sq) in merge_reports(reports, self._measured).items():
            self._observe(name, spread, compression, grad_sq)

    # --- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Controller state, the low-rank chooser's, and residuals, keyed by layer name.

        Format 3: format 1 plus ``lowrank`` (``LowRankChooser.state_dict()``, None when this
        compressor has no chooser: lowrank off, or a sharded exchange / second stage; format 2)
        and ``lowrank_agreement`` (``RankAgreement.state_dict()``: the next step's agreed ranks)."""
        return {
            "format": 3,
            "config": asdict(self.config),
            "layer_steps": dict(self._layer_steps),
            "controller": self.controller.state_dict(),
            "lowrank": self.lowrank.state_dict() if self.lowrank is not None else None,
            "lowrank_agreement": self.agreement.state_dict(),
            **super().state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any], *, residuals: bool = True) -> None:
        """Restore the controller state always, and the residuals unless ``residuals=False``
        (see ``RecordCompressor.load_state_dict``).

        The low-rank chooser's state (format 2) goes to ``LowRankChooser.load_state_dict``
        (other settings: a warning, the layers re-trial). Format 1, or a state saved with
        lowrank off, starts the chooser fresh; with lowrank off here a saved chooser state is
        ignored, and the quantizer sends its layers' restored residuals (nothing is lost).
        The agreed ranks (format 3) are restored with the residuals (the same workers go on);
        on a resize, or from format 1 / 2, every layer is quantized until its first exchange."""
        fmt = state["format"]
        if fmt not in (1, 2, 3):
            raise ConfigError(f"unsupported TailCompressor state format {fmt!r}, this build reads 1 to 3")
        self._layer_steps = {str(k): int(v) for k, v in dict(state["layer_steps"]).items()}
        self.controller.load_state_dict(state["controller"])
        self._load_lowrank(state["lowrank"] if fmt >= 2 else None)
        self.agreement.reset()
        if fmt == 3 and residuals:
            self.agreement.load_state_dict(state["lowrank_agreement"])
        super().load_state_dict(state, residuals=residuals)

    def _load_lowrank(self, saved: Mapping[str, Any] | None) -> None:
        if saved is not None and self.lowrank is not None:
            self.lowrank.load_state_dict(saved)
        elif saved is not None:
            log.info("checkpoint has low-rank state but this compressor's lowrank is off: ignored")
