"""Per layer: quantize, or send low-rank factors? Chosen by measured error and bytes.

The error both are held to is what error feedback leaves unsent, relative to the gradient:
the residual ratio rho = ||e||^2 / ||g||^2 in steady state. For the quantizer at relative
error nu_b (the bits the budget picked), e' = (g + e) - Q(g + e) settles at
rho_q = nu_b / (1 - nu_b). A per-step error is the wrong yardstick for low-rank: a rank-r
approximation leaves most of one step's gradient (nu 0.5-0.9 on these models' layers), yet
with error feedback the persistent directions pile up in e until they are sent, and the
residual ratio can sit well below the quantizer's (digits' fc1 at rank 8: rho 0.03 against
0.08 at 4 bits; measured offline on captured gradients, docs/engine.md). So:

- enter: every ``trial_every_steps`` a quantized layer runs a trial, one power iteration of
  M = g + e at the largest rank R whose factors would save ``min_gain`` of the layer's
  measured quantized bytes; the singular values of P^T M give the captured energy of every
  rank <= R in that subspace, hence nu_r, and rho_r = nu_r / (1 - nu_r) (conservative: in
  steady state error feedback makes M more low-rank than a fresh gradient). The smallest
  candidate rank with rho_r <= rho_q and the byte saving wins; none: stay quantized.
- stay: while low-rank, the residual's ratio is MEASURED every step (an EMA, the kernel's own
  ||e||^2); past ``exit_slack`` x rho_q (the budget's current bits: a critical phase that
  tightens tau tightens this too) after ``dwell_steps``, the next candidate rank that still
  saves bytes is tried (and the layer never goes below it again while low-rank), else the
  layer goes back to the quantizer (its residual carries over: nothing is lost), and waits
  twice as long before its next trial. Every ``trial_every_steps`` the current factors'
  singular values say whether a lower rank would keep the residual under half the target.
- rows left behind (lowrank_rows.py): a trial also fails where the typical row of the P it
  would send gets more rounding noise than signal in P's grid.
- bytes: the quantized bytes are the layer's own last payload; low-rank bytes are bounded by
  bit-packed factors (``lowrank.factor_bytes``), then measured. A low-rank layer whose
  measured bytes stop saving ``min_gain / 2`` goes back.

Costs: ~4 small products per trial, in the controller's ``decision_s``. What a rank SENDS is
the rank every rank agreed on from these wants (lowrank_agree.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tail_ray.bitwidth.lowrank_energy import captured_energy, warm_linalg
from tail_ray.bitwidth.lowrank_rows import rows_lost_share, warm_rows
from tail_ray.bitwidth.lowrank_state import (
    MAX_BACKOFF,
    STATE_FORMAT,
    LayerState,
    layer_from_state,
    layer_to_state,
    settings_changes,
)
from tail_ray.compression.lowrank import Matrix, factor_bytes, max_rank, trial_view
from tail_ray.errors import ConfigError

log = logging.getLogger(__name__)

LOWRANK_MODES = ("off", "auto", "on")  # "auto": for optimizers linear in the gradient
LOWRANK_TARGETS = ("auto", "bits", "budget")  # "auto": TailConfig.lowrank_target_for
TRIAL_TIMES_KEPT = 4096  # the latest trials' times a chooser keeps for the benchmarks


@dataclass(frozen=True)
class LowRankSettings:
    """ranks: the ranks a layer may take (ascending). bits: the factors' quantization.
    trial_every_steps / start_step: when quantized layers try low-rank. min_gain: the share
    of the quantized bytes low-rank must save. exit_slack / dwell_steps / ema: how far and
    how long the measured residual ratio may exceed the quantizer's before the layer moves."""

    ranks: tuple[int, ...] = (1, 2, 4, 8, 16)
    bits: int = 8
    trial_every_steps: int = 20
    start_step: int = 20
    min_gain: float = 0.2
    exit_slack: float = 1.5
    dwell_steps: int = 5
    ema: float = 0.2

    def __post_init__(self) -> None:
        ranks = tuple(sorted(int(r) for r in self.ranks))
        # 255 at most: a record's want is one byte (wire.MAX_WANT)
        if not ranks or ranks[0] < 1 or len(set(ranks)) != len(ranks) or ranks[-1] > 255:
            raise ConfigError(f"lowrank_ranks must be distinct integers in 1..255, got {self.ranks!r}")
        object.__setattr__(self, "ranks", ranks)
        if not 2 <= self.bits <= 8:
            raise ConfigError(f"lowrank_bits must be in 2..8, got {self.bits}")
        if not 0 <= self.min_gain < 1:
            raise ConfigError(f"min_gain must be in [0, 1), got {self.min_gain}")


def random_directions(cols: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """``width`` random start directions (cols x width, float32 +-1): a power iteration's
    start needs only directions in general position. Signs from the generator's integers:
    torch's Gaussian draws take a vector path (AVX2 or not) chosen by the CPU, its integer
    draws do not, so the same seed gives the same directions on every machine."""
    return torch.randint(0, 2, (cols, width), generator=gen, dtype=torch.int8).to(torch.float32) * 2 - 1


class LowRankChooser:
    """See the module docstring. One per compressor; state per layer name."""

    def __init__(
        self, settings: LowRankSettings, *, bucket_size: int, seed: int, target: str = "bits"
    ) -> None:
        self.settings = settings
        self.bucket_size = bucket_size
        # What the residual is held to (TailConfig.lowrank_target; the compressor applies it):
        # kept with the state, as ranks chosen under one target are not another's.
        self.target = target
        self._gen = torch.Generator().manual_seed(int(seed))
        self._layers: dict[str, LayerState] = {}
        self.decision_s = 0.0
        # (wall s, this thread's CPU s) of the latest trials: the decision share alone cannot
        # tell many cheap trials from a few slow ones, and issue 15's cost was the latter.
        self.trial_times_s: deque[tuple[float, float]] = deque(maxlen=TRIAL_TIMES_KEPT)
        self.rows_left_behind: dict[str, int] = {}  # layer -> trials failed (lowrank_rows.py)
        # Here, at hook set-up, not in the first trial: see lowrank_energy.warm_linalg.
        warm_linalg()
        warm_rows()

    # --- queries ---------------------------------------------------------------------------
    def rank_of(self, name: str) -> int:
        """The layer's current rank (0: quantized): what this rank wants to send."""
        layer = self._layers.get(name)
        return layer.rank if layer is not None else 0

    def warm_start(self, name: str) -> torch.Tensor | None:
        """The layer's Q to start its next power iteration from (cols x rank; None: quantized)."""
        layer = self._layers[name]
        if layer.q_wide is not None:  # sent wider than it wants: its best directions, now needed
            layer.q_warm = self.fit_warm(layer.q_wide, layer.cols, layer.rank)
            layer.q_wide = None
        return layer.q_warm

    def _fitted(self, name: str) -> LayerState:
        self.warm_start(name)
        return self._layers[name]

    def fit_warm(self, q: torch.Tensor | None, cols: int, width: int) -> torch.Tensor:
        """A warm start of ``width`` columns from ``q``: ``q`` itself, its best directions (a
        lower rank), or ``q`` and new random ones from this chooser's generator (a higher)."""
        have = 0 if q is None else q.shape[1]
        if q is not None and have == width:
            return q
        if q is not None and have > width:
            return captured_energy(q)[1][:, :width].contiguous()
        extra = random_directions(cols, width - have, self._gen)
        return extra if q is None else torch.cat((q, extra), dim=1).contiguous()

    def ranks(self) -> dict[str, int]:
        return {name: layer.rank for name, layer in self._layers.items()}

    def _lowrank_bytes(self, layer: LayerState, rank: int) -> float:
        return float(factor_bytes(layer.rows, layer.cols, rank, self.settings.bits, self.bucket_size))

    def _affordable(self, layer: LayerState, above: int = 0) -> list[int]:
        """Candidate ranks above ``above`` whose factors save ``min_gain`` of the quantized bytes."""
        if layer.quant_bytes is None:
            return []
        limit = (1 - self.settings.min_gain) * layer.quant_bytes
        top = max_rank(layer.rows, layer.cols)
        return [r for r in self.settings.ranks if above < r <= top and self._lowrank_bytes(layer, r) <= limit]

    # --- the decision, per layer and step ---------------------------------------------------
    def choose(
        self,
        name: str,
        shape: tuple[int, int],
        compensated: Matrix | None,
        nu_quant: float,
        step: int,
    ) -> int:
        """This step's rank for the layer (0: quantize). ``compensated`` is g + e (flat
        float32), needed only on a trial step (None: no trial possible now); ``nu_quant`` the
        quantizer's relative error at the bits the budget picked."""
        t0 = time.perf_counter()
        layer = self._layers.get(name)
        if layer is not None and (layer.rows, layer.cols) != shape:
            # Only a restored state can disagree (a layer keeps its shape within a run): the
            # checkpoint is of another model, or the model changed. Its rank, warm starts and
            # bytes are those of another matrix: dropped, the layer starts over.
            log.warning(
                "low-rank state of layer %r is for a %dx%d matrix, the layer is now %dx%d: "
                "dropped (the layer is quantized until a trial picks a rank again)",
                name,
                layer.rows,
                layer.cols,
                *shape,
            )
            layer = None
        if layer is None:
            layer = self._layers[name] = LayerState(*shape, next_trial=self.settings.start_step)
        if layer.rank == 0 and step >= layer.next_trial and compensated is not None:
            miss = self._trial(name, layer, compensated, self._target(nu_quant))
            if miss <= 1:
                layer.backoff = 1
            elif self._affordable(layer):
                # No rank met the target. A trial costs ~0.3-0.5 ms of CPU (384 x 128 at rank
                # 16), more when preempted on a loaded host: a layer that keeps failing is
                # tried less often, 2x later after a near miss, 4x after a clear one (the best
                # rank's estimate over 2x the target), up to 16x the interval.
                layer.backoff = min(layer.backoff * (2 if miss <= 2 else 4), MAX_BACKOFF)
            layer.next_trial = step + self.settings.trial_every_steps * layer.backoff
        self.decision_s += time.perf_counter() - t0
        return layer.rank

    def needs_trial(self, name: str, step: int) -> bool:
        """Whether ``choose`` would run a trial this step (the caller then builds g + e)."""
        layer = self._layers.get(name)
        if layer is None:
            return step >= self.settings.start_step
        return layer.rank == 0 and step >= layer.next_trial and bool(self._affordable(layer))

    @staticmethod
    def _target(nu_quant: float) -> float:
        nu = min(max(float(nu_quant), 0.0), 0.99)
        return nu / (1 - nu)

    def _trial(self, name: str, layer: LayerState, compensated: Matrix, target: float) -> float:
        """How far the best affordable rank's estimate is from the target (<= 1: it met it, and
        the layer is low-rank from now; inf: nothing to try)."""
        ranks = self._affordable(layer)
        if not ranks:
            return math.inf
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            return self._run_trial(name, layer, compensated, target, ranks)
        finally:
            self.trial_times_s.append((time.perf_counter() - wall0, time.thread_time() - cpu0))

    def _run_trial(
        self, name: str, layer: LayerState, compensated: Matrix, target: float, ranks: list[int]
    ) -> float:
        top = ranks[-1]
        m, m_sq, power_step = trial_view(compensated, layer.rows, layer.cols)
        # ||M||^2 by the project's fixed-order numba sum, not np.dot: numpy's OpenBLAS runs a
        # dot product of over 10k elements on all its threads, and with the cores busy (the
        # other ranks, a neighbour) the caller spins on threads that are not running: this line
        # was most of the trials' fat tail (issue 15: 2-12 ms, LM layers of 16k-65k elements).
        # Its bits then no longer depend on the BLAS's thread count either. (A CUDA layer's M
        # stays on its device: its norm and products are computed there, lowrank_device.py.)
        if not (m_sq > 0 and math.isfinite(m_sq)):
            return math.inf
        q = layer.trial_q
        iterations = 1
        if q is None or q.shape[1] != top:
            # A cold start: from random directions one iteration underestimates what rank r
            # keeps (measured on digits: fc1 then entered 80-280 steps later or not at
            # all, 11.4x instead of 16.8x over 5 seeds); later trials start from the last Q.
            q = random_directions(layer.cols, top, self._gen)
            iterations = 2
        for _ in range(iterations):
            _p, q = power_step(m, q)
        layer.trial_q = q
        captured, basis = captured_energy(q)
        best = math.inf
        for r in ranks:
            nu = max(0.0, 1.0 - float(captured[r - 1]) / m_sq)
            ratio = nu / (1 - nu) if nu < 1 else math.inf
            if ratio <= target:
                # The P rank r would send: its typical row lost in its grid fails the trial.
                p_r = power_step(m, basis[:, :r].contiguous())[0].numpy()
                if rows_lost_share(p_r, self.settings.bits, self.bucket_size) > 0.5:
                    self.rows_left_behind[name] = self.rows_left_behind.get(name, 0) + 1
                    return math.inf
                layer.start_rank(r, basis[:, :r].contiguous())
                return 0.0
            best = min(best, ratio)
        return best / target if target > 0 else math.inf

    # --- what the step measured -------------------------------------------------------------
    def observe_lowrank(
        self,
        name: str,
        q_next: torch.Tensor,
        *,
        e_sq: float,
        g_sq: float,
        m_sq: float,
        nu_quant: float,
        step: int,
    ) -> None:
        """After a low-rank step: the next warm start, the residual ratio it left (``e_sq`` over
        ``g_sq``), and ||g + e||^2 of the step (``m_sq``: a lower rank's estimate)."""
        t0 = time.perf_counter()
        layer = self._layers[name]
        if q_next.shape[1] > layer.rank:
            # Sent at a higher rank another rank wanted ("any"). Its best ``rank`` directions
            # (captured_energy: 0.15-0.7 ms here) are fitted only when this rank's own choice is
            # sent again (warm_start): fitted here every step, they were most of the agreed
            # variant's decision time (digits: 5-8 % of compress time, issue 15), and unused
            # while the agreed rank stays above this rank's own.
            layer.q_warm, layer.q_wide = None, q_next
        else:
            layer.q_warm, layer.q_wide = self.fit_warm(q_next, layer.cols, layer.rank), None
        layer.steps_in_mode += 1
        if g_sq > 0 and math.isfinite(e_sq):
            ratio = e_sq / g_sq
            a = self.settings.ema
            layer.ratio_ema = ratio if layer.ratio_ema is None else (1 - a) * layer.ratio_ema + a * ratio
        target = self._target(nu_quant)
        too_big = (
            layer.lowrank_bytes is not None
            and layer.quant_bytes is not None
            and (layer.lowrank_bytes > (1 - self.settings.min_gain / 2) * layer.quant_bytes)
        )
        if too_big:
            self._leave(layer, step)
        elif (
            layer.steps_in_mode >= self.settings.dwell_steps
            and layer.ratio_ema is not None
            and layer.ratio_ema > self.settings.exit_slack * target
        ):
            higher = self._affordable(layer, above=layer.rank)
            if higher:
                layer.start_rank(higher[0], self.fit_warm(q_next, layer.cols, higher[0]))
                layer.floor = higher[0]
            else:
                self._leave(layer, step)
        elif layer.steps_in_mode % self.settings.trial_every_steps == 0:
            self._try_lower(layer, q_next, m_sq, target)
        self.decision_s += time.perf_counter() - t0

    def _try_lower(self, layer: LayerState, q: torch.Tensor, m_sq: float, target: float) -> None:
        """A lower rank, where the current factors say it would meet the target too: Q = M^T P
        with P orthonormal, so the singular values of Q give the energy every lower rank keeps
        of this step's M (an entry trial's estimate, on the steady-state M)."""
        lower = [r for r in self.settings.ranks if layer.floor <= r < layer.rank]
        if not lower or not (m_sq > 0 and math.isfinite(m_sq)):
            return
        captured, basis = captured_energy(q)
        for r in lower:
            nu = max(0.0, 1.0 - float(captured[r - 1]) / m_sq)
            # Half the target: a rank that only just fits this step's M outgrows it once the
            # directions it drops pile up in the residual (measured: rank 4 -> 1 -> 2 -> 4).
            if nu < 1 and nu / (1 - nu) <= target / 2:
                layer.start_rank(r, basis[:, :r].contiguous())
                return

    def _leave(self, layer: LayerState, step: int) -> None:
        layer.rank = 0
        layer.floor = 0
        layer.q_warm = layer.q_wide = None
        layer.ratio_ema = None
        layer.steps_in_mode = 0
        layer.backoff = min(layer.backoff * 2, MAX_BACKOFF)
        layer.next_trial = step + self.settings.trial_every_steps * layer.backoff

    def observe_bytes(self, name: str, encoded_bytes: int, lowrank: bool) -> None:
        """A layer's payload bytes of this step (the wire's own count)."""
        layer = self._layers.get(name)
        if layer is None:
            return
        if lowrank:
            layer.lowrank_bytes = float(encoded_bytes)
        else:
            layer.quant_bytes = float(encoded_bytes)

    # --- checkpoint -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything later decisions and payloads depend on: the settings it was made with,
        the cold-start generator's state, and per layer (by name) its shape, rank (0:
        quantized), floor, trial schedule (``next_trial``, ``backoff``), the measured residual
        ratio and bytes, the steps in its mode, and the warm starts (``q_warm``: the next
        low-rank step's Q; ``trial_q``: the next trial's), as CPU tensor copies. Only tensors,
        numbers, strings, tuples and dicts: ``torch.load(..., weights_only=True)`` reads it."""
        return {
            "format": STATE_FORMAT,
            "settings": self._settings_key(),
            "generator": self._gen.get_state(),
            # warm_start first: a pending fit is saved as the q_warm it stands for.
            "layers": {name: layer_to_state(self._fitted(name)) for name in self._layers},
        }

    def _settings_key(self) -> dict[str, Any]:
        return {**asdict(self.settings), "bucket_size": self.bucket_size, "target": self.target}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``. What does not fit is dropped, never raised on:

        - made with other settings (any of ``LowRankSettings``, the bucket size or the target): nothing is
          restored, every layer starts over by trial, with one warning naming the settings
          and the layers. The saved ranks, floors and bytes were chosen and measured under
          those settings (a rank no longer allowed, bytes at other factor bits) and would be
          applied blindly otherwise;
        - a layer whose saved state is inconsistent (a warm start that is not cols x rank, a
          rank not among the candidates): that layer starts over, with a warning naming it;
        - a layer whose shape changed: found at its first ``choose`` (the chooser learns
          shapes from the gradients), dropped there with a warning naming it.

        Why not ``ConfigError``: this state is a warm start, not correctness. Losing it costs
        what a restart cost before it was saved (quantized layers until the trials find their
        ranks again), while an error would keep a job from resuming after a deliberate change
        of its low-rank settings, with nothing to fix but undoing the change. Only a state that
        is not a chooser state at all (another format, missing fields) raises ``ConfigError``.
        """
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise ConfigError(
                f"low-rank chooser state format {found!r}, this build reads {STATE_FORMAT}: "
                "pass LowRankChooser.state_dict() of a compatible build"
            )
        try:
            saved_settings = dict(state["settings"])
            generator = state["generator"]
            saved_layers = {str(name): dict(layer) for name, layer in dict(state["layers"]).items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"low-rank chooser state is incomplete ({exc!r}): not from state_dict()"
            ) from None
        changes = settings_changes(saved_settings, self._settings_key())
        if changes:
            log.warning(
                "low-rank state was saved with other settings (%s): not restored; layers %s "
                "start quantized and find their ranks again by trial",
                changes,
                sorted(saved_layers) or "(none)",
            )
            return
        try:
            self._gen.set_state(generator.clone())
        except (AttributeError, RuntimeError, TypeError) as exc:
            raise ConfigError(
                f"low-rank chooser state's generator is not a torch.Generator state: {exc}"
            ) from None
        layers: dict[str, LayerState] = {}
        for name, saved in saved_layers.items():
            try:
                layers[name] = layer_from_state(saved, self.settings.ranks)
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("low-rank state of layer %r dropped (%s): the layer re-trials", name, exc)
        self._layers = layers
