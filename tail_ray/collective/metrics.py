"""What a hook did during one optimizer step: the typed accumulator every hook state shares."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from tail_ray.compression.stats import LayerStats


@dataclass(frozen=True)
class HookStepMetrics:
    """What the hook did during one optimizer step on this rank.

    ``layers``: one record per layer (parameter) communicated this step. ``stage_two``: one
    record per layer slice this rank re-compressed as the owner of a shard (sharded and
    hierarchical collectives: the second stage's bits, bytes and estimated error; empty
    otherwise). ``bytes_sent`` /
    ``bytes_received``: bytes this rank handed to / got from the collectives (see
    docs/collective.md for how all-gather and all-reduce traffic is counted). ``raw_bytes``:
    fp32 size of every gradient communicated. Times are wall seconds summed over buckets.
    """

    layers: list[LayerStats] = field(default_factory=list)
    stage_two: list[LayerStats] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    raw_bytes: int = 0
    compress_s: float = 0.0
    decode_s: float = 0.0
    comm_s: float = 0.0
    exchanges: int = 0  # bucket exchanges (one per DDP bucket per step; 0 with world size 1)

    @property
    def encoded_bytes(self) -> int:
        """This rank's own encoded gradient bytes (before padding and size words)."""
        return sum(layer.encoded_bytes for layer in self.layers)

    @property
    def ratio(self) -> float:
        """Traffic reduction against sending fp32 gradients as they are."""
        return self.raw_bytes / self.bytes_sent if self.bytes_sent else float("inf")


class StepMetricsAccumulator:
    """Sums of one step's ``HookStepMetrics``, drained once per optimizer step.

    Async all-reduce callbacks add comm time from another thread: hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums = HookStepMetrics()

    def add(
        self,
        *,
        layers: Iterable[LayerStats] = (),
        stage_two: Iterable[LayerStats] = (),
        bytes_sent: int = 0,
        bytes_received: int = 0,
        compress_s: float = 0.0,
        decode_s: float = 0.0,
        comm_s: float = 0.0,
        exchanges: int = 0,
    ) -> None:
        """Add one bucket's (or one local round trip's) share; ``raw_bytes`` follows ``layers``."""
        layers = list(layers)
        with self._lock:
            s = self._sums
            s.layers.extend(layers)
            s.stage_two.extend(stage_two)
            self._sums = HookStepMetrics(
                layers=s.layers,
                stage_two=s.stage_two,
                bytes_sent=s.bytes_sent + bytes_sent,
                bytes_received=s.bytes_received + bytes_received,
                raw_bytes=s.raw_bytes + sum(layer.raw_bytes for layer in layers),
                compress_s=s.compress_s + compress_s,
                decode_s=s.decode_s + decode_s,
                comm_s=s.comm_s + comm_s,
                exchanges=s.exchanges + exchanges,
            )

    def drain(self) -> HookStepMetrics:
        """This step's sums since the last drain; starts new ones."""
        with self._lock:
            out, self._sums = self._sums, HookStepMetrics()
        return out
