"""Checkpoint and restore of a training run: model, optimizer, step, RNG and hook state.

Layout of one checkpoint directory (Ray Train merges the directories every worker reports
into one):

- ``train_state.pt`` (rank 0 writes it): step, world size, model and optimizer state, and
  the run's cumulative traffic counters. Model weights and optimizer state are identical on
  every rank under DDP, so one copy is enough.
- ``rank{r}.pt`` (every rank writes its own): that rank's RNG states and its comm-hook state
  (per-layer controller state and error-feedback residuals, keyed by parameter NAME).

Restore: every rank loads ``train_state.pt``. When the world size is unchanged, rank r
loads ``rank{r}.pt`` and resumes exactly. When it changed (an elastic resize or a restart
on fewer/more workers), rank-specific state has no meaning any more: every rank reads the
hook state of EVERY old rank and calls ``hook.load_resized(states)``. The controller's
per-layer state comes from rank 0's. Error-feedback residuals cannot be handed to new ranks
as they are (each belongs to the gradient stream one old worker saw, or, for a sharded
collective's second stage, to one old owner's slice of the mean), but what they owed the
old job's MEAN can be: each residual weighted by its share of that mean (1/W for a worker's
own stream, 1 for a second stage) and placed at its slice, summed over the old ranks. Every
new rank adds that sum to the first gradient it sends, so the new mean gets it exactly once,
whatever the new world size or collective (PayloadHookState.load_resized). Each rank also
reseeds its RNG from (seed, step, rank). If an old rank's file is missing, nothing is
carried (a partial sum would be wrong) and the residuals are dropped, as before.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

logger = logging.getLogger(__name__)

TRAIN_STATE_FILE = "train_state.pt"
FORMAT_VERSION = 1


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


class HookStateLike(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], *, residuals: bool = True) -> None: ...

    def load_resized(self, states: list[dict[str, Any]]) -> None: ...


@dataclass
class Restored:
    """What a worker resumes from."""

    step: int  # the next step to run
    saved_world_size: int
    exact: bool  # True when this rank got back its own rank-specific state
    totals: dict[str, float] = field(default_factory=dict)


def unwrap(model: nn.Module) -> nn.Module:
    """The module under a DDP wrapper (prepare_model wraps only when world size > 1)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def seed_everything(seed: int, step: int, rank: int) -> None:
    """A deterministic RNG state for (seed, step, rank): used at a fresh start and on resize."""
    value = (seed * 1_000_003 + step * 7919 + rank) & 0x7FFF_FFFF
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


def save_checkpoint(
    directory: str | Path,
    *,
    rank: int,
    world_size: int,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    hook: HookStateLike | None,
    totals: dict[str, float] | None = None,
) -> None:
    """Write this rank's share of the checkpoint for "``step`` steps done" into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        torch.save(
            {
                "format_version": FORMAT_VERSION,
                "step": step,
                "world_size": world_size,
                "model": unwrap(model).state_dict(),
                "optimizer": optimizer.state_dict(),
                "totals": dict(totals or {}),
            },
            directory / TRAIN_STATE_FILE,
        )
    torch.save(
        {
            "format_version": FORMAT_VERSION,
            "rank": rank,
            "world_size": world_size,
            "rng": rng_state(),
            "hook": hook.state_dict() if hook is not None else None,
        },
        directory / rank_file(rank),
    )


def load_checkpoint(
    directory: str | Path,
    *,
    rank: int,
    world_size: int,
    seed: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    hook: HookStateLike | None,
) -> Restored:
    """Load ``directory`` into model, optimizer, RNG and hook (see the module doc for resize)."""
    directory = Path(directory)
    train_state = _load(directory / TRAIN_STATE_FILE)
    unwrap(model).load_state_dict(train_state["model"])
    optimizer.load_state_dict(train_state["optimizer"])
    step = int(train_state["step"])
    saved_world_size = int(train_state["world_size"])
    exact = saved_world_size == world_size and (directory / rank_file(rank)).exists()
    rank_state = _load(directory / rank_file(rank if exact else 0))
    if exact:
        set_rng_state(rank_state["rng"])
    else:
        seed_everything(seed, step, rank)
    how = "exact"
    if hook is not None and rank_state.get("hook") is not None:
        if exact:
            hook.load_state_dict(rank_state["hook"], residuals=True)
        else:
            old = [directory / rank_file(r) for r in range(saved_world_size)]
            if all(path.exists() for path in old):
                hook.load_resized([_load(path)["hook"] for path in old])
                how = "what the old residuals owed the mean carried, RNG reseeded"
            else:
                missing = [path.name for path in old if not path.exists()]
                logger.warning("checkpoint lacks %s: error-feedback residuals dropped", missing)
                hook.load_state_dict(rank_state["hook"], residuals=False)
                how = "residuals dropped, RNG reseeded"
    elif not exact:
        how = "RNG reseeded"
    logger.info("restored step %d (saved by %d workers, now %d; %s)", step, saved_world_size, world_size, how)
    return Restored(step, saved_world_size, exact, dict(train_state.get("totals", {})))


def _load(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise FileNotFoundError(f"checkpoint file {path} is missing (incomplete checkpoint?)")
    # weights_only=False: the RNG states hold numpy arrays and Python tuples; these files are
    # written by this module into the run's own storage, never taken from a client.
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has format {state.get('format_version')}, need {FORMAT_VERSION}")
    return state
