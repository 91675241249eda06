# mypy: disable-error-code="assignment,return-value"
# (numba kernels: numpy scalars stand for machine ints inside @njit; numba types them, not mypy)
"""The entropy model: a quantised order-0 frequency table, apart from the coder that uses it.

An ``EntropyModel`` is ``freqs`` (int64 per symbol, every symbol that may occur >= 1) summing
to ``2**scale_bits`` (8..15). It owns what a table is, independent of how a stream is coded:

- fitting: ``EntropyModel.fit(counts, word_bits=, fixed_words=)`` quantises a histogram at the
  precision that minimises table bytes + the estimated coded size for a coder that writes
  ``word_bits``-bit words plus ``fixed_words`` words of its own (rANS: 16 and its 8 state
  words; see ``rans.fit_model``);
- serialisation: ``to_bytes`` / ``EntropyModel.read`` (scale byte + Elias-gamma table,
  docs/wire-format.md), the reader checking every bit, the symbol range and the sum before
  anything else uses the table;
- derived models: ``paired(n_pairs)``, the two-symbols-per-step product model both sides
  build from a sent table with integer arithmetic only (bit-identical everywhere);
- its cost: ``cost_bits(counts)`` (ideal code length), ``min_cost_bits``.

The coder (rans.py) encodes and decodes symbols given a model; it never builds one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from tail_ray.compression.bitio import flush_bits, put_bits
from tail_ray.errors import CodecError

MIN_SCALE_BITS = 8
MAX_SCALE_BITS = 15
MAX_FIT_SCALE_BITS = 13  # decode tables (2**13 slots) stay in L1; more buys < 0.1% here
# Pair table precision: 2**14 at most, less for small layers (a decode table is O(2**s)).
MAX_PAIR_SCALE_BITS = 14
MIN_PAIR_SCALE_BITS = 12

ERR_TABLE = -3  # frequency table malformed (sum, range, escape)
ERR_TABLE_TRUNCATED = -4  # frequency table runs past the bytes present
ERR_PAIR_TABLE = -1  # no valid pair table at this precision


# --------------------------------------------------------------------------- kernels


@njit(cache=True, nogil=True)
def quantize_freqs(counts: np.ndarray, scale_bits: int, freqs: np.ndarray) -> int:  # pragma: no cover
    """Scale ``counts`` to integer ``freqs`` summing to 2**scale_bits, every used symbol >= 1.

    Rounds to nearest, then fixes the sum on the largest frequency when the error is small next
    to it (the usual case), else greedily by the smallest code-length change. Returns the
    number of used symbols, or ERR_TABLE when more symbols are used than the precision has slots.
    """
    m = 1 << scale_bits
    total = 0
    used = 0
    for s in range(counts.size):
        total += counts[s]
        if counts[s] > 0:
            used += 1
    for s in range(freqs.size):
        freqs[s] = 0
    if used == 0:
        return 0
    if used > m:
        return ERR_TABLE
    fsum = 0
    for s in range(counts.size):
        c = counts[s]
        if c > 0:
            f = (2 * c * m + total) // (2 * total)
            if f < 1:
                f = 1
            freqs[s] = f
            fsum += f
    # Common case: the rounding error is small next to the largest frequency, whose code
    # length barely changes when it absorbs it (O(A) instead of the greedy O(A * error)).
    big = 0
    for s in range(counts.size):
        if freqs[s] > freqs[big]:
            big = s
    if abs(m - fsum) * 8 <= freqs[big]:
        freqs[big] += m - fsum
        return used
    while fsum < m:
        best = -1
        best_gain = -1.0
        for s in range(counts.size):
            if counts[s] > 0:
                gain = counts[s] / (freqs[s] + 0.5)  # ~ counts * ln((f + 1) / f), no log
                if gain > best_gain:
                    best_gain = gain
                    best = s
        # A large shortfall (rare) closes in halving steps instead of one slot at a time.
        step = m - fsum
        step = step // 2 if step > 64 else 1
        freqs[best] += step
        fsum += step
    while fsum > m:
        best = -1
        best_loss = np.inf
        for s in range(counts.size):
            if freqs[s] > 1:
                loss = counts[s] / (freqs[s] - 0.5)  # ~ counts * ln(f / (f - 1)), no log
                if loss < best_loss:
                    best_loss = loss
                    best = s
        freqs[best] -= 1
        fsum -= 1
    return used


@njit(cache=True, nogil=True)
def cost_bits(counts: np.ndarray, freqs: np.ndarray, scale_bits: int) -> float:  # pragma: no cover
    """Ideal code length in bits of symbols with ``counts`` under the quantised ``freqs``."""
    bits = 0.0
    for s in range(counts.size):
        if counts[s] > 0:
            bits += counts[s] * (scale_bits - np.log2(freqs[s]))
    return bits


@njit(cache=True, nogil=True)
def _bitlen(v: int) -> int:  # pragma: no cover - jit
    n = 0
    while v > 0:
        v >>= 1
        n += 1
    return n


@njit(cache=True, nogil=True, inline="always")
def _used_range(freqs):  # type: ignore[no-untyped-def]  # pragma: no cover - jit
    """(first, last) symbol with a non-zero frequency; (0, 0) when there is none (written as a
    one-symbol table the decoder never consults)."""
    lo = -1
    hi = -1
    for s in range(freqs.size):
        if freqs[s] > 0:
            if lo < 0:
                lo = s
            hi = s
    if lo < 0:
        return 0, 0
    return lo, hi


@njit(cache=True, nogil=True)
def table_bits(freqs: np.ndarray) -> int:  # pragma: no cover - jit
    """Exact size in bits of the table as ``write_table`` writes it (excluding the scale byte)."""
    lo, hi = _used_range(freqs)
    bits = 2 * _bitlen(lo + 1) - 1 + 2 * _bitlen(hi - lo + 1) - 1
    for s in range(lo, hi):  # the last frequency is implied by the sum
        bits += 2 * _bitlen(freqs[s] + 1) - 1
    return bits


@njit(cache=True, nogil=True)
def write_table(freqs: np.ndarray, scale_bits: int, out: np.ndarray, pos: int) -> int:  # pragma: no cover
    """Write ``scale_bits`` u8 then the Elias-gamma coded table at ``out[pos:]``; return end pos.

    Table: gamma(lo + 1), gamma(hi - lo + 1), then gamma(f + 1) for s in [lo, hi) (f[hi] is
    implied by the sum 2**scale_bits).
    """
    out[pos] = scale_bits
    pos += 1
    lo, hi = _used_range(freqs)
    acc = np.uint64(0)
    nacc = 0
    for k in range(2 + hi - lo):
        if k == 0:
            v = lo + 1
        elif k == 1:
            v = hi - lo + 1
        else:
            v = freqs[lo + k - 2] + 1
        nb = _bitlen(v)
        # gamma, LSB-first: (nb - 1) zeros, a one, then the low nb - 1 bits of v
        acc, nacc, pos = put_bits(acc, nacc, 0, nb - 1, out, pos)
        acc, nacc, pos = put_bits(acc, nacc, 1 | ((v & ((1 << (nb - 1)) - 1)) << 1), nb, out, pos)
    return flush_bits(acc, nacc, out, pos)


@njit(cache=True, nogil=True)
def read_table(
    data: np.ndarray, pos: int, alphabet: int, freqs: np.ndarray
) -> tuple[int, int]:  # pragma: no cover
    """Parse a table written by ``write_table``; return (status, end pos), status = scale_bits or ERR_*.

    Checks every bit against the bytes present, the symbol range against ``alphabet`` and the
    sum against 2**scale_bits before the caller builds any decode table.
    """
    for s in range(freqs.size):
        freqs[s] = 0
    if pos >= data.size:
        return ERR_TABLE_TRUNCATED, pos
    scale_bits = np.int64(data[pos])
    pos += 1
    if scale_bits < MIN_SCALE_BITS or scale_bits > MAX_SCALE_BITS:
        return ERR_TABLE, pos
    m = 1 << scale_bits
    at = 8 * pos  # the next bit, counted from data[0]'s lowest
    n_bits = 8 * data.size
    lo = -1
    count = 0
    k = 0
    fsum = 0
    n_values = 2
    while k < n_values:
        # one gamma code, LSB-first: zeros (at most 31), a one, then as many value bits
        zeros = 0
        while True:
            if at >= n_bits:
                return ERR_TABLE_TRUNCATED, (at + 7) >> 3
            bit = (np.int64(data[at >> 3]) >> (at & 7)) & 1
            at += 1
            if bit:
                break
            zeros += 1
            if zeros > 31:
                return ERR_TABLE, (at + 7) >> 3
        if at + zeros > n_bits:
            return ERR_TABLE_TRUNCATED, n_bits >> 3
        v = 1 << zeros
        for b in range(zeros):
            v |= ((np.int64(data[at >> 3]) >> (at & 7)) & 1) << b
            at += 1
        if k == 0:
            lo = v - 1
            if lo >= alphabet:
                return ERR_TABLE, (at + 7) >> 3
        elif k == 1:
            count = v
            if lo + count > alphabet:
                return ERR_TABLE, (at + 7) >> 3
            n_values = 1 + count
        else:
            f = v - 1
            if f > m:
                return ERR_TABLE, (at + 7) >> 3
            freqs[lo + k - 2] = f
            fsum += f
            if fsum > m:
                return ERR_TABLE, (at + 7) >> 3
        k += 1
    pos = (at + 7) >> 3  # every byte a bit was read from
    last = m - fsum
    if last < 1:
        return ERR_TABLE, pos
    freqs[lo + count - 1] = last
    return scale_bits, pos


@njit(cache=True, nogil=True)
def fit_freqs(
    counts: np.ndarray, word_bits: int, fixed_words: int, freqs_out: np.ndarray
) -> tuple[int, int, float]:  # pragma: no cover - jit
    """Pick scale_bits minimising table + estimated stream; fill ``freqs_out``.

    Returns (scale_bits, table_bytes incl. the scale byte, estimated stream bytes incl. the
    table and the coder's ``fixed_words``). One call instead of a Python loop: small layers
    are dominated by per-call overhead.
    """
    used = 0
    for s in range(counts.size):
        if counts[s] > 0:
            used += 1
    lo = MIN_SCALE_BITS
    while (1 << (lo - 2)) < used and lo < MAX_FIT_SCALE_BITS:
        lo += 1
    if used > 32 and lo < 11:  # wide alphabets: coarse tables lose more than their header saves
        lo = 11
    trial = np.zeros(counts.size, dtype=np.int64)
    best_scale = -1
    best_table = 0
    best_est = np.inf
    for scale in range(lo, MAX_FIT_SCALE_BITS + 1):
        if quantize_freqs(counts, scale, trial) < 0:
            continue
        table = 1 + (table_bits(trial) + 7) // 8
        words = np.ceil(cost_bits(counts, trial, scale) / word_bits) + fixed_words
        est = table + (word_bits // 8) * words
        if est < best_est:
            best_est = est
            best_scale = scale
            best_table = table
            for s in range(counts.size):
                freqs_out[s] = trial[s]
    return best_scale, best_table, best_est


@njit(cache=True, nogil=True)
def product_freqs(f1: np.ndarray, scale1: int, scale2: int) -> tuple[int, np.ndarray]:  # pragma: no cover
    """Integer-only pair table summing to 2**scale2 from a single table summing to 2**scale1:
    f_a * f_b >> (2 scale1 - scale2), every possible pair >= 1, the remainder on the largest."""
    a = f1.size
    shift = 2 * scale1 - scale2
    pf = np.zeros(a * a, dtype=np.int64)
    if shift < 0:
        return ERR_PAIR_TABLE, pf
    total = 0
    best = 0
    for x in range(a):
        for y in range(a):
            if f1[x] > 0 and f1[y] > 0:
                v = (f1[x] * f1[y]) >> shift
                if v < 1:
                    v = 1
                pf[x * a + y] = v
                total += v
                if v > pf[best]:
                    best = x * a + y
    pf[best] += (1 << scale2) - total
    if pf[best] < 1:
        return ERR_PAIR_TABLE, pf
    return 0, pf


def pair_scale_bits(single_scale_bits: int, n_pairs: int) -> int:
    """Precision of the pair model: 2**14, less for small layers. Depends only on what a
    decoder knows (the sent table's precision and the number of pairs)."""
    size_bits = max(MIN_PAIR_SCALE_BITS, int(n_pairs).bit_length() + 2)
    return min(MAX_PAIR_SCALE_BITS, 2 * single_scale_bits, size_bits)


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True, slots=True, eq=False)
class EntropyModel:
    """A quantised frequency table: ``freqs`` (int64[alphabet]) summing to 2**scale_bits."""

    scale_bits: int
    freqs: np.ndarray
    _max_freq: int = dataclasses.field(default=0, init=False, repr=False)  # cached by max_freq

    @property
    def max_freq(self) -> int:
        """The largest frequency (computed once: a decoder asks for it several times per stream)."""
        if not self._max_freq:
            object.__setattr__(self, "_max_freq", int(self.freqs.max()))
        return self._max_freq

    @classmethod
    def fit(cls, counts: np.ndarray, *, word_bits: int, fixed_words: int) -> ModelFit:
        """The model for a histogram, at the precision that minimises table + coded size."""
        freqs = np.zeros(counts.size, dtype=np.int64)
        scale, table, est = fit_freqs(counts, word_bits, fixed_words, freqs)
        if scale < 0:  # pragma: no cover - more used symbols than 2**13 slots cannot happen (<= 256)
            raise CodecError("no frequency table fits this alphabet", field="table")
        return ModelFit(cls(int(scale), freqs), int(table), float(est))

    @classmethod
    def read(
        cls, data: np.ndarray, pos: int, end: int, alphabet: int, *, layer: str | None, field: str
    ) -> tuple[EntropyModel, int]:
        """Parse a table written by ``to_bytes`` at ``data[pos:end]``; return (model, end pos).
        Every bit is checked against the bytes present, the symbols against ``alphabet`` and
        the frequencies against their sum; anything wrong is a CodecError naming ``field``."""
        freqs = np.zeros(alphabet, dtype=np.int64)
        status, new_pos = read_table(data[:end], pos, alphabet, freqs)
        if status == ERR_TABLE_TRUNCATED:
            raise CodecError("frequency table runs past the layer body", layer=layer, field=field)
        if status < 0:
            raise CodecError("malformed frequency table (scale, range or sum)", layer=layer, field=field)
        return cls(int(status), freqs), int(new_pos)

    def to_bytes(self) -> bytes:
        """Scale byte + Elias-gamma table (the last frequency implied by the sum)."""
        # Room for the scale byte and the two header codes (< 8 bytes) plus one code of < 32 bits
        # per symbol (frequencies are <= 2**15): no sizing pass needed.
        out = np.empty(8 + 4 * self.freqs.size, dtype=np.uint8)
        end = write_table(self.freqs, self.scale_bits, out, 0)
        return out[:end].tobytes()

    def cost_bits(self, counts: np.ndarray) -> float:
        """Ideal code length in bits of symbols with histogram ``counts`` under this table."""
        return float(cost_bits(counts, self.freqs, self.scale_bits))

    @property
    def min_cost_bits(self) -> float:
        """Bits the cheapest symbol costs (0.0: one symbol carries all the mass)."""
        return self.scale_bits - math.log2(self.max_freq)

    @property
    def only_symbol(self) -> int | None:
        """The symbol that carries all the mass, if one does (its stream needs no words)."""
        return int(np.argmax(self.freqs)) if self.max_freq == 1 << self.scale_bits else None

    def paired(self, n_pairs: int) -> EntropyModel | None:
        """The model of symbol pairs (s0 * alphabet + s1) for a stream of ``n_pairs`` pairs;
        None when no valid pair table exists at the derived precision."""
        scale = pair_scale_bits(self.scale_bits, n_pairs)
        status, freqs = product_freqs(self.freqs, self.scale_bits, scale)
        return None if status < 0 else EntropyModel(scale, freqs)


@dataclass(frozen=True, slots=True, eq=False)
class ModelFit:
    """A model fitted to a histogram, with its exact table size and the estimated stream size
    (table included) of the symbols it was fitted to."""

    model: EntropyModel
    table_bytes: int
    est_bytes: float
