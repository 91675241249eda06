"""The wire's sign fold of dithered levels: exactly where u >= 1/2, undone on decoding, and cheaper."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from tail_ray.compression.dither_fold import fold_levels
from tail_ray.compression.dither_slices import dither_in_slices
from tail_ray.compression.quantize import dequantize, quantize_finite
from tail_ray.compression.records import Kind, QuantRecord, slice_record
from tail_ray.compression.wire import decode_payload, encode_payload, seal
from tail_ray.errors import CodecError

BUCKET = 512


def _dithered(x: np.ndarray, bits: int, seed: int, name: str = "w") -> QuantRecord:
    levels = np.empty(x.size, np.int8)
    scales = np.empty(-(-x.size // BUCKET), np.float32)
    quantize_finite(x, None, bits, BUCKET, seed, levels, scales, rounding="dither")
    return QuantRecord(name, bits, BUCKET, scales, levels, dither_seed=seed)


def _small_values(n: int, seed: int) -> np.ndarray:
    """A gradient's bucket shape: one large value per bucket, the rest far below a 3-bit step."""
    rng = np.random.default_rng(seed)
    x = (rng.laplace(size=n) * 0.05).astype(np.float32)
    x[::BUCKET] = 3.0
    return x


@pytest.mark.parametrize(
    "numel, bucket",
    [(1, BUCKET), (511, BUCKET), (512, BUCKET), (3000, BUCKET), (2048 + 7, BUCKET), (9000, 4096)],
)
def test_the_fold_negates_exactly_where_the_dithers_uniform_is_at_least_a_half(numel, bucket):
    # (A bucket of 4096 spans four of the uniform table's chunks: the fold walks them as the
    # dither kernel does.)
    seed = 0x5EED0 + numel
    rng = np.random.default_rng(numel)
    levels = rng.integers(-7, 8, numel).astype(np.int8)
    folded = fold_levels(levels, bucket, seed)
    # The decoder's own uniforms: a zero level decodes to (1/2 - u) * step, <= 0 iff u >= 1/2.
    zeros = np.zeros(numel, np.int8)
    u_side = dequantize(zeros, np.full(-(-numel // bucket), 7.0, np.float32), 4, bucket, seed) <= 0
    assert np.array_equal(folded, np.where(u_side, -levels, levels))
    assert 0.4 < u_side.mean() < 0.6 or numel < 100
    assert np.array_equal(fold_levels(folded, bucket, seed), levels)  # its own inverse


def test_a_dithered_layer_goes_folded_and_decodes_to_the_quantizers_levels():
    x = _small_values(20 * BUCKET + 100, seed=1)
    rec = _dithered(x, 3, seed=0xABCDEF01)
    payload, costs = encode_payload([rec])
    (got,) = decode_payload(payload)
    assert got.kind == Kind.QUANT_DITHER and got.dither_seed == rec.dither_seed
    assert np.array_equal(got.levels, rec.levels) and np.array_equal(got.scales, rec.scales)
    # The kind byte on the wire is the folded kind (after the 16-byte header, the name).
    kind_at = 12 + 2 + len("w")
    assert payload[kind_at] == Kind.QUANT_DITHER_FOLDED
    # Folding is what makes it cheaper: the same levels coded unfolded (kind 5) cost more.
    unfolded = payload[:kind_at] + bytes([Kind.QUANT_DITHER]) + payload[kind_at + 1 : -4]
    assert costs[0].encoded_bytes < len(encode_payload([_as_plain_body(rec)])[0])
    # A payload of kind 5 (levels coded as they are) still decodes: here the folded body read
    # unfolded gives the folded levels back, which is what an old reader would have seen.
    (old,) = decode_payload(seal(unfolded))
    assert np.array_equal(old.levels, fold_levels(rec.levels, BUCKET, rec.dither_seed))


def _as_plain_body(rec: QuantRecord) -> QuantRecord:
    """The same levels with no dither seed: coded as they are (kind QUANT), for the size."""
    return QuantRecord(rec.name, rec.bits, rec.bucket_size, rec.scales, rec.levels)


def test_folding_saves_the_signs_the_receiver_can_guess():
    x = _small_values(200 * BUCKET, seed=2)
    rec = _dithered(x, 3, seed=7)
    folded = len(encode_payload([rec])[0]) - 4  # its seed
    plain = len(encode_payload([_as_plain_body(rec)])[0])
    assert folded < 0.97 * plain


def test_a_slice_of_a_dithered_layer_folds_with_its_own_seed():
    # The sharded exchange sends slices, each with its own seed and keyed from its own first
    # bucket: the owner unfolds what the sender folded.
    x = _small_values(8 * BUCKET, seed=3)
    levels, scales = np.empty(x.size, np.int8), np.empty(8, np.float32)
    rec, _ = dither_in_slices(x, None, 4, BUCKET, 11, [0, 2 * BUCKET, 5 * BUCKET], levels, scales)
    part = slice_record(rec, 2 * BUCKET, 5 * BUCKET)
    (got,) = decode_payload(encode_payload([part])[0])
    assert np.array_equal(got.levels, part.levels) and got.dither_seed == part.dither_seed
    assert got.dither_seed != rec.slice_seeds[0][1]  # not the first slice's seed
    # Folded with another seed, the slice would decode to other levels: the seed is the key.
    assert not np.array_equal(
        fold_levels(part.levels, BUCKET, 11), fold_levels(part.levels, BUCKET, part.dither_seed)
    )


def test_a_folded_layer_cut_inside_its_seed_is_refused():
    rec = _dithered(_small_values(BUCKET, seed=4), 3, seed=0x01020304)
    payload = encode_payload([rec])[0]
    seed_at = payload.index(struct.pack("<I", 0x01020304))
    with pytest.raises(CodecError) as err:
        decode_payload(seal(payload[: seed_at + 2]))
    assert err.value.field in ("dither_seed", "n_scales", "body_len")
