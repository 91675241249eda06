"""Run a function on W local processes joined in a gloo group on 127.0.0.1.

Used by the tests and by jobs/bench_convergence: real torch.distributed, no Ray start-up.
Every collective gets ``timeout_s`` (so a mismatch fails instead of hanging), and the whole
run gets ``timeout_s`` too: the processes are killed and TimeoutError raised past it.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    timeout_s: float,
    args: tuple,
    leave_together: bool,
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # One intra-op thread per process: W processes share the machine's cores.
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, world_size, *args)
        if leave_together:
            # A rank tearing its group down while the other still has gloo work in flight
            # with it can make gloo std::terminate that process (seen as SIGABRT).
            dist.barrier()
    finally:
        if leave_together:
            dist.destroy_process_group()
    if not leave_together:
        # The peers may have failed mid-collective (a test of a crashed rank): leave at once,
        # as a crashed worker would. gloo's teardown can block for good on a pair whose peer
        # vanished (seen with 4 ranks: a process stuck after its function returned).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_local_group(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple = (),
    timeout_s: float = 60.0,
    *,
    leave_together: bool = True,
    collective_timeout_s: float | None = None,
) -> None:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; raise on failure.

    ``timeout_s`` bounds the whole run, and each collective unless ``collective_timeout_s``
    is given (a test that must tell a hang from a slow start on a busy machine: starting W
    processes there can take longer than a collective may wait).

    ``fn`` must be importable by name (a module-level function). Results travel back through
    files or queues the caller passes in ``args``. ``leave_together``: the ranks meet at a
    barrier after ``fn`` returns, before tearing the group down; pass False when ``fn`` may
    return while its peers are still mid-collective (a test simulating a crashed rank).
    """
    port = free_port()
    ctx = mp.start_processes(
        _entry,
        args=(fn, world_size, port, collective_timeout_s or timeout_s, args, leave_together),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"local group of {world_size} did not finish within {timeout_s} s")
