"""Variable-size all-gather of byte payloads, on gloo (CPU) and nccl (GPU).

Compressed payloads differ in size from rank to rank, but gloo's ``all_gather`` needs every
rank to contribute a tensor of the same size. So the exchange is two collectives, always
issued in this order by the calling thread:

1. all-gather of every rank's payload length (one int64 each);
2. all-gather of the payloads, each padded with zeros to the longest length;

then each received payload is trimmed back to its real length.

Both collectives run synchronously: the caller gets the bytes back, and nothing is left in
flight that could interleave with the next bucket's collectives (see hook.py on why order
matters).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

SIZE_BYTES = 8  # one int64 length per rank in the size exchange


@dataclass(frozen=True, slots=True)
class GatherTraffic:
    """What one variable-size all-gather moved, from this rank's point of view.

    ``bytes_sent``: what this rank handed to the collectives: its length word plus its
    payload padded to the longest payload. ``bytes_received``: what arrived from the other
    ranks: their length words plus their padded payloads. ``payload_bytes``: this rank's
    payload before padding.
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
    dev = device if device is not None else collective_device(group)

    my_size = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world_size)]
    dist.all_gather(sizes, my_size, group=group)
    lengths = [int(s.item()) for s in sizes]
    padded = max(lengths)

    # One copy of the payload, straight into the padded send buffer (numpy reads the bytes in
    # place; torch.frombuffer would need a writable copy first), and only the padding zeroed.
    n = len(payload)
    send_np = np.empty(padded, dtype=np.uint8)
    send_np[:n] = np.frombuffer(payload, dtype=np.uint8)
    send_np[n:] = 0
    send = torch.from_numpy(send_np).to(dev)
    recv = [torch.empty(padded, dtype=torch.uint8, device=dev) for _ in range(world_size)]
    dist.all_gather(recv, send, group=group)

    out = [_to_bytes(buf[:n]) for buf, n in zip(recv, lengths, strict=True)]
    traffic = GatherTraffic(
        bytes_sent=SIZE_BYTES + padded,
        bytes_received=(world_size - 1) * (SIZE_BYTES + padded),
        payload_bytes=len(payload),
        padded_bytes=padded,
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
