"""Link-aware switch: compress only while compressing makes the training step faster.

Compression pays when the network is the bottleneck. On a link faster than the codec (two
ranks on one host, NVLink, a 100 Gbit fabric) plain all-reduce wins: it overlaps backward and
costs no CPU, while compress + exchange + decode sit on the critical path. Users should not
have to know which case they are in, so the hook measures it:

    warm-up    ``warmup_steps`` compressed steps, not timed (numba JIT, DDP's bucket rebuild)
    trial      ``trial_steps`` timed steps in each mode: compressed, then plain all-reduce
    decide     the mode with the smaller median step time, agreed by every rank
    settled    that mode for ``recheck_every_steps`` x gap**2 (gap = slower / faster median,
               capped at 64x) x 2**(re-checks in a row that confirmed it), at most
               ``max_recheck_every_steps``; then the other mode is tried again (the link, the
               load or the model's bit-widths may have changed).
               Sooner when the mode in use gets ``abort_ratio`` slower than when it was chosen
               (checked every 10 steps).

A trial of a mode stops as soon as the median of its steps so far is more than
``abort_ratio`` times the other mode's (checked after every trial step, so usually after the
first): on a 100 Mbit/s link one all-reduce step of a large model can cost 10x a compressed
one, and a re-check must not cost a whole trial.

Costs: on trial steps and every 10th settled step, bucket 0's hook runs one blocking
all-reduce of one or two floats (on NCCL a host sync in the middle of backward); the other
steps add nothing. Every rank must be given the same ``link_*`` settings (they are part of
the job's config), or their decision points differ and the collectives stop matching.

The measured quantity is the wall time between consecutive calls of the hook for DDP bucket 0,
i.e. the whole training iteration as the user sees it, not a model of it.

Agreement: every rank must pick the same mode for the same step, or the collectives of
different ranks stop matching. Each rank's medians are combined with one all-reduce (MAX: the
slowest rank's view) at every decision point; decision points fall on the same step on every
rank because every rank counts the same steps. The ``agree`` callable is that all-reduce;
tests pass the identity.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from tail_ray.errors import ConfigError

log = logging.getLogger(__name__)


class Mode(StrEnum):
    COMPRESS = "compress"
    ALLREDUCE = "allreduce"


def _other(mode: Mode) -> Mode:
    return Mode.ALLREDUCE if mode == Mode.COMPRESS else Mode.COMPRESS


@dataclass(frozen=True)
class LinkGateConfig:
    """Settings of the link-aware switch (hook settings ``link_aware``, ``link_*``).

    enabled: False pins the compressed path (for ablations and the benchmark's codec figures).
    warmup_steps: first compressed steps not timed (JIT compilation, DDP bucket rebuild).
    trial_steps: timed steps per mode in a trial; the median decides.
    recheck_every_steps / max_recheck_every_steps: steps in the chosen mode before the other
        is tried again after a near tie; longer after a clear decision and after each re-check
        that confirmed it (see the module docstring), never more than the max.
    abort_ratio: stop a trial of the mode not in use once its step is this much slower.
    """

    enabled: bool = True
    warmup_steps: int = 5
    trial_steps: int = 5
    recheck_every_steps: int = 25
    max_recheck_every_steps: int = 3200
    abort_ratio: float = 1.5

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"link_aware must be true or false, got {self.enabled!r}")
        for name in ("warmup_steps", "trial_steps", "recheck_every_steps", "max_recheck_every_steps"):
            value = getattr(self, name)
            least = 0 if name == "warmup_steps" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"link_{name} must be an integer >= {least}, got {value!r}")
        if self.max_recheck_every_steps < self.recheck_every_steps:
            raise ConfigError(
                f"link_max_recheck_every_steps ({self.max_recheck_every_steps}) must be >= "
                f"link_recheck_every_steps ({self.recheck_every_steps})"
            )
        if not (isinstance(self.abort_ratio, int | float) and self.abort_ratio > 1):
            raise ConfigError(f"link_abort_ratio must be a number > 1, got {self.abort_ratio!r}")


# Hook settings (in the method's config mapping) that configure the gate, not the compressor.
GATE_SETTINGS = {
    "link_aware": "enabled",
    "link_warmup_steps": "warmup_steps",
    "link_trial_steps": "trial_steps",
    "link_recheck_every_steps": "recheck_every_steps",
    "link_max_recheck_every_steps": "max_recheck_every_steps",
    "link_abort_ratio": "abort_ratio",
}


def split_gate_settings(settings: dict[str, object]) -> tuple[dict[str, object], LinkGateConfig]:
    """Separate the gate's ``link_*`` settings from the compressor's; validate the gate's."""
    gate = {GATE_SETTINGS[k]: settings[k] for k in settings if k in GATE_SETTINGS}
    rest = {k: v for k, v in settings.items() if k not in GATE_SETTINGS}
    return rest, LinkGateConfig(**gate)  # type: ignore[arg-type]


Agree = Callable[[Sequence[float]], Sequence[float]]

_WARMUP, _TRIAL, _SETTLED = "warmup", "trial", "settled"
# While settled, the mode in use is checked for drift this often (one tiny all-reduce).
_DRIFT_CHECK_EVERY_STEPS = 10
# A decision by a gap g (slower / faster median step) stretches the next re-check by g**2, up
# to this factor: a 3x gap waits 9x longer than a near tie, an 8x gap 64x.
_MAX_GAP_FACTOR = 64.0
_KEEP_DECISIONS = 256


class LinkGate:
    """Picks the mode of each training step; see the module docstring.

    ``begin_step(now_s, agree)`` is called once per step, at the step's first hook call
    (bucket 0), with a monotonic clock reading; it returns the mode for every bucket of
    that step. ``decisions`` keeps one (step, mode, median compressed s, median all-reduce s)
    per decision, for logs and tests.
    """

    def __init__(self, config: LinkGateConfig | None = None) -> None:
        self.config = config if config is not None else LinkGateConfig()
        self.step = -1  # index of the current step; -1 before the first
        self.mode = Mode.COMPRESS
        # The latest decisions (bounded: a run with tiny intervals decides every few steps).
        self.decisions: deque[tuple[int, Mode, float, float]] = deque(maxlen=_KEEP_DECISIONS)
        self._phase = _WARMUP if self.config.warmup_steps > 0 else _TRIAL
        self._phase_steps = 0  # steps begun in the current phase
        self._queue: list[Mode] = [Mode.COMPRESS, Mode.ALLREDUCE]  # modes still to measure
        self._incumbent: Mode | None = None  # the settled mode a re-check compares against
        self._samples: dict[Mode, list[float]] = {Mode.COMPRESS: [], Mode.ALLREDUCE: []}
        self._interval = self.config.recheck_every_steps
        self._confirmations = 0  # re-checks in a row that kept the mode in use
        self._started_s: float | None = None
        self._timed = False  # whether the current step's duration becomes a sample
        self._chosen_s = 0.0  # median step time of the settled mode when it was chosen

    def begin_step(self, now_s: float, agree: Agree) -> Mode:
        self.step += 1
        if not self.config.enabled:
            return Mode.COMPRESS
        if self._started_s is not None and self._timed:
            self._samples[self.mode].append(now_s - self._started_s)
        self._started_s = now_s
        if self.step > 0:
            self._advance(agree)
        self._timed = self._phase != _WARMUP
        return self.mode

    def _advance(self, agree: Agree) -> None:
        cfg = self.config
        self._phase_steps += 1
        if self._phase == _WARMUP:
            if self._phase_steps >= cfg.warmup_steps:
                self._enter(_TRIAL)
        elif self._phase == _TRIAL:
            measuring = self._queue[0]
            done, baseline = self._samples[measuring], self._samples[_other(measuring)]
            if done and baseline:
                # Early abort, checked after each trial step (the same step on every rank).
                trial_s, base_s = agree([statistics.median(done), statistics.median(baseline)])
                if trial_s > cfg.abort_ratio * base_s:
                    comp, allr = (trial_s, base_s) if measuring == Mode.COMPRESS else (base_s, trial_s)
                    self._settle(_other(measuring), comp, allr)
                    return
            if len(done) >= cfg.trial_steps:
                self._queue.pop(0)
                if self._queue:
                    self.mode = self._queue[0]
                else:
                    comp, allr = agree(
                        [
                            statistics.median(self._samples[Mode.COMPRESS]),
                            statistics.median(self._samples[Mode.ALLREDUCE]),
                        ]
                    )
                    self._settle(Mode.ALLREDUCE if allr < comp else Mode.COMPRESS, comp, allr)
        elif self._phase_steps >= self._interval or self._drifted(agree):
            # Settled long enough, or the mode in use got much slower: re-check the other mode.
            incumbent = self.mode
            keep = self._samples[incumbent][-cfg.trial_steps :]
            self._samples = {Mode.COMPRESS: [], Mode.ALLREDUCE: []}
            self._samples[incumbent] = keep
            self._queue = [_other(incumbent)]
            self._enter(_TRIAL)
        else:
            # Only the latest trial_steps samples of the mode in use matter at the next re-check.
            del self._samples[self.mode][: -cfg.trial_steps]

    def _drifted(self, agree: Agree) -> bool:
        """Every few settled steps: is the mode in use now ``abort_ratio`` slower than when it
        was chosen (the link got busy, another job moved in)? Agreed across ranks."""
        recent = self._samples[self.mode][-self.config.trial_steps :]
        if self._phase_steps % _DRIFT_CHECK_EVERY_STEPS or len(recent) < self.config.trial_steps:
            return False
        (now_s,) = agree([statistics.median(recent)])
        return now_s > self.config.abort_ratio * self._chosen_s

    def _enter(self, phase: str) -> None:
        self._phase = phase
        self._phase_steps = 0
        if phase == _TRIAL:
            self.mode = self._queue[0]

    def _settle(self, chosen: Mode, comp_s: float, allreduce_s: float) -> None:
        # The next re-check comes later the clearer this decision was (gap: slower / faster
        # median) and the more re-checks in a row confirmed it: a near tie is checked again
        # soon (early steps are noisy), a 10x gap on a slow link rarely, since each re-check
        # costs one step of the slow mode there.
        self._confirmations = self._confirmations + 1 if chosen == self._incumbent else 0
        gap = max(comp_s, allreduce_s) / max(min(comp_s, allreduce_s), 1e-9)
        cfg = self.config
        # The exponent is capped: 2**1024 overflows a float, and 2**20 is past any max interval.
        interval = (
            cfg.recheck_every_steps * 2 ** min(self._confirmations, 20) * min(gap * gap, _MAX_GAP_FACTOR)
        )
        self._interval = int(min(max(interval, cfg.recheck_every_steps), cfg.max_recheck_every_steps))
        self.decisions.append((self.step, chosen, comp_s, allreduce_s))
        log.info(
            "link gate, step %d: median step %.1f ms compressed vs %.1f ms plain all-reduce -> %s "
            "(next check in %d steps)",
            self.step,
            1e3 * comp_s,
            1e3 * allreduce_s,
            chosen.value,
            self._interval,
        )
        self._incumbent = chosen
        self._chosen_s = comp_s if chosen == Mode.COMPRESS else allreduce_s
        self.mode = chosen
        self._phase = _SETTLED
        self._phase_steps = 0
