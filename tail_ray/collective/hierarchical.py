"""The hierarchical collective: a plain mean inside each node, a compressed exchange across nodes.

Clusters of multi-GPU nodes on slow Ethernet have a fast link inside a node (NVLink, shared
memory) and a slow one between nodes. So, per DDP bucket, on N nodes of L ranks each:

    node mean    fp32 all-reduce of the bucket inside the node (the node's own process
                 group: NCCL over NVLink on GPUs, gloo on CPU), divided by L
    cross-node   local rank l owns part l of the bucket (the shard layout over L ranks) and
                 runs the sharded exchange (sharded.py) on that part with local rank l of
                 every other node (its "rail"): compressed slices in, compressed sums out
    node gather  every rank zeroes what it does not own and the node all-reduces (sums) the
                 bucket again: each element has exactly one non-zero term, so every rank of
                 the node gets the owners' values bit for bit

Each node thus sends about two compressed copies of the gradient across the slow link in
all, split over its L ranks, whatever the number of nodes. With one node it is a plain
all-reduce; with one rank per node it is the sharded exchange.

Which ranks share a node comes from the launcher (topology.NodeLayout: Ray Train's worker
context), never from a guess. The groups are built (and the layout checked against every
rank's) on the first exchange, at the same point on every rank.

Traffic counted in the metrics: what crosses the node boundary (the rail's exchange). The
plain reduction inside the node never leaves it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from tail_ray.collective.exchange import (
    MAIN,
    Exchange,
    ExchangeReport,
    Owed,
    flat_views,
    fold_scaled,
    plain_stats,
)
from tail_ray.collective.sharded import STAGE_TWO, ShardedExchange
from tail_ray.collective.shards import MIN_SLICE_NUMEL, Shard, restrict, shard_views
from tail_ray.collective.topology import NodeGroups, NodeLayout
from tail_ray.compression.base import Compressor


class HierarchicalExchange(Exchange):
    """See the module docstring. ``compressor`` (the hook's own) compresses this rank's part of
    its node's mean; the rail's sharded exchange makes its second stage."""

    name = "hierarchical"

    def __init__(
        self,
        compressor: Compressor,
        group: dist.ProcessGroup | None,
        layout: NodeLayout,
        *,
        model_layers: Sequence[tuple[str, int]] | None = None,
        min_slice_numel: int = MIN_SLICE_NUMEL,
    ) -> None:
        self.compressor = compressor
        self.group = group
        self.layout = layout
        self.model_layers = list(model_layers) if model_layers is not None else None
        self.nodes: NodeGroups | None = None
        self._parts: list[Shard] | None = None  # the model cut over the node's L ranks
        # The rail's exchange; its group and its layers (this rank's parts) are set once the
        # node layout is known.
        self.rail = ShardedExchange(compressor, None, min_slice_numel=min_slice_numel)
        self._part_offsets: dict[str, int] = {}  # where this rank's part of each layer starts

    def groups(self) -> NodeGroups:
        if self.nodes is None:
            self.nodes = NodeGroups.build(self.layout, self.group)
            self.rail.group = self.nodes.rail
            if self.model_layers is not None:
                self._parts = self.rail.cut(self.model_layers, self.nodes.local_world_size)
                mine = self._parts[self.nodes.local_rank]
                self.rail.model_layers = [(name, part.stop - part.start) for name, part in mine.items()]
        return self.nodes

    def _part(self, flat: Mapping[str, torch.Tensor], nodes: NodeGroups) -> dict[str, torch.Tensor]:
        """This rank's part of the bucket (views), recording where each layer's part starts."""
        if self._parts is not None:
            shards = restrict(self._parts, list(flat))
        else:
            shards = self.rail.cut([(name, t.numel()) for name, t in flat.items()], nodes.local_world_size)
        mine = shards[nodes.local_rank]
        for name, part in mine.items():
            self._part_offsets[name] = part.start
        return shard_views(flat, mine)

    def run(self, layers: Mapping[str, torch.Tensor], buffer: torch.Tensor) -> ExchangeReport:
        nodes = self.groups()
        flat = flat_views(layers)
        t0 = time.perf_counter()
        if nodes.intra is not None:
            dist.all_reduce(buffer, group=nodes.intra)
            buffer.div_(nodes.local_world_size)
        t1 = time.perf_counter()
        if nodes.rail is None:  # one node: the node mean is the mean, sent plain
            return ExchangeReport(stats=plain_stats(layers), comm_s=t1 - t0)
        part = self._part(flat, nodes)
        report = self.rail.run_flat(part, buffer.device)
        t2 = time.perf_counter()
        if nodes.intra is not None:
            kept = {name: t.clone() for name, t in part.items()}
            buffer.zero_()
            for name, t in part.items():
                t.copy_(kept[name])
            dist.all_reduce(buffer, group=nodes.intra)
        report.comm_s += (t1 - t0) + (time.perf_counter() - t2)
        return report

    # -- what the compressors owe ----------------------------------------------------------------

    def compressors(self) -> Mapping[str, Compressor]:
        return {STAGE_TWO: self.rail.stage_two}

    def fold(self, layers: Mapping[str, torch.Tensor], world_size: int) -> None:
        """The hook's compressor holds this rank's part of its NODE's mean: 1/N of the mean's
        debt, so L x it in one rank's gradient (the mean is over N x L ranks). The rail's stage
        two owes the mean itself: world_size x it (see ShardedExchange)."""
        nodes = self.groups()
        if nodes.rail is None:
            return
        part = self._part(flat_views(layers), nodes)
        fold_scaled(self.compressor, part, float(nodes.local_world_size))
        self.rail.fold_stage_two(part, world_size)

    def owed_parts(self, world_size: int) -> dict[str, Owed]:
        nodes = self.nodes
        num_nodes = nodes.num_nodes if nodes is not None else world_size // self.layout.local_world_size
        # The rail's slices are slices of this rank's part: offsets add up.
        stage_two = {
            name: self._part_offsets.get(name, 0) + start
            for name, start in self.rail.stage_two_offsets.items()
        }
        return {MAIN: (dict(self._part_offsets), 1.0 / max(num_nodes, 1)), STAGE_TWO: (stage_two, 1.0)}
