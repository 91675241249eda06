"""The cost model of the collectives: alpha-beta link terms plus measured codec speeds.

One function, ``collective_cost``, predicts for one training step and one rank: the bytes
that rank puts on the network, the seconds the link needs for them (alpha per message
round, beta = bytes / bandwidth), and the seconds the codec needs (compress and decode, at
speeds measured on the machine: ``jobs.collective_cost`` measures them). Used by the docs'
table (docs/collective.md), which ``python -m jobs.collective_cost`` prints, and checked there
against measured steps at W = 2, 4, 8.

    G   gradient bytes (fp32)          P = G / ratio   one rank's compressed payload
    W   ranks                          L               ranks per node (hierarchical)
    B   link bytes/s, each direction   alpha           seconds per message round

    collective    bytes sent per rank      link rounds     codec (G-equivalents)
    ring fp32     2 (W-1)/W G              2 (W-1)         -
    allgather     (W-1) P                  2 (W-1)         compress 1, decode W-1
    sharded       2 (W-1)/W P              4 (W-1)         compress 1 + 1/W, decode 2 (W-1)/W
    hierarchical  2 (N-1)/N P per NODE     4 (N-1) + intra compress (1 + 1/N)/L, decode 2 (N-1)/(N L)
                  (N = W / L nodes; each node's L ranks share its link; inside the node two
                   fp32 all-reduces of G at the node's local bandwidth)

Assumptions, said once: a rank's link is full duplex, so the time is that of the bytes it
SENDS (every collective here sends as much as it receives); an all-to-all or a ring step
costs one alpha per peer, in sequence (conservative: gloo sends to the peers of an
all-to-all one after another); compress and decode are not overlapped with the network (the
hook runs them synchronously). Compute (forward, backward) is not modelled: it is the same
for every collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from tail_ray.collective.choice import Collective
from tail_ray.errors import ConfigError

RING = "ring"  # fp32 all-reduce (method none): the baseline row of the table
COLLECTIVES = (RING, Collective.ALLGATHER.value, Collective.SHARDED.value, Collective.HIERARCHICAL.value)
SIZE_WORD_BYTES = 8  # one length per message in the variable-size exchanges


@dataclass(frozen=True)
class Link:
    """A rank's (or, for hierarchical, a node's) network link: ``gbit_s`` each direction,
    ``alpha_s`` per message round; ``local_gbit_s``: inside a node (hierarchical)."""

    gbit_s: float
    alpha_s: float = 50e-6
    local_gbit_s: float = 800.0  # 100 GB/s: NVLink-class; shared memory on CPU is ~10x less

    @property
    def bytes_per_s(self) -> float:
        return self.gbit_s * 1e9 / 8

    @property
    def local_bytes_per_s(self) -> float:
        return self.local_gbit_s * 1e9 / 8


@dataclass(frozen=True)
class Codec:
    """Codec speeds in GB/s of fp32 gradient: ``compress_gbps`` (gradient in), ``decode_gbps``
    (one payload decoded and averaged into the gradient, per gradient-sized payload)."""

    compress_gbps: float
    decode_gbps: float


@dataclass(frozen=True)
class CollectiveCost:
    """One step, one rank: bytes on the network link and seconds per part."""

    collective: str
    bytes_sent: float  # this rank's share of what crosses the (node's) network link
    link_bytes: float  # what the link it sends on carries (hierarchical: the node's L ranks)
    link_s: float  # alpha + beta of the network exchanges
    local_s: float  # the plain reduction inside a node (hierarchical)
    codec_s: float  # compress + decode

    @property
    def total_s(self) -> float:
        return self.link_s + self.local_s + self.codec_s


def collective_cost(
    collective: str,
    *,
    world_size: int,
    gradient_bytes: float,
    ratio: float,
    link: Link,
    codec: Codec | None = None,
    local_world_size: int = 1,
) -> CollectiveCost:
    """Predicted cost of one step of ``collective`` (one of ``COLLECTIVES``); see the module doc.

    ``ratio``: gradient bytes / one rank's payload bytes (the compression the method gets).
    ``codec`` None: codec time 0 (for byte counts only). ``local_world_size``: ranks per
    node, used by "hierarchical" (W must be a multiple of it).
    """
    if collective not in COLLECTIVES:
        raise ConfigError(f"collective must be one of {list(COLLECTIVES)}, got {collective!r}")
    w = int(world_size)
    if w < 1 or gradient_bytes < 0 or ratio <= 0:
        raise ConfigError(
            f"need world_size >= 1, gradient_bytes >= 0, ratio > 0; got {w}, {gradient_bytes}, {ratio}"
        )
    g = float(gradient_bytes)
    p = g / ratio
    b, alpha = link.bytes_per_s, link.alpha_s
    cc = codec.compress_gbps * 1e9 if codec is not None else float("inf")
    cd = codec.decode_gbps * 1e9 if codec is not None else float("inf")
    if w == 1:
        return CollectiveCost(collective, 0.0, 0.0, 0.0, 0.0, 0.0 if collective == RING else g / cc + g / cd)

    if collective == RING:
        sent = 2 * (w - 1) / w * g
        return CollectiveCost(collective, sent, sent, 2 * (w - 1) * alpha + sent / b, 0.0, 0.0)
    if collective == Collective.ALLGATHER:
        sent = (w - 1) * (p + SIZE_WORD_BYTES)
        codec_s = g / cc + (w - 1) * g / cd
        return CollectiveCost(collective, sent, sent, 2 * (w - 1) * alpha + sent / b, 0.0, codec_s)
    if collective == Collective.SHARDED:
        sent = 2 * (w - 1) * (p / w + 2 * SIZE_WORD_BYTES)
        codec_s = (g + g / w) / cc + 2 * (w - 1) / w * g / cd
        return CollectiveCost(collective, sent, sent, 4 * (w - 1) * alpha + sent / b, 0.0, codec_s)

    # hierarchical
    local = max(1, int(local_world_size))
    if w % local:
        raise ConfigError(f"world_size {w} is not a multiple of local_world_size {local}")
    nodes = w // local
    # Inside the node: two fp32 all-reduces of the bucket (node mean, then the node gather).
    local_s = 0.0
    if local > 1:
        local_s = 2 * (2 * (local - 1) * alpha + 2 * (local - 1) / local * g / link.local_bytes_per_s)
    if nodes == 1:
        return CollectiveCost(collective, 0.0, 0.0, 0.0, local_s, 0.0)
    part = g / local  # each rank compresses its part of the node's mean
    sent = 2 * (nodes - 1) * (p / local / nodes + 2 * SIZE_WORD_BYTES)
    node_bytes = local * sent  # the node's L ranks share its link
    codec_s = (part + part / nodes) / cc + 2 * (nodes - 1) / nodes * part / cd
    return CollectiveCost(
        collective, sent, node_bytes, 4 * (nodes - 1) * alpha + node_bytes / b, local_s, codec_s
    )
