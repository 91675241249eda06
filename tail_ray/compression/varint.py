"""Unsigned LEB128 varints, the integer fields of the wire's layer headers and bodies."""

from __future__ import annotations

import numpy as np

from tail_ray.errors import CodecError

MAX_VARINT_BYTES = 9  # < 2**63


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
    """Unsigned LEB128 at ``buf[pos:end]`` (at most 9 bytes, < 2**63); return (value, end pos)."""
    v = 0
    for k in range(MAX_VARINT_BYTES):
        if pos >= end:
            raise CodecError("truncated varint", layer=layer, field=field)
        b = int(buf[pos])
        pos += 1
        v |= (b & 0x7F) << (7 * k)
        if not b & 0x80:
            return v, pos
    raise CodecError(f"varint longer than {MAX_VARINT_BYTES} bytes", layer=layer, field=field)
