"""Subtractive dither (rounding="dither", issue 15): the kernel, its decoder, the wire, and Tail.

The cross-CPU bits of the kernel and its decoder are in isa_digest.py (test_grid.py runs them
under other numba builds); here: what the error is, what the receiver needs, and how Tail
uses it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tail_ray.bitwidth.quant_error import relative_errors
from tail_ray.compression.aggregate import mean_records_into, mean_tensors_into
from tail_ray.compression.dither import dither_error_sq
from tail_ray.compression.kernel_parts import UNIFORM_TABLE
from tail_ray.compression.quantize import dequantize, levels_max, n_buckets, quantize, quantize_finite
from tail_ray.compression.record_tensors import record_to_flat, sample_flat, sample_stack
from tail_ray.compression.records import Kind, QuantRecord, slice_record
from tail_ray.compression.tail import TailCompressor, TailConfig
from tail_ray.compression.tail_config import DITHER_START_STEPS
from tail_ray.compression.wire import decode_payload, encode_payload, seal
from tail_ray.errors import CodecError, ConfigError

BUCKET = 512


def _dither(x: np.ndarray, bits: int, seed: int, bucket: int = BUCKET) -> QuantRecord:
    levels = np.empty(x.size, np.int8)
    scales = np.empty(n_buckets(x.size, bucket), np.float32)
    quantize(x, bits, bucket, seed, levels, scales, rounding="dither")
    return QuantRecord("w", bits, bucket, scales, levels, dither_seed=seed)


def _gradient(n: int = 20_000, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_t(4, size=n) * 1e-2).astype(np.float32)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_the_error_is_within_half_a_step_and_its_size_is_known(bits):
    x = _gradient()
    rec = _dither(x, bits, seed=11)
    decoded = dequantize(rec.levels, rec.scales, bits, BUCKET, dither_seed=11)
    step = np.repeat(rec.scales / ((1 << (bits - 1)) - 1), BUCKET)[: x.size]
    err = decoded.astype(np.float64) - x
    # Half a step, except where the top level was clamped (a value at the scale itself).
    inside = np.abs(err) <= 0.5 * step * (1 + 1e-5)
    assert inside.mean() > 0.995
    assert np.all(np.abs(err) <= step * (1 + 1e-5))
    known = dither_error_sq(rec.scales, bits, BUCKET, x.size)
    assert float(np.sum(err * err)) == pytest.approx(known, rel=0.05)


def test_it_is_unbiased_and_needs_the_senders_seed():
    x = _gradient(4096, seed=1)
    total = np.zeros(x.size)
    for seed in range(300):
        rec = _dither(x, 2, seed)
        total += dequantize(rec.levels, rec.scales, 2, BUCKET, dither_seed=seed)
    sd_of_mean = np.sqrt(dither_error_sq(rec.scales, 2, BUCKET, x.size) / x.size / 300)
    assert abs(float(np.mean(total / 300 - x))) < 5 * sd_of_mean / np.sqrt(x.size)
    assert float(np.sqrt(np.mean((total / 300 - x) ** 2))) < 1.5 * sd_of_mean
    # Decoded with another seed the error is larger: that seed's uniforms add their own noise.
    right = dequantize(rec.levels, rec.scales, 2, BUCKET, dither_seed=299)
    wrong = dequantize(rec.levels, rec.scales, 2, BUCKET, dither_seed=298)
    assert float(np.sum((wrong - x) ** 2)) > 1.4 * float(np.sum((right - x) ** 2))


def test_zero_buckets_decode_to_zero_and_huge_values_stay_finite():
    x = _gradient(3 * BUCKET, seed=2)
    x[BUCKET : 2 * BUCKET] = 0.0
    x[0] = np.finfo(np.float32).max
    x[1] = -np.finfo(np.float32).max
    for bits in (2, 8):
        rec = _dither(x, bits, seed=3)
        decoded = dequantize(rec.levels, rec.scales, bits, BUCKET, dither_seed=3)
        assert np.all(decoded[BUCKET : 2 * BUCKET] == 0.0)
        assert np.all(np.isfinite(decoded))


def test_a_residual_is_sent_once_and_emptied():
    x = _gradient(5000, seed=4)
    residual = x * np.float32(0.5)
    levels = np.empty(x.size, np.int8)
    scales = np.empty(n_buckets(x.size, BUCKET), np.float32)
    _nnz, err = quantize_finite(x, residual, 4, BUCKET, 9, levels, scales, rounding="dither")
    assert err == 0.0 and not residual.any()
    decoded = dequantize(levels, scales, 4, BUCKET, dither_seed=9)
    assert float(np.sum((decoded - 1.5 * x) ** 2)) == pytest.approx(
        dither_error_sq(scales, 4, BUCKET, x.size), rel=0.1
    )


def test_the_controller_prices_exactly_the_error_the_kernel_makes():
    x = _gradient(30_000, seed=5)
    nu = relative_errors(
        x, None, BUCKET, (2, 3, 4, 8), sample_numel=None, rng=np.random.default_rng(0), rounding="dither"
    )
    for bits, nu_b in zip((2, 3, 4, 8), nu, strict=True):
        rec = _dither(x, bits, seed=1)
        exact = dither_error_sq(rec.scales, bits, BUCKET, x.size) / float(np.sum(x.astype(np.float64) ** 2))
        assert nu_b == pytest.approx(exact, rel=1e-4)


def test_the_wire_carries_the_seed_and_refuses_a_truncated_one():
    x = _gradient(3000, seed=6)
    rec = _dither(x, 3, seed=0xDEADBEEF)
    plain = QuantRecord("p", 3, BUCKET, rec.scales, rec.levels)
    payload, costs = encode_payload([rec, plain])
    got = decode_payload(payload)
    assert got[0].kind == Kind.QUANT_DITHER and got[0].dither_seed == 0xDEADBEEF
    assert got[1].kind == Kind.QUANT and got[1].dither_seed is None
    assert np.array_equal(
        record_to_flat(got[0]).numpy(), dequantize(rec.levels, rec.scales, 3, BUCKET, 0xDEADBEEF)
    )
    # The seed costs its 4 bytes; the levels go sign-folded by their uniforms (dither_fold.py),
    # which costs the coder fewer bytes than the same levels sent plain.
    assert costs[0].encoded_bytes - 4 < costs[1].encoded_bytes
    # A flipped seed bit is caught by the checksum; cut inside the seed (re-sealed: past the
    # CRC), the parser names the field.
    broken = bytearray(payload)
    seed_at = payload.index((0xDEADBEEF).to_bytes(4, "little"))
    broken[seed_at] ^= 1
    with pytest.raises(CodecError) as crc:
        decode_payload(bytes(broken))
    assert crc.value.field == "checksum"
    frame = payload[:-4]
    cut = seal(frame[: seed_at + 2])
    with pytest.raises(CodecError):
        decode_payload(cut)
    with pytest.raises(CodecError) as bad:
        encode_payload([QuantRecord("w", 3, BUCKET, rec.scales, rec.levels, dither_seed=1 << 32)])
    assert bad.value.field == "dither_seed"


@pytest.mark.parametrize("buckets", [(BUCKET, BUCKET), (2048, 7), (3000, 512, 1024)])
def test_every_decoder_subtracts_the_uniforms(buckets):
    """The fused rank mean and the controller's strided sample give the bits of the plain
    decode (record_to_flat), also for ranks with other bucket sizes, buckets that are not a
    multiple of the uniforms' chunk, and a layer that ends mid-chunk."""
    x = _gradient(10_001, seed=7)
    x[:5] = np.finfo(np.float32).max  # saturating values, in the first bucket of every rank
    recs = [_dither(x + np.float32(r * 1e-3), 3 + r, seed=40 + r, bucket=b) for r, b in enumerate(buckets)]
    flats = [record_to_flat(r) for r in recs]
    assert all(bool(torch.isfinite(f).all()) for f in flats)
    for stride in (1, 5, 1031):
        assert np.array_equal(sample_flat(recs[-1], stride).numpy(), flats[-1].numpy()[::stride])
        want = torch.stack([f[::stride] for f in flats]).double().numpy()
        assert np.array_equal(sample_stack(recs, stride).numpy(), want)
    into_records = {"w": torch.empty(x.size)}
    into_tensors = {"w": torch.empty(x.size)}
    mean_records_into([{"w": r} for r in recs], into_records)
    mean_tensors_into([{"w": f} for f in flats], into_tensors)
    assert torch.equal(into_records["w"], into_tensors["w"])
    # Independent errors average: the mean's error is below one rank's (past the first
    # buckets, whose huge scale swamps everything).
    tail = slice(max(buckets), None)
    x64 = x[tail].astype(np.float64)
    err = float(np.mean((into_records["w"].numpy()[tail] - (x64 + 1e-3 * (len(buckets) - 1) / 2)) ** 2))
    assert err < 0.75 * float(np.mean((flats[0].numpy()[tail].astype(np.float64) - x64) ** 2))
    with pytest.raises(ValueError, match="dithered whole"):
        slice_record(recs[0], buckets[0], 2 * buckets[0])


def _grads(rng: np.random.Generator) -> dict[str, torch.Tensor]:
    return {
        "w": torch.from_numpy((rng.standard_normal(40_000) * 1e-2).astype(np.float32)),
        "b": torch.from_numpy(rng.standard_normal(64).astype(np.float32)),
    }


def test_tail_sends_dithered_layers_with_a_known_error_and_no_residual():
    comp = TailCompressor(TailConfig(rounding="dither", seed=5))
    assert comp.controller.policy.noise_fraction == TailConfig().dither_noise_fraction
    rng = np.random.default_rng(8)
    bits_seen = []
    for _ in range(DITHER_START_STEPS + 3):
        grads = _grads(rng)
        records = {r.name: r for r in decode_payload(comp.compress(grads))}
        w = records["w"]
        assert isinstance(w, QuantRecord) and w.dither_seed is not None
        stat = next(s for s in comp.last_stats if s.layer == "w")
        g = grads["w"].numpy().astype(np.float64)
        assert stat.rel_error == pytest.approx(
            dither_error_sq(w.scales, w.bits, w.bucket_size, w.numel) / float(np.sum(g * g)), rel=1e-6
        )
        assert "w" not in comp.feedback  # no residual is kept
        bits_seen.append(w.bits)
    start_bits = TailConfig().start_bits()
    assert bits_seen[:DITHER_START_STEPS] == [start_bits] * DITHER_START_STEPS
    assert max(bits_seen[DITHER_START_STEPS:]) < start_bits


@pytest.mark.parametrize("start_steps", [0, 2])
def test_dither_start_steps_sets_how_many_first_steps_go_at_the_start_bits(start_steps):
    comp = TailCompressor(TailConfig(rounding="dither", seed=6, dither_start_steps=start_steps))
    rng = np.random.default_rng(8)
    bits_seen = []
    for _ in range(start_steps + 2):
        w = next(r for r in decode_payload(comp.compress(_grads(rng))) if r.name == "w")
        assert isinstance(w, QuantRecord)
        bits_seen.append(w.bits)
    start_bits = TailConfig().start_bits()
    assert bits_seen[:start_steps] == [start_bits] * start_steps
    assert max(bits_seen[start_steps:]) < start_bits
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="dither_start_steps"):
            TailConfig(dither_start_steps=bad)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({}, 8),  # the default: the largest of (2, 3, 4, 5, 6, 8)
        ({"dither_start_bits": 6}, 6),
        ({"dither_start_bits": 7}, 6),  # not a candidate: the largest one below it
        ({"candidate_bits": (2, 3, 4)}, 4),
        ({"candidate_bits": (8,)}, 8),  # pinned bits stay pinned
        ({"candidate_bits": (3, 8), "dither_start_bits": 2}, 3),  # all above: the smallest
    ],
)
def test_start_bits_are_the_largest_candidate_not_above_dither_start_bits(settings, expected):
    assert TailConfig(**settings).start_bits() == expected


def test_the_first_steps_go_at_the_start_bits_and_bad_start_bits_are_refused():
    comp = TailCompressor(TailConfig(rounding="dither", seed=7, dither_start_bits=6, dither_start_steps=2))
    rng = np.random.default_rng(3)
    bits = [
        next(r for r in decode_payload(comp.compress(_grads(rng))) if r.name == "w").bits for _ in range(2)
    ]
    assert bits == [6, 6]
    for bad in (1, 9, 6.0, True, "6"):
        with pytest.raises(ConfigError, match="dither_start_bits"):
            TailConfig(dither_start_bits=bad)


def test_a_restored_residual_is_sent_once_under_dither():
    nearest = TailCompressor(TailConfig(seed=1, rounding="nearest", lowrank="off"))
    rng = np.random.default_rng(9)
    nearest.compress(_grads(rng))
    state = nearest.state_dict()
    assert float(state["residuals"]["w"].norm()) > 0
    comp = TailCompressor(TailConfig(seed=1, rounding="dither", lowrank="off"))
    comp.load_state_dict(state)
    grads = _grads(rng)
    decoded = comp.decompress(comp.compress(grads))["w"]
    owed = grads["w"] + state["residuals"]["w"]
    assert float(((decoded - owed) ** 2).sum()) < float(((decoded - grads["w"]) ** 2).sum())
    assert "w" not in comp.feedback


def test_the_sharded_exchange_dithers_each_slice_from_its_own_seed():
    """compress_shards sends a dithered layer slice by slice: each slice decodes alone (its
    owner holds only it), with dither's unbiased error, and the budget stays dither's."""
    cut = 20_480  # 40 buckets of 512
    shards = [{"w": slice(0, cut), "b": slice(0, 64)}, {"w": slice(cut, 40_000)}]
    rng = np.random.default_rng(10)
    comps = [TailCompressor(TailConfig(seed=2 + r, dither_start_steps=0)) for r in range(2)]
    for _ in range(2):  # the second step's bits are the budget's own
        grads = [_grads(rng) for _ in comps]
        sent = [
            comp.compress_shards(g, shards, own_shard=r)
            for r, (comp, g) in enumerate(zip(comps, grads, strict=True))
        ]
    for comp in comps:
        assert comp.controller.rounding == "dither"
        assert comp.controller.policy.noise_fraction == TailConfig().dither_noise_fraction
    w = grads[0]["w"].numpy()
    parts = []
    for k, (lo, hi) in enumerate([(0, cut), (cut, 40_000)]):
        recs = [next(r for r in decode_payload(p[k]) if r.name == "w") for p in sent]
        assert all(isinstance(r, QuantRecord) and r.numel == hi - lo for r in recs)
        assert len({r.dither_seed for r in recs}) == 2  # independent noise per rank
        decoded = record_to_flat(recs[0]).numpy()
        err = decoded.astype(np.float64) - w[lo:hi]
        step = np.repeat(recs[0].scales / levels_max(recs[0].bits), BUCKET)[: hi - lo].astype(np.float64)
        assert np.all(np.abs(err) <= step / 2 * (1 + 1e-5) + 1e-30)  # within half a step: its own uniforms
        assert abs(float(np.mean(err / np.where(step > 0, step, 1)))) < 0.02  # unbiased
        # The owner's fused mean of every rank's slice is the mean of their decodes.
        into = {"w": torch.empty(hi - lo)}
        mean_records_into([{"w": r} for r in recs], into)
        assert torch.equal(into["w"], torch.stack([record_to_flat(r) for r in recs]).mean(0))
        parts.append(recs[0].dither_seed)
    assert parts[0] != parts[1]  # two slices of one layer: two streams
    # The whole layer of slices is never sent whole, nor cut elsewhere.
    comp = TailCompressor(TailConfig(seed=9))
    comp._slice_starts = {"w": [0, cut]}
    whole = next(c.record for c in comp.compress_records(_grads(rng)) if c.record.name == "w")
    assert isinstance(whole, QuantRecord) and whole.slice_seeds is not None
    with pytest.raises(CodecError, match="sent as its slices"):
        encode_payload([whole])
    for decode in (record_to_flat, lambda r: sample_flat(r, 3), lambda r: sample_stack([r, r], 3)):
        with pytest.raises(ValueError, match="decode its slices"):
            decode(whole)  # no one seed decodes it: refused, not right for its first slice only
    with pytest.raises(ValueError, match="decode its slices"):
        mean_records_into([{"w": whole}, {"w": whole}], {"w": torch.empty(40_000)})
    with pytest.raises(ValueError, match="in slices at"):
        slice_record(whole, 512, cut)
    with pytest.raises(ValueError, match="in slices"):
        slice_record(whole, 0, 40_000)
    assert slice_record(whole, cut, 40_000).dither_seed == dict(whole.slice_seeds)[cut]


def test_dither_needs_a_positive_noise_fraction():
    with pytest.raises(ConfigError, match="dither_noise_fraction"):
        TailConfig(rounding="dither", dither_noise_fraction=0.0)


def test_the_seed_is_the_wires_32_bits_and_the_input_may_be_read_only():
    x = _gradient(3000, seed=11)
    frozen = np.frombuffer(x.tobytes(), dtype=np.float32)  # read-only, as a received buffer is
    assert not frozen.flags.writeable
    rec = _dither(frozen, 4, seed=(1 << 32) + 7)  # only the low 32 bits are the seed
    same = _dither(x, 4, seed=7)
    assert np.array_equal(rec.levels, same.levels)
    decoded = dequantize(rec.levels, rec.scales, 4, BUCKET, dither_seed=7)
    assert np.array_equal(decoded, dequantize(rec.levels, rec.scales, 4, BUCKET, dither_seed=(1 << 32) + 7))


def test_every_rank_reads_the_same_shipped_table_of_uniforms():
    # The receiver of a dithered layer draws the sender's uniforms from this table, so it is
    # shipped (not drawn from numpy's generator, whose stream may change between versions).
    half = UNIFORM_TABLE.size // 2
    assert UNIFORM_TABLE.dtype == np.uint16 and half == 1 << 16
    assert np.array_equal(np.sort(UNIFORM_TABLE[:half]), np.arange(half))
    assert np.array_equal(UNIFORM_TABLE[:half], UNIFORM_TABLE[half:])
