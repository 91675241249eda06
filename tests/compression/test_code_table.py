"""The code table: one strategy per wire id, a generic chooser, and the plug-in point for
another backend's coder or a new code."""

from __future__ import annotations

import numpy as np
import pytest

from tail_ray.compression.code_table import CODE_NAMES, DEFAULT_CODES, CodeTable
from tail_ray.compression.codes import Code, LayerHeader, LevelCode, LevelStats
from tail_ray.compression.dense_codes import RansPairsCode
from tail_ray.compression.records import Kind, QuantRecord, RawRecord, SparseRecord
from tail_ray.compression.wire import decode_payload, encode_payload
from tail_ray.errors import CodecError

RNG = np.random.default_rng(11)


def _quant(name: str, levels: np.ndarray, bits: int) -> QuantRecord:
    return QuantRecord(name, bits, 256, RNG.random(-(-levels.size // 256)).astype(np.float32), levels)


def _peaked(n: int, half: int) -> np.ndarray:
    return np.clip(np.round(RNG.standard_normal(n) * half / 4), -half, half).astype(np.int8)


def test_every_kind_has_codes_and_every_code_one_wire_id() -> None:
    assert sorted(DEFAULT_CODES) == [0, 2, 3, 4, 5, 6, 7]  # 1 (int8) is reserved, never produced
    for kind in Kind:
        assert DEFAULT_CODES.for_kind(kind), kind
    assert {CODE_NAMES[Code(c)] for c in DEFAULT_CODES} == {
        "raw",
        "bitpack",
        "rans",
        "rans-pairs",
        "sparse-rans",
        "sparse-pos",
        "lowrank",
    }
    with pytest.raises(ValueError, match="two codes for wire id 6"):
        CodeTable([RansPairsCode(), RansPairsCode()])


class _CountingPairs(RansPairsCode):
    """Another implementation of rans-pairs (as a device backend's would be): same bytes."""

    def __init__(self) -> None:
        self.encoded = self.decoded = 0

    def encode(self, layer: LevelStats) -> tuple[int, bytes] | None:
        self.encoded += 1
        return super().encode(layer)

    def decode_levels(
        self, body: np.ndarray, numel: int, bits: int, nnz: int, *, layer: str | None
    ) -> np.ndarray:
        self.decoded += 1
        return super().decode_levels(body, numel, bits, nnz, layer=layer)


def test_a_backend_coder_replaces_its_id_and_writes_the_same_bytes() -> None:
    backend = _CountingPairs()
    table = DEFAULT_CODES.with_codes(backend)
    assert list(table) == list(DEFAULT_CODES)  # replaced in place: the tie-break order holds
    records = [_quant("a", _peaked(50_000, 7), 4), RawRecord("b", RNG.random(10).astype(np.float32))]
    payload, costs = encode_payload(records, codes=table)
    assert costs[0].code == "rans-pairs" and backend.encoded == 1
    assert payload == encode_payload(records)[0]
    decoded = decode_payload(payload, codes=table)
    assert backend.decoded == 1
    assert isinstance(decoded[0], QuantRecord) and np.array_equal(decoded[0].levels, records[0].levels)


class _OneBytePerLevel(LevelCode):
    """A new code on an unused id: each level as one byte (exact size)."""

    code = Code.INT8
    name = "int8-test"
    exact_size = True

    def estimate(self, layer: LevelStats) -> float:
        return float(layer.numel)

    def encode(self, layer: LevelStats) -> tuple[int, bytes]:
        return layer.nnz, layer.levels.tobytes()

    def decode_levels(
        self, body: np.ndarray, numel: int, bits: int, nnz: int, *, layer: str | None
    ) -> np.ndarray:
        if body.size != numel:
            raise CodecError("wrong size", layer=layer, field="body_len")
        return body.view(np.int8).copy()


def test_a_new_code_plugs_in_without_touching_the_chooser_or_the_container() -> None:
    uniform = RNG.integers(-127, 128, 3000).astype(np.int8)  # bitpack = 3000 bytes = one byte each
    first = CodeTable([_OneBytePerLevel(), *DEFAULT_CODES.values()])
    last = DEFAULT_CODES.with_codes(_OneBytePerLevel())
    payload, costs = encode_payload([_quant("u", uniform, 8)], codes=first)
    assert costs[0].code == "int8-test"  # a tie goes to the code listed first
    assert encode_payload([_quant("u", uniform, 8)], codes=last)[1][0].code == "bitpack"
    rec = decode_payload(payload, codes=first)[0]
    assert isinstance(rec, QuantRecord) and np.array_equal(rec.levels, uniform)
    with pytest.raises(CodecError) as err:  # a receiver without the code says so
        decode_payload(payload)
    assert (err.value.layer, err.value.field) == ("u", "code")


class _Truncating(RansPairsCode):
    def decode_levels(
        self, body: np.ndarray, numel: int, bits: int, nnz: int, *, layer: str | None
    ) -> np.ndarray:
        return super().decode_levels(body, numel, bits, nnz, layer=layer)[:-1]


def test_a_code_that_decodes_the_wrong_size_is_caught_by_the_container() -> None:
    payload, _ = encode_payload([_quant("a", _peaked(9000, 3), 3)])
    with pytest.raises(CodecError) as err:
        decode_payload(payload, codes=DEFAULT_CODES.with_codes(_Truncating()))
    assert (err.value.layer, err.value.field) == ("a", "code")


def test_codes_only_read_the_kinds_they_carry() -> None:
    head = LayerHeader("x", Kind.RAW_F32, 0, 4, 0, 0, np.zeros(0, np.float32))
    with pytest.raises(CodecError) as err:
        DEFAULT_CODES.decoder(int(Code.BITPACK), head.kind, layer=head.name)
    assert err.value.field == "code"
    raw = DEFAULT_CODES.decoder(int(Code.RAW), head.kind, layer=head.name)
    rec = raw.decode(np.zeros(16, np.uint8), head)
    assert isinstance(rec, RawRecord) and rec.values.tolist() == [0.0] * 4


def test_sparse_records_go_through_their_one_code() -> None:
    rec = SparseRecord("t", 100, np.array([1, 50, 99]), np.ones(3, np.float32))
    code, nnz, body = DEFAULT_CODES.encode(rec)
    assert (code, nnz) == (Code.SPARSE_POS, 3) and len(body) > 12
    with pytest.raises(CodecError, match="not a candidate"):
        DEFAULT_CODES.encode(rec, force=Code.RANS)
