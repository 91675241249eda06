"""Which compressed collective a payload method runs: the ``collective`` setting and "auto".

    allgather     every rank's payload to every rank: (W-1) payloads sent and decoded per rank
    sharded       slices to their owners, compressed sums back: ~2 payloads per rank, any W
    hierarchical  plain mean inside a node, sharded across nodes: ~2 payloads per NODE
    auto          (default) from W and the node layout, as the cost model (cost.py) says:
                  W <= 2                              -> allgather
                  several nodes of several ranks each -> hierarchical
                  otherwise                           -> sharded

Why "auto" needs no trial between the compressed collectives (cost.py has the model): from
W = 3 on the sharded exchange sends fewer bytes (2 (W-1)/W payloads against W-1) and decodes
fewer payloads (the same ratio) than the all-gather; it takes twice the message rounds (4
exchanges against 2), which outweighs the bytes saved only for small buckets: at W = 3 and
50 us a round, payloads below ~40 kB on 1 Gbit/s (~400 kB on 10 Gbit/s), before counting the
decoding it saves. At W = 2 the two send and decode the same,
and the all-gather quantizes once instead of twice. Across nodes the hierarchical exchange
sends L x fewer bytes over a node's link than the sharded one. What does depend on the
measured link is whether compressing pays at all: the link-aware switch (gate.py) times the
chosen collective against plain all-reduce and sends each step the faster way.
"""

from __future__ import annotations

from enum import StrEnum

from tail_ray.collective.topology import NodeLayout
from tail_ray.errors import ConfigError


class Collective(StrEnum):
    ALLGATHER = "allgather"
    SHARDED = "sharded"
    HIERARCHICAL = "hierarchical"
    AUTO = "auto"

    @classmethod
    def parse(cls, value: object) -> Collective:
        """``value`` as a Collective; anything else is a ``ConfigError`` naming the choices."""
        if isinstance(value, str) and value in cls._value2member_map_:
            return cls(value)
        raise ConfigError(f"collective must be one of {[c.value for c in cls]}, got {value!r}")


def resolve(
    choice: Collective | str,
    *,
    world_size: int,
    layout: NodeLayout | None,
    shardable: bool,
) -> Collective:
    """The collective to run: ``choice`` itself, or what "auto" picks (see the module docstring).

    An explicit "sharded" / "hierarchical" the compressor cannot run, or "hierarchical"
    without a node layout, is a ``ConfigError`` that says what to do instead.
    """
    choice = Collective.parse(choice)
    if world_size <= 1:
        return Collective.ALLGATHER  # nothing is exchanged: the local round trip (register.py)
    if choice == Collective.AUTO:
        if world_size <= 2 or not shardable:
            return Collective.ALLGATHER
        if layout is not None and 1 < layout.local_world_size < world_size:
            return Collective.HIERARCHICAL
        return Collective.SHARDED
    if choice in (Collective.SHARDED, Collective.HIERARCHICAL) and not shardable:
        raise ConfigError(
            f"collective={choice.value!r} needs a compressor that can compress shards; use 'allgather'"
        )
    if choice == Collective.HIERARCHICAL and layout is None:
        raise ConfigError(
            "collective='hierarchical' needs the node layout (node rank, local rank, local world "
            "size): a Ray Train job passes it from its worker context; a plain DDP script passes "
            "register_tail_hook(..., layout=NodeLayout(...)) or runs under torchrun"
        )
    return choice
