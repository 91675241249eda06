"""The table of layer codes, keyed by wire id: choosing a code is "estimate all, keep the cheapest".

``CodeTable.encode(record)`` asks every code that carries the record's kind for its
estimate and encodes the cheapest, under two declarative tie-breaks the codes state
themselves (codes.py): a code with ``must_beat`` / ``min_gain`` is weighed only if its
estimate saves ``min_gain`` over the best of those codes (sparse rANS over the dense entropy
code); a body larger than an ``exact_size`` candidate's size is refused and the next code
tried (an entropy body never beats bit-packing by estimate alone). ``refine`` makes a sampled
estimate exact before its code is encoded; if it no longer passes its margin, the next code
is tried. Decoding is a lookup: ``CodeTable[code_id].decode(body, header)``.

Ties keep table order (``DEFAULT_CODES``: raw, bitpack, rans, rans-pairs, sparse-rans,
sparse-pos), which is part of what makes the bytes reproducible.

A second backend (GPU kernels) or a new code (issue 12's chunked rANS) plugs in here: a
``LayerCode`` for a new id, or another implementation of an existing id that writes the same
bytes, in a table of its own (``DEFAULT_CODES.with_codes(...)``) that ``wire.encode_payload``
/ ``decode_payload`` take as ``codes=``. Neither this chooser nor the wire framing changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from tail_ray.compression.codes import AnyCode, Code, LevelCode, LevelStats, check_bits
from tail_ray.compression.dense_codes import BitPackCode, RansCode, RansPairsCode, RawCode
from tail_ray.compression.lowrank_code import LowRankCode
from tail_ray.compression.pair_symbols import PAIR_MAX_BITS
from tail_ray.compression.records import Kind, LayerRecord, QuantRecord
from tail_ray.compression.sparse_codes import SparsePosCode, SparseRansCode
from tail_ray.errors import CodecError


class CodeTable(Mapping[int, AnyCode]):
    """Layer codes by wire id, in tie-break order. ``level_stats`` builds the statistics the
    level codes estimate from (one per quantized layer; a device backend brings its own)."""

    def __init__(
        self, codes: Iterable[AnyCode], *, level_stats: Callable[[np.ndarray, int], LevelStats] = LevelStats
    ) -> None:
        self.level_stats = level_stats
        self._codes: dict[int, AnyCode] = {}
        for c in codes:
            if int(c.code) in self._codes:
                raise ValueError(
                    f"two codes for wire id {int(c.code)}: {self._codes[int(c.code)].name}, {c.name}"
                )
            self._codes[int(c.code)] = c
        self._by_kind = {kind: [c for c in self._codes.values() if kind in c.kinds] for kind in Kind}

    def __getitem__(self, code: int) -> AnyCode:
        return self._codes[code]

    def __iter__(self) -> Iterator[int]:
        return iter(self._codes)

    def __len__(self) -> int:
        return len(self._codes)

    def with_codes(self, *codes: AnyCode) -> CodeTable:
        """This table with ``codes`` added, or replacing the entry of the same wire id in place."""
        replaced = {int(c.code): c for c in codes}
        kept = [replaced.pop(cid, c) for cid, c in self._codes.items()]
        return CodeTable([*kept, *replaced.values()], level_stats=self.level_stats)

    def name(self, code: int) -> str:
        return self._codes[code].name if code in self._codes else f"code-{code}"

    def for_kind(self, kind: Kind) -> list[AnyCode]:
        """The codes that carry ``kind``, in tie-break order."""
        return self._by_kind[kind]

    def decoder(self, code: int, kind: Kind, *, layer: str | None) -> AnyCode:
        """The code that reads a ``kind`` body written with wire id ``code``; CodecError if none."""
        found = self._codes.get(code)
        if found is None or kind not in found.kinds:
            raise CodecError(f"code {code} cannot carry a {kind.name} layer", layer=layer, field="code")
        return found

    # --- choosing ---------------------------------------------------------------------------
    def encode(self, record: LayerRecord, *, force: Code | None = None) -> tuple[Code, int, bytes]:
        """(code, nnz, body) of the cheapest applicable code, or of ``force`` (tests, benchmarks)."""
        layer: Any = record
        if isinstance(record, QuantRecord):  # level codes estimate from one shared counting pass
            layer = self.level_stats(record.levels, record.bits)
        return choose(self._by_kind[record.kind], layer, force=force)


def choose(codes: Sequence[AnyCode], layer: Any, *, force: Code | None = None) -> tuple[Code, int, bytes]:
    """(code, nnz, body): the cheapest of ``codes`` for ``layer`` (see the module docstring), or
    ``force``'s body (tests, benchmarks). ``codes`` are in tie-break order."""
    if len(codes) == 1 and force is None:  # nothing to weigh (raw values, top-k positions)
        got = codes[0].encode(layer)
        if got is None:
            raise CodecError(f"code {codes[0].name} refused this layer", field="code")
        return codes[0].code, got[0], got[1]
    weighed = [(c, est) for c in codes if (est := c.estimate(layer)) is not None]
    if force is not None:
        return _forced(force, weighed, layer)
    best = {c.code: est for c, est in weighed}
    floor = min((est for c, est in weighed if c.exact_size), default=math.inf)
    ranked = []
    for c, est in weighed:
        rivals = [best[r] for r in c.must_beat if r in best]
        limit = (1 - c.min_gain) * min(rivals) if rivals else math.inf  # its min_gain margin
        if est <= limit:
            ranked.append((est, c, limit))
    ranked.sort(key=lambda r: r[0])  # stable: a tie keeps table order
    for _est, c, limit in ranked:
        if c.refine(layer) > limit:
            continue  # the exact estimate no longer pays its margin: the next code
        got = c.encode(layer)
        if got is not None and len(got[1]) <= floor:
            return c.code, got[0], got[1]
    raise CodecError("no code could encode this layer", field="code")


def _forced(force: Code, weighed: Sequence[tuple[AnyCode, float]], layer: Any) -> tuple[Code, int, bytes]:
    found = [c for c, _est in weighed if c.code == force]
    if not found:
        raise CodecError(f"code {force.name} is not a candidate for this layer", field="code")
    found[0].refine(layer)
    got = found[0].encode(layer)
    if got is None:
        raise CodecError(f"code {force.name} refused this layer (capacity rule)", field="code")
    return force, got[0], got[1]


DEFAULT_CODES = CodeTable(
    [RawCode(), BitPackCode(), RansCode(), RansPairsCode(), SparseRansCode(), SparsePosCode(), LowRankCode()]
)
CODE_NAMES = {code: DEFAULT_CODES.name(code) for code in Code}


# --------------------------------------------------------------------------- level coder API


def encode_levels(
    levels: np.ndarray, bits: int, *, force: Code | None = None, codes: CodeTable = DEFAULT_CODES
) -> tuple[Code, int, bytes]:
    """Code one layer's levels; return (code, nnz, body). ``force`` picks a code (for tests)."""
    return choose(codes.for_kind(Kind.QUANT), codes.level_stats(levels, bits), force=force)


def decode_levels(
    code: int,
    body: np.ndarray,
    numel: int,
    bits: int,
    nnz: int,
    *,
    layer: str | None,
    codes: CodeTable = DEFAULT_CODES,
) -> np.ndarray:
    """Decode one layer body (uint8 array) into int8 levels in [-L, L]; CodecError on anything wrong."""
    check_bits(bits, layer=layer)
    found = codes.decoder(code, Kind.QUANT, layer=layer)
    assert isinstance(found, LevelCode)
    return found.decode_levels(body, numel, bits, nnz, layer=layer)


def candidate_codes(bits: int, numel: int) -> tuple[Code, ...]:
    """The codes ``encode_levels`` weighs for a layer (for tests and benchmarks)."""
    dense = Code.RANS_PAIRS if bits <= PAIR_MAX_BITS else Code.RANS
    return (Code.BITPACK, dense, Code.SPARSE_RANS) if numel else (Code.BITPACK, Code.SPARSE_RANS)
