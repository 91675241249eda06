"""Your own model and loop on Ray Train, with Tail: a ResNet-18 (the standard architecture,
11.2M parameters, random-initialised) on CIFAR-shaped images, with checkpoints that keep the
Tail controller across restarts and elastic resizes.

The images are scikit-learn's bundled handwritten digits (no download), upscaled to 32x32x3.
The network is written out here in plain torch with torchvision's layer names
(``conv1``, ``layer1.0.conv1``, ..., ``fc``): PyPI's torchvision builds need another torch than
this project's CPU build (``operator torchvision::nms does not exist`` beside it), so
``torchvision.models.resnet18(num_classes=10)`` is a drop-in here where it installs.

    python examples/resnet18_cifar.py --workers 2 --steps 60                   # standalone
    RAY_AUTH_MODE=token ray job submit --working-dir examples -- python resnet18_cifar.py --steps 60
    tail-ray submit --working-dir examples -- python resnet18_cifar.py --steps 60
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

import tail_ray.train


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet18(nn.Module):
    """He et al. 2016, 18 layers: a 7x7 stem, four stages of two basic blocks, a linear head."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = (64, 128, 256, 512)
        cin = 64
        for i, width in enumerate(widths, start=1):
            stride = 1 if i == 1 else 2
            setattr(
                self, f"layer{i}", nn.Sequential(BasicBlock(cin, width, stride), BasicBlock(width, width, 1))
            )
            cin = width
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return ResNet18(num_classes=10)


class Data:
    """Digits 8x8 -> 32x32x3 (bilinear), standardised; 80 % train, 20 % validation."""

    def __init__(self, seed: int = 0) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        x = nn.functional.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False).repeat(
            1, 3, 1, 1
        )
        x = (x - x.mean()) / x.std()
        y = torch.tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
        split = int(0.8 * len(y))
        self.train = (x[order[:split]], y[order[:split]])
        self.val = (x[order[split:]], y[order[split:]])
        self.seed = seed

    def batch(
        self, step: int, rank: int, world_size: int, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * world_size + rank)
        idx = torch.randint(0, len(self.train[1]), (batch_size,), generator=g)
        return self.train[0][idx], self.train[1][idx]

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        model.eval()
        logits = torch.cat([model(x) for x in self.val[0].split(128)])
        model.train()
        return {"val_accuracy": float((logits.argmax(1) == self.val[1]).float().mean())}


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import ray.train

    data = Data(config["seed"])
    model = tail_ray.train.prepare_model(build_model(config["seed"]), config["method"], config["compression"])
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9, weight_decay=5e-4)
    bare = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    session = tail_ray.train.current_session()
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:  # a restart or an elastic resize: model, optimizer AND the controller
        with checkpoint.as_directory() as ckpt:
            state = torch.load(Path(ckpt) / "model.pt", map_location="cpu")
            bare.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            tail_ray.train.load_checkpoint(ckpt)
            start = session.step
    for step in range(start, config["steps"]):
        if step == int(0.75 * config["steps"]):
            for group in optimizer.param_groups:
                group["lr"] *= 0.1  # an lr drop the controller sees by itself
        x, y = data.batch(step, session.rank, session.world_size, config["batch_size"])
        loss = data.loss(model, x, y)
        optimizer.zero_grad()
        loss.backward()
        tail_ray.train.report_loss(loss)
        optimizer.step()
        done = step + 1
        if done % config["checkpoint_every"] == 0 or done == config["steps"]:
            metrics = {"step": done, "loss": float(loss)}
            if done == config["steps"] and session.rank == 0:
                metrics.update(data.evaluate(bare))
            with tempfile.TemporaryDirectory() as tmp:
                if session.rank == 0:
                    torch.save(
                        {"model": bare.state_dict(), "optimizer": optimizer.state_dict()}, f"{tmp}/model.pt"
                    )
                tail_ray.train.save_checkpoint(tmp)  # every rank: its controller state and residuals
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
            if session.rank == 0 and done == config["steps"]:
                print(json.dumps(metrics), flush=True)
    tail_ray.train.finish()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--method", default="tail")
    p.add_argument("--compression", default="{}", help="settings as JSON")
    args = p.parse_args(argv)
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    config = {**vars(args), "compression": json.loads(args.compression)}
    TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.workers),
        run_config=RunConfig(failure_config=FailureConfig(max_failures=2)),
    ).fit()


if __name__ == "__main__":
    main()
