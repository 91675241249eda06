"""Tail's traffic on the CPU backend and on the Triton backend, side by side, on real gradients.

Trains digits_cnn (scikit-learn's bundled digits) with 2 simulated data-parallel workers and
SGD, keeps every worker's gradients, then runs two Tail compressors per backend over the same
gradients (open loop: the training itself is uncompressed, so both backends see the same
inputs) and prints per backend the traffic reduction over the run and its second half, and how
many steps each layer went as low-rank factors. The two backends should send about the same:
the quantized layers byte for byte, the low-rank ones from factors the device computes in its
own order (docs/gpu.md, "Low-rank layers on the device").

    python -m jobs.backend_traffic                          # a CUDA machine: gradients on the GPU
    TRITON_INTERPRET=1 python -m jobs.backend_traffic       # no GPU: Triton's CPU interpreter
                                                            # (~4 min for the Triton side)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from tail_ray.compression.device import BACKEND_ENV
from tail_ray.compression.tail import TailCompressor, TailConfig
from tail_ray.runner.datasets import make_dataset
from tail_ray.runner.models import loss_fn, make_model

Grads = dict[str, torch.Tensor]


def capture(steps: int, workers: int, batch: int, seed: int) -> list[list[Grads]]:
    """Every worker's gradients of every step of a plain data-parallel SGD run."""
    torch.manual_seed(seed)
    ds = make_dataset("digits", seed)
    model = make_model("digits_cnn", ds, seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        grads = []
        for _ in range(workers):
            idx = torch.randint(0, len(ds.train_x), (batch,), generator=gen)
            model.zero_grad()
            loss_fn(ds, model(ds.train_x[idx]), ds.train_y[idx]).backward()
            params = model.named_parameters()
            grads.append({n: p.grad.detach().clone() for n, p in params if p.grad is not None})
        out.append(grads)
        for n, p in model.named_parameters():
            p.grad = sum(g[n] for g in grads) / workers
        opt.step()
    return out


def run(backend: str, captured: list[list[Grads]], device: torch.device) -> dict[str, object]:
    """Tail on ``backend`` over the captured gradients: bytes per step and low-rank steps per layer."""
    os.environ[BACKEND_ENV] = backend
    workers = len(captured[0])
    comps = [TailCompressor(TailConfig(seed=r)) for r in range(workers)]
    for c in comps:
        c.set_linear_optimizer(True)  # SGD, as bench_convergence's digits task tells it
    sent: list[float] = []
    lowrank: dict[str, int] = {}
    t0 = time.perf_counter()
    for grads in captured:
        on_device = [{n: g.to(device) for n, g in w.items()} for w in grads]
        payloads = [c.compress(g) for c, g in zip(comps, on_device, strict=True)]
        for rank, c in enumerate(comps):
            c.aggregate(payloads, {n: torch.empty_like(g) for n, g in on_device[0].items()}, own=rank)
        sent.append(sum(len(p) for p in payloads) / workers)
        for st in comps[0].last_stats:
            if st.code.startswith("lowrank"):
                lowrank[st.layer] = lowrank.get(st.layer, 0) + 1
    raw = 4 * sum(g.numel() for g in captured[0][0].values())
    half = len(sent) // 2
    return {
        "ratio": raw * len(sent) / sum(sent),
        "second_half": raw * (len(sent) - half) / sum(sent[half:]),
        "lowrank_steps": lowrank,
        "seconds": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=120, help="training steps captured (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="data, model and sampling seed (default %(default)s)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        print("no CUDA device: run on a GPU machine, or with TRITON_INTERPRET=1 (Triton's CPU interpreter)",
              file=sys.stderr)  # fmt: skip
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    captured = capture(args.steps, workers=2, batch=32, seed=args.seed)
    print(f"digits_cnn, 2 workers, {args.steps} steps, seed {args.seed}, device {device}")
    for backend in ("cpu", "triton"):
        r = run(backend, captured, device)
        print(
            f"{backend:6s} {r['ratio']:.2f}x (second half {r['second_half']:.2f}x), "
            f"low-rank steps per layer {r['lowrank_steps']}, {r['seconds']:.0f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
