"""A corrupted payload inside a running collective (2 gloo ranks, spawned): rank 1's payload
bytes are damaged on the wire from step 1 on (a test-only wrapper around its compressor).

The receiver (rank 0) decodes the damaged payload, so its step fails with CodecError at
once. The sender does not decode its own payload (the hook takes its own values from the
compressor, as a real sender cannot see corruption in transit either), so it finishes the
step; its next collective then finds its peer gone and fails too. Nobody hangs until the
collective timeout: a Ray Train job would tear the group down and restart it from the last
checkpoint."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from corruption_steps import steps_until_error
from torch import nn
from torch.multiprocessing.spawn import ProcessExitedException

from tail_ray.collective import register_tail_hook
from tail_ray.collective.launch import run_local_group
from tail_ray.errors import CodecError

COLLECTIVE_TIMEOUT_S = 60
CORRUPT_FROM_STEP = 1


IN_FEATURES = 128  # the first layer (8192 weights) is coded, not sent raw


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(IN_FEATURES, 64), nn.ReLU(), nn.Linear(64, 10))


@pytest.fixture(scope="module", autouse=True)
def _warm_numba_cache() -> None:
    """Compile the Tail kernels here once (they cache to disk) so the two spawned ranks load
    them instead of both compiling at once on a cold CI machine."""
    from tail_ray.compression import make_compressor

    grads = {n: torch.randn_like(p) for n, p in _model().named_parameters()}
    compressor = make_compressor("tail")
    for _ in range(2):
        compressor.decompress(compressor.compress(grads))


class CorruptingCompressor:
    """Wraps a compressor; once ``armed``, damages what ``compress`` returns."""

    def __init__(self, inner: Any, mode: str) -> None:
        self.inner = inner
        self.mode = mode
        self.armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def compress(self, grads: dict[str, torch.Tensor]) -> bytes:
        payload = bytes(self.inner.compress(grads))
        if not self.armed:
            return payload
        if self.mode == "truncated":
            return payload[: len(payload) // 2]
        if self.mode == "bad_magic":
            return b"\x00\x00\x00\x00" + payload[4:]
        raise ValueError(self.mode)


def _worker(rank: int, world_size: int, out_dir, mode: str) -> None:

    torch.manual_seed(0)
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    state = register_tail_hook(ddp, "tail", None)
    wrapper = CorruptingCompressor(state.compressor, mode) if rank == 1 else None
    if wrapper is not None:
        state.compressor = wrapper
    steps_until_error(
        ddp, rank, out_dir, in_features=IN_FEATURES, corrupt_from_step=CORRUPT_FROM_STEP, wrapper=wrapper
    )
    # Return: the launcher destroys the group and the process exits, as a crashed worker's would.


@pytest.mark.parametrize("mode", ["truncated", "bad_magic"])
def test_corrupted_payload_fails_the_step_with_codec_error_on_every_rank(tmp_path, mode: str) -> None:
    t0 = time.monotonic()
    try:
        run_local_group(_worker, 2, (tmp_path, mode), timeout_s=COLLECTIVE_TIMEOUT_S, leave_together=False)
    except ProcessExitedException as exc:
        # gloo may abort a process outright when its peer vanished mid-collective: the sender,
        # or the receiver at teardown (after it saved its outcome: loaded and checked below).
        # A crash, not a hang, which is all a supervisor (Ray Train) needs.
        assert exc.error_index in (0, 1), exc
    wall_s = time.monotonic() - t0
    assert wall_s < COLLECTIVE_TIMEOUT_S, f"the group took {wall_s:.1f} s: something waited for the timeout"
    sender_file = tmp_path / "rank1.pt"
    sender_aborted = {
        "ok_steps": CORRUPT_FROM_STEP + 1,
        "failed_step": CORRUPT_FROM_STEP + 1,
        "failed_after_s": 0.0,
        "chain": ["process aborted by gloo"],
    }
    receiver = torch.load(tmp_path / "rank0.pt", weights_only=False)
    sender = torch.load(sender_file, weights_only=False) if sender_file.exists() else sender_aborted
    outs = [receiver, sender]
    assert receiver["ok_steps"] == CORRUPT_FROM_STEP, receiver  # the collective ran fine before
    assert receiver["failed_step"] == CORRUPT_FROM_STEP, receiver
    assert any(CodecError.__name__ in link for link in receiver["chain"]), receiver["chain"]
    # The sender fails no later than its next collective, and neither waits for the timeout.
    assert CORRUPT_FROM_STEP <= sender.get("failed_step", 99) <= CORRUPT_FROM_STEP + 1, sender
    for out in outs:
        assert out["failed_after_s"] < COLLECTIVE_TIMEOUT_S / 4, out
    failed_in = ", ".join(f"{o['failed_after_s'] * 1000:.0f} ms" for o in outs)
    print(
        f"\n{mode}: receiver / sender failed after {failed_in} ({outs[0]['chain'][0][:120]});"
        f" group wall {wall_s:.1f} s"
    )
