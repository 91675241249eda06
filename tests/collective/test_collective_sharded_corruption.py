"""Bad or mismatched shard payloads inside a running sharded collective (4 gloo ranks, spawned).

From step 1 on, rank 1 misbehaves in one of three ways (test-only wrappers):

- ``truncated``: its stage-one payload for rank 0 is cut in half. Rank 0, which decodes it,
  fails with CodecError; the others block in the next collective until rank 0's process is
  gone, then fail too.
- ``stage_two``: the compressed sum it sends as the owner of shard 1 has a damaged header.
  Every OTHER rank decodes it and fails with CodecError (rank 1 takes its own records).
- ``layout``: it cuts its gradients with another shard layout (another ``shard_min_numel``:
  a rank configured differently). Where a shard is cut differently, the envelope's layout
  digest differs: its owner refuses what rank 1 sent (and rank 1, if its own shard differs,
  what the others sent) before decoding anything.

In every case the receiver fails at once, and nobody waits for the collective timeout: a Ray
Train job would tear the group down and restart it from the last checkpoint.
"""

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
from tail_ray.collective.sharded import layout_digest, seal, unseal
from tail_ray.collective.shards import shard_layout
from tail_ray.errors import CodecError

WORLD_SIZE = 4
COLLECTIVE_TIMEOUT_S = 30
# Starting 4 processes on a busy 2-core machine can take longer than a collective may wait:
# the run as a whole gets more; a hang shows as a rank failing only after COLLECTIVE_TIMEOUT_S.
RUN_TIMEOUT_S = 240
CORRUPT_FROM_STEP = 1
MIN_SLICE = 4096


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


class _Wrapper:
    """Delegates to a compressor; ``armed`` switches the damage on."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class TruncateForRankZero(_Wrapper):
    def compress_shards(self, grads, shards, *, own_shard=None):  # type: ignore[no-untyped-def]
        payloads = self.inner.compress_shards(grads, shards, own_shard=own_shard)
        if self.armed:
            payloads[0] = payloads[0][: len(payloads[0]) // 2]
        return payloads


class DamageStageTwo(_Wrapper):
    def compress(self, grads):  # type: ignore[no-untyped-def]
        payload = self.inner.compress(grads)
        return b"\x00\x00\x00\x00" + payload[4:] if self.armed else payload


def _worker(rank: int, world_size: int, out_dir, mode: str) -> None:
    ddp = nn.parallel.DistributedDataParallel(_model())
    config: dict[str, Any] = {"collective": "sharded", "shard_min_numel": MIN_SLICE, "link_aware": False}
    if mode == "layout" and rank == 1:
        config["shard_min_numel"] = 2 * MIN_SLICE  # this rank was configured differently
    state = register_tail_hook(ddp, "tail", config)
    exchange = state.exchange
    wrapper: _Wrapper | None = None
    if rank == 1 and mode == "truncated":
        wrapper = exchange.compressor = TruncateForRankZero(exchange.compressor)  # type: ignore[attr-defined]
    if rank == 1 and mode == "stage_two":
        wrapper = exchange.stage_two = DamageStageTwo(exchange.stage_two)  # type: ignore[attr-defined]
    steps_until_error(
        ddp, rank, out_dir, in_features=64, corrupt_from_step=CORRUPT_FROM_STEP, wrapper=wrapper
    )


def _ranks_whose_shard_differs() -> set[int]:
    """Rank r refuses rank 1's payload for shard r (and rank 1 the others' for shard 1) when
    shard r is cut differently under the two settings."""
    layers = [(n, p.numel()) for n, p in _model().named_parameters()]
    digests = [
        [layout_digest(s) for s in shard_layout(layers, WORLD_SIZE, alignment=512, min_slice_numel=m)]
        for m in (MIN_SLICE, 2 * MIN_SLICE)
    ]
    return {r for r in range(WORLD_SIZE) if digests[0][r] != digests[1][r]}


# Which ranks must fail with CodecError (decoding or refusing a payload), and at which step.
EXPECTED = {
    "truncated": ({0}, CORRUPT_FROM_STEP),
    "stage_two": ({0, 2, 3}, CORRUPT_FROM_STEP),
    "layout": (_ranks_whose_shard_differs(), 0),
}


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_bad_shard_payload_fails_the_receiver_with_codec_error_and_nobody_hangs(tmp_path, mode: str) -> None:
    t0 = time.monotonic()
    try:
        run_local_group(
            _worker,
            WORLD_SIZE,
            (tmp_path, mode),
            timeout_s=RUN_TIMEOUT_S,
            collective_timeout_s=COLLECTIVE_TIMEOUT_S,
            leave_together=False,
        )
    except ProcessExitedException as exc:
        # gloo may abort a process outright when a peer vanished mid-collective: a crash, not
        # a hang, which is all a supervisor (Ray Train) needs. Outcomes saved before it count.
        assert 0 <= exc.error_index < WORLD_SIZE, exc
    wall_s = time.monotonic() - t0
    receivers, step = EXPECTED[mode]
    assert receivers, "the scenario must make some rank receive a bad payload"
    outs = {r: torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)
            if (tmp_path / f"rank{r}.pt").exists()}  # fmt: skip
    for r in receivers:
        assert r in outs, f"rank {r} saved nothing"
        assert outs[r]["ok_steps"] == step and outs[r]["failed_step"] == step, outs[r]
        assert any(CodecError.__name__ in link for link in outs[r]["chain"]), outs[r]["chain"]
        assert outs[r]["failed_after_s"] < COLLECTIVE_TIMEOUT_S / 4, outs[r]
    for r, out in outs.items():  # the others fail no later than their next step, and fast
        assert step <= out.get("failed_step", 99) <= step + 1, (r, out)
        assert out["failed_after_s"] < COLLECTIVE_TIMEOUT_S / 2, (r, out)
    print(
        f"\n{mode} (group wall {wall_s:.0f} s): "
        + ", ".join(f"rank {r} {o.get('chain', ['ok'])[0][:80]}" for r, o in sorted(outs.items()))
    )


def test_envelope_refuses_another_shard_or_another_layout() -> None:
    framed = seal(b"payload", stage=1, shard=2, digest=0xABC)
    assert unseal(framed, stage=1, shard=2, digest=0xABC, sender=3) == b"payload"
    with pytest.raises(CodecError, match="shard 2") as err:
        unseal(framed, stage=1, shard=0, digest=0xABC, sender=3)
    assert err.value.field == "shard"
    with pytest.raises(CodecError) as err:
        unseal(framed, stage=2, shard=2, digest=0xABC, sender=3)
    assert err.value.field == "shard"
    with pytest.raises(CodecError, match="another layout") as err:
        unseal(framed, stage=1, shard=2, digest=0xABD, sender=3)
    assert err.value.field == "layout"
    reported = seal(b"payload", stage=2, shard=2, digest=0xABC, report=b"r" * 32)
    assert unseal(reported, stage=2, shard=2, digest=0xABC, sender=3) == b"payload"
    lying = reported[:16] + (10**6).to_bytes(4, "little") + reported[20:]  # claims a longer report
    with pytest.raises(CodecError) as err:
        unseal(lying, stage=2, shard=2, digest=0xABC, sender=3)
    assert err.value.field == "report"
    for bad in (b"", framed[:10], b"XXXX" + framed[4:]):
        with pytest.raises(CodecError) as err:
            unseal(bad, stage=1, shard=2, digest=0xABC, sender=3)
        assert err.value.field == "envelope"
