"""Static-model rANS entropy coder (numba), 4 interleaved 32-bit states, 16-bit renormalisation.

The model is an order-0 frequency table quantised to ``2**scale_bits`` (scale_bits 10..15) and
sent in front of the stream in a compact Elias-gamma form. Encoding uses ryg's reciprocal trick
(no division in the loop); decoding uses one slot table lookup per symbol. Interleaving four
states hides the lookup latency.

Stream layout (bytes): ``words u16le[n_words]`` where the first 8 words are the four final
encoder states (the decoder's start states) and the rest are renormalisation words in decode
order. A correctly decoded stream ends with every state back at ``RANS_L`` and every word
consumed: the decoder checks both, which catches almost every corruption of the words.

Every kernel returns a status (negative = error) instead of raising, so the caller names
the layer and field; every read is bounds-checked explicitly.
"""

from __future__ import annotations

import numpy as np
from numba import njit

RANS_L = 1 << 15  # states live in [RANS_L, RANS_L << 16) = [2**15, 2**31): reciprocals stay exact
MIN_SCALE_BITS = 8
MAX_SCALE_BITS = 15
N_STATES = 4
STATE_WORDS = 2 * N_STATES

OK = 0
ERR_TRUNCATED = -1  # fewer words than the decoder needs
ERR_STATE = -2  # final states or word count do not match: the stream is corrupted
ERR_TABLE = -3  # frequency table malformed (sum, range, escape)
ERR_TABLE_TRUNCATED = -4  # frequency table runs past the bytes present


# --------------------------------------------------------------------------- frequency model


@njit(cache=True, nogil=True)
def quantize_freqs(counts: np.ndarray, scale_bits: int, freqs: np.ndarray) -> int:  # pragma: no cover
    """Scale ``counts`` to integer ``freqs`` summing to 2**scale_bits, every used symbol >= 1.

    Rounds to nearest, then fixes the sum greedily by the smallest code-length change, so the
    table is close to the best the precision allows. Returns the number of used symbols, or
    ERR_TABLE when more symbols are used than the precision has slots.
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
    while fsum < m:
        best = -1
        best_gain = -1.0
        for s in range(counts.size):
            if counts[s] > 0:
                gain = counts[s] * np.log2((freqs[s] + 1.0) / freqs[s])
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
                loss = counts[s] * np.log2(freqs[s] / (freqs[s] - 1.0))
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


@njit(cache=True, nogil=True)
def table_bits(freqs: np.ndarray) -> int:  # pragma: no cover - jit
    """Exact size in bits of the table as ``write_table`` writes it (excluding the scale byte)."""
    lo = -1
    hi = -1
    for s in range(freqs.size):
        if freqs[s] > 0:
            if lo < 0:
                lo = s
            hi = s
    if lo < 0:
        lo = 0
        hi = 0
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
    lo = -1
    hi = -1
    for s in range(freqs.size):
        if freqs[s] > 0:
            if lo < 0:
                lo = s
            hi = s
    if lo < 0:  # no symbols: written as a one-symbol table the decoder never consults
        lo = 0
        hi = 0
    acc = np.uint64(0)
    nacc = 0
    n_values = 2 + hi - lo
    for k in range(n_values):
        if k == 0:
            v = lo + 1
        elif k == 1:
            v = hi - lo + 1
        else:
            v = freqs[lo + k - 2] + 1
        nb = _bitlen(v)
        # gamma, LSB-first: (nb - 1) zeros, a one, then the low nb - 1 bits of v
        nacc += nb - 1
        while nacc >= 8:
            out[pos] = np.uint8(acc & np.uint64(0xFF))
            acc >>= np.uint64(8)
            nacc -= 8
            pos += 1
        acc |= np.uint64(1) << np.uint64(nacc)
        nacc += 1
        acc |= np.uint64(v & ((1 << (nb - 1)) - 1)) << np.uint64(nacc)
        nacc += nb - 1
        while nacc >= 8:
            out[pos] = np.uint8(acc & np.uint64(0xFF))
            acc >>= np.uint64(8)
            nacc -= 8
            pos += 1
    if nacc > 0:
        out[pos] = np.uint8(acc & np.uint64(0xFF))
        pos += 1
    return pos


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
    acc = np.uint64(0)
    nacc = 0
    lo = -1
    count = 0
    k = 0
    fsum = 0
    n_values = 2
    while k < n_values:
        # read one gamma code: count zeros (at most 31), then nb - 1 value bits
        zeros = 0
        while True:
            if nacc == 0:
                if pos >= data.size:
                    return ERR_TABLE_TRUNCATED, pos
                acc = np.uint64(data[pos])
                pos += 1
                nacc = 8
            bit = acc & np.uint64(1)
            acc >>= np.uint64(1)
            nacc -= 1
            if bit:
                break
            zeros += 1
            if zeros > 31:
                return ERR_TABLE, pos
        low = 0
        for b in range(zeros):
            if nacc == 0:
                if pos >= data.size:
                    return ERR_TABLE_TRUNCATED, pos
                acc = np.uint64(data[pos])
                pos += 1
                nacc = 8
            low |= int(acc & np.uint64(1)) << b
            acc >>= np.uint64(1)
            nacc -= 1
        v = (1 << zeros) | low
        if k == 0:
            lo = v - 1
            if lo >= alphabet:
                return ERR_TABLE, pos
        elif k == 1:
            count = v
            if lo + count > alphabet:
                return ERR_TABLE, pos
            n_values = 1 + count
        else:
            f = v - 1
            if f > m:
                return ERR_TABLE, pos
            freqs[lo + k - 2] = f
            fsum += f
            if fsum > m:
                return ERR_TABLE, pos
        k += 1
    last = m - fsum
    if last < 1:
        return ERR_TABLE, pos
    freqs[lo + count - 1] = last
    return scale_bits, pos


# --------------------------------------------------------------------------- encoder


@njit(cache=True, nogil=True)
def _enc_tables(freqs: np.ndarray, scale_bits: int) -> np.ndarray:  # pragma: no cover - jit
    """Per symbol: [x_max, rcp_freq, rcp_shift, bias, cmpl_freq] (ryg_rans RansEncSymbolInit)."""
    m = 1 << scale_bits
    tab = np.zeros((freqs.size, 5), dtype=np.int64)
    cum = 0
    for s in range(freqs.size):
        f = freqs[s]
        if f == 0:
            continue
        tab[s, 0] = f << (31 - scale_bits)
        tab[s, 4] = m - f
        if f < 2:
            tab[s, 1] = 0xFFFFFFFF
            tab[s, 2] = 0
            tab[s, 3] = cum + m - 1
        else:
            shift = 0
            while f > (1 << shift):
                shift += 1
            tab[s, 1] = ((1 << (shift + 31)) + f - 1) // f
            tab[s, 2] = shift - 1
            tab[s, 3] = cum
        cum += f
    return tab


@njit(cache=True, nogil=True)
def encode(
    symbols: np.ndarray, offset: int, freqs: np.ndarray, scale_bits: int
) -> np.ndarray:  # pragma: no cover
    """Encode ``symbols + offset`` (each must have freqs > 0); return the uint16 word stream.

    Four states, manually inlined: numba's tuple-returning inline helper was 4x slower.
    """
    n = symbols.size
    tab = _enc_tables(freqs, scale_bits)
    xmax = tab[:, 0].copy()
    rcp = tab[:, 1].copy()
    rsh = tab[:, 2].copy()
    bias = tab[:, 3].copy()
    cmpl = tab[:, 4].copy()
    # Each symbol emits at most one word; states add 8; +1 for the always-written slot.
    out = np.empty(n + STATE_WORDS + 1, dtype=np.uint16)
    pos = out.size
    x0 = RANS_L
    x1 = RANS_L
    x2 = RANS_L
    x3 = RANS_L
    n4 = n - (n & 3)
    # Tail (positions n4..n-1 use states 0..2), in reverse.
    for i in range(n - 1, n4 - 1, -1):
        j = i - n4
        if j == 0:
            s = np.int64(symbols[i]) + offset
            fl = np.int64(x0 >= xmax[s])
            out[pos - 1] = np.uint16(x0 & 0xFFFF)  # branch-free renormalisation: written always,
            pos -= fl  # kept only when the state overflows
            x0 >>= fl << 4
            x0 = x0 + bias[s] + (((x0 * rcp[s]) >> 32) >> rsh[s]) * cmpl[s]
        elif j == 1:
            s = np.int64(symbols[i]) + offset
            fl = np.int64(x1 >= xmax[s])
            out[pos - 1] = np.uint16(x1 & 0xFFFF)  # branch-free renormalisation: written always,
            pos -= fl  # kept only when the state overflows
            x1 >>= fl << 4
            x1 = x1 + bias[s] + (((x1 * rcp[s]) >> 32) >> rsh[s]) * cmpl[s]
        else:
            s = np.int64(symbols[i]) + offset
            fl = np.int64(x2 >= xmax[s])
            out[pos - 1] = np.uint16(x2 & 0xFFFF)  # branch-free renormalisation: written always,
            pos -= fl  # kept only when the state overflows
            x2 >>= fl << 4
            x2 = x2 + bias[s] + (((x2 * rcp[s]) >> 32) >> rsh[s]) * cmpl[s]
    for i in range(n4 - 4, -1, -4):
        s = np.int64(symbols[i + 3]) + offset
        fl = np.int64(x3 >= xmax[s])
        out[pos - 1] = np.uint16(x3 & 0xFFFF)  # branch-free renormalisation: written always,
        pos -= fl  # kept only when the state overflows
        x3 >>= fl << 4
        x3 = x3 + bias[s] + (((x3 * rcp[s]) >> 32) >> rsh[s]) * cmpl[s]
        s = np.int64(symbols[i + 2]) + offset
        fl = np.int64(x2 >= xmax[s])
        out[pos - 1] = np.uint16(x2 & 0xFFFF)  # branch-free renormalisation: written always,
        pos -= fl  # kept only when the state overflows
        x2 >>= fl << 4
        x2 = x2 + bias[s] + (((x2 * rcp[s]) >> 32) >> rsh[s]) * cmpl[s]
        s = np.int64(symbols[i + 1]) + offset
        fl = np.int64(x1 >= xmax[s])
        out[pos - 1] = np.uint16(x1 & 0xFFFF)  # branch-free renormalisation: written always,
        pos -= fl  # kept only when the state overflows
        x1 >>= fl << 4
        x1 = x1 + bias[s] + (((x1 * rcp[s]) >> 32) >> rsh[s]) * cmpl[s]
        s = np.int64(symbols[i]) + offset
        fl = np.int64(x0 >= xmax[s])
        out[pos - 1] = np.uint16(x0 & 0xFFFF)  # branch-free renormalisation: written always,
        pos -= fl  # kept only when the state overflows
        x0 >>= fl << 4
        x0 = x0 + bias[s] + (((x0 * rcp[s]) >> 32) >> rsh[s]) * cmpl[s]
    for x in (x3, x2, x1, x0):
        pos -= 1
        out[pos] = np.uint16(x >> 16)
        pos -= 1
        out[pos] = np.uint16(x & 0xFFFF)
    return out[pos:]


# --------------------------------------------------------------------------- decoder


@njit(cache=True, nogil=True)
def dec_tables(freqs: np.ndarray, scale_bits: int) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover
    """Slot -> symbol (uint8) and slot -> freq | (slot - cum) << 16 (uint32); freqs pre-validated."""
    m = 1 << scale_bits
    sym = np.empty(m, dtype=np.uint8)
    fb = np.empty(m, dtype=np.uint32)
    cum = 0
    for s in range(freqs.size):
        f = freqs[s]
        for k in range(f):
            sym[cum + k] = s
            fb[cum + k] = np.uint32(f | (k << 16))
        cum += f
    return sym, fb


@njit(cache=True, nogil=True)
def decode(
    data: np.ndarray,
    start: int,
    n_words: int,
    freqs: np.ndarray,
    scale_bits: int,
    offset: int,
    out: np.ndarray,
) -> int:  # pragma: no cover - jit
    """Decode ``out.size`` symbols from ``n_words`` u16le words at ``data[start:]``; store sym - offset.

    The caller has checked ``start + 2 * n_words <= data.size``; this re-checks and never reads
    past it. Returns OK or ERR_*.
    """
    n = out.size
    if n_words < STATE_WORDS or start < 0 or start + 2 * n_words > data.size:
        return ERR_TRUNCATED
    sym, fb = dec_tables(freqs, scale_bits)
    mask = (1 << scale_bits) - 1
    b = start
    x0 = (
        np.int64(data[b])
        | np.int64(data[b + 1]) << 8
        | np.int64(data[b + 2]) << 16
        | np.int64(data[b + 3]) << 24
    )
    x1 = (
        np.int64(data[b + 4])
        | np.int64(data[b + 5]) << 8
        | np.int64(data[b + 6]) << 16
        | np.int64(data[b + 7]) << 24
    )
    x2 = (
        np.int64(data[b + 8])
        | np.int64(data[b + 9]) << 8
        | np.int64(data[b + 10]) << 16
        | np.int64(data[b + 11]) << 24
    )
    x3 = (
        np.int64(data[b + 12])
        | np.int64(data[b + 13]) << 8
        | np.int64(data[b + 14]) << 16
        | np.int64(data[b + 15]) << 24
    )
    for x in (x0, x1, x2, x3):
        if x < RANS_L or x >= (RANS_L << 16):
            return ERR_STATE
    pos = b + 16
    end = start + 2 * n_words
    n4 = n - (n & 3)
    for i in range(0, n4, 4):
        slot = x0 & mask
        out[i] = sym[slot] - offset
        e = np.int64(fb[slot])
        x0 = (e & 0xFFFF) * (x0 >> scale_bits) + (e >> 16)
        if x0 < RANS_L:
            if pos >= end:
                return ERR_TRUNCATED
            x0 = (x0 << 16) | np.int64(data[pos]) | np.int64(data[pos + 1]) << 8
            pos += 2
        slot = x1 & mask
        out[i + 1] = sym[slot] - offset
        e = np.int64(fb[slot])
        x1 = (e & 0xFFFF) * (x1 >> scale_bits) + (e >> 16)
        if x1 < RANS_L:
            if pos >= end:
                return ERR_TRUNCATED
            x1 = (x1 << 16) | np.int64(data[pos]) | np.int64(data[pos + 1]) << 8
            pos += 2
        slot = x2 & mask
        out[i + 2] = sym[slot] - offset
        e = np.int64(fb[slot])
        x2 = (e & 0xFFFF) * (x2 >> scale_bits) + (e >> 16)
        if x2 < RANS_L:
            if pos >= end:
                return ERR_TRUNCATED
            x2 = (x2 << 16) | np.int64(data[pos]) | np.int64(data[pos + 1]) << 8
            pos += 2
        slot = x3 & mask
        out[i + 3] = sym[slot] - offset
        e = np.int64(fb[slot])
        x3 = (e & 0xFFFF) * (x3 >> scale_bits) + (e >> 16)
        if x3 < RANS_L:
            if pos >= end:
                return ERR_TRUNCATED
            x3 = (x3 << 16) | np.int64(data[pos]) | np.int64(data[pos + 1]) << 8
            pos += 2
    for i in range(n4, n):
        j = i - n4
        x = x0 if j == 0 else (x1 if j == 1 else x2)
        slot = x & mask
        out[i] = sym[slot] - offset
        e = np.int64(fb[slot])
        x = (e & 0xFFFF) * (x >> scale_bits) + (e >> 16)
        if x < RANS_L:
            if pos >= end:
                return ERR_TRUNCATED
            x = (x << 16) | np.int64(data[pos]) | np.int64(data[pos + 1]) << 8
            pos += 2
        if j == 0:
            x0 = x
        elif j == 1:
            x1 = x
        else:
            x2 = x
    if x0 != RANS_L or x1 != RANS_L or x2 != RANS_L or x3 != RANS_L or pos != end:
        return ERR_STATE
    return OK
