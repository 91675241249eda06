"""The sharded collective: reduce-scatter of compressed slices, then all-gather of compressed sums.

Per DDP bucket, on W ranks (the shard layout: shards.py; rank r owns shard r):

    stage one   ``compress_shards``: every layer compressed once (error feedback, Tail's
                controller), cut into W payloads, payload j = the slices rank j owns
    all-to-all  payload j to rank j (transport.all_to_all_bytes: exact sizes, no padding)
    reduce      the owner decodes the W payloads of its shard and writes their mean into its
                slices of the bucket (``aggregate``; Tail's controller measures the SGD noise
                of the workers AND of their mean here)
    stage two   the owner re-compresses that mean (``second_stage()``: its own residuals, so
                what stage two drops is sent on a later step, and a budget relative to the
                mean's SGD noise)
    all-gather  every owner's payload to every rank (the same all-to-all, one payload copied
                W-1 times); every rank decodes shard j into its slices of the bucket

Each rank sends (W-1)/W of its payload in each stage and decodes (W-1)/W of a payload in
each: about two payloads per rank whatever W is, where the all-gather moves and decodes W-1.
Every rank ends with the same bits: each slice's final value is what its owner's stage-two
payload decodes to, on the owner too (its own records, not decoded, are the same bits).

Framing: every payload travels in a 20-byte envelope of this collective's own (the
compressor's payload inside is untouched): magic, stage, the shard it is for, a digest of
that shard's layout (layer names and element ranges), and the length of the owner's
controller report that precedes a stage-two payload (``Compressor.peer_report``: only the
owner sees every worker's version of its shard, so only it can measure the SGD noise there;
the report hands that to every other rank's controller, 32 bytes per layer of the shard).
A payload meant for another shard, or cut by a rank that computed another layout (different
settings, a different model), is refused by the receiver before the compressor decodes
anything: a mismatched shard of the same layers and sizes would otherwise decode "fine" into
the wrong elements.

Errors: a bad or mismatched shard payload is a ``CodecError`` on the rank that receives it,
before it writes anything; its peers' next collective then fails when that rank's process
leaves (no one waits for a timeout).
"""

from __future__ import annotations

import struct
import time
import zlib
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from tail_ray.collective.exchange import MAIN, Exchange, ExchangeReport, Owed, flat_views, fold_scaled
from tail_ray.collective.shards import MIN_SLICE_NUMEL, Shard, restrict, shard_layout, shard_views
from tail_ray.collective.transport import all_to_all_bytes
from tail_ray.compression.base import Compressor
from tail_ray.errors import CodecError, ConfigError

STAGE_TWO = "stage_two"

# magic, version, stage, reserved, shard, layout digest, length of the controller's report
_ENVELOPE = struct.Struct("<4sBBHIII")
_MAGIC = b"TShd"
_VERSION = 1
_MAX_REPORT_BYTES = 1 << 24  # a report is a few numbers per layer: anything near this is garbage


def layout_digest(shard: Shard) -> int:
    """crc32 of a shard's layer names and element ranges: equal on ranks that agree on it."""
    text = ";".join(f"{name}:{part.start}:{part.stop}" for name, part in shard.items())
    return zlib.crc32(text.encode())


def seal(payload: bytes, *, stage: int, shard: int, digest: int, report: bytes = b"") -> bytes:
    """The payload in this collective's envelope (see the module docstring), after the owner's
    controller report (stage two: what it measured on its shard, for the other ranks)."""
    return _ENVELOPE.pack(_MAGIC, _VERSION, stage, 0, shard, digest, len(report)) + report + payload


def unseal(framed: bytes, *, stage: int, shard: int, digest: int, sender: int) -> bytes:
    """The payload inside ``framed``, after checking it is the one this rank expects from
    ``sender``; otherwise a ``CodecError`` naming the sender and what did not match."""
    return unseal_with_report(framed, stage=stage, shard=shard, digest=digest, sender=sender)[0]


def unseal_with_report(
    framed: bytes, *, stage: int, shard: int, digest: int, sender: int
) -> tuple[bytes, bytes]:
    """``unseal``, and the controller report the envelope carries."""
    if len(framed) < _ENVELOPE.size:
        raise CodecError(
            f"rank {sender}'s stage-{stage} payload has {len(framed)} bytes, no envelope", field="envelope"
        )
    magic, version, got_stage, _, got_shard, got_digest, report_len = _ENVELOPE.unpack_from(framed)
    if magic != _MAGIC or version != _VERSION:
        raise CodecError(f"rank {sender}'s stage-{stage} payload is not a shard payload", field="envelope")
    if got_stage != stage or got_shard != shard:
        raise CodecError(
            f"rank {sender} sent its stage-{got_stage} payload for shard {got_shard} where stage "
            f"{stage} of shard {shard} was expected",
            field="shard",
        )
    if got_digest != digest:
        raise CodecError(
            f"rank {sender} cut shard {shard} with another layout (digest {got_digest:#x}, here "
            f"{digest:#x}): do all ranks run the same model and collective settings?",
            field="layout",
        )
    end = _ENVELOPE.size + report_len
    if report_len > _MAX_REPORT_BYTES or end > len(framed):
        raise CodecError(f"rank {sender}'s envelope claims a {report_len}-byte report", field="report")
    return framed[end:], framed[_ENVELOPE.size : end]


class ShardedExchange(Exchange):
    """See the module docstring. ``compressor`` is the hook's own (stage one, shared with its
    all-gather and local paths); the second stage is made from it."""

    name = "sharded"

    def __init__(
        self,
        compressor: Compressor,
        group: dist.ProcessGroup | None,
        *,
        model_layers: Sequence[tuple[str, int]] | None = None,
        min_slice_numel: int = MIN_SLICE_NUMEL,
    ) -> None:
        """``model_layers``: every parameter (name, elements) in the model's order: the layout
        is cut from the whole model (shards.py). None: from each bucket's own layers."""
        if not compressor.shardable:
            raise ConfigError(
                f"compressor {compressor.name!r} cannot run a sharded collective (it does not "
                "implement compress_shards / second_stage); use collective='allgather'"
            )
        self.compressor = compressor
        self.stage_two = compressor.second_stage()
        self.group = group
        self.min_slice_numel = min_slice_numel
        self.model_layers = list(model_layers) if model_layers is not None else None
        self._model_shards: dict[int, list[Shard]] = {}  # world size -> the model's shards
        self._layouts: dict[tuple[tuple[str, int], ...], tuple[list[Shard], list[int]]] = {}
        # Where this rank's stage-two residual of each layer starts (its slice): checkpoints.
        self._stage_two_offsets: dict[str, int] = {}

    # -- layout ----------------------------------------------------------------------------------

    def layout(self, flat: Mapping[str, torch.Tensor], world_size: int) -> tuple[list[Shard], list[int]]:
        """The shards of these layers and their digests (cached: the same bucket comes back)."""
        key = tuple((name, t.numel()) for name, t in flat.items())
        cached = self._layouts.get(key)
        if cached is None or len(cached[0]) != world_size:
            if self.model_layers is None:
                shards = self.cut(key, world_size)
            else:
                model = self._model_shards.get(world_size)
                if model is None:
                    model = self._model_shards[world_size] = self.cut(self.model_layers, world_size)
                sizes = dict(self.model_layers)
                wrong = [(name, n) for name, n in key if sizes.get(name) != n]
                if wrong:
                    raise ValueError(
                        f"layers {wrong} are not the model's (name, size): build the state from it"
                    )
                shards = restrict(model, [name for name, _ in key])
            cached = (shards, [layout_digest(shard) for shard in shards])
            self._layouts[key] = cached
        return cached

    def cut(self, layers: Sequence[tuple[str, int]], world_size: int) -> list[Shard]:
        """``layers`` cut into ``world_size`` shards at this compressor's alignment (the
        hierarchical exchange cuts a node's parts with it too)."""
        return shard_layout(
            layers,
            world_size,
            alignment=self.compressor.shard_alignment,
            min_slice_numel=self.min_slice_numel,
        )

    # -- one bucket ------------------------------------------------------------------------------

    def run(self, layers: Mapping[str, torch.Tensor], buffer: torch.Tensor) -> ExchangeReport:
        return self.run_flat(flat_views(layers), buffer.device)

    def run_flat(self, flat: Mapping[str, torch.Tensor], device: torch.device) -> ExchangeReport:
        """The exchange over flat gradient views (the hierarchical collective passes its part)."""
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        shards, digests = self.layout(flat, world)
        mine = shard_views(flat, shards[rank])

        t0 = time.perf_counter()
        payloads = self.compressor.compress_shards(flat, shards, own_shard=rank)
        stats = list(self.compressor.last_stats)
        sealed = [seal(p, stage=1, shard=j, digest=digests[j]) for j, p in enumerate(payloads)]
        t1 = time.perf_counter()
        received, scatter = all_to_all_bytes(sealed, self.group, device=device)
        t2 = time.perf_counter()
        # The owner's mean of its shard, written into its own slices of the bucket.
        pieces = _unseal_all(received, stage=1, shards=[rank] * world, digests=[digests[rank]] * world)
        self.compressor.aggregate(pieces, mine, own=rank)
        t3 = time.perf_counter()
        # What the owner's controller measured there goes out with its compressed sum.
        report = self.compressor.peer_report(list(shards[rank]))
        summed = seal(self.stage_two.compress(mine), stage=2, shard=rank, digest=digests[rank], report=report)
        stage_two = list(self.stage_two.last_stats)
        for name, part in shards[rank].items():
            self._stage_two_offsets[name] = part.start
        t4 = time.perf_counter()
        sums, gather = all_to_all_bytes([summed] * world, self.group, device=device)
        t5 = time.perf_counter()
        opened = [
            unseal_with_report(f, stage=2, shard=j, digest=digests[j], sender=j) for j, f in enumerate(sums)
        ]
        sums = [payload for payload, _ in opened]
        self.compressor.observe_reports([(list(shards[j]), opened[j][1]) for j in range(world) if j != rank])
        # Shard by shard, its own first: a compressor hands out the records of its latest
        # compress to the next aggregate only (the owner's own shard: the same bits, not decoded).
        for owner in [rank, *(j for j in range(world) if j != rank)]:
            own = 0 if owner == rank else None
            self.stage_two.aggregate([sums[owner]], shard_views(flat, shards[owner]), own=own)
        t6 = time.perf_counter()
        return ExchangeReport(
            stats=stats,
            stage_two=stage_two,
            bytes_sent=scatter.bytes_sent + gather.bytes_sent,
            bytes_received=scatter.bytes_received + gather.bytes_received,
            compress_s=(t1 - t0) + (t4 - t3),
            comm_s=(t2 - t1) + (t5 - t4),
            decode_s=(t3 - t2) + (t6 - t5),
        )

    # -- what stage two owes ---------------------------------------------------------------------

    def compressors(self) -> Mapping[str, Compressor]:
        return {STAGE_TWO: self.stage_two}

    def fold(self, layers: Mapping[str, torch.Tensor], world_size: int) -> None:
        self.compressor.fold_residuals(layers)  # stage one: 1/W of the mean, like the gradient
        self.fold_stage_two(flat_views(layers), world_size)

    def fold_stage_two(self, flat: Mapping[str, torch.Tensor], world_size: int) -> None:
        """Stage two's residuals are owed to the mean itself; a plain step averages over
        ``world_size`` ranks, so the owner adds world_size x its residual to its slices."""
        rank = dist.get_rank(self.group)
        shards, _ = self.layout(flat, dist.get_world_size(self.group))
        fold_scaled(self.stage_two, shard_views(flat, shards[rank]), float(world_size))

    @property
    def stage_two_offsets(self) -> dict[str, int]:
        """Layer -> first element of this rank's slice (where its stage-two residual sits)."""
        return dict(self._stage_two_offsets)

    def owed_parts(self, world_size: int) -> dict[str, Owed]:
        return {MAIN: ({}, 1.0 / world_size), STAGE_TWO: (self.stage_two_offsets, 1.0)}


def _unseal_all(framed: Sequence[bytes], *, stage: int, shards: list[int], digests: list[int]) -> list[bytes]:
    """Every sender's payload out of its envelope, all checked before any is decoded."""
    return [
        unseal(f, stage=stage, shard=shard, digest=digest, sender=sender)
        for sender, (f, shard, digest) in enumerate(zip(framed, shards, digests, strict=True))
    ]
