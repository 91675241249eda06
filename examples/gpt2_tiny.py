"""Your own model and loop on Ray Train, with Tail: a Hugging Face GPT-2 (small config,
random-initialised) learning the Python standard library's own docstrings, byte by byte.

The one line that makes it a tail-ray job is ``tail_ray.train.prepare_model`` where Ray's
``ray.train.torch.prepare_model`` would be: from then on every optimizer step streams its
per-layer compression metrics to the job's sink, and the tail-ray service shows the job.

    python examples/gpt2_tiny.py --workers 2 --steps 100                 # standalone (local Ray)
    RAY_AUTH_MODE=token ray job submit --working-dir examples -- python gpt2_tiny.py --steps 100
    tail-ray submit --working-dir examples -- python gpt2_tiny.py --steps 100   # through REST
    torchrun --standalone --nproc-per-node 2 examples/gpt2_tiny.py --no-ray    # no Ray at all

Needs ``transformers`` (``pip install -e ".[examples]"``); nothing is downloaded: the config is
built here and the text comes from modules every Python has.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
from typing import Any

import torch

import tail_ray.train

SEQ_LEN = 64
TEXT_MODULES = ("argparse", "collections", "functools", "itertools", "json", "pathlib", "re", "string")


def build_model(seed: int = 0) -> torch.nn.Module:
    """GPT-2 with 2 blocks of width 128 over bytes (vocab 256): 0.45M parameters."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=256, n_positions=SEQ_LEN, n_embd=128, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


def corpus_bytes() -> bytes:
    """Every docstring of a few standard-library modules, in a fixed order."""
    docs: list[str] = []
    for name in TEXT_MODULES:
        module = __import__(name)
        for _, obj in sorted(inspect.getmembers(module), key=lambda kv: kv[0]):
            doc = inspect.getdoc(obj)
            if doc and (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                docs.append(doc)
    return "\n\n".join(docs).encode("utf-8", errors="replace")


class Data:
    """Byte windows of the corpus: 90 % train, 10 % validation; batches from (seed, step, rank)."""

    def __init__(self, seed: int = 0) -> None:
        tokens = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()
        split = int(0.9 * len(tokens))
        self.train, self.val, self.seed = tokens[:split], tokens[split:], seed

    def batch(self, step: int, rank: int, world_size: int, batch_size: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * world_size + rank)
        starts = torch.randint(0, len(self.train) - SEQ_LEN, (batch_size,), generator=g)
        return torch.stack([self.train[s : s + SEQ_LEN] for s in starts.tolist()])

    def loss(self, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return model(input_ids=tokens, labels=tokens).loss

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, batches: int = 8) -> dict[str, float]:
        model.eval()
        windows = self.val[: (len(self.val) // SEQ_LEN) * SEQ_LEN].view(-1, SEQ_LEN)[: batches * 16]
        loss = float(torch.stack([self.loss(model, w) for w in windows.split(16)]).mean())
        model.train()
        return {"val_loss": loss}


def train_loop_per_worker(config: dict[str, Any]) -> None:
    data = Data(config["seed"])
    model = tail_ray.train.prepare_model(build_model(config["seed"]), config["method"], config["compression"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.01)
    # A cosine schedule: the controller reads each step's lr from the optimizer by itself.
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config["steps"])
    session = tail_ray.train.current_session()
    for step in range(config["steps"]):
        tokens = data.batch(step, session.rank, session.world_size, config["batch_size"])
        loss = data.loss(model, tokens)
        optimizer.zero_grad()
        loss.backward()
        tail_ray.train.report_loss(loss)  # optional: the loss chart
        optimizer.step()
        scheduler.step()
    if session.rank == 0:
        bare = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        print(
            json.dumps({"step": config["steps"], "loss": float(loss.detach()), **data.evaluate(bare)}),
            flush=True,
        )
    tail_ray.train.finish()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="Ray Train workers (default %(default)s)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--method", default="tail", help="none, fp16, bf16, powersgd, qsgd, topk, tail")
    p.add_argument("--compression", default="{}", help="settings as JSON, e.g. '{\"link_aware\": false}'")
    p.add_argument("--no-ray", action="store_true", help="train in this process (torchrun: in its group)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = {**vars(args), "compression": json.loads(args.compression)}
    if args.no_ray:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            torch.distributed.init_process_group("gloo")
        train_loop_per_worker(config)
        return
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.workers),
    ).fit()


if __name__ == "__main__":
    main()
