"""The low-rank chooser's per-layer state, and its checkpoint form (plain tensors, numbers and
dicts: ``torch.load(..., weights_only=True)`` reads it). ``LowRankChooser.state_dict`` /
``load_state_dict`` (lowrank_choice.py) use these; what a mismatch does is said there."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tail_ray.compression.lowrank import max_rank

STATE_FORMAT = 1  # LowRankChooser.state_dict()
MAX_BACKOFF = 16  # a failed trial waits at most this many trial intervals for the next
# A setting's name where a user sets it (TailConfig), for the messages about a checkpoint.
_CONFIG_NAMES = {
    "ranks": "lowrank_ranks",
    "bits": "lowrank_bits",
    "trial_every_steps": "redecide_every_steps",
    "start_step": "warmup_steps",
    "target": "lowrank_target",
}


@dataclass
class LayerState:
    rows: int
    cols: int
    rank: int = 0  # 0: quantized
    q_warm: torch.Tensor | None = None
    # The Q last sent, when the agreed rank was above ``rank``: q_warm is its best ``rank``
    # directions, fitted from it when first needed (LowRankChooser.warm_start); then None.
    q_wide: torch.Tensor | None = None
    trial_q: torch.Tensor | None = None
    quant_bytes: float | None = None  # the layer's latest quantized payload bytes
    lowrank_bytes: float | None = None  # ... and low-rank, at ``rank``
    ratio_ema: float | None = None
    steps_in_mode: int = 0
    floor: int = 0  # a rank the measured residual outgrew: never lowered below again while low-rank
    next_trial: int = 0
    backoff: int = 1

    def start_rank(self, rank: int, q_warm: torch.Tensor) -> None:
        """Low-rank at ``rank`` from the next step, warm-started from ``q_warm``; what was
        measured at another rank (or quantized) starts over."""
        self.rank = rank
        self.q_warm, self.q_wide = q_warm, None
        self.ratio_ema = None
        self.steps_in_mode = 0
        self.lowrank_bytes = None


def layer_to_state(layer: LayerState) -> dict[str, Any]:
    """One layer's checkpoint form; the warm starts as CPU tensor copies."""
    return {
        "rows": layer.rows,
        "cols": layer.cols,
        "rank": layer.rank,
        "floor": layer.floor,
        "next_trial": layer.next_trial,
        "backoff": layer.backoff,
        "steps_in_mode": layer.steps_in_mode,
        "ratio_ema": layer.ratio_ema,
        "quant_bytes": layer.quant_bytes,
        "lowrank_bytes": layer.lowrank_bytes,
        "q_warm": _cpu_copy(layer.q_warm),
        "trial_q": _cpu_copy(layer.trial_q),
    }


def layer_from_state(saved: Mapping[str, Any], ranks: tuple[int, ...]) -> LayerState:
    """One layer's state, checked for consistency with itself and the candidate ``ranks``
    (ValueError says what is off)."""
    rows, cols, rank, floor = (int(saved[k]) for k in ("rows", "cols", "rank", "floor"))
    if rows < 1 or cols < 1:
        raise ValueError(f"shape {rows}x{cols}")
    allowed = set(ranks)
    if rank and (rank not in allowed or rank > max_rank(rows, cols)):
        raise ValueError(f"rank {rank} is not a candidate for a {rows}x{cols} matrix")
    if floor and (floor not in allowed or floor > rank):
        raise ValueError(f"floor {floor} with rank {rank}")
    q_warm, trial_q = _tensor_or_none(saved["q_warm"]), _tensor_or_none(saved["trial_q"])
    if (q_warm is None) != (rank == 0) or (q_warm is not None and tuple(q_warm.shape) != (cols, rank)):
        shape = None if q_warm is None else tuple(q_warm.shape)
        raise ValueError(f"warm start of shape {shape} for rank {rank} of a {rows}x{cols} matrix")
    if trial_q is not None and (trial_q.dim() != 2 or trial_q.shape[0] != cols):
        raise ValueError(f"trial start of shape {tuple(trial_q.shape)} for {cols} columns")
    return LayerState(
        rows,
        cols,
        rank=rank,
        q_warm=q_warm,
        trial_q=trial_q,
        quant_bytes=_float_or_none(saved["quant_bytes"]),
        lowrank_bytes=_float_or_none(saved["lowrank_bytes"]),
        ratio_ema=_float_or_none(saved["ratio_ema"]),
        steps_in_mode=int(saved["steps_in_mode"]),
        floor=floor,
        next_trial=int(saved["next_trial"]),
        backoff=min(max(int(saved["backoff"]), 1), MAX_BACKOFF),
    )


def settings_changes(saved: Mapping[str, Any], ours: Mapping[str, Any]) -> str:
    """The settings that differ, by the names users set them by ("" when none do)."""
    return ", ".join(
        f"{_CONFIG_NAMES.get(k, k)} {_setting(saved.get(k))!r} -> {_setting(v)!r}"
        for k, v in ours.items()
        if _setting(saved.get(k)) != _setting(v)
    )


def _cpu_copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to("cpu", copy=True)


def _tensor_or_none(value: Any) -> torch.Tensor | None:
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise ValueError(f"expected a float tensor or None, got {type(value).__name__}")
    # A copy, strides kept: the continuation's products then run exactly as the saved run's.
    return value.detach().to("cpu", torch.float32, copy=True)


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _setting(value: Any) -> Any:
    """A setting as compared: a checkpoint may hold a list where the settings hold a tuple."""
    return tuple(value) if isinstance(value, list | tuple) else value
