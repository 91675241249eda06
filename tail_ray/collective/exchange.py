"""A compressed exchange of one DDP bucket: the interface every compressed collective implements.

The payload hook (payload.py) runs one of these per bucket on a compressed step:

    allgather     every rank's payload to every rank; each decodes W-1 payloads (this file)
    sharded       all-to-all of per-owner slices, owner sums and re-compresses, all-gather
                  of the compressed sums (sharded.py)
    hierarchical  plain mean inside a node, sharded exchange across nodes (hierarchical.py)

Each drives compressors only through the ``Compressor`` contract, writes the mean over ranks
into the bucket's gradient views (bit-identical on every rank), and reports what it did. Each
also says what error feedback it still owes (``fold``: on a step the link-aware switch sends
uncompressed) and hands its own compressors to the hook's checkpoint (``compressors()``, by
role) with what their residuals owe the mean (``owed_parts``).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tail_ray.collective.transport import all_gather_bytes
from tail_ray.compression.base import Compressor
from tail_ray.compression.stats import LayerStats


@dataclass
class ExchangeReport:
    """One bucket's exchange on this rank: ``stats`` of its own (first-stage) compression per
    layer, ``stage_two`` of the slices it re-compressed as an owner, bytes it handed to / got
    from the network, and wall seconds of each part."""

    stats: list[LayerStats]
    stage_two: list[LayerStats] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    compress_s: float = 0.0
    comm_s: float = 0.0
    decode_s: float = 0.0


# What a compressor's residuals are worth to the job's mean: (offsets, weight). Its residual
# of layer L covers elements [offsets[L], offsets[L] + size) of L (0 when L is missing), and
# the mean over every rank is owed weight x residual there: 1/W for a rank's own stream in an
# all-gather or a sharded exchange, 1 for a second stage (it compressed the mean itself).
Owed = tuple[dict[str, int], float]
MAIN = "main"  # the role of the hook's own compressor in ``owed_parts``


class Exchange(ABC):
    """One compressed collective over ``group``; see the module docstring."""

    name = "exchange"

    @abstractmethod
    def run(self, layers: Mapping[str, torch.Tensor], buffer: torch.Tensor) -> ExchangeReport:
        """Exchange one bucket: ``layers`` are views of ``buffer`` keyed by parameter name."""

    def compressors(self) -> Mapping[str, Compressor]:
        """The compressors this exchange owns besides the hook's main one, by role."""
        return {}

    @abstractmethod
    def fold(self, layers: Mapping[str, torch.Tensor], world_size: int) -> None:
        """Before a plain step (fp32 mean over ``world_size`` ranks): add into ``layers`` what
        error feedback still owes the mean (the hook's compressor's and this exchange's own),
        each scaled to count once in that mean; then forget it."""

    def owed_parts(self, world_size: int) -> dict[str, Owed]:
        """For ``MAIN`` and each role of ``compressors()``: where its residuals sit and what
        they are worth to the mean (see ``Owed``). Checkpoints keep this, so a resized job can
        sum what every old rank owed (PayloadHookState.load_resized)."""
        return {MAIN: ({}, 1.0 / world_size)}


class AllGatherExchange(Exchange):
    """Every rank's payload to every rank (``transport.all_gather_bytes``), then each rank's
    compressor decodes the W payloads and writes their mean (``Compressor.aggregate``)."""

    name = "allgather"

    def __init__(self, compressor: Compressor, group: dist.ProcessGroup | None) -> None:
        self.compressor = compressor
        self.group = group

    def run(self, layers: Mapping[str, torch.Tensor], buffer: torch.Tensor) -> ExchangeReport:
        start = time.perf_counter()
        payload = self.compressor.compress(layers)
        stats = list(self.compressor.last_stats)
        compressed = time.perf_counter()
        payloads, traffic = all_gather_bytes(payload, self.group, device=buffer.device)
        exchanged = time.perf_counter()
        self.compressor.aggregate(payloads, layers, own=dist.get_rank(self.group))
        return ExchangeReport(
            stats=stats,
            bytes_sent=traffic.bytes_sent,
            bytes_received=traffic.bytes_received,
            compress_s=compressed - start,
            comm_s=exchanged - compressed,
            decode_s=time.perf_counter() - exchanged,
        )

    def fold(self, layers: Mapping[str, torch.Tensor], world_size: int) -> None:
        # A rank's residual is 1/W of the mean's debt, as its gradient is 1/W of the mean.
        self.compressor.fold_residuals(layers)


def plain_stats(layers: Mapping[str, torch.Tensor]) -> list[LayerStats]:
    """Layer stats of gradients sent as they are (fp32; code "allreduce", as the hook's plain
    steps record them)."""
    return [
        LayerStats(name, g.numel(), 32, 1.0, 4 * g.numel(), 4 * g.numel(), 0.0, "allreduce")
        for name, g in layers.items()
    ]


def flat_views(layers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Flat views of the bucket's gradients (DDP's are contiguous views of its buffer)."""
    out = {}
    for name, g in layers.items():
        if not g.is_contiguous():
            raise ValueError(f"gradient of {name!r} is not contiguous: a shard view would be a copy")
        out[name] = g.view(-1)
    return out


def fold_scaled(
    compressor: Compressor,
    targets: Mapping[str, torch.Tensor],
    scale: float,
) -> None:
    """targets += scale * (what ``compressor`` owes for each of their layers), then forgotten.

    ``Compressor.fold_residuals`` adds a residual as it is; a residual kept for a slice of the
    mean must count ``scale`` times in a rank's gradient to count once in the mean.

    Multiplied, then added: two separately rounded float32 operations. ``add_(x, alpha=s)``
    is a fused multiply-add in ATen's AVX2/AVX-512 kernels and two roundings in its default
    one, so its bits would depend on the CPU."""
    owed = {name: torch.zeros(t.numel(), dtype=torch.float32) for name, t in targets.items()}
    compressor.fold_residuals(owed)
    for name, t in targets.items():
        if owed[name].any():
            t.add_(owed[name].mul_(scale).to(device=t.device, dtype=t.dtype).view(t.shape))
