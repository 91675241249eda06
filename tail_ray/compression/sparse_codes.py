"""The sparse codes: quantized levels as gaps + non-zero levels, and top-k positions.

Bodies (docs/wire-format.md has the details; the gap code is sparse.py's):

    SPARSE_RANS  empty if nnz = 0; else slot table | level table | varint n_slot_words
                 | slot words | varint n_level_words | level words | gap extra bits (rest)
    SPARSE_POS   (nnz > 0) slot table | varint n_words | slot words | gap extra bits,
                 then the values f32[nnz]

For bits 2..4 the non-zero levels go two per rANS step, as in rans-pairs (the pair model
derived from the sent level table). Sparse rANS must save ``SPARSE_MIN_GAIN`` over the dense
entropy code to be chosen: at the densities where the two are close the dense code encodes
4-5x faster (measured on 1M-element layers: 2.2 vs 0.45 GB/s).
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np

from tail_ray.compression import rans, sparse
from tail_ray.compression.codes import Code, LayerCode, LayerHeader, LevelCode, LevelStats, check_bits
from tail_ray.compression.entropy_model import EntropyModel
from tail_ray.compression.pair_symbols import PAIR_MAX_BITS, pair_up, symbol_pair_values
from tail_ray.compression.records import Kind, LayerRecord, SparseRecord
from tail_ray.compression.varint import read_varint, varint
from tail_ray.errors import CodecError

# Sparse coding must save at least this share of the dense entropy code's size to be chosen.
SPARSE_MIN_GAIN = 0.05
_IDENTITY = np.arange(256, dtype=np.uint8)


def _read_words(body: np.ndarray, pos: int, *, layer: str | None, field: str) -> tuple[int, int]:
    """varint n_words then the words: (first word's offset, n_words), checked against the body."""
    n_words, pos = read_varint(body, pos, body.size, layer=layer, field=field)
    if n_words > (body.size - pos) // 2:
        raise CodecError(f"stream claims {n_words} words", layer=layer, field=field)
    return pos, n_words


def _check_capacity(count: int, model: EntropyModel, n_words: int, *, layer: str | None, field: str) -> None:
    if not rans.capacity_ok(count, model, n_words):
        raise CodecError(f"{count} symbols cannot come from {n_words} words", layer=layer, field=field)


def _positions(
    slots: np.ndarray, body: np.ndarray, pos: int, numel: int, *, layer: str | None
) -> tuple[np.ndarray, int]:
    """Positions from decoded slots + the extra bits at body[pos:]: (indices, bytes used)."""
    idx = np.empty(slots.size, dtype=np.int64)
    used = sparse.positions(slots, body, pos, body.size, numel, idx)
    if used == sparse.ERR_EXTRA_TRUNCATED:
        raise CodecError("gap extra bits end early", layer=layer, field="positions")
    if used < 0:
        raise CodecError("a position runs past numel", layer=layer, field="positions")
    return idx, int(used)


class SparseRansCode(LevelCode):
    """Gaps between non-zero levels (slot stream + extra bits) and the non-zero levels."""

    code = Code.SPARSE_RANS
    name = "sparse-rans"
    must_beat = (Code.RANS, Code.RANS_PAIRS)
    min_gain = SPARSE_MIN_GAIN

    def estimate(self, layer: LevelStats) -> float:
        if layer.slot_fit is None or layer.nonzero_fit is None:
            return 0.0  # no non-zero level: an empty body
        return layer.slot_fit.est_bytes + layer.nonzero_fit.est_bytes + 4 + math.ceil(layer.extra_bits / 8)

    def refine(self, layer: LevelStats) -> float:
        layer.count_gaps_exactly()  # the sampled gaps ranked it; the real model sees every gap
        return self.estimate(layer)

    def encode(self, layer: LevelStats) -> tuple[int, bytes] | None:
        if layer.slot_fit is None or layer.nonzero_fit is None:
            return 0, b""
        slot_model, level_model = layer.slot_fit.model, layer.nonzero_fit.model
        slots, syms, extra = sparse.split_levels(layer.levels, layer.half, layer.nnz, layer.extra_bits)
        w_slot, nw_slot = rans.encode_stream(slots, 0, slot_model)
        lvl_syms, lvl_model = syms, level_model
        if layer.bits <= PAIR_MAX_BITS:  # non-zero levels go two per step, as in rans-pairs
            paired = level_model.paired((layer.nnz + 1) // 2)
            if paired is None:
                return None
            lvl_syms, lvl_model = pair_up(syms, 2 * layer.half)[0], paired
        w_lvl, nw_lvl = rans.encode_stream(lvl_syms, 0, lvl_model)
        if not (
            rans.capacity_ok(layer.nnz, slot_model, nw_slot)
            and rans.capacity_ok(int(lvl_syms.size), lvl_model, nw_lvl)
        ):
            return None
        tables = slot_model.to_bytes() + level_model.to_bytes()
        return layer.nnz, b"".join((tables, varint(nw_slot), w_slot, varint(nw_lvl), w_lvl, extra.tobytes()))

    def decode_levels(
        self, body: np.ndarray, numel: int, bits: int, nnz: int, *, layer: str | None
    ) -> np.ndarray:
        half = check_bits(bits, layer=layer)
        if nnz > numel:
            raise CodecError(f"nnz {nnz} > numel {numel}", layer=layer, field="nnz")
        if nnz == 0:
            if body.size:
                raise CodecError(
                    "sparse body of an all-zero layer must be empty", layer=layer, field="body_len"
                )
            return np.zeros(numel, dtype=np.int8)
        slot_model, pos = EntropyModel.read(
            body, 0, body.size, sparse.N_SLOTS, layer=layer, field="slot_table"
        )
        lvl_model, pos = EntropyModel.read(body, pos, body.size, 2 * half, layer=layer, field="level_table")
        slot_start, nw_slot = _read_words(body, pos, layer=layer, field="slot_words")
        lvl_start, nw_lvl = _read_words(body, slot_start + 2 * nw_slot, layer=layer, field="level_words")
        pos = lvl_start + 2 * nw_lvl
        n_lvl, lvl_values = nnz, _IDENTITY
        if bits <= PAIR_MAX_BITS:  # non-zero levels were coded two per step
            n_lvl = (nnz + 1) // 2
            paired = lvl_model.paired(n_lvl)
            if paired is None:
                raise CodecError("level table gives no valid pair model", layer=layer, field="level_table")
            lvl_model, lvl_values = paired, symbol_pair_values(2 * half)
        _check_capacity(nnz, slot_model, nw_slot, layer=layer, field="slot_words")
        _check_capacity(n_lvl, lvl_model, nw_lvl, layer=layer, field="level_words")
        slots = np.empty(nnz, dtype=np.uint8)
        rans.decode_stream(
            body, slot_start, nw_slot, slot_model, _IDENTITY, slots, layer=layer, field="slots"
        )
        sym_buf = np.empty(2 * n_lvl if bits <= PAIR_MAX_BITS else nnz, dtype=np.uint8)
        lvl_out = sym_buf.view(np.uint16) if bits <= PAIR_MAX_BITS else sym_buf
        rans.decode_stream(
            body, lvl_start, nw_lvl, lvl_model, lvl_values, lvl_out, layer=layer, field="levels"
        )
        idx, used = _positions(slots, body, pos, numel, layer=layer)
        if pos + used != body.size:
            raise CodecError(
                f"{body.size - pos - used} unused bytes after the gap bits", layer=layer, field="body_len"
            )
        out = np.zeros(numel, dtype=np.int8)
        sparse.scatter_levels(idx, sym_buf[:nnz], half, out)
        return out


def encode_positions(indices: np.ndarray, numel: int) -> bytes:
    """Strictly increasing indices -> slot table | varint n_words | slot words | extra bits."""
    idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
    if idx.size == 0:
        return b""
    status, slots, extra = sparse.index_slots(idx, numel)
    if status < 0:
        raise CodecError("indices must be strictly increasing in [0, numel)", field="indices")
    model = rans.fit_model(np.bincount(slots, minlength=sparse.N_SLOTS).astype(np.int64)).model
    words, n_words = rans.encode_stream(slots, 0, model)
    if not rans.capacity_ok(int(idx.size), model, n_words):  # pragma: no cover
        raise CodecError("position stream violates the capacity rule", field="indices")
    return model.to_bytes() + varint(n_words) + words + extra.tobytes()


def decode_positions(body: np.ndarray, nnz: int, numel: int, *, layer: str | None) -> tuple[np.ndarray, int]:
    """Inverse of ``encode_positions`` over a prefix of ``body``; return (indices, bytes used)."""
    if nnz == 0:
        return np.zeros(0, dtype=np.int64), 0
    model, pos = EntropyModel.read(body, 0, body.size, sparse.N_SLOTS, layer=layer, field="slot_table")
    pos, n_words = _read_words(body, pos, layer=layer, field="slot_words")
    _check_capacity(nnz, model, n_words, layer=layer, field="slot_words")
    slots = np.empty(nnz, dtype=np.uint8)
    rans.decode_stream(body, pos, n_words, model, _IDENTITY, slots, layer=layer, field="slots")
    idx, used = _positions(slots, body, pos + 2 * n_words, numel, layer=layer)
    return idx, pos + 2 * n_words + used


class SparsePosCode(LayerCode[SparseRecord]):
    """Top-k: the kept positions as gaps, then their float32 values."""

    code = Code.SPARSE_POS
    name = "sparse-pos"
    kinds: ClassVar[frozenset[Kind]] = frozenset({Kind.SPARSE_F32})

    def estimate(self, layer: SparseRecord) -> float:
        n, k = layer.numel, int(layer.indices.size)
        log2_choose = (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)
        return 4.0 * k + max(log2_choose, 0.0) / 8  # values + the positions' information bound

    def encode(self, layer: SparseRecord) -> tuple[int, bytes]:
        idx = np.asarray(layer.indices).reshape(-1)
        vals = np.ascontiguousarray(layer.values, dtype="<f4").reshape(-1)
        if idx.size != vals.size:
            raise CodecError(f"{idx.size} indices but {vals.size} values", field="values")
        return int(idx.size), encode_positions(idx, layer.numel) + vals.tobytes()

    def decode(self, body: np.ndarray, head: LayerHeader) -> LayerRecord:
        nnz, numel, name = head.nnz, head.numel, head.name
        if nnz > numel or 4 * nnz > body.size:
            raise CodecError(f"nnz {nnz} inconsistent with numel / body_len", layer=name, field="nnz")
        pos_len = body.size - 4 * nnz
        idx, used = decode_positions(body[:pos_len], nnz, numel, layer=name)
        if used != pos_len:
            raise CodecError(f"{pos_len - used} unused position bytes", layer=name, field="body_len")
        return SparseRecord(name, numel, idx, body[pos_len:].view("<f4").astype(np.float32))
