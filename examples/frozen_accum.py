"""Your own model and loop on Ray Train, with Tail: the kinds of model DDP users have.

- a frozen encoder (``requires_grad=False``): DDP never communicates it, nor does Tail;
- an auxiliary head used only on some steps: unused parameters, so DDP needs
  ``find_unused_parameters=True``, which ``prepare_model`` passes on like any DDP argument;
- gradient accumulation: ``--accumulate`` micro-batches per optimizer step, all but the last
  under ``model.no_sync()``, so gradients are exchanged (and compressed) once per step, and
  the metrics count optimizer steps.

    python examples/frozen_accum.py --workers 2 --steps 40
    RAY_AUTH_MODE=token ray job submit --working-dir examples -- python frozen_accum.py --steps 40
    tail-ray submit --working-dir examples -- python frozen_accum.py --steps 40
"""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Any

import torch
from torch import nn

import tail_ray.train


class Adapted(nn.Module):
    """A frozen encoder, a trained adapter and classifier, and an auxiliary reconstruction head
    used every ``aux_every`` steps only."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 256))
        self.encoder.requires_grad_(False)
        self.adapter = nn.Sequential(nn.Linear(256, 256), nn.ReLU())
        self.classifier = nn.Linear(256, 10)
        self.aux_head = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor, with_aux: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.adapter(self.encoder(x))
        return self.classifier(h), (self.aux_head(h) if with_aux else None)


def build_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Adapted()


class Data:
    """scikit-learn's bundled digits as 64 features; 80 % train, 20 % validation."""

    def __init__(self, seed: int = 0) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
        split = int(0.8 * len(y))
        self.train, self.val, self.seed = (
            (x[order[:split]], y[order[:split]]),
            (x[order[split:]], y[order[split:]]),
            seed,
        )

    def batch(
        self, step: int, rank: int, world_size: int, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * world_size + rank)
        idx = torch.randint(0, len(self.train[1]), (batch_size,), generator=g)
        return self.train[0][idx], self.train[1][idx]

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        logits, _ = model(self.val[0])
        return {"val_accuracy": float((logits.argmax(1) == self.val[1]).float().mean())}


def train_loop_per_worker(config: dict[str, Any]) -> None:
    data = Data(config["seed"])
    model = tail_ray.train.prepare_model(
        build_model(config["seed"]), config["method"], config["compression"], find_unused_parameters=True
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=config["lr"])
    session = tail_ray.train.current_session()
    accumulate = config["accumulate"]
    for step in range(config["steps"]):
        optimizer.zero_grad()
        with_aux = step % config["aux_every"] == 0
        total = 0.0
        for micro in range(accumulate):
            x, y = data.batch(
                step * accumulate + micro, session.rank, session.world_size, config["batch_size"]
            )
            last = micro == accumulate - 1
            # no_sync exists only on the DDP wrapper (world size 1 has none: nothing to sync).
            quiet: Any = contextlib.nullcontext()
            if isinstance(model, nn.parallel.DistributedDataParallel) and not last:
                quiet = model.no_sync()
            with quiet:
                logits, recon = model(x, with_aux)
                loss = nn.functional.cross_entropy(logits, y)
                if recon is not None:
                    loss = loss + 0.1 * nn.functional.mse_loss(recon, x)
                (loss / accumulate).backward()
            total += float(loss) / accumulate
        tail_ray.train.report_loss(total)
        optimizer.step()
    if session.rank == 0:
        bare = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        print(json.dumps({"step": config["steps"], "loss": total, **data.evaluate(bare)}), flush=True)
    tail_ray.train.finish()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16, help="per micro-batch, per worker")
    p.add_argument("--accumulate", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--aux-every", type=int, default=2, help="the auxiliary head trains every N steps")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--method", default="tail")
    p.add_argument("--compression", default="{}", help="settings as JSON")
    args = p.parse_args(argv)
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    config = {**vars(args), "compression": json.loads(args.compression)}
    TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.workers),
    ).fit()


if __name__ == "__main__":
    main()
