"""Tail with ``lowrank="auto"`` under SGD (the hook's watch names it) through the real comm
hook: 2 gloo ranks train, some layer is sent as low-rank factors, and both ranks keep
bit-identical weights."""

from __future__ import annotations

import torch
from torch import nn

from tail_ray.collective import register_tail_hook
from tail_ray.collective.launch import run_local_group

STEPS = 40
LR = 0.05  # at 0.1 (momentum 0.9) the compressed run spiked to losses of 3-4 on some batches
EVAL_STEPS = range(1000, 1008)  # held-out batches: the judged loss is the trained model's on them
SETTINGS = {
    "lowrank": "auto",
    # A fixed rounding seed: a test that reads the same numbers on every run. Seeds 0-7 all
    # kept >= 91% of plain DDP's held-out improvement here (the bound below is 80%).
    "seed": 0,
    "warmup_steps": 5,
    "redecide_every_steps": 5,
    "raw_below_numel": 1024,
    "link_aware": False,  # ranks on one host: the switch would (rightly) send plain all-reduce
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Inputs on a fixed 4-dimensional subspace of R^64: the first layer's weight gradient
    # (delta^T x) has rank <= 4 at every step, in the same row space, which a low rank sends
    # exactly; the later layers' gradients are full-rank. The class is the argmax of 4 fixed
    # projections of the hidden coordinates (a learnable task).
    fixed = torch.Generator().manual_seed(42)
    basis, w = torch.randn(4, 64, generator=fixed), torch.randn(4, 4, generator=fixed)
    z = torch.randn(32, 4, generator=torch.Generator().manual_seed(1000 * step + rank))
    return z @ basis, (z @ w).argmax(dim=1)


def _train(ddp: nn.Module, state, rank: int) -> tuple[list[float], list[dict[str, str]]]:  # type: ignore[no-untyped-def]
    # Not told by hand: register_tail_hook's watch names the SGD at its first step, and "auto"
    # goes low-rank from then on (optimizer_watch.py).
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    losses, codes = [], []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if state is not None:
            codes.append({s.layer: s.code for s in state.drain_metrics().layers})
    return losses, codes


def _held_out_loss(model: nn.Module) -> float:
    """Mean loss on fixed batches no step trained on: one training batch's loss swings by 0.1-1
    from batch to batch at any stage, which made a window of the last steps' losses noisy."""
    with torch.no_grad():
        batches = [_batch(0, step) for step in EVAL_STEPS]
        return _mean([float(nn.functional.cross_entropy(model(x), y)) for x, y in batches])


def _worker(rank: int, world_size: int, out_dir) -> None:  # type: ignore[no-untyped-def]
    initial = _held_out_loss(_model())
    plain = nn.parallel.DistributedDataParallel(_model())
    _train(plain, None, rank)
    ddp = nn.parallel.DistributedDataParallel(_model())
    state = register_tail_hook(ddp, "tail", dict(SETTINGS))
    _, codes = _train(ddp, state, rank)
    weights = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    held_out = {"initial": initial, "plain": _held_out_loss(plain.module), "tail": _held_out_loss(ddp.module)}
    torch.save(
        {"codes": codes, "weights": weights, "held_out": held_out},
        out_dir / f"rank{rank}.pt",
    )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_two_workers_train_with_lowrank_layers_and_stay_in_sync(tmp_path) -> None:  # type: ignore[no-untyped-def]
    run_local_group(_worker, 2, (tmp_path,), timeout_s=240)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for name, w in ranks[0]["weights"].items():
        assert torch.equal(w, ranks[1]["weights"][name]), name  # every rank averaged the same bits
    codes = ranks[0]["codes"]
    lowrank_steps = [step for step, c in enumerate(codes) if c.get("0.weight", "").startswith("lowrank")]
    # The first layer (rank-4 gradients) goes low-rank after the warm-up and stays there.
    assert len(lowrank_steps) >= STEPS // 2, [c.get("0.weight") for c in codes]
    held_out = ranks[0]["held_out"]
    assert held_out["tail"] < 0.5 * held_out["initial"], held_out  # it learned
    # Most of what plain DDP gained on the same batches (not all: the error-feedback residual
    # delays part of each update by a few steps).
    gained = (held_out["initial"] - held_out["tail"]) / (held_out["initial"] - held_out["plain"])
    assert gained >= 0.8, held_out
