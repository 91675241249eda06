"""The contract of a layer code (a strategy per wire code id) and what level codes share.

Every way the wire can write a layer body is one ``LayerCode``: its wire id (``Code``), the
record kinds it carries, and three operations:

    estimate(layer) -> bytes or None   how big its body would be (None: it does not apply)
    encode(layer)   -> (nnz, body) or None   the body (None: it refuses, e.g. capacity rule)
    decode(body, head) -> record       the record back, CodecError on anything wrong

plus two declarative tie-break fields the chooser (code_table.py) applies: ``exact_size``
(the estimate is the body's exact size, so a real body of another code larger than it is
refused) and ``must_beat`` / ``min_gain`` (taken only when it saves ``min_gain`` over the
best of those codes). ``refine`` re-estimates exactly, right before encoding, what an
estimate only sampled. The chooser knows nothing else about any code, and the wire only
frames bodies: a new code, or another backend's encoder for an existing id, is one more (or
another) entry in a ``CodeTable``.

Level codes (the codes of ``QuantRecord``) all size themselves from one counting pass over
the levels, ``LevelStats``, built once per layer before any estimate.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np

from tail_ray.compression import level_histograms as hist
from tail_ray.compression import rans
from tail_ray.compression.entropy_model import EntropyModel, ModelFit
from tail_ray.compression.grid import levels_max
from tail_ray.compression.pair_symbols import PAIR_MAX_BITS
from tail_ray.compression.records import Kind, LayerRecord, QuantRecord
from tail_ray.compression.sparse import N_SLOTS
from tail_ray.errors import CodecError

MIN_BITS = 2
MAX_BITS = 8


class Code(IntEnum):
    """Wire code ids (the layer header's ``code`` byte)."""

    RAW = 0  # the values' own bytes (RAW_F32 / RAW_F16)
    INT8 = 1  # reserved: version-1 levels as one byte each (never produced, never accepted)
    BITPACK = 2
    RANS = 3
    SPARSE_RANS = 4
    SPARSE_POS = 5  # SPARSE_F32: positions as sparse gaps, values raw f32
    RANS_PAIRS = 6  # bits 2..4: two levels per rANS symbol, pair model derived from the sent table
    LOWRANK = 7  # LOWRANK: rows, rank, then each factor's levels in a level code of their own


@dataclass(frozen=True, slots=True, eq=False)
class LayerHeader:
    """What the container read before a layer's body: everything a code may need to decode it
    (``scales`` is empty unless the kind is QUANT; the container has checked its size)."""

    name: str
    kind: Kind
    bits: int
    numel: int
    bucket_size: int
    nnz: int
    scales: np.ndarray
    dither_seed: int | None = None  # QUANT_DITHER(_FOLDED): the seed of the uniforms to subtract


In = TypeVar("In")


class LayerCode(ABC, Generic[In]):
    """One wire code: see the module docstring. ``In`` is what its estimate and encoder read
    (``LevelStats`` for level codes, the record itself for the others)."""

    code: ClassVar[Code]
    name: ClassVar[str]
    kinds: ClassVar[frozenset[Kind]]
    exact_size: ClassVar[bool] = False
    must_beat: ClassVar[tuple[Code, ...]] = ()
    min_gain: ClassVar[float] = 0.0

    @abstractmethod
    def estimate(self, layer: In) -> float | None:
        """Body bytes this code would write (exact or estimated), or None if it does not apply."""

    def refine(self, layer: In) -> float:
        """The estimate made exact where ``estimate`` sampled; called right before ``encode``."""
        est = self.estimate(layer)
        assert est is not None, f"{self.name} refined on a layer it does not apply to"
        return est

    @abstractmethod
    def encode(self, layer: In) -> tuple[int, bytes] | None:
        """(nnz, body), or None when this code refuses the layer."""

    @abstractmethod
    def decode(self, body: np.ndarray, head: LayerHeader) -> LayerRecord:
        """The record from its body (a uint8 view); CodecError naming the field on anything wrong."""


class LevelCode(LayerCode["LevelStats"]):
    """Base of the codes of quantized levels: decoding is levels -> ``QuantRecord``."""

    kinds: ClassVar[frozenset[Kind]] = frozenset({Kind.QUANT, Kind.QUANT_DITHER, Kind.QUANT_DITHER_FOLDED})

    @abstractmethod
    def decode_levels(
        self, body: np.ndarray, numel: int, bits: int, nnz: int, *, layer: str | None
    ) -> np.ndarray:
        """int8 levels in [-L, L] from a body; CodecError on anything wrong."""

    def decode(self, body: np.ndarray, head: LayerHeader) -> LayerRecord:
        levels = self.decode_levels(body, head.numel, head.bits, head.nnz, layer=head.name)
        return QuantRecord(
            head.name, head.bits, head.bucket_size, head.scales, levels, dither_seed=head.dither_seed
        )


def check_bits(bits: int, *, layer: str | None = None) -> int:
    """L for quantized levels at ``bits``; CodecError unless 2 <= bits <= 8 (bits 1 has no
    non-zero level)."""
    if not MIN_BITS <= bits <= MAX_BITS:
        raise CodecError(
            f"bits must be {MIN_BITS}..{MAX_BITS} for quantized levels, got {bits}", layer=layer, field="bits"
        )
    return levels_max(bits)


@functools.cache
def level_values(half: int) -> np.ndarray:
    """int8 output value of each level symbol 0..2L."""
    return (np.arange(2 * half + 1) - half).astype(np.int8)


class LevelStats:
    """One layer's levels with what every level code's estimate needs, counted once.

    Level (and, for bits 2..4, pair) counts are exact; the gap-slot histogram of the
    non-zeros is exact up to ``GAP_EXACT_NUMEL`` levels and sampled above
    (``gaps_exact``) until ``count_gaps_exactly`` is called.
    """

    def __init__(self, levels: np.ndarray, bits: int) -> None:
        half = check_bits(bits)
        levels = np.asarray(levels)
        if levels.dtype != np.int8:
            # A wider integer type would wrap silently in the cast: check the range first.
            if levels.dtype.kind not in "iu":
                raise CodecError(f"levels must be integers, got {levels.dtype}", field="levels")
            if levels.size and (int(levels.min()) < -half or int(levels.max()) > half):
                raise CodecError(f"levels outside [-{half}, {half}] for bits={bits}", field="levels")
        self.levels = np.ascontiguousarray(levels, dtype=np.int8).reshape(-1)
        self.bits = bits
        self.half = half
        self.numel = int(self.levels.size)
        self.counts = np.zeros(2 * half + 1, dtype=np.int64)
        self.slot_counts = np.zeros(N_SLOTS, dtype=np.int64)
        self.pair_syms: np.ndarray | None = None
        self.pair_counts: np.ndarray | None = None
        if bits <= PAIR_MAX_BITS:
            nnz, extra, self.pair_syms, self.pair_counts, exact = hist.pair_level_stats_fast(
                self.levels, half, self.counts, self.slot_counts
            )
        else:
            nnz, extra, exact = hist.level_stats_fast(self.levels, half, self.counts, self.slot_counts)
        if nnz < 0:
            lo, hi = int(self.levels.min()), int(self.levels.max())
            raise CodecError(
                f"levels span [{lo}, {hi}], outside [-{half}, {half}] for bits={bits}", field="levels"
            )
        self.nnz = int(nnz)
        self.extra_bits = int(extra)
        self.gaps_exact = bool(exact)
        # Every model a candidate's estimate needs, fitted once (the chooser asks them all):
        # the dense table (None: empty layer), the pair model derived from it (None: bits > 4
        # or no valid pair table), and the sparse code's non-zero level and gap-slot tables
        # (None: no non-zero level). The slot table is refitted by ``count_gaps_exactly``.
        self.dense: ModelFit | None = rans.fit_model(self.counts) if self.numel else None
        self.pair_model: EntropyModel | None = None
        if self.dense is not None and self.pair_counts is not None:
            self.pair_model = self.dense.model.paired((self.numel + 1) // 2)
        self.nonzero_fit: ModelFit | None = None
        self.slot_fit: ModelFit | None = None
        if self.nnz:
            self.nonzero_fit = rans.fit_model(np.concatenate((self.counts[:half], self.counts[half + 1 :])))
            self.slot_fit = rans.fit_model(self.slot_counts)

    def count_gaps_exactly(self) -> None:
        """Replace sampled gap statistics by an exact count (the sparse code's real model)."""
        if self.gaps_exact:
            return
        nnz, extra = hist.level_stats(self.levels, self.half, np.zeros_like(self.counts), self.slot_counts)
        self.nnz = int(nnz)
        self.extra_bits = int(extra)
        self.slot_fit = rans.fit_model(self.slot_counts)
        self.gaps_exact = True


AnyCode = LayerCode[Any]
