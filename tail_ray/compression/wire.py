"""The wire format: one self-describing, versioned, little-endian payload per step.

This is the CONTAINER: it frames per-layer records and validates every length and count
against the bytes really present and against sane upper bounds before allocating. How a
layer's quantized levels are coded (dense bit-packing, sparse positions, entropy coding) is
chosen per layer inside ``encode_payload``.

Layout (all little-endian):
    header   magic b"TAIL" | version u8 | flags u8 | reserved u16 | n_layers u32
    layer    name_len u16 | name utf-8 | kind u8 | code u8 | bits u8 | reserved u8
             | numel u64 | bucket_size u32 | n_scales u32 | nnz u64 | body_len u32
             | scales f32[n_scales] | body u8[body_len]
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from tail_ray.errors import CodecError

MAGIC = b"TAIL"
VERSION = 1
_HEADER = struct.Struct("<4sBBHI")
_LAYER_FIXED = struct.Struct("<BBBBQIIQI")

# Sane upper bounds checked before any allocation: a corrupted length must never make the
# decoder allocate gigabytes or loop for minutes.
MAX_LAYERS = 1 << 16
MAX_NAME_BYTES = 1024
MAX_NUMEL = 1 << 31
MAX_BUCKET_SIZE = 1 << 24


class Kind(IntEnum):
    RAW_F32 = 0  # values: float32[numel]
    RAW_F16 = 1  # values: float16[numel] (decoded to float32)
    QUANT = 2  # levels: int8[numel] in [-L, L], scales: float32[ceil(numel / bucket_size)]
    SPARSE_F32 = 3  # indices: int64[nnz] strictly increasing, values: float32[nnz]


class Code(IntEnum):
    RAW = 0  # the values' own bytes
    INT8 = 1  # levels as one byte each


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


def _body_for(rec: LayerRecord) -> tuple[Code, int, bytes]:
    """Return (code, nnz, body) for one record."""
    if rec.kind == Kind.RAW_F32:
        assert rec.values is not None
        return Code.RAW, 0, np.ascontiguousarray(rec.values, dtype="<f4").tobytes()
    if rec.kind == Kind.RAW_F16:
        assert rec.values is not None
        return Code.RAW, 0, np.ascontiguousarray(rec.values, dtype="<f2").tobytes()
    if rec.kind == Kind.QUANT:
        assert rec.levels is not None
        levels = np.ascontiguousarray(rec.levels, dtype=np.int8)
        return Code.INT8, int(np.count_nonzero(levels)), levels.tobytes()
    if rec.kind == Kind.SPARSE_F32:
        assert rec.indices is not None and rec.values is not None
        idx = np.ascontiguousarray(rec.indices, dtype="<i8")
        val = np.ascontiguousarray(rec.values, dtype="<f4")
        return Code.RAW, len(idx), idx.tobytes() + val.tobytes()
    raise CodecError(f"unknown kind {rec.kind!r}", layer=rec.name, field="kind")


def encode_payload(records: list[LayerRecord]) -> tuple[bytes, list[EncodedLayer]]:
    """Frame ``records`` into one payload; also return what each layer cost."""
    parts = [_HEADER.pack(MAGIC, VERSION, 0, 0, len(records))]
    costs: list[EncodedLayer] = []
    for rec in records:
        name = rec.name.encode("utf-8")
        code, nnz, body = _body_for(rec)
        scales = b"" if rec.scales is None else np.ascontiguousarray(rec.scales, dtype="<f4").tobytes()
        n_scales = 0 if rec.scales is None else len(rec.scales)
        fixed = _LAYER_FIXED.pack(
            int(rec.kind), int(code), rec.bits, 0, rec.numel, rec.bucket_size, n_scales, nnz, len(body)
        )
        chunk = struct.pack("<H", len(name)) + name + fixed + scales + body
        parts.append(chunk)
        costs.append(EncodedLayer(rec.name, len(chunk), code.name.lower(), nnz))
    return b"".join(parts), costs


class _Reader:
    def __init__(self, buf: bytes) -> None:
        self.buf = memoryview(buf)
        self.pos = 0

    def take(self, n: int, *, layer: str | None, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise CodecError(
                f"truncated payload: need {n} bytes at offset {self.pos}, {len(self.buf) - self.pos} left",
                layer=layer,
                field=what,
            )
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out


def decode_payload(payload: bytes) -> list[LayerRecord]:
    """Parse a payload made by ``encode_payload``; raise ``CodecError`` on anything wrong."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise CodecError(f"payload must be bytes, got {type(payload).__name__}", field="payload")
    r = _Reader(bytes(payload))
    magic, version, _flags, _res, n_layers = _HEADER.unpack(r.take(_HEADER.size, layer=None, what="header"))
    if magic != MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}", field="magic")
    if version != VERSION:
        raise CodecError(f"unsupported wire version {version}, this build reads {VERSION}", field="version")
    if n_layers > MAX_LAYERS:
        raise CodecError(f"n_layers {n_layers} exceeds bound {MAX_LAYERS}", field="n_layers")
    out: list[LayerRecord] = []
    for i in range(n_layers):
        where = f"#{i}"
        (name_len,) = struct.unpack("<H", r.take(2, layer=where, what="name_len"))
        if name_len > MAX_NAME_BYTES:
            raise CodecError(f"name_len {name_len} exceeds {MAX_NAME_BYTES}", layer=where, field="name_len")
        try:
            name = bytes(r.take(name_len, layer=where, what="name")).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CodecError(f"layer name is not utf-8: {exc}", layer=where, field="name") from None
        kind_v, code_v, bits, _r, numel, bucket, n_scales, nnz, body_len = _LAYER_FIXED.unpack(
            r.take(_LAYER_FIXED.size, layer=name, what="layer_header")
        )
        if numel > MAX_NUMEL:
            raise CodecError(f"numel {numel} exceeds {MAX_NUMEL}", layer=name, field="numel")
        try:
            kind = Kind(kind_v)
        except ValueError:
            raise CodecError(f"unknown kind {kind_v}", layer=name, field="kind") from None
        scales_b = r.take(4 * n_scales, layer=name, what="scales")
        body = r.take(body_len, layer=name, what="body")
        rec = LayerRecord(name=name, numel=numel, kind=kind, bits=bits, bucket_size=bucket)
        if kind == Kind.RAW_F32:
            if body_len != 4 * numel:
                raise CodecError(f"body_len {body_len} != 4*numel", layer=name, field="body_len")
            rec.values = np.frombuffer(body, dtype="<f4").astype(np.float32)
        elif kind == Kind.RAW_F16:
            if body_len != 2 * numel:
                raise CodecError(f"body_len {body_len} != 2*numel", layer=name, field="body_len")
            rec.values = np.frombuffer(body, dtype="<f2").astype(np.float32)
        elif kind == Kind.QUANT:
            if not 1 <= bits <= 8:
                raise CodecError(f"bits {bits} not in 1..8", layer=name, field="bits")
            if not 1 <= bucket <= MAX_BUCKET_SIZE:
                raise CodecError(f"bucket_size {bucket} out of range", layer=name, field="bucket_size")
            if n_scales != -(-numel // bucket):
                raise CodecError(f"n_scales {n_scales} != ceil(numel/bucket)", layer=name, field="n_scales")
            if code_v != Code.INT8 or body_len != numel:
                raise CodecError(f"bad code {code_v} / body_len {body_len}", layer=name, field="body_len")
            rec.scales = np.frombuffer(scales_b, dtype="<f4").astype(np.float32)
            rec.levels = np.frombuffer(body, dtype=np.int8).copy()
            limit = (1 << (bits - 1)) - 1 if bits > 1 else 1
            if rec.levels.size and int(np.abs(rec.levels.astype(np.int16)).max()) > limit:
                raise CodecError(f"level outside [-{limit}, {limit}]", layer=name, field="levels")
        else:  # SPARSE_F32
            if nnz > numel or body_len != 12 * nnz:
                raise CodecError(f"nnz {nnz} / body_len {body_len} inconsistent", layer=name, field="nnz")
            idx = np.frombuffer(body[: 8 * nnz], dtype="<i8").astype(np.int64)
            if nnz and (idx[0] < 0 or idx[-1] >= numel or np.any(np.diff(idx) <= 0)):
                raise CodecError("indices not strictly increasing in [0, numel)", layer=name, field="indices")
            rec.indices = idx
            rec.values = np.frombuffer(body[8 * nnz :], dtype="<f4").astype(np.float32)
        out.append(rec)
    if r.pos != len(r.buf):
        raise CodecError(f"{len(r.buf) - r.pos} trailing bytes after the last layer", field="trailer")
    return out
