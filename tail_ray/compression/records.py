"""What one layer is on the wire: a tagged union of records, one class per kind.

A compressor builds records, the wire encodes them (wire.py) and decodes them back:

    QuantRecord    integer levels in [-L, L] at ``bits`` and one float32 scale per bucket
                   (and, when dithered, the seed of the uniforms the receiver subtracts)
    RawRecord      the values themselves, float32 (or float16 on the wire: ``fp16``)
    SparseRecord   sorted unique positions in [0, numel) and their float32 values (top-k)
    LowRankRecord  a (rows x cols) layer as two quantized factors P (rows x rank) and
                   Q (cols x rank); the layer is P Q^T (lowrank.py reconstructs it)

QuantRecord and LowRankRecord also carry ``want``: the rank the sender's low-rank chooser
wants for the layer (0: quantize, or no chooser; the layer header's byte after ``bits``,
docs/wire-format.md). Tail with ``lowrank="auto"`` makes every rank's next choice from all
ranks' wants (bitwidth/lowrank_agree.py); nothing else reads it.

Each class carries exactly the arrays its kind needs, so code that holds one never checks
for a missing array: ``match`` on the class (or ``isinstance``) and read the fields. ``kind``
is the wire's tag (``Kind``), ``numel`` the layer's element count.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import IntEnum
from typing import ClassVar

import numpy as np


class Kind(IntEnum):
    """The wire's record kinds (the layer header's ``kind`` byte)."""

    RAW_F32 = 0  # values: float32[numel]
    RAW_F16 = 1  # values: float16[numel] (decoded to float32)
    QUANT = 2  # levels: int8[numel] in [-L, L], scales: float32[ceil(numel / bucket_size)]
    SPARSE_F32 = 3  # indices: int64[nnz] strictly increasing, values: float32[nnz]
    LOWRANK = 4  # two quantized factors P, Q: the layer is P Q^T (rows x cols, row-major)
    QUANT_DITHER = 5  # QUANT made by subtractive dither, plus the u32 seed of its uniforms
    # QUANT_DITHER whose levels are coded sign-folded by their uniforms (dither_fold.py): what
    # the wire sends for a dithered layer; a decoded record is QUANT_DITHER again.
    QUANT_DITHER_FOLDED = 6


@dataclass(frozen=True, slots=True, eq=False)
class QuantRecord:
    """A quantized layer: ``levels`` (int8, flat) in [-L, L] at ``bits`` (2..8), and one scale
    per ``bucket_size`` consecutive levels (the bucket's max |x|).

    ``dither_seed`` (a u32) when the levels were made by subtractive dither (rounding "dither"):
    the decoded value then subtracts the sender's uniforms, drawn from that seed
    (``quantize.dequantize``). None: the plain grid value. Every decoder of a QuantRecord must
    pass it on; the wire sends such a layer as kind QUANT_DITHER.

    ``slice_seeds`` (sender side only, never on the wire): a layer dithered in slices for a
    sharded exchange, each slice from its own seed and keyed from its own first bucket, as
    ((start, seed), ...) in element order. Only its slices (``slice_record`` at those
    starts) decode; the whole record does not, and the wire refuses it."""

    name: str
    bits: int
    bucket_size: int
    scales: np.ndarray
    levels: np.ndarray
    want: int = 0  # the rank the sender's low-rank chooser wants for the layer
    dither_seed: int | None = None
    slice_seeds: tuple[tuple[int, int], ...] | None = None

    @property
    def kind(self) -> Kind:
        return Kind.QUANT if self.dither_seed is None else Kind.QUANT_DITHER

    @property
    def numel(self) -> int:
        return int(self.levels.size)


@dataclass(frozen=True, slots=True, eq=False)
class RawRecord:
    """A layer sent as its values: float32, or float16 on the wire when ``fp16`` (decoded back
    to float32)."""

    name: str
    values: np.ndarray
    fp16: bool = False

    @property
    def kind(self) -> Kind:
        return Kind.RAW_F16 if self.fp16 else Kind.RAW_F32

    @property
    def numel(self) -> int:
        return int(self.values.size)


@dataclass(frozen=True, slots=True, eq=False)
class SparseRecord:
    """A layer of ``numel`` elements of which only ``indices`` (int64, strictly increasing)
    are sent, with their float32 ``values``; every other element is zero."""

    kind: ClassVar[Kind] = Kind.SPARSE_F32
    name: str
    numel: int
    indices: np.ndarray
    values: np.ndarray


@dataclass(frozen=True, slots=True, eq=False)
class LowRankRecord:
    """A matrix-shaped layer (``rows`` x ``cols``, flattened row-major: conv weights as
    (out, in * kh * kw)) sent as P Q^T: P is ``rows`` x ``rank``, Q is ``cols`` x ``rank``.
    Both factors are quantized on Tail's grid at ``bits`` with one scale per ``bucket_size``
    levels; each is stored factor-column by factor-column (``p_levels[c * rows + i]`` is
    P[i, c]), so a column of P or Q is contiguous."""

    kind: ClassVar[Kind] = Kind.LOWRANK
    name: str
    rows: int
    cols: int
    rank: int
    bits: int
    bucket_size: int
    p_scales: np.ndarray
    p_levels: np.ndarray
    q_scales: np.ndarray
    q_levels: np.ndarray
    want: int = 0  # the rank the sender's chooser wants next

    @property
    def numel(self) -> int:
        return self.rows * self.cols


LayerRecord = QuantRecord | RawRecord | SparseRecord | LowRankRecord


def decodable_seed(rec: QuantRecord) -> int | None:
    """The dither seed a decoder of ``rec`` subtracts the uniforms of (None: not dithered).
    A layer dithered in slices (``slice_seeds``) has no one seed: a ValueError, not a decode
    that is right for its first slice only."""
    if rec.slice_seeds is not None:
        raise ValueError(f"layer {rec.name!r} is dithered in slices: decode its slices (slice_record)")
    # 32 bits, as every decoder reads it (``dequantize`` masks too; the wire carries no more).
    return None if rec.dither_seed is None else rec.dither_seed & 0xFFFFFFFF


def _dithered_slice(rec: QuantRecord, start: int, stop: int) -> QuantRecord:
    """Elements [start, stop) of a layer dithered in slices (``slice_seeds``): exactly one of
    its slices, as a whole dithered record of its own seed. A layer dithered whole has no
    element slices: its uniforms are keyed by bucket from the layer's start."""
    cuts = dict(rec.slice_seeds or ())
    starts = sorted(cuts)
    if start not in cuts:
        raise ValueError(
            f"layer {rec.name!r} is dithered {'whole' if not cuts else f'in slices at {starts}'}:"
            f" no slice starts at {start}"
        )
    i = starts.index(start)
    end = starts[i + 1] if i + 1 < len(starts) else rec.numel
    if stop != end:
        raise ValueError(f"layer {rec.name!r} is dithered in slices: [{start}, {end}), not [{start}, {stop})")
    first = start // rec.bucket_size
    n_buckets = -(-(stop - start) // rec.bucket_size)
    return replace(
        rec,
        levels=rec.levels.reshape(-1)[start:stop],
        scales=rec.scales[first : first + n_buckets],
        dither_seed=cuts[start],
        slice_seeds=None,
    )


def slice_record(rec: LayerRecord, start: int, stop: int) -> LayerRecord:
    """Elements [start, stop) of a record, as a record of the same kind under the same name
    (views, no copies): what a sharded collective sends one slice's owner. A quantized record
    is cut between its buckets, so ``start`` must be a multiple of its bucket size; levels and
    scales are then exactly what the whole record holds there."""
    if not 0 <= start <= stop <= rec.numel:
        raise ValueError(f"slice [{start}, {stop}) outside layer {rec.name!r} of {rec.numel} elements")
    if start == 0 and stop == rec.numel and not (isinstance(rec, QuantRecord) and rec.slice_seeds):
        return rec
    match rec:
        case QuantRecord():
            if rec.dither_seed is not None:
                return _dithered_slice(rec, start, stop)
            if start % rec.bucket_size:
                raise ValueError(
                    f"slice of layer {rec.name!r} starts at {start}, inside a bucket of {rec.bucket_size}"
                )
            first = start // rec.bucket_size
            n_buckets = -(-(stop - start) // rec.bucket_size)
            return replace(
                rec, levels=rec.levels.reshape(-1)[start:stop], scales=rec.scales[first : first + n_buckets]
            )
        case RawRecord():
            return replace(rec, values=rec.values.reshape(-1)[start:stop])
        case LowRankRecord():
            # A product of factors has no element slices; the sharded exchanges never send one.
            raise ValueError(f"layer {rec.name!r} is low-rank: it cannot be sent in slices")
        case SparseRecord():
            lo, hi = np.searchsorted(rec.indices, [start, stop])
            return replace(
                rec, numel=stop - start, indices=rec.indices[lo:hi] - start, values=rec.values[lo:hi]
            )
