"""observe_peers' reading of the between-worker spread (peer_spread.py): the fixed-lane sums are
the torch reductions over the decoded sample, to float64 rounding, for plain, dithered, raw and
mixed ranks of any bucket size and stride. Their bits on other CPUs: isa_digest.py
("peer_sums"); the sample itself: test_quantize.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tail_ray.compression.aggregate import mean_records_into
from tail_ray.compression.grid import n_buckets
from tail_ray.compression.peer_spread import peer_sums
from tail_ray.compression.quantize import quantize_finite
from tail_ray.compression.record_tensors import sample_flat
from tail_ray.compression.records import QuantRecord, RawRecord
from tail_ray.compression.tail import TailCompressor, TailConfig
from tail_ray.compression.wire import decode_payload


def _record(x: np.ndarray, bits: int, bucket: int, seed: int, dither: bool) -> QuantRecord:
    levels, scales = np.empty(x.size, np.int8), np.empty(n_buckets(x.size, bucket), np.float32)
    rounding = "dither" if dither else "nearest"
    quantize_finite(x, None, bits, bucket, seed, levels, scales, rounding=rounding)
    return QuantRecord("w", bits, bucket, scales, levels, dither_seed=seed if dither else None)


def _torch_sums(records, stride):  # type: ignore[no-untyped-def]
    """What observe_peers computed before: torch reductions over the decoded sample."""
    stack = torch.stack([sample_flat(r, stride) for r in records]).double()
    row = stack.mean(dim=0)
    return float((stack - row).pow(2).sum()), float(stack.pow(2).sum()), float(row.pow(2).sum())


@pytest.mark.parametrize("stride", [1, 7, 64])
@pytest.mark.parametrize(
    "ranks",
    [
        [(4, 512, True), (4, 512, True)],
        [(3, 512, False), (5, 128, False), (8, 2048, False)],
        [(2, 512, True), (4, 100, False), (3, 2048, True), (6, 64, True)],  # mixed, odd buckets
    ],
)
def test_the_sums_are_the_torch_reductions(ranks: list[tuple[int, int, bool]], stride: int) -> None:
    rng = np.random.default_rng(len(ranks) * 100 + stride)
    n = 5000
    base = rng.standard_normal(n).astype(np.float32)
    records = []
    for r, (bits, bucket, dither) in enumerate(ranks):
        x = base + np.float32(0.3) * rng.standard_normal(n).astype(np.float32)
        x[:bucket] = 0.0  # an all-zero bucket: step 0 decodes to 0 under dither too
        records.append(_record(x, bits, bucket, 11 + r, dither))
    got = peer_sums(records, stride)
    assert (got.n, got.world) == (len(range(0, n, stride)), len(ranks))
    want = _torch_sums(records, stride)
    assert got.spread > 0 and got.power > 0 and got.mean > 0
    np.testing.assert_allclose([got.spread, got.power, got.mean], want, rtol=1e-12)


def test_raw_and_mixed_records_and_mis_sized_ones_raise() -> None:
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal(1000).astype(np.float32) for _ in range(2))
    raw = [RawRecord("w", a), RawRecord("w", b)]
    np.testing.assert_allclose(peer_sums(raw, 3)[:3], _torch_sums(raw, 3), rtol=1e-12)
    mixed = [RawRecord("w", a), _record(b, 4, 512, 1, True)]
    np.testing.assert_allclose(peer_sums(mixed, 1)[:3], _torch_sums(mixed, 1), rtol=1e-12)
    with pytest.raises(RuntimeError):  # observe_peers skips such a layer
        peer_sums([RawRecord("w", a), RawRecord("w", b[:999])], 1)
    with pytest.raises(RuntimeError):
        peer_sums([_record(a, 4, 512, 1, True), _record(b[:999], 4, 512, 2, True)], 1)


@pytest.mark.parametrize("stride", [1, 3, 64, 2047, 2048, 5000])
@pytest.mark.parametrize(
    "ranks",
    [
        [(4, 512, True), (4, 512, True)],
        [(3, 512, True), (5, 128, True), (8, 2048, True)],  # segments end at every rank's bucket
        [(3, 512, False), (5, 100, False), (8, 2048, False), (2, 64, False)],
        [(4, 512, True), (4, 512, False)],  # a mix: sampled before the mean is written
        [(4, 512, True), "raw"],
    ],
)
def test_the_mean_pass_reads_the_same_sums_as_peer_sums(ranks: list, stride: int) -> None:  # type: ignore[type-arg]
    """aggregate's fused means read the sample on the way: peer_sums' bits, whichever path the
    layer takes (and the mean itself unchanged)."""
    rng = np.random.default_rng(stride + 7 * len(ranks))
    n = 9001  # segments of MEAN_TILE (2,048) and a partial tail
    base = rng.standard_normal(n).astype(np.float32)
    records: list[QuantRecord | RawRecord] = []
    for r, spec in enumerate(ranks):
        x = base + np.float32(0.3) * rng.standard_normal(n).astype(np.float32)
        x[64:700] = 0.0  # all-zero buckets: step 0
        x[900] = -0.0
        records.append(RawRecord("w", x) if spec == "raw" else _record(x, *spec[:2], 5 + r, spec[2]))
    by_rank = [{"w": rec} for rec in records]
    into = {"w": torch.empty(n)}
    sums = mean_records_into(by_rank, into, sample_strides={"w": stride})
    want = peer_sums(records, stride)
    assert sums["w"] == want  # every field, float for float
    plain = {"w": torch.empty(n)}
    assert mean_records_into(by_rank, plain) == {}
    assert plain["w"].numpy().tobytes() == into["w"].numpy().tobytes()


def test_tail_reads_the_same_noise_from_the_mean_pass_as_from_the_records() -> None:
    """observe_peers fed by aggregate (sums from the mean pass) and fed the records alone
    (sampled there) leave the budget in the same state, bit for bit."""
    rng = np.random.default_rng(9)

    def grads(r: int) -> dict[str, torch.Tensor]:
        return {"a": torch.from_numpy(rng.standard_normal(30000).astype(np.float32) * (1 + r)),
                "b": torch.from_numpy(rng.standard_normal(5000).astype(np.float32))}  # fmt: skip

    fed, sampled = (
        [TailCompressor(TailConfig(seed=r, warmup_steps=0, lowrank="off")) for r in range(2)]
        for _ in range(2)
    )
    for _ in range(6):
        g = [grads(r) for r in range(2)]
        pays = [c.compress(x) for c, x in zip(fed, g, strict=True)]
        for c, x in zip(sampled, g, strict=True):
            c.compress(x)
        fed[0].aggregate(pays, {k: torch.empty_like(v) for k, v in g[0].items()}, own=0)
        sampled[0].observe_peers([{rec.name: rec for rec in decode_payload(p)} for p in pays])
    assert fed[0]._measured and fed[0]._measured == sampled[0]._measured
    assert fed[0].controller.policy.state_dict() == sampled[0].controller.policy.state_dict()
