"""Variable-size exchanges of byte payloads, on gloo (CPU) and nccl (GPU): all-gather and all-to-all.

Compressed payloads differ in size from rank to rank (a dithered layer's entropy-coded levels
differ by a few hundred bytes every step). Each exchange is two steps, always issued in this
order by the calling thread:

1. the sizes: an all-gather (``all_gather_bytes``) or an all-to-all (``all_to_all_bytes``) of
   one int64 per rank;
2. the payloads, each at its exact size: nothing is padded.

``all_gather_bytes`` sends its payload to every other rank point to point
(``batch_isend_irecv``, one send buffer for all peers, no copy per peer). A ring all-gather
would move the same bytes per rank ((W-1) chunks out, (W-1) in), but gloo's and NCCL's
all-gather need equal sizes: every payload padded to the longest, which cost the LM's 2 ranks
0.7 % of their bytes and grows with W (the longest of W dithered payloads).

``all_to_all_bytes`` (the sharded collectives) sends a different payload to every rank in one
``all_to_all_single`` with uneven split sizes (gloo implements uneven splits for CPU tensors;
checked on torch 2.13: the list form ``all_to_all`` and uneven ``all_gather`` are refused by
gloo, ``all_to_all_single`` with split sizes is not).

Every exchange runs synchronously: the caller gets the bytes back, and nothing is left in
flight that could interleave with the next bucket's collectives (see payload.py on why order
matters).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

SIZE_BYTES = 8  # one int64 length per rank in the size exchange


@dataclass(frozen=True, slots=True)
class GatherTraffic:
    """What one variable-size all-gather moved, from this rank's point of view.

    ``bytes_sent``: its size word and its payload, to each of the W-1 other ranks.
    ``bytes_received``: every other rank's size word and payload. ``payload_bytes``: this
    rank's payload. Nothing is padded, so ``padded_bytes`` (the longest payload, what a
    padded all-gather would have sent per chunk) is kept only to show what padding would cost.
    """

    bytes_sent: int
    bytes_received: int
    payload_bytes: int
    padded_bytes: int


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where tensors for ``group``'s collectives must live: the current CUDA device for nccl."""
    backend = dist.get_backend(group)
    if backend == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank P2P calls address (``peer``); torch < 2.6 has no ``group_peer``."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def all_gather_bytes(
    payload: bytes,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> tuple[list[bytes], GatherTraffic]:
    """Gather every rank's ``payload`` (sizes may differ); return them in rank order.

    Every rank of ``group`` must call this, in the same order relative to its other
    collectives. ``device`` defaults to what the group's backend needs.
    """
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    dev = device if device is not None else collective_device(group)
    if dev.type != "cpu" and dist.get_backend(group) == dist.Backend.GLOO:
        # gloo's point-to-point sends read host memory only (and the payload is host bytes).
        dev = torch.device("cpu")

    my_size = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world_size)]
    dist.all_gather(sizes, my_size, group=group)
    lengths = [int(s.item()) for s in sizes]

    # One send buffer for every peer (numpy reads the bytes in place; torch.frombuffer would
    # need a writable copy first); each peer's payload lands in a buffer of its exact size. A
    # zero-length payload is neither sent nor received: both sides know its length.
    send = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy()).to(dev)
    recv = {j: torch.empty(n, dtype=torch.uint8, device=dev) for j, n in enumerate(lengths) if j != rank}
    ops = []
    for j in range(world_size):
        if j == rank:
            continue
        peer = _global_rank(group, j)
        if len(payload):
            ops.append(dist.P2POp(dist.isend, send, peer, group))
        if lengths[j]:
            ops.append(dist.P2POp(dist.irecv, recv[j], peer, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    out = [payload if j == rank else _to_bytes(recv[j]) for j in range(world_size)]
    others = [n for j, n in enumerate(lengths) if j != rank]
    traffic = GatherTraffic(
        bytes_sent=(world_size - 1) * (SIZE_BYTES + len(payload)),
        bytes_received=sum(SIZE_BYTES + n for n in others),
        payload_bytes=len(payload),
        padded_bytes=max(lengths),
    )
    return out, traffic


@dataclass(frozen=True, slots=True)
class ExchangeTraffic:
    """What one all-to-all moved, from this rank's point of view: the length words and payload
    bytes it sent to / received from the OTHER ranks (its own share never leaves it)."""

    bytes_sent: int
    bytes_received: int


def all_to_all_bytes(
    sends: Sequence[bytes],
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> tuple[list[bytes], ExchangeTraffic]:
    """Send ``sends[j]`` to rank j of ``group``; return what every rank sent this one, in rank order.

    Every rank of ``group`` must call this, in the same order relative to its other
    collectives, with one payload per rank (its own is handed back without a copy on the wire).
    """
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if len(sends) != world_size:
        raise ValueError(f"all_to_all_bytes needs one payload per rank ({world_size}), got {len(sends)}")
    dev = device if device is not None else collective_device(group)

    send_sizes = torch.tensor([len(p) for p in sends], dtype=torch.int64, device=dev)
    recv_sizes = torch.empty(world_size, dtype=torch.int64, device=dev)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    in_splits = [len(p) for p in sends]
    out_splits = [int(n) for n in recv_sizes.tolist()]

    send_np = np.empty(sum(in_splits), dtype=np.uint8)
    at = 0
    for p in sends:
        send_np[at : at + len(p)] = np.frombuffer(p, dtype=np.uint8)
        at += len(p)
    send = torch.from_numpy(send_np).to(dev)
    recv = torch.empty(sum(out_splits), dtype=torch.uint8, device=dev)
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)

    got_np = recv.cpu().numpy()
    out, at = [], 0
    for n in out_splits:
        out.append(got_np[at : at + n].tobytes())
        at += n
    others = [j for j in range(world_size) if j != rank]
    traffic = ExchangeTraffic(
        bytes_sent=sum(SIZE_BYTES + in_splits[j] for j in others),
        bytes_received=sum(SIZE_BYTES + out_splits[j] for j in others),
    )
    return out, traffic


def _to_bytes(t: torch.Tensor) -> bytes:
    return np.ascontiguousarray(t.cpu().numpy()).tobytes()


def ring_allreduce_bytes(tensor_bytes: int, world_size: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``tensor_bytes``.

    Reduce-scatter then all-gather, each moving (W-1)/W of the tensor: 2*(W-1)/W * size.
    This is the model used to count all-reduce traffic; it is what NCCL's ring and gloo's
    ring algorithms move, and the lower bound for any all-reduce algorithm.
    """
    if world_size <= 1:
        return 0
    return (2 * (world_size - 1) * tensor_bytes) // world_size
