"""Fuzz the decoder: random and mutated payloads give CodecError or a valid result, quickly.

Every example runs with ``max_numel`` as a real receiver would pass it (it knows its model),
so no mutated numel can make a test allocate more than a few MB.
"""

from __future__ import annotations

import struct
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tail_ray.compression.code_table import candidate_codes, decode_levels, encode_levels
from tail_ray.compression.grid import scales_up_reference
from tail_ray.compression.lowrank import compress_lowrank, max_rank, reconstruct
from tail_ray.compression.records import LowRankRecord, QuantRecord, RawRecord, SparseRecord
from tail_ray.compression.varint import varint
from tail_ray.compression.wire import (
    MAGIC,
    NAMES_SHARED,
    SCALES_16,
    VERSION,
    decode_payload,
    encode_payload,
    seal,
)
from tail_ray.errors import CodecError

MAX_NUMEL = 1 << 22
FUZZ = settings(
    max_examples=150,
    deadline=2000,  # ms per example: a hang or a runaway loop fails the test
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)


def _valid_payloads() -> list[bytes]:
    rng = np.random.default_rng(3)
    dense = np.clip(np.round(rng.standard_normal(3000) * 1.3), -7, 7).astype(np.int8)
    sparse = np.zeros(5000, np.int8)
    sparse[rng.choice(5000, 40, replace=False)] = 1
    out = []
    for levels, bits in ((dense, 4), (sparse, 2), (rng.integers(-127, 128, 200).astype(np.int8), 8)):
        n = levels.size
        scales = rng.random(-(-n // 256)).astype(np.float32)
        records = [
            QuantRecord("w", bits, 256, scales, levels),
            RawRecord("b", np.array([1.0, np.nan, np.inf], np.float32)),
            SparseRecord("t", 1000, np.arange(3, 1000, 97), np.ones(11, np.float32)),
        ]
        out.append(encode_payload(records)[0])
    # A low-rank layer first (so the length-field edits below hit its header), factors at 4
    # and 8 bits: their bodies nest a level code each.
    for bits in (4, 8):
        m = rng.standard_normal(24 * 40).astype(np.float32)
        q = torch.from_numpy(rng.standard_normal((40, 3)).astype(np.float32))
        low, _q, _recon = compress_lowrank("lr", m, 24, 40, q, bits=bits, bucket_size=32, seed=bits)
        records = [
            low,
            RawRecord("b", np.array([1.0, np.nan, np.inf], np.float32)),
            QuantRecord(
                "w", 3, 256, rng.random(2).astype(np.float32), rng.integers(-3, 4, 300).astype(np.int8)
            ),
        ]
        out.append(encode_payload(records)[0])
        # The same layers with every scale on the 16-bit grid: scales go as u16 (SCALES_16).
        records[2] = replace(records[2], scales=scales_up_reference(records[2].scales))
        out.append(encode_payload(records)[0])
        assert out[-1][5] == SCALES_16 and out[-2][5] == 0
    out.append(SHARED_NAMES)
    return out


def _shared_names_payload() -> bytes:
    """Names with common prefixes go front-coded (NAMES_SHARED); the first layer is raw (no
    scales), so the second layer's name fields are easy to find (_second_name_offsets)."""
    rng = np.random.default_rng(4)
    records = [
        RawRecord("blocks.0.attn.bias", np.array([1.0, np.nan, np.inf], np.float32)),
        QuantRecord(
            "blocks.0.attn.weight",
            3,
            256,
            rng.random(2).astype(np.float32),
            rng.integers(-3, 4, 300).astype(np.int8),
        ),
        SparseRecord("blocks.1.attn.weight", 1000, np.arange(3, 1000, 97), np.ones(11, np.float32)),
    ]
    payload = encode_payload(records)[0]
    assert payload[5] == NAMES_SHARED
    return payload


SHARED_NAMES = _shared_names_payload()


VALID = _valid_payloads()


def _warm_up_every_kernel() -> None:
    """Compile (or load from numba's cache) every decode path before the timed examples run."""
    levels = np.array([0, 1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, -2, 0], np.int8)
    for bits in (3, 6):
        for code in candidate_codes(bits, levels.size):
            _, nnz, body = encode_levels(levels, bits, force=code)
            decode_levels(code, np.frombuffer(body, np.uint8), levels.size, bits, nnz, layer="warm-up")
    for payload in VALID:
        decode_payload(payload)


_warm_up_every_kernel()


def _check(payload: bytes) -> None:
    start = time.perf_counter()
    try:
        records = decode_payload(payload, max_numel=MAX_NUMEL)
    except CodecError as exc:
        assert exc.field is not None  # every error names the field where decoding stopped
        return
    finally:
        assert time.perf_counter() - start < 2.0
    for rec in records:  # a result that decodes must be internally consistent
        if isinstance(rec, QuantRecord):
            assert rec.levels.dtype == np.int8
            half = (1 << (rec.bits - 1)) - 1
            if rec.numel:
                assert -half <= int(rec.levels.min()) and int(rec.levels.max()) <= half
            assert rec.scales.size == -(-rec.numel // rec.bucket_size)
        elif isinstance(rec, SparseRecord):
            assert rec.indices.size == rec.values.size
            if rec.indices.size:
                assert (
                    np.all(np.diff(rec.indices) > 0) and rec.indices[0] >= 0 and rec.indices[-1] < rec.numel
                )
        elif isinstance(rec, LowRankRecord):
            assert 1 <= rec.rank <= max_rank(rec.rows, rec.cols) and rec.rows * rec.cols == rec.numel
            assert rec.p_levels.size == rec.rank * rec.rows and rec.q_levels.size == rec.rank * rec.cols
            assert reconstruct(rec).size == rec.numel
        else:
            assert isinstance(rec, RawRecord) and rec.values.dtype == np.float32


def test_valid_payloads_decode() -> None:
    for payload in VALID:
        _check(payload)
        assert len(decode_payload(payload)) == 3


@FUZZ
@given(st.binary(max_size=3000))
def test_random_bytes(data: bytes) -> None:
    _check(data)


@FUZZ
@given(
    st.binary(max_size=3000), st.integers(0, 3), st.sampled_from([0, NAMES_SHARED, SCALES_16 | NAMES_SHARED])
)
def test_random_bytes_behind_a_valid_header(data: bytes, n_layers: int, flags: int) -> None:
    _check(seal(struct.pack("<4sBBHI", MAGIC, VERSION, flags, 0, n_layers) + data))


@FUZZ
@given(
    st.sampled_from(range(len(VALID))),
    st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 7)), min_size=1, max_size=8),
)
def test_bit_flips(which: int, flips: list[tuple[int, int]]) -> None:
    # Flip inside the frame and re-seal, so the parser's own checks (not the CRC) are fuzzed.
    bad = bytearray(_frame(VALID[which]))
    for at, bit in flips:
        bad[at % len(bad)] ^= 1 << bit
    _check(seal(bytes(bad)))


@FUZZ
@given(st.sampled_from(range(len(VALID))), st.integers(0, 1 << 20), st.integers(0, 7))
def test_any_single_bit_flip_in_transit_is_caught(which: int, at: int, bit: int) -> None:
    # Without re-sealing: every single-bit error anywhere must raise, never decode silently
    # (version 2 let 9 of 300 through as wrong numbers; the CRC32 trailer closes that).
    bad = bytearray(VALID[which])
    bad[at % len(bad)] ^= 1 << bit
    with pytest.raises(CodecError):
        decode_payload(bytes(bad))


def _frame(payload: bytes) -> bytes:
    """The payload without its CRC32 trailer."""
    return payload[:-4]


@FUZZ
@given(st.sampled_from(range(len(VALID))), st.integers(0, 1 << 20))
def test_truncation(which: int, cut: int) -> None:
    payload = VALID[which]
    _check(payload[: cut % len(payload)])


def _varint_offsets(payload: bytes) -> list[tuple[int, int]]:
    """(offset, length) of numel, bucket_size, n_scales, nnz, body_len of the first layer."""
    pos = 12
    if payload[5] & NAMES_SHARED:  # varint shared (0: the first name), varint name_len (< 128 here)
        assert payload[pos] == 0 and payload[pos + 1] < 0x80
        pos += 2 + payload[pos + 1] + 4
    else:
        name_len = payload[pos] | payload[pos + 1] << 8
        pos += 2 + name_len + 4
    out = []
    for _ in range(5):
        start = pos
        while payload[pos] & 0x80:
            pos += 1
        pos += 1
        out.append((start, pos - start))
    return out


@FUZZ
@given(st.sampled_from(range(len(VALID))), st.integers(0, 4), st.integers(0, 1 << 40))
def test_edited_length_fields(which: int, field_no: int, value: int) -> None:
    payload = _frame(VALID[which])
    start, length = _varint_offsets(payload)[field_no]
    _check(seal(payload[:start] + varint(value) + payload[start + length :]))


def _second_name_offsets(payload: bytes) -> list[tuple[int, int]]:
    """(offset, length) of the second layer's front-coded name fields (shared, name_len), in
    SHARED_NAMES: its first layer carries no scales, so its body follows its body_len."""
    start, length = _varint_offsets(payload)[4]
    body_len = payload[start]
    assert length == 1 and body_len == 12  # 3 float32 values
    pos = start + length + body_len
    return [(pos, 1), (pos + 1, 1)]


@FUZZ
@given(st.integers(0, 1), st.integers(0, 1 << 40))
def test_edited_shared_name_fields(field_no: int, value: int) -> None:
    payload = _frame(SHARED_NAMES)
    start, length = _second_name_offsets(payload)[field_no]
    _check(seal(payload[:start] + varint(value) + payload[start + length :]))


def test_the_second_name_fields_are_where_the_fuzz_edits_them() -> None:
    # (shared, name_len) of "blocks.0.attn.weight" after "blocks.0.attn.bias": 14 bytes in common.
    payload = _frame(SHARED_NAMES)
    (shared_at, _), (len_at, _) = _second_name_offsets(payload)
    assert (payload[shared_at], payload[len_at]) == (14, len("weight"))
    assert payload[len_at + 1 : len_at + 7] == b"weight"


@FUZZ
@given(st.sampled_from(range(len(VALID))), st.integers(0, 255), st.integers(0, 1 << 20))
def test_overwritten_byte_anywhere(which: int, value: int, at: int) -> None:
    bad = bytearray(_frame(VALID[which]))
    bad[at % len(bad)] = value
    _check(seal(bytes(bad)))


@pytest.mark.parametrize("version", [0, 1, VERSION + 1, 255])
def test_wrong_version(version: int) -> None:
    bad = bytearray(VALID[0])
    bad[4] = version
    with pytest.raises(CodecError) as err:
        decode_payload(bytes(bad))
    assert err.value.field == "version"
