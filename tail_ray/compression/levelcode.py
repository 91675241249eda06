"""Per-layer coding of quantized levels: pick the smallest of bit-pack, dense rANS, sparse rANS.

The choice is made on sizes: bit-pack size is exact; a rANS size is the ideal code length
under the quantised table actually used plus the table's exact size (the real stream is
within ~0.1% + 8 bytes of it). Only the winner is encoded; an entropy body that turns out
larger than bit-pack falls back to bit-pack. One documented tie-break: sparse rANS must save
``SPARSE_MIN_GAIN`` (5%) over the dense entropy code, which encodes 4-5x faster at the
densities where the two are close (measured on 1M-element layers: 2.2 vs 0.45 GB/s).

Bodies (the container frames them; ``a`` = 2L + 1); docs/wire-format.md has the details:
    BITPACK      (level + L) packed at ceil(log2(a)) bits each, LSB-first
    RANS         table | u16 words (rest of body)                                   rans.py
    RANS_PAIRS   table | u16 words of ceil(n/2) pair symbols (bits 2..4)            pairs.py
    SPARSE_RANS  (only when nnz > 0) slot table | level table | varint n_slot_words | slot words
                 | varint n_level_words | level words | extra gap bits (rest)       sparse.py
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from tail_ray.compression import bitpack, pairs, rans, sparse
from tail_ray.compression.grid import levels_max
from tail_ray.errors import CodecError

# A stream may claim at most this many symbols per bit actually present, relative to its
# model's cheapest symbol (see ``_capacity_ok``): the encoder guarantees it, the decoder
# rejects anything more before allocating.
_CAPACITY_FACTOR = 2.0
_CAPACITY_SLACK_BITS = 256.0


class Code(IntEnum):
    RAW = 0  # the values' own bytes (RAW_F32 / RAW_F16 / legacy)
    INT8 = 1  # reserved: version-1 levels as one byte each (never produced, never accepted)
    BITPACK = 2
    RANS = 3
    SPARSE_RANS = 4
    SPARSE_POS = 5  # SPARSE_F32: positions as sparse gaps, values raw f32
    RANS_PAIRS = 6  # bits 2..4: two levels per rANS symbol, pair model derived from the sent table


CODE_NAMES = {
    Code.RAW: "raw",
    Code.INT8: "int8",
    Code.BITPACK: "bitpack",
    Code.RANS: "rans",
    Code.SPARSE_RANS: "sparse-rans",
    Code.SPARSE_POS: "sparse-pos",
    Code.RANS_PAIRS: "rans-pairs",
}
PAIR_MAX_BITS = 4  # (2L + 1)**2 <= 225 pair symbols fit a byte
# Sparse coding must save at least this share of the dense entropy code's size to be chosen.
SPARSE_MIN_GAIN = 0.05

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("tail_ray's level coder views int8 pairs as uint16: it needs a little-endian host")

_IDENTITY = np.arange(256, dtype=np.uint8)


@functools.cache
def _level_values(half: int) -> np.ndarray:
    return (np.arange(2 * half + 1) - half).astype(np.int8)


@functools.cache
def _pair_values(half: int) -> np.ndarray:
    return pairs.pair_values(half)


@functools.cache
def _symbol_pair_values(alphabet: int) -> np.ndarray:
    return pairs.symbol_pair_values(alphabet)


def pack_width(bits: int) -> int:
    """ceil(log2(2L + 1)) bits per level for dense bit-packing (equals ``bits`` for 2..8)."""
    return max(1, math.ceil(math.log2(2 * levels_max(bits) + 1)))


def varint(v: int) -> bytes:
    """Unsigned LEB128 of ``v`` (0 <= v < 2**63)."""
    if not 0 <= v < 1 << 63:
        raise ValueError(f"varint value {v} outside [0, 2**63)")
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def read_varint(buf: np.ndarray, pos: int, end: int, *, layer: str | None, field: str) -> tuple[int, int]:
    """Unsigned LEB128 at ``buf[pos:end]`` (at most 9 bytes, < 2**63)."""
    v = 0
    for k in range(9):
        if pos >= end:
            raise CodecError("truncated varint", layer=layer, field=field)
        b = int(buf[pos])
        pos += 1
        v |= (b & 0x7F) << (7 * k)
        if not b & 0x80:
            return v, pos
    raise CodecError("varint longer than 9 bytes", layer=layer, field=field)


# --------------------------------------------------------------------------- models


@dataclass(frozen=True)
class _Model:
    scale_bits: int
    freqs: np.ndarray  # int64[alphabet]
    table_bytes: int  # scale byte + gamma table
    est_stream_bytes: float  # table + words


def _build_model(counts: np.ndarray) -> _Model:
    """Pick the precision (scale bits) that minimises table + estimated words."""
    freqs = np.zeros(counts.size, dtype=np.int64)
    scale, table, est = rans.build_model(counts, freqs)
    if scale < 0:  # pragma: no cover - more used symbols than 2**13 slots cannot happen (<= 256)
        raise CodecError("no frequency table fits this alphabet", field="table")
    return _Model(int(scale), freqs, int(table), float(est))


def _min_cost_bits(freqs: np.ndarray, scale_bits: int) -> float:
    return scale_bits - math.log2(int(freqs.max()))


def _capacity_ok(count: int, freqs: np.ndarray, scale_bits: int, n_words: int) -> bool:
    """Whether ``count`` symbols fit in ``n_words`` words for this model (see _CAPACITY_FACTOR)."""
    min_cost = _min_cost_bits(freqs, scale_bits)
    if min_cost == 0.0:  # one symbol carries all mass: decoded by a fill, no stream work
        return True
    return count * min_cost <= _CAPACITY_FACTOR * 16 * n_words + _CAPACITY_SLACK_BITS


def _table(model: _Model) -> bytes:
    table = np.empty(model.table_bytes + 8, dtype=np.uint8)
    end = rans.write_table(model.freqs, model.scale_bits, table, 0)
    return table[:end].tobytes()


def _words(symbols: np.ndarray, offset: int, freqs: np.ndarray, scale_bits: int) -> tuple[bytes, int]:
    """(u16le word bytes, n_words); the host is little-endian (checked at import)."""
    words = rans.encode(symbols, offset, freqs, scale_bits)
    return words.tobytes(), int(words.size)


# --------------------------------------------------------------------------- encode


def encode_levels(levels: np.ndarray, bits: int, *, force: Code | None = None) -> tuple[Code, int, bytes]:
    """Code one layer's levels; return (code, nnz, body). ``force`` picks a code (for tests)."""
    if not 2 <= bits <= 8:
        raise CodecError(f"bits must be 2..8 for quantized levels, got {bits}", field="bits")
    half = levels_max(bits)
    levels = np.asarray(levels)
    if levels.dtype != np.int8:
        # A wider integer type would wrap silently in the cast: check the range first.
        if levels.dtype.kind not in "iu":
            raise CodecError(f"levels must be integers, got {levels.dtype}", field="levels")
        if levels.size and (int(levels.min()) < -half or int(levels.max()) > half):
            raise CodecError(f"levels outside [-{half}, {half}] for bits={bits}", field="levels")
    lv = np.ascontiguousarray(levels, dtype=np.int8).reshape(-1)
    n = int(lv.size)
    counts = np.zeros(2 * half + 1, dtype=np.int64)
    slot_counts = np.zeros(sparse.N_SLOTS, dtype=np.int64)
    pair_syms = pair_counts = None
    gaps_exact = True
    if bits <= PAIR_MAX_BITS:
        # Large layers: gap slots estimated from a sample (level and pair counts exact);
        # re-counted exactly below if the sparse code is the one to build.
        nnz, extra_bits, pair_syms, pair_counts, gaps_exact = pairs.pair_level_stats_fast(
            lv, half, counts, slot_counts
        )
    else:
        nnz, extra_bits, gaps_exact = pairs.level_stats_fast(lv, half, counts, slot_counts)
    if nnz < 0:
        lo, hi = int(lv.min()), int(lv.max())
        raise CodecError(
            f"levels span [{lo}, {hi}], outside [-{half}, {half}] for bits={bits}", field="levels"
        )
    nnz = int(nnz)

    width = pack_width(bits)
    candidates: dict[Code, float] = {Code.BITPACK: float(bitpack.packed_bytes(n, width))}
    dense_model = _build_model(counts) if n else None
    pair_freqs = None
    pair_scale = 0
    if dense_model is not None and pair_counts is not None:
        # Small alphabets code two levels per step (twice the speed, same order-0 size).
        pair_scale = pairs.pair_scale_bits(dense_model.scale_bits, (n + 1) // 2)
        status, pair_freqs = pairs.product_freqs(dense_model.freqs, dense_model.scale_bits, pair_scale)
        if status == 0:
            est = rans.cost_bits(pair_counts, pair_freqs, pair_scale)
            words = math.ceil(est / 16) + rans.STATE_WORDS
            candidates[Code.RANS_PAIRS] = dense_model.table_bytes + 2 * words
        else:  # no valid pair table at this precision: code single levels
            candidates[Code.RANS] = dense_model.est_stream_bytes
    elif dense_model is not None:
        candidates[Code.RANS] = dense_model.est_stream_bytes
    slot_model = level_model = None
    if nnz == 0:
        candidates[Code.SPARSE_RANS] = 0.0
    else:
        slot_model = _build_model(slot_counts)
        level_model = _build_model(np.delete(counts, half))
        candidates[Code.SPARSE_RANS] = (
            slot_model.est_stream_bytes + level_model.est_stream_bytes + 4 + math.ceil(extra_bits / 8)
        )

    def build(code: Code) -> bytes | None:
        if code == Code.BITPACK:
            out = np.empty(bitpack.packed_bytes(n, width), dtype=np.uint8)
            bitpack.pack_fixed(lv, half, width, out)
            return out.tobytes()
        if code == Code.RANS:
            assert dense_model is not None
            words, n_words = _words(lv, half, dense_model.freqs, dense_model.scale_bits)
            if not _capacity_ok(n, dense_model.freqs, dense_model.scale_bits, n_words):
                return None
            return _table(dense_model) + words
        if code == Code.RANS_PAIRS:
            assert dense_model is not None and pair_syms is not None and pair_freqs is not None
            words, n_words = _words(pair_syms, 0, pair_freqs, pair_scale)
            if not _capacity_ok(int(pair_syms.size), pair_freqs, pair_scale, n_words):
                return None
            return _table(dense_model) + words
        if nnz == 0:
            return b""
        assert slot_model is not None and level_model is not None
        slots, syms, extra = sparse.split_levels(lv, half, nnz, extra_bits)
        w_slot, nw_slot = _words(slots, 0, slot_model.freqs, slot_model.scale_bits)
        lvl_syms, lvl_freqs, lvl_scale = syms, level_model.freqs, level_model.scale_bits
        if bits <= PAIR_MAX_BITS:  # non-zero levels go two per step, as in rans-pairs
            lvl_scale = pairs.pair_scale_bits(level_model.scale_bits, (nnz + 1) // 2)
            status, lvl_freqs = pairs.product_freqs(level_model.freqs, level_model.scale_bits, lvl_scale)
            if status < 0:
                return None
            lvl_syms, _ = pairs.pair_up(syms, 2 * half)
        w_lvl, nw_lvl = _words(lvl_syms, 0, lvl_freqs, lvl_scale)
        if not (
            _capacity_ok(nnz, slot_model.freqs, slot_model.scale_bits, nw_slot)
            and _capacity_ok(int(lvl_syms.size), lvl_freqs, lvl_scale, nw_lvl)
        ):
            return None
        parts = (_table(slot_model), _table(level_model), varint(nw_slot), w_slot, varint(nw_lvl), w_lvl)
        return b"".join((*parts, extra.tobytes()))

    def exact_gaps() -> None:
        # The sparse estimate came from sampled gaps: the real model must see every gap.
        nonlocal nnz, extra_bits, slot_model, gaps_exact
        exact_nnz, extra_bits = sparse.level_stats(lv, half, np.zeros_like(counts), slot_counts)
        nnz = int(exact_nnz)
        slot_model = _build_model(slot_counts)
        gaps_exact = True

    if force is not None:
        if force not in candidates:
            raise CodecError(f"code {force.name} is not a candidate for this layer", field="code")
        if force == Code.SPARSE_RANS and not gaps_exact:
            exact_gaps()
        body = build(force)
        if body is None:
            raise CodecError(f"code {force.name} refused this layer (capacity rule)", field="code")
        return force, nnz, body

    # Cheapest estimate first. Bit-pack sizes are exact; a rANS estimate is the ideal code
    # length under the very table that is used, plus the table's exact size, and the real
    # stream lands within ~0.1% + 8 bytes of it. A real entropy body larger than bit-pack
    # falls back to bit-pack, so the result is never worse than the dense fixed-width code.
    dense_est = min(candidates.get(Code.RANS, math.inf), candidates.get(Code.RANS_PAIRS, math.inf))
    if Code.SPARSE_RANS in candidates and candidates[Code.SPARSE_RANS] > dense_est * (1 - SPARSE_MIN_GAIN):
        # A near-tie (typical when zeros are scattered at random) goes to the dense code: it
        # is several times faster at high density and within SPARSE_MIN_GAIN of the size.
        del candidates[Code.SPARSE_RANS]
    for code, _est in sorted(candidates.items(), key=lambda kv: kv[1]):
        if code == Code.SPARSE_RANS and not gaps_exact:
            exact_gaps()
            assert slot_model is not None and level_model is not None
            exact_est = (
                slot_model.est_stream_bytes + level_model.est_stream_bytes + 4 + math.ceil(extra_bits / 8)
            )
            if exact_est > dense_est * (1 - SPARSE_MIN_GAIN):
                continue  # the sample was wrong about the gaps: the dense code is next
        body = build(code)
        if body is not None and (code == Code.BITPACK or len(body) <= candidates[Code.BITPACK]):
            return code, nnz, body
    raise AssertionError("unreachable: bit-pack always builds")  # pragma: no cover


def candidate_codes(bits: int, numel: int) -> tuple[Code, ...]:
    """The codes ``encode_levels`` weighs for a layer (for tests and benchmarks)."""
    dense = Code.RANS_PAIRS if bits <= PAIR_MAX_BITS else Code.RANS
    return (Code.BITPACK, dense, Code.SPARSE_RANS) if numel else (Code.BITPACK, Code.SPARSE_RANS)


# --------------------------------------------------------------------------- decode


def _read_model(
    data: np.ndarray, pos: int, end: int, alphabet: int, *, layer: str | None, field: str
) -> tuple[int, np.ndarray, int]:
    freqs = np.zeros(alphabet, dtype=np.int64)
    status, new_pos = rans.read_table(data[:end], pos, alphabet, freqs)
    if status == rans.ERR_TABLE_TRUNCATED:
        raise CodecError("frequency table runs past the layer body", layer=layer, field=field)
    if status < 0:
        raise CodecError("malformed frequency table (scale, range or sum)", layer=layer, field=field)
    return int(status), freqs, int(new_pos)


def _decode_stream(
    data: np.ndarray,
    start: int,
    n_words: int,
    freqs: np.ndarray,
    scale_bits: int,
    values: np.ndarray,
    out: np.ndarray,
    *,
    layer: str | None,
    field: str,
) -> None:
    if not _capacity_ok(out.size, freqs, scale_bits, n_words):
        raise CodecError(
            f"{out.size} symbols cannot come from {n_words} words with this table", layer=layer, field=field
        )
    if int(freqs.max()) == (1 << scale_bits):  # a single symbol: the stream holds only the states
        if n_words != rans.STATE_WORDS:
            raise CodecError("single-symbol stream must hold only the states", layer=layer, field=field)
        out[:] = values[int(np.argmax(freqs))]
        return
    status = rans.decode(data, start, n_words, freqs, scale_bits, values, out)
    if status == rans.ERR_TRUNCATED:
        raise CodecError("entropy stream ends early", layer=layer, field=field)
    if status < 0:
        raise CodecError("entropy stream corrupted (final state check failed)", layer=layer, field=field)


def decode_levels(
    code: int, body: np.ndarray, numel: int, bits: int, nnz: int, *, layer: str | None
) -> np.ndarray:
    """Decode one layer body (uint8 array) into int8 levels in [-L, L]; CodecError on anything wrong."""
    if not 2 <= bits <= 8:
        raise CodecError(f"bits {bits} not in 2..8", layer=layer, field="bits")
    half = levels_max(bits)
    size = int(body.size)
    if code == Code.BITPACK:
        width = pack_width(bits)
        if size != bitpack.packed_bytes(numel, width):
            raise CodecError(
                f"bit-packed body is {size} bytes, {numel} levels at {width} bits need "
                f"{bitpack.packed_bytes(numel, width)}",
                layer=layer,
                field="body_len",
            )
        syms = np.empty(numel, dtype=np.uint8)
        if bitpack.unpack_fixed(body, width, 2 * half, syms) < 0:
            raise CodecError(f"bit-packed level outside [-{half}, {half}]", layer=layer, field="levels")
        return (syms - np.uint8(half)).view(np.int8)
    if code == Code.RANS:
        if numel == 0:
            raise CodecError("rans code with numel 0", layer=layer, field="code")
        scale, freqs, pos = _read_model(body, 0, size, 2 * half + 1, layer=layer, field="table")
        if (size - pos) % 2:
            raise CodecError("rans word stream has odd byte length", layer=layer, field="body_len")
        out = np.empty(0, dtype=np.int8)
        n_words = (size - pos) // 2
        # Check capacity before the big allocation: _decode_stream re-checks with the real array.
        if not _capacity_ok(numel, freqs, scale, n_words):
            raise CodecError(f"numel {numel} cannot come from {n_words} words", layer=layer, field="numel")
        out = np.empty(numel, dtype=np.int8)
        _decode_stream(
            body, pos, n_words, freqs, scale, _level_values(half), out, layer=layer, field="levels"
        )
        return out
    if code == Code.RANS_PAIRS:
        if numel == 0 or bits > PAIR_MAX_BITS:
            raise CodecError(f"rans-pairs code with numel {numel}, bits {bits}", layer=layer, field="code")
        scale, freqs, pos = _read_model(body, 0, size, 2 * half + 1, layer=layer, field="table")
        pair_scale = pairs.pair_scale_bits(scale, (numel + 1) // 2)
        status, pair_freqs = pairs.product_freqs(freqs, scale, pair_scale)
        if status < 0:
            raise CodecError("table gives no valid pair model", layer=layer, field="table")
        if (size - pos) % 2:
            raise CodecError("rans word stream has odd byte length", layer=layer, field="body_len")
        n_words = (size - pos) // 2
        n_pairs = (numel + 1) // 2
        if not _capacity_ok(n_pairs, pair_freqs, pair_scale, n_words):
            raise CodecError(f"numel {numel} cannot come from {n_words} words", layer=layer, field="numel")
        out = np.empty(2 * n_pairs, dtype=np.int8)
        _decode_stream(
            body,
            pos,
            n_words,
            pair_freqs,
            pair_scale,
            _pair_values(half),
            out.view(np.uint16),
            layer=layer,
            field="levels",
        )
        return out[:numel]
    if code == Code.SPARSE_RANS:
        if nnz > numel:
            raise CodecError(f"nnz {nnz} > numel {numel}", layer=layer, field="nnz")
        if nnz == 0:
            if size:
                raise CodecError(
                    "sparse body of an all-zero layer must be empty", layer=layer, field="body_len"
                )
            return np.zeros(numel, dtype=np.int8)
        s_scale, s_freqs, pos = _read_model(body, 0, size, sparse.N_SLOTS, layer=layer, field="slot_table")
        l_scale, l_freqs, pos = _read_model(body, pos, size, 2 * half, layer=layer, field="level_table")
        nw_slot, pos = read_varint(body, pos, size, layer=layer, field="slot_words")
        if nw_slot > (size - pos) // 2:
            raise CodecError(f"slot stream claims {nw_slot} words", layer=layer, field="slot_words")
        slot_start = pos
        pos += 2 * nw_slot
        nw_lvl, pos = read_varint(body, pos, size, layer=layer, field="level_words")
        if nw_lvl > (size - pos) // 2:
            raise CodecError(f"level stream claims {nw_lvl} words", layer=layer, field="level_words")
        lvl_start = pos
        pos += 2 * nw_lvl
        n_lvl = nnz
        lvl_values = _IDENTITY
        if bits <= PAIR_MAX_BITS:  # non-zero levels were coded two per step
            n_lvl = (nnz + 1) // 2
            pair_scale = pairs.pair_scale_bits(l_scale, n_lvl)
            status, l_freqs = pairs.product_freqs(l_freqs, l_scale, pair_scale)
            if status < 0:
                raise CodecError("level table gives no valid pair model", layer=layer, field="level_table")
            l_scale = pair_scale
            lvl_values = _symbol_pair_values(2 * half)
        for freqs, scale, count, nw, what in (
            (s_freqs, s_scale, nnz, nw_slot, "slot_words"),
            (l_freqs, l_scale, n_lvl, nw_lvl, "level_words"),
        ):
            if not _capacity_ok(count, freqs, scale, nw):
                raise CodecError(f"nnz {nnz} cannot come from {nw} words", layer=layer, field=what)
        slots = np.empty(nnz, dtype=np.uint8)
        _decode_stream(
            body, slot_start, nw_slot, s_freqs, s_scale, _IDENTITY, slots, layer=layer, field="slots"
        )
        sym_buf = np.empty(2 * n_lvl if bits <= PAIR_MAX_BITS else nnz, dtype=np.uint8)
        lvl_out: np.ndarray = sym_buf.view(np.uint16) if bits <= PAIR_MAX_BITS else sym_buf
        _decode_stream(
            body, lvl_start, nw_lvl, l_freqs, l_scale, lvl_values, lvl_out, layer=layer, field="levels"
        )
        syms = sym_buf[:nnz]
        idx = np.empty(nnz, dtype=np.int64)
        used = sparse.positions(slots, body, pos, size, numel, idx)
        if used == sparse.ERR_EXTRA_TRUNCATED:
            raise CodecError("gap extra bits end early", layer=layer, field="positions")
        if used < 0:
            raise CodecError("a position runs past numel", layer=layer, field="positions")
        if pos + used != size:
            raise CodecError(
                f"{size - pos - used} unused bytes after the gap bits", layer=layer, field="body_len"
            )
        out = np.zeros(numel, dtype=np.int8)
        sparse.scatter_levels(idx, syms, half, out)
        return out
    raise CodecError(f"code {code} cannot carry quantized levels", layer=layer, field="code")


# --------------------------------------------------------------------------- top-k positions


def encode_positions(indices: np.ndarray, numel: int, *, layer: str | None = None) -> bytes:
    """Strictly increasing indices -> slot table | varint n_words | slot words | extra bits."""
    idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
    if idx.size == 0:
        return b""
    status, slots, extra = sparse.index_slots(idx, numel)
    if status < 0:
        raise CodecError("indices must be strictly increasing in [0, numel)", layer=layer, field="indices")
    counts = np.bincount(slots, minlength=sparse.N_SLOTS).astype(np.int64)
    model = _build_model(counts)
    words, n_words = _words(slots, 0, model.freqs, model.scale_bits)
    if not _capacity_ok(int(idx.size), model.freqs, model.scale_bits, n_words):  # pragma: no cover
        raise CodecError("position stream violates the capacity rule", layer=layer, field="indices")
    return _table(model) + varint(n_words) + words + extra.tobytes()


def decode_positions(body: np.ndarray, nnz: int, numel: int, *, layer: str | None) -> tuple[np.ndarray, int]:
    """Inverse of ``encode_positions`` over a prefix of ``body``; return (indices, bytes used)."""
    if nnz == 0:
        return np.zeros(0, dtype=np.int64), 0
    size = int(body.size)
    scale, freqs, pos = _read_model(body, 0, size, sparse.N_SLOTS, layer=layer, field="slot_table")
    n_words, pos = read_varint(body, pos, size, layer=layer, field="slot_words")
    if n_words > (size - pos) // 2:
        raise CodecError(f"slot stream claims {n_words} words", layer=layer, field="slot_words")
    if not _capacity_ok(nnz, freqs, scale, n_words):
        raise CodecError(f"nnz {nnz} cannot come from {n_words} words", layer=layer, field="slot_words")
    slots = np.empty(nnz, dtype=np.uint8)
    _decode_stream(body, pos, n_words, freqs, scale, _IDENTITY, slots, layer=layer, field="slots")
    pos += 2 * n_words
    idx = np.empty(nnz, dtype=np.int64)
    used = sparse.positions(slots, body, pos, size, numel, idx)
    if used == sparse.ERR_EXTRA_TRUNCATED:
        raise CodecError("gap extra bits end early", layer=layer, field="positions")
    if used < 0:
        raise CodecError("a position runs past numel", layer=layer, field="positions")
    return idx, pos + int(used)
