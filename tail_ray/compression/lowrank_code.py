"""The LOWRANK layer code: a low-rank record's two factors, each in the cheapest level code.

Body (docs/wire-format.md; the container's header carries bits and bucket size of both
factors, numel = rows x cols, and the scales: P's, then Q's):

    varint rows | varint rank
    | u8 p_code | varint p_nnz | varint p_len | P's level body u8[p_len]
    | u8 q_code | varint q_nnz | Q's level body (the rest)

P^T's levels (rank x rows) and Q^T's (rank x cols) are each coded as a quantized layer would
be (bit-packed, rANS, rANS pairs or sparse rANS: ``code_table.encode_levels``), so an 8-bit
factor is entropy-coded where that pays. Decoding checks, before allocating: rows divides
numel, 1 <= rank <= ``lowrank.max_rank(rows, cols)`` (so the factors hold fewer numbers than
the layer, which ``max_numel`` bounds), the scale count, each factor's code and length.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from tail_ray.compression.codes import Code, LayerCode, LayerHeader
from tail_ray.compression.lowrank import max_rank
from tail_ray.compression.quantize import n_buckets
from tail_ray.compression.records import Kind, LayerRecord, LowRankRecord
from tail_ray.compression.varint import read_varint, varint
from tail_ray.errors import CodecError


class LowRankCode(LayerCode[LowRankRecord]):
    """See the module docstring."""

    code = Code.LOWRANK
    name = "lowrank"
    kinds: ClassVar[frozenset[Kind]] = frozenset({Kind.LOWRANK})

    def estimate(self, layer: LowRankRecord) -> float:
        return float(layer.p_levels.size + layer.q_levels.size)

    def encode(self, layer: LowRankRecord) -> tuple[int, bytes]:
        from tail_ray.compression.code_table import encode_levels  # the table holds this code

        rows, cols, rank = layer.rows, layer.cols, layer.rank
        if not 1 <= rank <= max_rank(rows, cols):
            raise CodecError(f"rank {rank} outside 1..{max_rank(rows, cols)}", layer=layer.name, field="rank")
        for what, levels, scales, n in (
            ("p", layer.p_levels, layer.p_scales, rank * rows),
            ("q", layer.q_levels, layer.q_scales, rank * cols),
        ):
            if levels.size != n or scales.size != n_buckets(n, layer.bucket_size):
                raise CodecError(
                    f"factor {what} has {levels.size} levels / {scales.size} scales for rank {rank}",
                    layer=layer.name,
                    field=f"{what}_levels",
                )
        p_code, p_nnz, p_body = encode_levels(layer.p_levels, layer.bits)
        q_code, q_nnz, q_body = encode_levels(layer.q_levels, layer.bits)
        body = b"".join(
            (
                varint(rows),
                varint(rank),
                bytes((int(p_code),)),
                varint(p_nnz),
                varint(len(p_body)),
                p_body,
                bytes((int(q_code),)),
                varint(q_nnz),
                q_body,
            )
        )
        return p_nnz + q_nnz, body

    def decode(self, body: np.ndarray, head: LayerHeader) -> LayerRecord:
        from tail_ray.compression.code_table import decode_levels

        name, size = head.name, int(body.size)
        rows, pos = read_varint(body, 0, size, layer=name, field="rows")
        rank, pos = read_varint(body, pos, size, layer=name, field="rank")
        if rows < 1 or head.numel % rows:
            raise CodecError(f"rows {rows} does not divide numel {head.numel}", layer=name, field="rows")
        cols = head.numel // rows
        if not 1 <= rank <= max_rank(rows, cols):
            raise CodecError(f"rank {rank} outside 1..{max_rank(rows, cols)}", layer=name, field="rank")
        n_p, n_q = rank * rows, rank * cols
        sp, sq = n_buckets(n_p, head.bucket_size), n_buckets(n_q, head.bucket_size)
        if head.scales.size != sp + sq:
            raise CodecError(
                f"{head.scales.size} scales, factors of rank {rank} need {sp + sq}",
                layer=name,
                field="n_scales",
            )
        if pos >= size:
            raise CodecError("truncated before P's code", layer=name, field="p_code")
        p_code = int(body[pos])
        p_nnz, pos = read_varint(body, pos + 1, size, layer=name, field="p_nnz")
        p_len, pos = read_varint(body, pos, size, layer=name, field="p_len")
        if p_len > size - pos:
            raise CodecError(f"p_len {p_len} exceeds the {size - pos} bytes left", layer=name, field="p_len")
        p_levels = decode_levels(p_code, body[pos : pos + p_len], n_p, head.bits, p_nnz, layer=name)
        pos += p_len
        if pos >= size:
            raise CodecError("truncated before Q's code", layer=name, field="q_code")
        q_code = int(body[pos])
        q_nnz, pos = read_varint(body, pos + 1, size, layer=name, field="q_nnz")
        q_levels = decode_levels(q_code, body[pos:], n_q, head.bits, q_nnz, layer=name)
        return LowRankRecord(
            name,
            rows,
            cols,
            rank,
            head.bits,
            head.bucket_size,
            head.scales[:sp],
            p_levels,
            head.scales[sp:],
            q_levels,
        )
