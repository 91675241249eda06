"""The session's state in the user's own checkpoints.

In memory: ``tail_ray.train.state_dict()`` / ``load_state_dict(saved)``. In a checkpoint
directory (what ``ray.train.Checkpoint.from_directory`` reports; Ray Train merges every
worker's files into one): ``save_checkpoint(dir)`` writes this rank's ``tail_ray.rank<r>.pt``
and ``load_checkpoint(dir)`` takes this rank's file when the group has the same size, else
rank 0's without error-feedback residuals (an elastic resize or a restart on other workers:
the controller's per-layer state is kept; see docs/training.md, "Residuals on resize").
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tail_ray.train.prepare import current_session

logger = logging.getLogger(__name__)


def session_file(rank: int) -> str:
    return f"tail_ray.rank{rank}.pt"


def state_dict() -> dict[str, Any]:
    """The prepared model's hook state, step counter and traffic totals (see TrainSession)."""
    return current_session().state_dict()


def load_state_dict(saved: dict[str, Any], *, residuals: bool | None = None) -> bool:
    """Restore what ``state_dict()`` returned; returns whether residuals were restored."""
    return current_session().load_state_dict(saved, residuals=residuals)


def save_checkpoint(directory: str | Path) -> Path:
    """Write this rank's session state into ``directory`` (every rank calls it)."""
    session = current_session()
    path = Path(directory) / session_file(session.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(session.state_dict(), path)
    return path


def load_checkpoint(directory: str | Path) -> bool:
    """Restore this rank's session state from ``directory``; False when it holds none (a
    checkpoint written without tail_ray: the session starts fresh) or after a resize."""
    session = current_session()
    directory = Path(directory)
    own = directory / session_file(session.rank)
    path = own if own.exists() else directory / session_file(0)
    if not path.exists():
        logger.warning("checkpoint %s holds no tail_ray state: the hook starts fresh", directory)
        return False
    # weights_only=False: the state holds plain Python values next to tensors; the file was
    # written by save_checkpoint into the run's own storage.
    saved = torch.load(path, map_location="cpu", weights_only=False)
    exact = session.load_state_dict(saved)
    logger.info(
        "tail_ray state restored at step %d from %s (%s)",
        session.step,
        path.name,
        "exact" if exact else "resized: residuals dropped",
    )
    return exact
