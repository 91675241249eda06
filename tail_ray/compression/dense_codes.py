"""The dense codes: raw values, bit-packed levels, rANS levels and rANS level pairs.

Bodies (``a`` = 2L + 1 level symbols; docs/wire-format.md has the details):

    RAW          the values' bytes (f32 or f16, as the record's kind says)
    BITPACK      (level + L) packed at ceil(log2(a)) bits each, LSB-first      exact size
    RANS         table | u16 words (rest of body)                               bits 5..8
    RANS_PAIRS   table | u16 words of ceil(n/2) pair symbols                    bits 2..4

A rANS estimate is the ideal code length under the table actually used plus the table's exact
size; the real stream is within ~0.1% + 8 bytes of it.
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import numpy as np

from tail_ray.compression import bitpack, rans
from tail_ray.compression.codes import (
    Code,
    LayerCode,
    LayerHeader,
    LevelCode,
    LevelStats,
    check_bits,
    level_values,
)
from tail_ray.compression.entropy_model import EntropyModel
from tail_ray.compression.pair_symbols import PAIR_MAX_BITS, level_pair_values
from tail_ray.compression.records import Kind, LayerRecord, RawRecord
from tail_ray.errors import CodecError


class RawCode(LayerCode[RawRecord]):
    """The values as they are, little-endian float32 or float16."""

    code = Code.RAW
    name = "raw"
    kinds: ClassVar[frozenset[Kind]] = frozenset({Kind.RAW_F32, Kind.RAW_F16})
    exact_size = True

    @staticmethod
    def _dtype(kind: Kind) -> str:
        return "<f2" if kind == Kind.RAW_F16 else "<f4"

    def estimate(self, layer: RawRecord) -> float:
        return float(np.dtype(self._dtype(layer.kind)).itemsize * layer.numel)

    def encode(self, layer: RawRecord) -> tuple[int, bytes]:
        return 0, np.ascontiguousarray(layer.values, dtype=self._dtype(layer.kind)).reshape(-1).tobytes()

    def decode(self, body: np.ndarray, head: LayerHeader) -> LayerRecord:
        dtype = self._dtype(head.kind)
        want = np.dtype(dtype).itemsize * head.numel
        if body.size != want:
            raise CodecError(f"body_len {body.size} != {want}", layer=head.name, field="body_len")
        return RawRecord(head.name, body.view(dtype).astype(np.float32), fp16=head.kind == Kind.RAW_F16)


@functools.cache
def pack_width(bits: int) -> int:
    """ceil(log2(2L + 1)) bits per level for dense bit-packing (equals ``bits`` for 2..8)."""
    return max(1, math.ceil(math.log2(2 * check_bits(bits) + 1)))


class BitPackCode(LevelCode):
    """Fixed width: the floor every entropy code must beat (its size is exact)."""

    code = Code.BITPACK
    name = "bitpack"
    exact_size = True

    def estimate(self, layer: LevelStats) -> float:
        return float(bitpack.packed_bytes(layer.numel, pack_width(layer.bits)))

    def encode(self, layer: LevelStats) -> tuple[int, bytes]:
        width = pack_width(layer.bits)
        out = np.empty(bitpack.packed_bytes(layer.numel, width), dtype=np.uint8)
        bitpack.pack_fixed(layer.levels, layer.half, width, out)
        return layer.nnz, out.tobytes()

    def decode_levels(
        self, body: np.ndarray, numel: int, bits: int, nnz: int, *, layer: str | None
    ) -> np.ndarray:
        half = check_bits(bits, layer=layer)
        width = pack_width(bits)
        want = bitpack.packed_bytes(numel, width)
        if body.size != want:
            raise CodecError(
                f"bit-packed body is {body.size} bytes, {numel} levels at {width} bits need {want}",
                layer=layer,
                field="body_len",
            )
        syms = np.empty(numel, dtype=np.uint8)
        if bitpack.unpack_fixed(body, width, 2 * half, syms) < 0:
            raise CodecError(f"bit-packed level outside [-{half}, {half}]", layer=layer, field="levels")
        return (syms - np.uint8(half)).view(np.int8)


def read_word_stream(
    body: np.ndarray, alphabet: int, count: int, *, layer: str | None, paired: bool = False
) -> tuple[EntropyModel, int, int]:
    """Table | u16 words (the rest of the body): (model, first word's offset, n_words), the
    capacity for ``count`` symbols (pairs: ``count`` levels) checked before anything is
    allocated. ``paired``: the stream codes the pair model derived from the table."""
    size = int(body.size)
    model, pos = EntropyModel.read(body, 0, size, alphabet, layer=layer, field="table")
    if paired:
        count = (count + 1) // 2
        pair = model.paired(count)
        if pair is None:
            raise CodecError("table gives no valid pair model", layer=layer, field="table")
        model = pair
    if (size - pos) % 2:
        raise CodecError("rans word stream has odd byte length", layer=layer, field="body_len")
    n_words = (size - pos) // 2
    if not rans.capacity_ok(count, model, n_words):
        raise CodecError(f"{count} symbols cannot come from {n_words} words", layer=layer, field="numel")
    return model, pos, n_words


class RansCode(LevelCode):
    """One rANS symbol per level; the single-level table is sent."""

    code = Code.RANS
    name = "rans"

    def estimate(self, layer: LevelStats) -> float | None:
        if layer.dense is None or layer.pair_model is not None:
            return None  # empty layer, or the pair code applies
        return layer.dense.est_bytes

    def encode(self, layer: LevelStats) -> tuple[int, bytes] | None:
        assert layer.dense is not None
        model = layer.dense.model
        words, n_words = rans.encode_stream(layer.levels, layer.half, model)
        if not rans.capacity_ok(layer.numel, model, n_words):
            return None
        return layer.nnz, model.to_bytes() + words

    def decode_levels(
        self, body: np.ndarray, numel: int, bits: int, nnz: int, *, layer: str | None
    ) -> np.ndarray:
        half = check_bits(bits, layer=layer)
        if numel == 0:
            raise CodecError("rans code with numel 0", layer=layer, field="code")
        model, pos, n_words = read_word_stream(body, 2 * half + 1, numel, layer=layer)
        out = np.empty(numel, dtype=np.int8)
        rans.decode_stream(body, pos, n_words, model, level_values(half), out, layer=layer, field="levels")
        return out


class RansPairsCode(LevelCode):
    """Two levels per rANS symbol (bits 2..4): half the serial steps; only the single-level
    table is sent, the pair model is derived from it on both sides."""

    code = Code.RANS_PAIRS
    name = "rans-pairs"

    def estimate(self, layer: LevelStats) -> float | None:
        if layer.dense is None or layer.pair_model is None or layer.pair_counts is None:
            return None
        return layer.dense.table_bytes + rans.stream_bytes(layer.pair_model, layer.pair_counts)

    def encode(self, layer: LevelStats) -> tuple[int, bytes] | None:
        assert layer.dense is not None and layer.pair_model is not None and layer.pair_syms is not None
        words, n_words = rans.encode_stream(layer.pair_syms, 0, layer.pair_model)
        if not rans.capacity_ok(int(layer.pair_syms.size), layer.pair_model, n_words):
            return None
        return layer.nnz, layer.dense.model.to_bytes() + words

    def decode_levels(
        self, body: np.ndarray, numel: int, bits: int, nnz: int, *, layer: str | None
    ) -> np.ndarray:
        half = check_bits(bits, layer=layer)
        if numel == 0 or bits > PAIR_MAX_BITS:
            raise CodecError(f"rans-pairs code with numel {numel}, bits {bits}", layer=layer, field="code")
        model, pos, n_words = read_word_stream(body, 2 * half + 1, numel, layer=layer, paired=True)
        out = np.empty(2 * ((numel + 1) // 2), dtype=np.int8)
        rans.decode_stream(
            body,
            pos,
            n_words,
            model,
            level_pair_values(half),
            out.view(np.uint16),
            layer=layer,
            field="levels",
        )
        return out[:numel]
