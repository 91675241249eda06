"""Reproduce the gloo ordering hazard of PyTorch's powerSGD_hook, and show the serialised wrapper.

    python -m jobs.repro_powersgd_order [--bucket-cap-mb 0.001] [--steps 30] [--timeout-s 60]

Two gloo workers train 13 small Linear layers with many DDP buckets in flight, first with
PyTorch's ``PowerSGDState`` + ``powerSGD_hook`` registered directly, then with
``register_tail_hook(ddp, "powersgd")`` (the same hook, waited on bucket by bucket). The
direct hook chains its 2nd and 3rd all-reduce in future callbacks, so ranks can issue
collectives in different orders: gloo aborts ("Received data size doesn't match expected
size") or hangs until the timeout. Whether it strikes depends on timing; it is a race.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from tail_ray.collective import register_tail_hook
from tail_ray.collective.launch import run_local_group


def _worker(rank: int, world_size: int, direct: bool, bucket_cap_mb: float, steps: int) -> None:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(48, 48), nn.Tanh()) for _ in range(12)]
    model = nn.Sequential(*blocks, nn.Linear(48, 10))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if direct:
        ddp.register_comm_hook(
            PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2), powerSGD_hook
        )
    else:
        register_tail_hook(ddp, "powersgd", {"rank": 2})
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 48, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        ddp.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bucket-cap-mb", type=float, default=0.001)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args()
    for label, direct in (("PyTorch powerSGD_hook, direct", True), ("register_tail_hook 'powersgd'", False)):
        start = time.perf_counter()
        try:
            run_local_group(_worker, 2, (direct, args.bucket_cap_mb, args.steps), timeout_s=args.timeout_s)
            outcome = "OK"
        except Exception as exc:  # the point is to show what PyTorch's hook does
            outcome = f"FAILED: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
        print(f"{label:<32} {outcome}  ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
