"""The training loop of the corruption tests: a few DDP steps in which one rank starts
sending damaged payloads; each rank records how far it got and what stopped it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

STEPS = 3


class Armable(Protocol):
    armed: bool


def steps_until_error(
    ddp: nn.Module,
    rank: int,
    out_dir: Path,
    *,
    in_features: int,
    corrupt_from_step: int,
    wrapper: Armable | None,
) -> None:
    """Run STEPS steps (the wrapper armed from ``corrupt_from_step``); save to rank{r}.pt the
    steps that succeeded and, for the first that failed, the exception chain and how long
    the rank waited before it came."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    outcome: dict[str, Any] = {"ok_steps": 0}
    for step in range(STEPS):
        if wrapper is not None:
            wrapper.armed = step >= corrupt_from_step
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, in_features, generator=gen), torch.randint(0, 10, (8,), generator=gen)
        t0 = time.perf_counter()
        try:
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        except Exception as exc:
            chain: list[str] = []
            e: BaseException | None = exc
            while e is not None:
                chain.append(f"{type(e).__name__}: {e}")
                e = e.__cause__ or e.__context__
            outcome.update(failed_step=step, failed_after_s=time.perf_counter() - t0, chain=chain)
            break
        outcome["ok_steps"] += 1
    torch.save(outcome, out_dir / f"rank{rank}.pt")
