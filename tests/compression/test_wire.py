"""Lossless round trips through the wire container, for every kind and code."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tail_ray.compression import wire
from tail_ray.compression.grid import MAX_SCALE, on_scale_grid, scales_up_reference
from tail_ray.compression.records import LayerRecord, QuantRecord, RawRecord, SparseRecord
from tail_ray.compression.varint import varint
from tail_ray.compression.wire import (
    NAMES_SHARED,
    PAYLOAD_OVERHEAD_BYTES,
    SCALES_16,
    VERSION,
    EncodedLayer,
    decode_payload,
    encode_payload,
    seal,
)
from tail_ray.errors import CodecError

RNG = np.random.default_rng(20261129)


def quant(name: str, levels: np.ndarray, bits: int, bucket: int = 128) -> QuantRecord:
    n = int(levels.size)
    scales = RNG.random(-(-n // bucket)).astype(np.float32)
    return QuantRecord(name, bits, bucket, scales, levels.astype(np.int8))


def peaked(n: int, bits: int, spread: float = 0.25) -> np.ndarray:
    half = (1 << (bits - 1)) - 1
    return np.clip(np.round(RNG.standard_normal(n) * max(spread * half, 0.6)), -half, half).astype(np.int8)


def roundtrip(records: list[LayerRecord]) -> tuple[list[LayerRecord], list[EncodedLayer], bytes]:
    payload, costs = encode_payload(records)
    return decode_payload(payload), costs, payload


def assert_same(a: LayerRecord, b: LayerRecord) -> None:
    assert (type(a), a.name, a.numel, a.kind) == (type(b), b.name, b.numel, b.kind)
    for attr in ("levels", "scales", "values", "indices"):
        if hasattr(a, attr):
            x, y = np.asarray(getattr(a, attr)), np.asarray(getattr(b, attr))
            assert x.tobytes() == y.astype(x.dtype).tobytes(), attr


@pytest.mark.parametrize("bits", range(2, 9))
def test_every_bit_width_round_trips_dense_and_sparse_and_edges(bits: int) -> None:
    half = (1 << (bits - 1)) - 1
    sparse = np.zeros(50_000, dtype=np.int8)
    where = RNG.choice(sparse.size, 200, replace=False)
    sparse[where] = RNG.choice([-half, -1, 1, half], where.size)
    extremes = RNG.choice([-half, half], 3000).astype(np.int8)
    records = [
        quant("dense", peaked(20_000, bits), bits),
        quant("sparse", sparse, bits),
        quant("zeros", np.zeros(10_000, np.int8), bits),
        quant("one", np.array([half], np.int8), bits),
        quant("empty", np.zeros(0, np.int8), bits),
        quant("extremes", extremes, bits),
        quant("uniform", RNG.integers(-half, half + 1, 5000).astype(np.int8), bits),
    ]
    decoded, costs, payload = roundtrip(records)
    for a, b in zip(records, decoded, strict=True):
        assert_same(a, b)
        assert isinstance(b, QuantRecord) and b.levels.dtype == np.int8
    assert sum(c.encoded_bytes for c in costs) + PAYLOAD_OVERHEAD_BYTES == len(payload)  # all attributed
    assert [c.nnz for c in costs] == [int(np.count_nonzero(r.levels)) for r in records]
    assert all(not hasattr(b, "values") for b in decoded)  # a tagged union: only its own arrays


def test_large_layer_round_trips() -> None:
    lv = peaked(1 << 20, 4)
    decoded, costs, _ = roundtrip([quant("big", lv, 4, bucket=512)])
    assert isinstance(decoded[0], QuantRecord) and np.array_equal(decoded[0].levels, lv)
    assert costs[0].code in ("rans-pairs", "sparse-rans")  # near-equal sizes on iid levels


def test_all_zero_layer_costs_almost_nothing() -> None:
    decoded, costs, _ = roundtrip([quant("z", np.zeros(1 << 20, np.int8), 3, bucket=1 << 20)])
    assert isinstance(decoded[0], QuantRecord) and not decoded[0].levels.any()
    assert costs[0].code == "sparse-rans"
    assert costs[0].encoded_bytes < 32  # header share + one scale, empty body


def test_raw_f32_passes_nan_and_inf_bit_exactly() -> None:
    # NaN with a payload and a sign, signalling NaN bits, +-Inf, -0.0, denormal: the container
    # never inspects float values, so every bit pattern comes back unchanged.
    bits = np.array([0x7FC00001, 0xFFC12345, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000, 1], np.uint32)
    values = bits.view(np.float32)
    decoded, costs, _ = roundtrip([RawRecord("raw", values)])
    assert isinstance(decoded[0], RawRecord)
    assert decoded[0].values.view(np.uint32).tolist() == bits.tolist()
    assert costs[0].code == "raw"


def test_raw_f16_and_scales_with_nonfinite_pass_through() -> None:
    vals = np.array([1.0, np.inf, -2.5, 0.0], np.float16)
    lv = peaked(300, 4)
    rec = quant("q", lv, 4, bucket=100)
    rec.scales[1] = np.nan
    decoded, _, _ = roundtrip([RawRecord("h", vals, fp16=True), rec])
    h, q = decoded
    assert isinstance(h, RawRecord) and h.fp16 and h.values.dtype == np.float32
    assert h.values.tolist() == vals.astype(np.float32).tolist()
    assert isinstance(q, QuantRecord) and np.isnan(q.scales[1])
    assert np.array_equal(q.levels, lv)


def test_topk_indices_are_coded_compactly_and_exactly() -> None:
    n = 200_000
    idx = np.sort(RNG.choice(n, 2000, replace=False)).astype(np.int64)
    vals = RNG.standard_normal(idx.size).astype(np.float32)
    vals[0] = np.nan
    decoded, costs, _ = roundtrip([SparseRecord("t", n, idx, vals)])
    assert isinstance(decoded[0], SparseRecord) and np.array_equal(decoded[0].indices, idx)
    assert decoded[0].values.tobytes() == vals.tobytes()
    assert costs[0].code == "sparse-pos"
    # positions cost a little over log2(C(n, k)) (~8.1 bits each here), far below 8 raw bytes
    log2_choose = (math.lgamma(n + 1) - math.lgamma(2001) - math.lgamma(n - 1999)) / math.log(2)
    assert costs[0].encoded_bytes - 4 * idx.size < 1.05 * log2_choose / 8 + 64


def test_topk_rejects_unsorted_indices() -> None:
    rec = SparseRecord("t", 10, np.array([3, 2]), np.ones(2, np.float32))
    with pytest.raises(CodecError) as err:
        encode_payload([rec])
    assert (err.value.layer, err.value.field) == ("t", "indices")


@pytest.mark.parametrize("bits", [0, 1, 9])
def test_bits_outside_2_to_8_are_rejected_clearly(bits: int) -> None:
    with pytest.raises(CodecError, match="bits") as err:
        encode_payload([quant("q", np.zeros(10, np.int8), bits)])
    assert err.value.layer == "q"


def test_level_outside_range_is_rejected_not_wrapped() -> None:
    with pytest.raises(CodecError, match="outside") as err:
        encode_payload([quant("q", np.array([0, 2, -1], np.int8), 2)])
    assert (err.value.layer, err.value.field) == ("q", "levels")


def test_wide_integer_levels_are_range_checked_before_the_int8_cast() -> None:
    wide = np.array([0, 1, 200], np.int32)  # 200 would wrap to -56, inside [-127, 127]
    with pytest.raises(CodecError, match="outside") as err:
        encode_payload([QuantRecord("w", 8, 4, np.ones(1, np.float32), wide)])
    assert err.value.layer == "w"
    ok = np.array([0, 1, -127], np.int64)
    decoded, _, _ = roundtrip([QuantRecord("w", 8, 4, np.ones(1, np.float32), ok)])
    assert isinstance(decoded[0], QuantRecord) and decoded[0].levels.tolist() == [0, 1, -127]


@pytest.mark.parametrize(
    ("bits", "bucket", "field"),
    [
        (-1, 4, "bits"),
        (256, 4, "bits"),
        (3, 0, "bucket_size"),
        (3, -5, "bucket_size"),
        (3, 1 << 25, "bucket_size"),
    ],
)
def test_out_of_range_header_fields_are_codec_errors(bits: int, bucket: int, field: str) -> None:
    rec = QuantRecord("r", bits, bucket, np.ones(1, np.float32), np.zeros(2, np.int8))
    with pytest.raises(CodecError) as err:
        encode_payload([rec])
    assert (err.value.layer, err.value.field) == ("r", field)


def test_wrong_version_and_trailing_bytes_are_codec_errors() -> None:
    payload, _ = encode_payload([quant("q", peaked(100, 3), 3)])
    bad = bytearray(payload)
    bad[4] = VERSION + 1
    with pytest.raises(CodecError) as err:
        decode_payload(bytes(bad))
    assert err.value.field == "version"
    with pytest.raises(CodecError) as err:
        decode_payload(payload + b"\0")  # the CRC no longer sits where it should
    assert err.value.field == "checksum"
    with pytest.raises(CodecError) as err:
        decode_payload(seal(payload[:-4] + b"\0"))  # a sealed frame with a stray byte
    assert err.value.field == "trailer"


def _on_grid_records() -> list[LayerRecord]:
    """Quantized layers whose scales are on the 16-bit grid (as Tail's quantizers make them),
    edges included: 0, the largest grid value, a subnormal; and a raw layer beside them."""
    lv = peaked(4000, 4)
    scales = scales_up_reference(RNG.random(-(-lv.size // 128)).astype(np.float32) * 1e-3)
    scales[:3] = (
        0.0,
        MAX_SCALE,
        np.float32(2.0**-134),
    )  # a subnormal on the grid
    assert on_scale_grid(scales)
    return [
        QuantRecord("a", 4, 128, scales, lv),
        QuantRecord("b", 3, 512, scales_up_reference(np.array([0.5, 3e-5], np.float32)), peaked(600, 3)),
        RawRecord("r", np.array([1.5, np.nan], np.float32)),
    ]


def test_scales_on_the_grid_go_as_16_bits_and_come_back_bit_exact() -> None:
    records = _on_grid_records()
    half, costs = encode_payload(records)
    assert half[5] == SCALES_16  # the header's flags
    for a, b in zip(records, decode_payload(half), strict=True):
        assert_same(a, b)
    # One scale off the grid anywhere sends the whole payload's scales as float32: every byte of
    # the difference is 2 per scale, and the off-grid scale comes back exactly too.
    off = list(records)
    off_scales = off[1].scales.copy()  # type: ignore[union-attr]
    off_scales[1] = np.nextafter(off_scales[1], np.float32(1))
    off[1] = QuantRecord("b", 3, 512, off_scales, records[1].levels)  # type: ignore[union-attr]
    full, full_costs = encode_payload(off)
    assert full[5] == 0
    assert_same(off[1], decode_payload(full)[1])
    n_scales = sum(r.scales.size for r in records if isinstance(r, QuantRecord))
    assert len(full) - len(half) == 2 * n_scales
    assert [f.encoded_bytes - c.encoded_bytes for f, c in zip(full_costs, costs, strict=True)] == [
        2 * r.scales.size if isinstance(r, QuantRecord) else 0 for r in records
    ]


def test_version_3_payloads_still_decode_and_unknown_flags_are_codec_errors() -> None:
    records = [quant("q", peaked(1000, 3), 3), RawRecord("r", np.ones(3, np.float32))]
    payload, _ = encode_payload(records)
    assert payload[5] == 0  # random scales: float32
    v3 = bytearray(payload[:-4])
    v3[4] = 3
    for a, b in zip(records, decode_payload(seal(bytes(v3))), strict=True):
        assert_same(a, b)
    v3[5] = SCALES_16  # version 3 had no flags
    for frame, flags in ((bytes(v3), SCALES_16), (payload[:5] + b"\x04" + payload[6:-4], 4)):
        with pytest.raises(CodecError) as err:
            decode_payload(seal(frame))
        assert err.value.field == "flags" and f"{flags:#04x}" in err.value.message


def _names_records(names: list[str]) -> list[LayerRecord]:
    return [RawRecord(name, np.full(3, i, np.float32)) for i, name in enumerate(names)]


def test_names_with_common_prefixes_go_front_coded_and_decode_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # "aé" / "aè": the shared prefix ends inside the two-byte "é" (c3 a9 / c3 a8).
    names = ["blocks.0.attn.weight", "blocks.0.attn.bias", "blocks.1.mlp.weight", "head", "aé", "aè", "aè"]
    records = _names_records(names)
    decoded, costs, payload = roundtrip(records)
    assert payload[5] == NAMES_SHARED
    assert [r.name for r in decoded] == names
    for a, b in zip(records, decoded, strict=True):
        assert_same(a, b)
    assert sum(c.encoded_bytes for c in costs) + PAYLOAD_OVERHEAD_BYTES == len(payload)
    # The same records with plain names: the difference is the name fields' alone.
    monkeypatch.setattr(wire, "_shared_prefix", lambda a, b: 0)
    # Uncached, so the names are coded again under the patch, not looked up.
    monkeypatch.setattr(wire, "_name_fields", wire._name_fields.__wrapped__)
    plain, _ = encode_payload(records)
    assert plain[5] == 0
    raw = [n.encode() for n in names]
    shared = [0, 14, 7, 0, 0, 2, 3]  # bytes in common with the name before
    front = sum(2 + len(n) - k for n, k in zip(raw, shared, strict=True))  # one-byte varints here
    assert len(plain) - len(payload) == sum(2 + len(n) for n in raw) - front


def test_names_stay_plain_where_front_coding_saves_nothing() -> None:
    for names in (["only.one.layer.weight"], ["w", "b"], ["fc.weight", "conv.bias"]):
        decoded, _, payload = roundtrip(_names_records(names))
        assert payload[5] == 0 and [r.name for r in decoded] == names


def test_front_coded_names_that_do_not_add_up_are_codec_errors() -> None:
    frame = encode_payload(_names_records(["layer.weight", "layer.bias"]))[0][:-4]
    assert frame[5] == NAMES_SHARED and frame[12:14] == b"\x00\x0c"  # shared 0, name_len 12
    second = frame.index(b"\x06\x04bias")  # shared 6 ("layer."), name_len 4
    cases = {
        "first name shares with nothing": (12, varint(1), "name_shared"),
        "shares more than the name before": (second, varint(13), "name_shared"),
        "longer than a name may be": (second + 1, varint(1024), "name_len"),
        "runs past the payload": (second + 1, varint(500), "name"),
    }
    for why, (at, value, field) in cases.items():
        with pytest.raises(CodecError) as err:
            decode_payload(seal(frame[:at] + value + frame[at + 1 :]))
        assert err.value.field == field, why
    not_utf8 = frame[: second + 2] + b"\xff" + frame[second + 3 :]
    with pytest.raises(CodecError) as err:
        decode_payload(seal(not_utf8))
    assert err.value.field == "name" and err.value.layer == "#1"


def test_max_numel_bounds_the_receiver() -> None:
    payload, _ = encode_payload([quant("z", np.zeros(5000, np.int8), 2)])
    with pytest.raises(CodecError) as err:
        decode_payload(payload, max_numel=4999)
    assert (err.value.layer, err.value.field) == ("z", "numel")
    assert decode_payload(payload, max_numel=5000)[0].numel == 5000


def test_encode_payload_equals_sealing_the_frame() -> None:
    """The encoder runs the CRC over the pieces as it frames them: same trailer as ``seal``."""
    rng = np.random.default_rng(3)
    recs = [
        RawRecord("r", rng.standard_normal(10).astype(np.float32)),
        QuantRecord(
            "q",
            bits=3,
            bucket_size=512,
            scales=np.ones(2, np.float32),
            levels=rng.integers(-3, 4, 1000).astype(np.int8),
        ),
    ]
    payload, costs = encode_payload(recs)
    assert payload == seal(payload[:-4])
    assert sum(c.encoded_bytes for c in costs) == len(payload) - PAYLOAD_OVERHEAD_BYTES
