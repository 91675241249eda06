"""The wire format: one self-describing, versioned, little-endian payload per step.

This is the CONTAINER: it frames per-layer records (records.py) and validates every length
and count against the bytes really present and against sane upper bounds before allocating.
What a layer's body holds is its code's business: the code table (code_table.py) picks the
cheapest code per layer and decodes a body by looking its code id up. docs/wire-format.md
has the full layout; in short (all little-endian, varint = unsigned LEB128):

    header   magic b"TAIL" | version u8 (=4) | flags u8 | reserved u16 | n_layers u32
    layer    name (name_len u16 | name utf-8; NAMES_SHARED: varint shared | varint name_len
             | the name's utf-8 after the ``shared`` bytes it has in common with the name
             before it) | kind u8 | code u8 | bits u8 | want u8 | varint numel
             | varint bucket_size | varint n_scales | varint nnz | varint body_len
             | scales (f32 | u16)[n_scales] | [dither_seed u32: kinds QUANT_DITHER(_FOLDED) only]
             | body u8[body_len]
    trailer  crc32 u32 of everything before it

The CRC32 trailer (version 3) exists because the framing checks alone cannot see every
corruption: flipping one bit inside a scale or a raw value, or inside a layer name, leaves a
well-formed payload that decodes to wrong numbers (measured: 9 of 300 random single-bit
flips got through version 2). CRC32 detects every burst of up to 32 bits, so a corrupted
payload raises ``CodecError(field="checksum")`` instead of silently poisoning the average.

``want`` (the byte that was reserved, 0, before it) is the rank the sender's low-rank chooser
wants for a QUANT or LOWRANK layer (records.py); 0 on every other kind, checked. A payload
written before it has 0 there and decodes as it did ("wants nothing": quantize).

A dithered layer goes as QUANT_DITHER_FOLDED: its levels are coded negated where their
uniform is >= 1/2 (dither_fold.py; ``wire_form``), and ``decode_payload`` unfolds them
(``unfolded``), so records keep their levels as the quantizer made them. QUANT_DITHER
(levels coded as they are) still decodes.

RAW_F32 / RAW_F16 values pass through bit-exactly (NaN payloads and +-Inf included): the
container never inspects float values. QUANT scales are float32 and pass through the same way.

Flags (version 4): bit 0, SCALES_16, says every scale of the payload is on the 16-bit scale
grid (grid.py: Tail's quantizers round each max-abs up onto it) and goes as u16, bits 30..15 of
its float32; the receiver shifts them back, the same float32 bit for bit. The encoder sets it
whenever every scale qualifies, so Tail's payloads save 2 bytes a bucket and a record with any
other scales (a hand-made one, a foreign quantizer's) still goes exactly, as float32. Version 3
(no flags) still decodes; a flag this build does not know is an error, not a guess.

Flags bit 1, NAMES_SHARED: every layer's name is front-coded against the name of the layer
before it (the first against b""), set where that makes the payload's names smaller. A
module's parameter names share long prefixes: the char LM's 30 names cost 879 bytes a step
in the plain form, 0.8 % of its payload, and 333 front-coded. A build from before refuses
the flag (CodecError(field="flags")), so it never reads such a name as a u16 length.
"""

from __future__ import annotations

import functools
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from tail_ray.compression.code_table import DEFAULT_CODES, CodeTable
from tail_ray.compression.codes import LayerHeader
from tail_ray.compression.dither_fold import fold_levels
from tail_ray.compression.grid import SCALE_SHIFT, on_scale_grid
from tail_ray.compression.records import Kind, LayerRecord, LowRankRecord, QuantRecord
from tail_ray.compression.varint import read_varint, varint
from tail_ray.errors import CodecError

__all__ = [
    "MAGIC",
    "PAYLOAD_OVERHEAD_BYTES",
    "VERSION",
    "EncodedLayer",
    "decode_payload",
    "encode_payload",
    "seal",
]

MAGIC = b"TAIL"
VERSION = 4
READABLE_VERSIONS = (3, 4)  # 3: before flags; its flags byte is 0
SCALES_16 = 0x01  # header flag: every scale goes as u16 (bits 30..15 of its float32)
NAMES_SHARED = 0x02  # header flag: every name goes front-coded against the layer's before it
KNOWN_FLAGS = SCALES_16 | NAMES_SHARED
_HEADER = struct.Struct("<4sBBHI")
_CHECKSUM = struct.Struct("<I")
# Bytes of a payload that belong to no layer: the header and the checksum trailer.
PAYLOAD_OVERHEAD_BYTES = _HEADER.size + _CHECKSUM.size
_LAYER_FIXED = struct.Struct("<BBBB")  # kind, code, bits, want (QUANT / LOWRANK; else 0)
MAX_WANT = 255  # a rank the sender's low-rank chooser wants: one byte
_NAME_LEN = struct.Struct("<H")
_DITHER_SEED = struct.Struct("<I")  # QUANT_DITHER(_FOLDED): the seed of the uniforms the receiver subtracts
QUANT_KINDS = (Kind.QUANT, Kind.QUANT_DITHER, Kind.QUANT_DITHER_FOLDED)  # levels, bits, a scale per bucket

# Sane upper bounds checked before any allocation: a corrupted length must never make the
# decoder allocate gigabytes or loop for minutes. A receiver that knows its model passes a
# tighter ``max_numel`` to ``decode_payload``.
MAX_LAYERS = 1 << 16
MAX_NAME_BYTES = 1024
MAX_NUMEL = 1 << 31
MAX_BUCKET_SIZE = 1 << 24


@dataclass(frozen=True, slots=True)
class EncodedLayer:
    """What one layer cost on the wire: every byte it added to the payload, and the code used."""

    name: str
    encoded_bytes: int
    code: str
    nnz: int = 0


# --------------------------------------------------------------------------- encode


def _scales_of(rec: LayerRecord) -> np.ndarray:
    """The float32 scales a record sends (QUANT; LOWRANK: P's then Q's), checked against its
    buckets."""
    if isinstance(rec, LowRankRecord):
        if not 1 <= rec.bucket_size <= MAX_BUCKET_SIZE:
            raise CodecError(
                f"bucket_size {rec.bucket_size} out of range", layer=rec.name, field="bucket_size"
            )
        return np.concatenate(
            (
                np.asarray(rec.p_scales, dtype="<f4").reshape(-1),
                np.asarray(rec.q_scales, dtype="<f4").reshape(-1),
            )
        )
    if not isinstance(rec, QuantRecord):
        return np.zeros(0, dtype="<f4")
    if rec.slice_seeds is not None:  # each slice has its own uniforms: no one seed decodes it
        raise CodecError(
            "a layer dithered in slices is sent as its slices", layer=rec.name, field="dither_seed"
        )
    if rec.dither_seed is not None and not 0 <= rec.dither_seed <= 0xFFFFFFFF:
        raise CodecError(f"dither_seed {rec.dither_seed} is not a u32", layer=rec.name, field="dither_seed")
    if not 1 <= rec.bucket_size <= MAX_BUCKET_SIZE:
        raise CodecError(f"bucket_size {rec.bucket_size} out of range", layer=rec.name, field="bucket_size")
    sc = np.ascontiguousarray(rec.scales, dtype="<f4").reshape(-1)
    if sc.size != -(-rec.numel // rec.bucket_size):
        raise CodecError(
            f"{sc.size} scales for numel {rec.numel} / bucket {rec.bucket_size}",
            layer=rec.name,
            field="scales",
        )
    return sc


def _scale_bytes(scales: np.ndarray, half: bool) -> bytes:
    """The scales as the wire carries them: float32, or (``half``) the u16 of bits 30..15."""
    if not half:
        return scales.tobytes()
    return (scales.view("<u4") >> np.uint32(SCALE_SHIFT)).astype("<u2").tobytes()


def _shared_prefix(a: bytes, b: bytes) -> int:
    k, end = 0, min(len(a), len(b))
    while k < end and a[k] == b[k]:
        k += 1
    return k


@functools.lru_cache(maxsize=64)
def _name_fields(names: tuple[str, ...]) -> tuple[tuple[bytes, ...], bool]:
    """Every layer's name field, and whether they are front-coded (NAMES_SHARED: only where
    that is smaller over the payload; a one-layer payload never is). Cached: a model sends
    the same names every step (the char LM's 30 took ~40 us to front-code)."""
    raw = [name.encode("utf-8") for name in names]
    for name, b in zip(names, raw, strict=True):
        if len(b) > MAX_NAME_BYTES:
            raise CodecError(f"name is {len(b)} bytes, max {MAX_NAME_BYTES}", layer=name, field="name")
    plain = tuple(_NAME_LEN.pack(len(b)) + b for b in raw)
    shared, before = [], b""
    for b in raw:
        k = _shared_prefix(before, b)
        shared.append(varint(k) + varint(len(b) - k) + b[k:])
        before = b
    if sum(map(len, shared)) < sum(map(len, plain)):
        return tuple(shared), True
    return plain, False


def _layer_chunks(
    rec: LayerRecord, name_field: bytes, scales: np.ndarray, half: bool, codes: CodeTable
) -> tuple[bytes, bytes, bytes, EncodedLayer]:
    """(layer header, scales, body) of one record (its ``name_field``, its checked ``scales``)
    and what they cost."""
    if not 0 <= rec.numel <= MAX_NUMEL:
        raise CodecError(f"numel {rec.numel} outside [0, {MAX_NUMEL}]", layer=rec.name, field="numel")
    kind, coded = wire_form(rec)
    try:
        code, nnz, body = codes.encode(coded)
    except CodecError as exc:
        if exc.layer is not None:
            raise
        raise CodecError(exc.message, layer=rec.name, field=exc.field) from None
    bits, bucket, want = (0, 0, 0)
    if isinstance(rec, QuantRecord | LowRankRecord):
        bits, bucket, want = rec.bits, rec.bucket_size, rec.want
    if not 0 <= want <= MAX_WANT:
        raise CodecError(f"want {want} outside [0, {MAX_WANT}]", layer=rec.name, field="want")
    head = b"".join(
        (
            name_field,
            _LAYER_FIXED.pack(int(kind), int(code), bits, want),
            varint(rec.numel),
            varint(bucket),
            varint(scales.size),
            varint(nnz),
            varint(len(body)),
        )
    )
    sc = _scale_bytes(scales, half)
    if isinstance(rec, QuantRecord) and rec.dither_seed is not None:
        sc += _DITHER_SEED.pack(rec.dither_seed)
    return head, sc, body, EncodedLayer(rec.name, len(head) + len(sc) + len(body), codes.name(code), nnz)


def wire_form(rec: LayerRecord) -> tuple[Kind, LayerRecord]:
    """The kind a record goes as, and the record whose body is coded: a dithered layer's levels
    sign-folded by their uniforms (dither_fold.py: its sign bits, which the receiver could
    guess from u, no longer cost the entropy coder), every other record as it is."""
    if isinstance(rec, QuantRecord) and rec.dither_seed is not None:
        folded = fold_levels(rec.levels, rec.bucket_size, rec.dither_seed)
        return Kind.QUANT_DITHER_FOLDED, replace(rec, levels=folded)
    return rec.kind, rec


def unfolded(rec: QuantRecord) -> QuantRecord:
    """``wire_form``'s fold undone on a decoded QUANT_DITHER_FOLDED layer (the fold is its own
    inverse): the levels as the sender's quantizer made them."""
    assert rec.dither_seed is not None  # the container reads the seed of this kind
    return replace(rec, levels=fold_levels(rec.levels, rec.bucket_size, rec.dither_seed))


def encode_payload(
    records: Sequence[LayerRecord], *, codes: CodeTable = DEFAULT_CODES
) -> tuple[bytes, list[EncodedLayer]]:
    """Frame ``records`` into one payload; also return what each layer cost (every byte it adds).
    ``codes``: the code table to choose from (another backend's, see code_table.py)."""
    if len(records) > MAX_LAYERS:
        raise CodecError(f"{len(records)} layers exceed the bound {MAX_LAYERS}", field="n_layers")
    # Every piece goes into one list, joined once at the end, with the CRC run over the pieces
    # as they come: a payload of megabytes is copied once, not once per framing level.
    # Every record's framing is checked before any time goes into a body.
    scales = [_scales_of(rec) for rec in records]
    # (A payload with no scales leaves the flag off: its bytes are then what version 3 wrote.)
    half = any(sc.size for sc in scales) and all(on_scale_grid(sc) for sc in scales if sc.size)
    name_fields, shared = _name_fields(tuple(rec.name for rec in records))
    flags = (SCALES_16 if half else 0) | (NAMES_SHARED if shared else 0)
    parts = [_HEADER.pack(MAGIC, VERSION, flags, 0, len(records))]
    crc = zlib.crc32(parts[0])
    costs: list[EncodedLayer] = []
    for rec, field, sc in zip(records, name_fields, scales, strict=True):
        *chunks, cost = _layer_chunks(rec, field, sc, half, codes)
        for piece in chunks:
            parts.append(piece)
            crc = zlib.crc32(piece, crc)
        costs.append(cost)
    parts.append(_CHECKSUM.pack(crc))
    return b"".join(parts), costs


def seal(frame: bytes) -> bytes:
    """Append the CRC32 trailer to a framed payload (header + layers)."""
    return frame + _CHECKSUM.pack(zlib.crc32(frame))


# --------------------------------------------------------------------------- decode


def _open(payload: bytes) -> tuple[np.ndarray, int, int]:
    """The checked frame (header, version, flags, checksum) as a uint8 view without its trailer,
    its layer count and its flags."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise CodecError(f"payload must be bytes, got {type(payload).__name__}", field="payload")
    buf = np.frombuffer(payload, dtype=np.uint8)
    size = int(buf.size)
    if size < _HEADER.size:
        raise CodecError(f"payload is {size} bytes, the header alone is {_HEADER.size}", field="header")
    magic, version, flags, _res, n_layers = _HEADER.unpack(buf[: _HEADER.size].tobytes())
    if magic != MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}", field="magic")
    if version not in READABLE_VERSIONS:
        raise CodecError(
            f"unsupported wire version {version}, this build reads {READABLE_VERSIONS}", field="version"
        )
    if flags & ~(KNOWN_FLAGS if version >= 4 else 0):
        raise CodecError(f"unknown flags {flags:#04x} in a version {version} payload", field="flags")
    if size < _HEADER.size + _CHECKSUM.size:
        raise CodecError(f"payload is {size} bytes, too short for its checksum", field="checksum")
    size -= _CHECKSUM.size
    (want_crc,) = _CHECKSUM.unpack(buf[size:].tobytes())
    if zlib.crc32(buf[:size].data) != want_crc:  # over the buffer itself: no copy
        raise CodecError("checksum mismatch: the payload was corrupted in transit", field="checksum")
    if n_layers > MAX_LAYERS:
        raise CodecError(f"n_layers {n_layers} exceeds bound {MAX_LAYERS}", field="n_layers")
    return buf[:size], int(n_layers), int(flags)


def _read_name(buf: np.ndarray, pos: int, where: str, before: bytes | None) -> tuple[str, int]:
    """The layer's name at ``pos`` and the position after it: u16 length + name, or (NAMES_SHARED)
    front-coded against ``before``, the previous layer's name (b"" for the first)."""
    size = int(buf.size)
    prefix = b""
    if before is None:
        if pos + 2 > size:
            raise CodecError("truncated payload before name_len", layer=where, field="name_len")
        name_len = int(buf[pos]) | int(buf[pos + 1]) << 8
        pos += 2
    else:
        shared, pos = read_varint(buf, pos, size, layer=where, field="name_shared")
        if shared > len(before):
            raise CodecError(
                f"name shares {shared} bytes with a previous name of {len(before)}",
                layer=where,
                field="name_shared",
            )
        prefix = before[:shared]
        name_len, pos = read_varint(buf, pos, size, layer=where, field="name_len")
    if len(prefix) + name_len > MAX_NAME_BYTES:
        raise CodecError(
            f"name_len {len(prefix) + name_len} exceeds {MAX_NAME_BYTES}", layer=where, field="name_len"
        )
    if pos + name_len > size:
        raise CodecError("truncated payload inside the name", layer=where, field="name")
    try:
        return (prefix + buf[pos : pos + name_len].tobytes()).decode("utf-8"), pos + name_len
    except UnicodeDecodeError as exc:
        raise CodecError(f"layer name is not utf-8: {exc}", layer=where, field="name") from None


def _check_kind_fields(kind: Kind, bits: int, bucket: int, numel: int, n_scales: int, *, name: str) -> None:
    """What the container itself knows about a kind: only QUANT and LOWRANK have bits, buckets
    and scales (LOWRANK's scale count depends on its rank, in the body: its code checks it)."""
    if kind == Kind.LOWRANK:
        if not 2 <= bits <= 8:
            raise CodecError(f"bits {bits} not in 2..8", layer=name, field="bits")
        if not 1 <= bucket <= MAX_BUCKET_SIZE:
            raise CodecError(f"bucket_size {bucket} out of range", layer=name, field="bucket_size")
        return
    if kind not in QUANT_KINDS:
        if n_scales:
            raise CodecError(f"{kind.name} layer carries {n_scales} scales", layer=name, field="n_scales")
        return
    if not 2 <= bits <= 8:
        raise CodecError(f"bits {bits} not in 2..8", layer=name, field="bits")
    if not 1 <= bucket <= MAX_BUCKET_SIZE:
        raise CodecError(f"bucket_size {bucket} out of range", layer=name, field="bucket_size")
    if n_scales != -(-numel // bucket):
        raise CodecError(f"n_scales {n_scales} != ceil(numel/bucket)", layer=name, field="n_scales")


def _read_scales(buf: np.ndarray, pos: int, n_scales: int, width: int, name: str) -> tuple[np.ndarray, int]:
    """``n_scales`` float32 scales at ``pos``, ``width`` bytes each (4: float32; 2: SCALES_16)."""
    if n_scales > (buf.size - pos) // width:
        raise CodecError(f"n_scales {n_scales} exceeds the bytes present", layer=name, field="n_scales")
    raw = buf[pos : pos + width * n_scales]
    if width == 4:
        return raw.view("<f4").astype(np.float32), pos + width * n_scales
    wide = raw.view("<u2").astype(np.uint32) << np.uint32(SCALE_SHIFT)
    return wide.view(np.float32), pos + width * n_scales


def _read_layer(
    buf: np.ndarray,
    pos: int,
    where: str,
    max_numel: int,
    numel_before: int,
    scale_width: int,
    name_before: bytes | None,
) -> tuple[LayerHeader, int, np.ndarray, int, int]:
    """One layer's header, code id and body (a view), the end position, and its ``want`` byte.
    ``max_numel`` bounds the layer, and the payload with ``numel_before`` (the layers before it);
    ``scale_width``: a scale's bytes, ``name_before``: the previous name where names are
    front-coded, else None (the header's flags)."""
    size = int(buf.size)
    name, pos = _read_name(buf, pos, where, name_before)
    if pos + _LAYER_FIXED.size > size:
        raise CodecError("truncated layer header", layer=name, field="layer_header")
    kind_v, code, bits, want = _LAYER_FIXED.unpack(buf[pos : pos + _LAYER_FIXED.size].tobytes())
    pos += _LAYER_FIXED.size
    numel, pos = read_varint(buf, pos, size, layer=name, field="numel")
    bucket, pos = read_varint(buf, pos, size, layer=name, field="bucket_size")
    n_scales, pos = read_varint(buf, pos, size, layer=name, field="n_scales")
    nnz, pos = read_varint(buf, pos, size, layer=name, field="nnz")
    body_len, pos = read_varint(buf, pos, size, layer=name, field="body_len")
    if numel > min(MAX_NUMEL, max_numel):
        raise CodecError(f"numel {numel} exceeds {min(MAX_NUMEL, max_numel)}", layer=name, field="numel")
    if numel_before + numel > max_numel:
        raise CodecError(f"layers add up to more than {max_numel} elements", layer=name, field="numel")
    try:
        kind = Kind(kind_v)
    except ValueError:
        raise CodecError(f"unknown kind {kind_v}", layer=name, field="kind") from None
    scales, pos = _read_scales(buf, pos, n_scales, scale_width, name)
    dither_seed = None
    if kind in (Kind.QUANT_DITHER, Kind.QUANT_DITHER_FOLDED):
        if pos + _DITHER_SEED.size > size:
            raise CodecError("truncated payload inside the dither seed", layer=name, field="dither_seed")
        (dither_seed,) = _DITHER_SEED.unpack(buf[pos : pos + _DITHER_SEED.size].tobytes())
        pos += _DITHER_SEED.size
    if body_len > size - pos:
        raise CodecError(
            f"body_len {body_len} exceeds the {size - pos} bytes left", layer=name, field="body_len"
        )
    _check_kind_fields(kind, bits, bucket, numel, n_scales, name=name)
    if want and kind not in (*QUANT_KINDS, Kind.LOWRANK):
        raise CodecError(f"{kind.name} layer carries want {want}", layer=name, field="want")
    head = LayerHeader(name, kind, bits, numel, bucket, nnz, scales, dither_seed=dither_seed)
    return head, code, buf[pos : pos + body_len], pos + body_len, want


def decode_payload(
    payload: bytes, *, max_numel: int = MAX_NUMEL, codes: CodeTable = DEFAULT_CODES
) -> list[LayerRecord]:
    """Parse a payload made by ``encode_payload``; raise ``CodecError`` on anything wrong.

    ``max_numel`` bounds every layer and the sum over layers: a receiver that knows its model's
    size passes it, so a corrupted numel can never make it allocate more. ``codes``: the code
    table whose decoders read the bodies (another backend's, see code_table.py).
    """
    buf, n_layers, flags = _open(payload)
    scale_width = 2 if flags & SCALES_16 else 4
    name_before = b"" if flags & NAMES_SHARED else None
    pos = _HEADER.size
    total_numel = 0
    out: list[LayerRecord] = []
    for i in range(n_layers):
        head, code, body, pos, want = _read_layer(
            buf, pos, f"#{i}", max_numel, total_numel, scale_width, name_before
        )
        if name_before is not None:
            name_before = head.name.encode("utf-8")
        total_numel += head.numel
        rec = codes.decoder(code, head.kind, layer=head.name).decode(body, head)
        if head.kind == Kind.QUANT_DITHER_FOLDED and isinstance(rec, QuantRecord):
            rec = unfolded(rec)
        if want and isinstance(rec, QuantRecord | LowRankRecord):
            rec = replace(rec, want=want)
        if rec.numel != head.numel:  # a code's own bug, never the payload's: say so, do not pass it on
            raise CodecError(
                f"code {code} decoded {rec.numel} elements of {head.numel}", layer=head.name, field="code"
            )
        out.append(rec)
    if pos != buf.size:
        raise CodecError(f"{buf.size - pos} trailing bytes after the last layer", field="trailer")
    return out
