"""The wire format: one self-describing, versioned, little-endian payload per step.

This is the CONTAINER: it frames per-layer records and validates every length and count
against the bytes really present and against sane upper bounds before allocating. How a
layer's quantized levels are coded (bit-pack, dense rANS, sparse rANS) is chosen per layer
by ``levelcode.encode_levels``: the smallest real body wins. docs/wire-format.md has the
full layout; in short (all little-endian, varint = unsigned LEB128):

    header   magic b"TAIL" | version u8 (=3) | flags u8 | reserved u16 | n_layers u32
    layer    name_len u16 | name utf-8 | kind u8 | code u8 | bits u8 | varint numel
             | varint bucket_size | varint n_scales | varint nnz | varint body_len
             | scales f32[n_scales] | body u8[body_len]
    trailer  crc32 u32 of everything before it

The CRC32 trailer (version 3) exists because the framing checks alone cannot see every
corruption: flipping one bit inside a scale or a raw value, or inside a layer name, leaves a
well-formed payload that decodes to wrong numbers (measured: 9 of 300 random single-bit
flips got through version 2). CRC32 detects every burst of up to 32 bits, so a corrupted
payload raises ``CodecError(field="checksum")`` instead of silently poisoning the average.

RAW_F32 / RAW_F16 values pass through bit-exactly (NaN payloads and +-Inf included): the
container never inspects float values. QUANT scales are float32 and pass through the same way.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from tail_ray.compression import levelcode
from tail_ray.compression.entropy import entropy_bound_bytes, sparse_entropy_bound_bytes
from tail_ray.compression.levelcode import CODE_NAMES, Code, read_varint, varint
from tail_ray.errors import CodecError

__all__ = [
    "MAGIC",
    "PAYLOAD_OVERHEAD_BYTES",
    "VERSION",
    "Code",
    "EncodedLayer",
    "Kind",
    "LayerRecord",
    "decode_payload",
    "encode_payload",
    "entropy_bound_bytes",
    "seal",
    "sparse_entropy_bound_bytes",
]

MAGIC = b"TAIL"
VERSION = 3
_HEADER = struct.Struct("<4sBBHI")
_CHECKSUM = struct.Struct("<I")
# Bytes of a payload that belong to no layer: the header and the checksum trailer.
PAYLOAD_OVERHEAD_BYTES = _HEADER.size + _CHECKSUM.size
_LAYER_FIXED = struct.Struct("<BBBB")  # kind, code, bits, reserved

# Sane upper bounds checked before any allocation: a corrupted length must never make the
# decoder allocate gigabytes or loop for minutes. A receiver that knows its model passes a
# tighter ``max_numel`` to ``decode_payload``.
MAX_LAYERS = 1 << 16
MAX_NAME_BYTES = 1024
MAX_NUMEL = 1 << 31
MAX_BUCKET_SIZE = 1 << 24


class Kind(IntEnum):
    RAW_F32 = 0  # values: float32[numel]
    RAW_F16 = 1  # values: float16[numel] (decoded to float32)
    QUANT = 2  # levels: int8[numel] in [-L, L], scales: float32[ceil(numel / bucket_size)]
    SPARSE_F32 = 3  # indices: int64[nnz] strictly increasing, values: float32[nnz]


@dataclass
class LayerRecord:
    """One layer as it travels. Exactly the arrays its ``kind`` needs are set."""

    name: str
    numel: int
    kind: Kind
    bits: int = 0
    bucket_size: int = 0
    scales: np.ndarray | None = None
    levels: np.ndarray | None = None
    values: np.ndarray | None = None
    indices: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class EncodedLayer:
    """What one layer cost on the wire: every byte it added to the payload, and the code used."""

    name: str
    encoded_bytes: int
    code: str
    nnz: int = field(default=0)


def _need(arr: np.ndarray | None, rec: LayerRecord, what: str) -> np.ndarray:
    if arr is None:
        raise CodecError(f"{rec.kind.name} record needs {what}", layer=rec.name, field=what)
    return arr


def _body_for(rec: LayerRecord) -> tuple[Code, int, bytes]:
    """Return (code, nnz, body) for one record."""
    if rec.kind == Kind.RAW_F32:
        vals = np.ascontiguousarray(_need(rec.values, rec, "values"), dtype="<f4").reshape(-1)
        if vals.size != rec.numel:
            raise CodecError(f"{vals.size} values for numel {rec.numel}", layer=rec.name, field="values")
        return Code.RAW, 0, vals.tobytes()
    if rec.kind == Kind.RAW_F16:
        vals = np.ascontiguousarray(_need(rec.values, rec, "values"), dtype="<f2").reshape(-1)
        if vals.size != rec.numel:
            raise CodecError(f"{vals.size} values for numel {rec.numel}", layer=rec.name, field="values")
        return Code.RAW, 0, vals.tobytes()
    if rec.kind == Kind.QUANT:
        levels = _need(rec.levels, rec, "levels").reshape(-1)
        if levels.size != rec.numel:
            raise CodecError(f"{levels.size} levels for numel {rec.numel}", layer=rec.name, field="levels")
        try:
            return levelcode.encode_levels(levels, rec.bits)
        except CodecError as exc:
            raise CodecError(exc.message, layer=rec.name, field=exc.field) from None
    if rec.kind == Kind.SPARSE_F32:
        idx = _need(rec.indices, rec, "indices").reshape(-1)
        val = np.ascontiguousarray(_need(rec.values, rec, "values"), dtype="<f4").reshape(-1)
        if idx.size != val.size:
            raise CodecError(f"{idx.size} indices but {val.size} values", layer=rec.name, field="values")
        pos = levelcode.encode_positions(idx, rec.numel, layer=rec.name)
        return Code.SPARSE_POS, int(idx.size), pos + val.tobytes()
    raise CodecError(f"unknown kind {rec.kind!r}", layer=rec.name, field="kind")


def encode_payload(records: list[LayerRecord]) -> tuple[bytes, list[EncodedLayer]]:
    """Frame ``records`` into one payload; also return what each layer cost (every byte it adds)."""
    if len(records) > MAX_LAYERS:
        raise CodecError(f"{len(records)} layers exceed the bound {MAX_LAYERS}", field="n_layers")
    # Every piece goes into one list, joined once at the end, with the CRC run over the pieces
    # as they come: a payload of megabytes is copied once, not once per framing level.
    parts = [_HEADER.pack(MAGIC, VERSION, 0, 0, len(records))]
    crc = zlib.crc32(parts[0])
    costs: list[EncodedLayer] = []
    for rec in records:
        name = rec.name.encode("utf-8")
        if len(name) > MAX_NAME_BYTES:
            raise CodecError(f"name is {len(name)} bytes, max {MAX_NAME_BYTES}", layer=rec.name, field="name")
        if not 0 <= rec.numel <= MAX_NUMEL:
            raise CodecError(f"numel {rec.numel} outside [0, {MAX_NUMEL}]", layer=rec.name, field="numel")
        if not 0 <= rec.bits <= 255 or not 0 <= rec.bucket_size <= MAX_BUCKET_SIZE:
            raise CodecError(
                f"bits {rec.bits} / bucket_size {rec.bucket_size} out of range", layer=rec.name, field="bits"
            )
        scales = b""
        n_scales = 0
        if rec.kind == Kind.QUANT:  # check the framing before spending time on the levels
            if not 1 <= rec.bucket_size <= MAX_BUCKET_SIZE:
                raise CodecError(
                    f"bucket_size {rec.bucket_size} out of range", layer=rec.name, field="bucket_size"
                )
            sc = np.ascontiguousarray(_need(rec.scales, rec, "scales"), dtype="<f4").reshape(-1)
            if sc.size != -(-rec.numel // rec.bucket_size):
                raise CodecError(
                    f"{sc.size} scales for numel {rec.numel} / bucket {rec.bucket_size}",
                    layer=rec.name,
                    field="scales",
                )
            scales, n_scales = sc.tobytes(), int(sc.size)
        code, nnz, body = _body_for(rec)
        head = b"".join(
            (
                struct.pack("<H", len(name)),
                name,
                _LAYER_FIXED.pack(int(rec.kind), int(code), rec.bits, 0),
                varint(rec.numel),
                varint(rec.bucket_size),
                varint(n_scales),
                varint(nnz),
                varint(len(body)),
            )
        )
        for piece in (head, scales, body):
            parts.append(piece)
            crc = zlib.crc32(piece, crc)
        costs.append(EncodedLayer(rec.name, len(head) + len(scales) + len(body), CODE_NAMES[code], nnz))
    parts.append(_CHECKSUM.pack(crc))
    return b"".join(parts), costs


def seal(frame: bytes) -> bytes:
    """Append the CRC32 trailer to a framed payload (header + layers)."""
    return frame + _CHECKSUM.pack(zlib.crc32(frame))


def _check_float_body(code: int, body_len: int, want: int, *, layer: str, what: str) -> None:
    if code != Code.RAW:
        raise CodecError(f"{what} layer needs the raw code, got {code}", layer=layer, field="code")
    if body_len != want:
        raise CodecError(f"body_len {body_len} != {want}", layer=layer, field="body_len")


def decode_payload(payload: bytes, *, max_numel: int = MAX_NUMEL) -> list[LayerRecord]:
    """Parse a payload made by ``encode_payload``; raise ``CodecError`` on anything wrong.

    ``max_numel`` bounds every layer (and the sum over layers): a receiver that knows its
    model's size passes it, so a corrupted numel can never make it allocate more.
    """
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise CodecError(f"payload must be bytes, got {type(payload).__name__}", field="payload")
    buf = np.frombuffer(payload, dtype=np.uint8)
    size = int(buf.size)
    if size < _HEADER.size:
        raise CodecError(f"payload is {size} bytes, the header alone is {_HEADER.size}", field="header")
    magic, version, _flags, _res, n_layers = _HEADER.unpack(buf[: _HEADER.size].tobytes())
    if magic != MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}", field="magic")
    if version != VERSION:
        raise CodecError(f"unsupported wire version {version}, this build reads {VERSION}", field="version")
    if size < _HEADER.size + _CHECKSUM.size:
        raise CodecError(f"payload is {size} bytes, too short for its checksum", field="checksum")
    size -= _CHECKSUM.size
    (want_crc,) = _CHECKSUM.unpack(buf[size:].tobytes())
    if zlib.crc32(buf[:size].data) != want_crc:  # over the buffer itself: no copy
        raise CodecError("checksum mismatch: the payload was corrupted in transit", field="checksum")
    buf = buf[:size]
    if n_layers > MAX_LAYERS:
        raise CodecError(f"n_layers {n_layers} exceeds bound {MAX_LAYERS}", field="n_layers")
    pos = _HEADER.size
    total_numel = 0
    out: list[LayerRecord] = []
    for i in range(n_layers):
        where = f"#{i}"
        if pos + 2 > size:
            raise CodecError("truncated payload before name_len", layer=where, field="name_len")
        name_len = int(buf[pos]) | int(buf[pos + 1]) << 8
        pos += 2
        if name_len > MAX_NAME_BYTES:
            raise CodecError(f"name_len {name_len} exceeds {MAX_NAME_BYTES}", layer=where, field="name_len")
        if pos + name_len > size:
            raise CodecError("truncated payload inside the name", layer=where, field="name")
        try:
            name = buf[pos : pos + name_len].tobytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CodecError(f"layer name is not utf-8: {exc}", layer=where, field="name") from None
        pos += name_len
        if pos + _LAYER_FIXED.size > size:
            raise CodecError("truncated layer header", layer=name, field="layer_header")
        kind_v, code_v, bits, _r = _LAYER_FIXED.unpack(buf[pos : pos + _LAYER_FIXED.size].tobytes())
        pos += _LAYER_FIXED.size
        numel, pos = read_varint(buf, pos, size, layer=name, field="numel")
        bucket, pos = read_varint(buf, pos, size, layer=name, field="bucket_size")
        n_scales, pos = read_varint(buf, pos, size, layer=name, field="n_scales")
        nnz, pos = read_varint(buf, pos, size, layer=name, field="nnz")
        body_len, pos = read_varint(buf, pos, size, layer=name, field="body_len")
        if numel > min(MAX_NUMEL, max_numel):
            raise CodecError(f"numel {numel} exceeds {min(MAX_NUMEL, max_numel)}", layer=name, field="numel")
        total_numel += numel
        if total_numel > max_numel:
            raise CodecError(f"layers add up to more than {max_numel} elements", layer=name, field="numel")
        try:
            kind = Kind(kind_v)
        except ValueError:
            raise CodecError(f"unknown kind {kind_v}", layer=name, field="kind") from None
        if n_scales > (size - pos) // 4:
            raise CodecError(f"n_scales {n_scales} exceeds the bytes present", layer=name, field="n_scales")
        scales_at = pos
        pos += 4 * n_scales
        if body_len > size - pos:
            raise CodecError(
                f"body_len {body_len} exceeds the {size - pos} bytes left", layer=name, field="body_len"
            )
        body = buf[pos : pos + body_len]
        pos += body_len
        rec = LayerRecord(name=name, numel=numel, kind=kind, bits=bits, bucket_size=bucket)
        if kind != Kind.QUANT and n_scales:
            raise CodecError(f"{kind.name} layer carries {n_scales} scales", layer=name, field="n_scales")
        if kind == Kind.RAW_F32:
            _check_float_body(code_v, body_len, 4 * numel, layer=name, what="RAW_F32")
            rec.values = body.view("<f4").astype(np.float32)
        elif kind == Kind.RAW_F16:
            _check_float_body(code_v, body_len, 2 * numel, layer=name, what="RAW_F16")
            rec.values = body.view("<f2").astype(np.float32)
        elif kind == Kind.QUANT:
            if not 2 <= bits <= 8:
                raise CodecError(f"bits {bits} not in 2..8", layer=name, field="bits")
            if not 1 <= bucket <= MAX_BUCKET_SIZE:
                raise CodecError(f"bucket_size {bucket} out of range", layer=name, field="bucket_size")
            if n_scales != -(-numel // bucket):
                raise CodecError(f"n_scales {n_scales} != ceil(numel/bucket)", layer=name, field="n_scales")
            rec.scales = buf[scales_at : scales_at + 4 * n_scales].view("<f4").astype(np.float32)
            rec.levels = levelcode.decode_levels(code_v, body, numel, bits, nnz, layer=name)
        else:  # SPARSE_F32
            if code_v != Code.SPARSE_POS:
                raise CodecError(
                    f"SPARSE_F32 layer needs the sparse-pos code, got {code_v}", layer=name, field="code"
                )
            if nnz > numel or 4 * nnz > body_len:
                raise CodecError(f"nnz {nnz} inconsistent with numel / body_len", layer=name, field="nnz")
            pos_len = body_len - 4 * nnz
            idx, used = levelcode.decode_positions(body[:pos_len], nnz, numel, layer=name)
            if used != pos_len:
                raise CodecError(f"{pos_len - used} unused position bytes", layer=name, field="body_len")
            rec.indices = idx
            rec.values = body[pos_len:].view("<f4").astype(np.float32)
        out.append(rec)
    if pos != size:
        raise CodecError(f"{size - pos} trailing bytes after the last layer", field="trailer")
    return out
