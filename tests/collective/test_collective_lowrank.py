"""Tail with ``lowrank="auto"`` through the real comm hook: 2 gloo ranks train, some layer is
sent as low-rank factors, and both ranks keep bit-identical weights."""

from __future__ import annotations

import torch
from torch import nn

from tail_ray.collective import register_tail_hook
from tail_ray.collective.launch import run_local_group

STEPS = 40
SETTINGS = {
    "lowrank": "auto",
    "warmup_steps": 5,
    "redecide_every_steps": 5,
    "raw_below_numel": 1024,
    "link_aware": False,  # ranks on one host: the switch would (rightly) send plain all-reduce
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    # A learnable task: the class is the argmax of 4 fixed projections of the input. A small
    # batch makes each weight gradient a matrix of low rank, which low-rank sends exactly.
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 64, generator=gen)  # 8 samples: gradients of rank <= 8
    w = torch.randn(64, 4, generator=torch.Generator().manual_seed(42))
    return x, (x @ w).argmax(dim=1)


def _worker(rank: int, world_size: int, out_dir) -> None:  # type: ignore[no-untyped-def]
    ddp = nn.parallel.DistributedDataParallel(_model())
    state = register_tail_hook(ddp, "tail", dict(SETTINGS))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    losses, codes = [], []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        metrics = state.drain_metrics()
        codes.append({s.layer: s.code for s in metrics.layers})
    weights = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    torch.save({"losses": losses, "codes": codes, "weights": weights}, out_dir / f"rank{rank}.pt")


def test_two_workers_train_with_lowrank_layers_and_stay_in_sync(tmp_path) -> None:  # type: ignore[no-untyped-def]
    run_local_group(_worker, 2, (tmp_path,), timeout_s=240)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for name, w in ranks[0]["weights"].items():
        assert torch.equal(w, ranks[1]["weights"][name]), name  # every rank averaged the same bits
    lowrank_steps = [
        step
        for step, codes in enumerate(ranks[0]["codes"])
        if any(c.startswith("lowrank") for c in codes.values())
    ]
    assert len(lowrank_steps) >= STEPS // 4, ranks[0]["codes"][-1]
    losses = ranks[0]["losses"]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, (first, last)
