"""The "none" compressor: every layer raw fp32 (the exact reference for the payload path).

It implements only ``compress`` and ``decompress``: everything else is the contract's default
(decode every payload, average), so it also shows what a compressor needs at the least.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tail_ray.compression.base import Compressor
from tail_ray.compression.record_tensors import records_to_flat
from tail_ray.compression.records import RawRecord
from tail_ray.compression.stats import LayerStats
from tail_ray.compression.wire import decode_payload, encode_payload


class RawCompressor(Compressor):
    """Raw fp32: exact, the accuracy baseline of the all-gather path."""

    name = "none"
    shardable = True  # stateless: a shard is compressed like any subset of layers

    def compress(self, grads: Mapping[str, torch.Tensor]) -> bytes:
        records = [
            RawRecord(name, t.detach().reshape(-1).to("cpu", torch.float32).numpy())
            for name, t in grads.items()
        ]
        payload, costs = encode_payload(records)
        self._last_stats = [
            LayerStats(c.name, r.numel, 32, 1.0, 4 * r.numel, c.encoded_bytes, 0.0, c.code)
            for r, c in zip(records, costs, strict=True)
        ]
        return payload

    def decompress(self, payload: bytes) -> dict[str, torch.Tensor]:
        return records_to_flat(decode_payload(payload))

    def compress_shards(
        self,
        grads: Mapping[str, torch.Tensor],
        shards: Sequence[Mapping[str, slice]],
        *,
        own_shard: int | None = None,
    ) -> list[bytes]:
        flat = {name: t.detach().reshape(-1) for name, t in grads.items()}
        payloads, stats = [], []
        for shard in shards:
            payloads.append(self.compress({name: flat[name][part] for name, part in shard.items()}))
            stats.extend(self._last_stats)
        by_layer: dict[str, list[LayerStats]] = {}
        for st in stats:
            by_layer.setdefault(st.layer, []).append(st)
        self._last_stats = [
            LayerStats(
                name,
                flat[name].numel(),
                32,
                1.0,
                4 * flat[name].numel(),
                sum(s.encoded_bytes for s in parts),
                0.0,
                parts[0].code,
            )
            for name, parts in by_layer.items()
        ]
        return payloads

    def second_stage(self) -> RawCompressor:
        return RawCompressor()
