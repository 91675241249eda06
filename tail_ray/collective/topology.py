"""The node layout of a worker group: which ranks share a node, as the launcher says it.

The hierarchical collective reduces plainly inside a node and compresses across nodes. Which
ranks share a node must come from whoever placed the workers (Ray Train's worker context:
node rank, local rank, local world size; torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE / GROUP_RANK),
never from a guess such as "consecutive ranks": Ray places workers by resources, and a wrong
guess would send node-local traffic over the slow link.

``NodeLayout`` is one rank's own view. ``NodeGroups.build`` checks every rank's view against
the others' (one all-gather of three integers, once) and makes the process groups: one per
node (the plain reduction) and one per local rank, across the nodes (a "rail": the compressed
exchange). It needs every node to hold the same number of ranks; otherwise it says so.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tail_ray.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeLayout:
    """This rank's place: ``node_rank`` (which node), ``local_rank`` (its index on that node),
    ``local_world_size`` (ranks on that node)."""

    node_rank: int
    local_rank: int
    local_world_size: int

    def __post_init__(self) -> None:
        for name in ("node_rank", "local_rank", "local_world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"node layout: {name} must be an integer >= 0, got {value!r}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ConfigError(
                f"node layout: local_rank {self.local_rank} is not in 0..local_world_size-1 "
                f"(local_world_size {self.local_world_size})"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NodeLayout | None:
        """torchrun's variables (GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE), or None when unset."""
        env = os.environ if env is None else env
        keys = ("GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        if not all(k in env for k in keys):
            return None
        try:
            node, local, size = (int(env[k]) for k in keys)
        except ValueError:
            raise ConfigError(f"node layout: {keys} must be integers, got {[env[k] for k in keys]}") from None
        return cls(node, local, size)


@dataclass
class NodeGroups:
    """The checked layout of a whole group and the process groups built from it."""

    num_nodes: int
    local_world_size: int
    node_index: int  # this rank's node among the sorted node ranks: its rank in its rail
    local_rank: int
    intra: dist.ProcessGroup | None  # this node's ranks (None: one rank per node)
    rail: dist.ProcessGroup | None  # the ranks with this local rank, one per node (None: one node)

    @classmethod
    def build(cls, layout: NodeLayout, group: dist.ProcessGroup | None) -> NodeGroups:
        """Check ``layout`` against every rank's and make the groups; every rank of ``group``
        must call this at the same point. A layout that does not add up is a ``ConfigError``
        on every rank (they all see the same gathered table)."""
        world = dist.get_world_size(group)
        mine = torch.tensor([layout.node_rank, layout.local_rank, layout.local_world_size], dtype=torch.int64)
        table = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(table, mine, group=group)
        rows = [tuple(int(v) for v in t.tolist()) for t in table]
        nodes: dict[int, dict[int, int]] = {}  # node rank -> local rank -> group rank
        for rank, (node, local, size) in enumerate(rows):
            if size != rows[0][2]:
                raise ConfigError(
                    f"hierarchical collective: every node must hold the same number of ranks; rank "
                    f"{rank} reports local_world_size {size}, rank 0 {rows[0][2]} (layout {rows})"
                )
            if local in nodes.setdefault(node, {}):
                raise ConfigError(f"node layout: node {node} has local rank {local} twice (layout {rows})")
            nodes[node][local] = rank
        size = rows[0][2]
        for node, locals_ in nodes.items():
            if sorted(locals_) != list(range(size)):
                raise ConfigError(
                    f"node layout: node {node} has local ranks {sorted(locals_)}, expected 0..{size - 1}"
                )
        order = sorted(nodes)
        backend = dist.get_backend(group)

        def global_ranks(ranks: list[int]) -> list[int]:
            return [dist.get_global_rank(group, r) if group is not None else r for r in ranks]

        # Only members call new_group for a group (local synchronization), every rank in the
        # same order (its node's group, then its rail), so no rank waits on another's groups.
        intra = rail = None
        me = dist.get_rank(group)
        my_node = rows[me][0]
        if size > 1:
            members = global_ranks([nodes[my_node][local] for local in range(size)])
            intra = dist.new_group(members, backend=backend, use_local_synchronization=True)
        if len(order) > 1:
            members = global_ranks([nodes[node][layout.local_rank] for node in order])
            rail = dist.new_group(members, backend=backend, use_local_synchronization=True)
        log.info("node layout: %d nodes x %d ranks; this rank is node %d local %d", len(order), size, my_node,
                 layout.local_rank)  # fmt: skip
        return cls(
            num_nodes=len(order),
            local_world_size=size,
            node_index=order.index(my_node),
            local_rank=layout.local_rank,
            intra=intra,
            rail=rail,
        )
