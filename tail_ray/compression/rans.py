# mypy: disable-error-code="assignment,return-value"
# (numba kernels: numpy scalars stand for machine ints inside @njit; numba types them, not mypy)
"""The rANS coder: encode / decode symbols given an ``EntropyModel`` (numba, one thread).

Four interleaved 32-bit states in [2**15, 2**31), 16-bit renormalisation. Encoding uses
ryg's reciprocal trick (no division in the loop); decoding one slot-table lookup per symbol.
Interleaving four states hides the lookup latency. The per-lane step is one inline helper
(``_enc_step`` / ``_dec_step``) that numba splices into the 4-way unrolled loop at its IR
level, so the loop compiles as it did when the four lanes were written out by hand.

Stream layout (bytes): ``words u16le[n_words]`` where the first 8 words are the four final
encoder states (the decoder's start states) and the rest are renormalisation words in decode
order. A correctly decoded stream ends with every state back at ``RANS_L`` and every word
consumed: the decoder checks both, which catches almost every corruption of the words.

Kernels return a status (negative = error) instead of raising; the Python wrappers
(``encode_stream`` / ``decode_stream``) turn it into a CodecError naming the layer and field.
The model is the caller's (entropy_model.py): ``fit_model`` fits one for this coder's stream.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from tail_ray.compression.entropy_model import EntropyModel, ModelFit
from tail_ray.errors import CodecError

RANS_L = 1 << 15  # states live in [RANS_L, RANS_L << 16) = [2**15, 2**31): reciprocals stay exact
N_STATES = 4
STATE_WORDS = 2 * N_STATES
WORD_BITS = 16

OK = 0
ERR_TRUNCATED = -1  # fewer words than the decoder needs
ERR_STATE = -2  # final states or word count do not match: the stream is corrupted
ERR_TABLE = -3  # the model has more symbols than the decoder has output values

# A stream may claim at most this many symbols per bit actually present, relative to its
# model's cheapest symbol (``capacity_ok``): the encoder guarantees it, the decoder rejects
# anything more before allocating.
CAPACITY_FACTOR = 2.0
CAPACITY_SLACK_BITS = 256.0


def fit_model(counts: np.ndarray) -> ModelFit:
    """The model for ``counts`` at the precision that minimises table + this coder's stream."""
    return EntropyModel.fit(counts, word_bits=WORD_BITS, fixed_words=STATE_WORDS)


def stream_bytes(model: EntropyModel, counts: np.ndarray) -> int:
    """Estimated words of symbols with histogram ``counts`` under ``model``, in bytes (the
    ideal code length rounded up to words, plus the states): within ~0.1% + 8 bytes."""
    return 2 * (math.ceil(model.cost_bits(counts) / WORD_BITS) + STATE_WORDS)


def capacity_ok(count: int, model: EntropyModel, n_words: int) -> bool:
    """Whether ``count`` symbols fit in ``n_words`` words under ``model`` (CAPACITY_FACTOR)."""
    min_cost = model.min_cost_bits
    if min_cost == 0.0:  # one symbol carries all mass: decoded by a fill, no stream work
        return True
    return count * min_cost <= CAPACITY_FACTOR * WORD_BITS * n_words + CAPACITY_SLACK_BITS


def encode_stream(symbols: np.ndarray, offset: int, model: EntropyModel) -> tuple[bytes, int]:
    """Code ``symbols + offset`` (each with a non-zero frequency): (u16le word bytes, n_words)."""
    words = encode(symbols, offset, model.freqs, model.scale_bits)
    return words.tobytes(), int(words.size)


def decode_stream(
    data: np.ndarray,
    start: int,
    n_words: int,
    model: EntropyModel,
    values: np.ndarray,
    out: np.ndarray,
    *,
    layer: str | None,
    field: str,
) -> None:
    """Decode ``out.size`` symbols from ``n_words`` words at ``data[start:]`` into
    ``values[symbol]``; CodecError (naming ``field``) on anything wrong."""
    if not capacity_ok(out.size, model, n_words):
        raise CodecError(
            f"{out.size} symbols cannot come from {n_words} words with this table", layer=layer, field=field
        )
    only = model.only_symbol
    if only is not None:  # a single symbol: the stream holds only the states
        if n_words != STATE_WORDS:
            raise CodecError("single-symbol stream must hold only the states", layer=layer, field=field)
        out[:] = values[only]
        return
    status = decode(data, start, n_words, model.freqs, model.scale_bits, values, out)
    if status == ERR_TRUNCATED:
        raise CodecError("entropy stream ends early", layer=layer, field=field)
    if status < 0:
        raise CodecError("entropy stream corrupted (final state check failed)", layer=layer, field=field)


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


@njit(cache=True, nogil=True, inline="always")
def _enc_step(x, s, xmax, rcp, rsh, bias, cmpl, out, pos):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Push symbol ``s`` onto state ``x``; return the new (x, pos). Branch-free renormalisation:
    the low word is written always, and kept (pos moves down) only when the state overflows."""
    fl = np.int64(x >= xmax[s])
    out[pos - 1] = np.uint16(x & 0xFFFF)
    pos -= fl
    x >>= fl << 4
    x = x + bias[s] + (((x * rcp[s]) >> 32) >> rsh[s]) * cmpl[s]
    return x, pos


@njit(cache=True, nogil=True)
def encode(
    symbols: np.ndarray, offset: int, freqs: np.ndarray, scale_bits: int
) -> np.ndarray:  # pragma: no cover
    """Encode ``symbols + offset`` (each must have freqs > 0); return the uint16 word stream.

    Table indices are unsigned so numba emits no negative-index wraparound (30% faster).
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
    for i in range(n - 1, n4 - 1, -1):  # the tail (positions n4.. use states 0..2), in reverse
        s = np.uint64(np.int64(symbols[i]) + offset)
        if i == n4:
            x0, pos = _enc_step(x0, s, xmax, rcp, rsh, bias, cmpl, out, pos)
        elif i == n4 + 1:
            x1, pos = _enc_step(x1, s, xmax, rcp, rsh, bias, cmpl, out, pos)
        else:
            x2, pos = _enc_step(x2, s, xmax, rcp, rsh, bias, cmpl, out, pos)
    for i in range(n4 - 4, -1, -4):
        s = np.uint64(np.int64(symbols[i + 3]) + offset)
        x3, pos = _enc_step(x3, s, xmax, rcp, rsh, bias, cmpl, out, pos)
        s = np.uint64(np.int64(symbols[i + 2]) + offset)
        x2, pos = _enc_step(x2, s, xmax, rcp, rsh, bias, cmpl, out, pos)
        s = np.uint64(np.int64(symbols[i + 1]) + offset)
        x1, pos = _enc_step(x1, s, xmax, rcp, rsh, bias, cmpl, out, pos)
        s = np.uint64(np.int64(symbols[i]) + offset)
        x0, pos = _enc_step(x0, s, xmax, rcp, rsh, bias, cmpl, out, pos)
    for x in (x3, x2, x1, x0):
        pos -= 1
        out[pos] = np.uint16(x >> 16)
        pos -= 1
        out[pos] = np.uint16(x & 0xFFFF)
    return out[pos:]


# --------------------------------------------------------------------------- decoder


@njit(cache=True, nogil=True)
def dec_tables(
    freqs: np.ndarray, scale_bits: int, values: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - jit
    """Slot -> output value (``values[symbol]``) and slot -> freq | (slot - cum) << 16 (uint32).

    ``freqs`` is pre-validated (sums to 2**scale_bits, length <= values.size).
    """
    m = 1 << scale_bits
    val = np.empty(m, dtype=values.dtype)
    fb = np.empty(m, dtype=np.uint32)
    cum = 0
    for s in range(freqs.size):
        f = freqs[s]
        for k in range(f):
            val[cum + k] = values[s]
            fb[cum + k] = np.uint32(f | (k << 16))
        cum += f
    return val, fb


@njit(cache=True, nogil=True, inline="always")
def _read_state(data, b):  # type: ignore[no-untyped-def]  # pragma: no cover - jit
    """The u32le start state at data[b:b + 4] (the caller checked the bounds)."""
    return (
        np.int64(data[b])
        | np.int64(data[b + 1]) << 8
        | np.int64(data[b + 2]) << 16
        | np.int64(data[b + 3]) << 24
    )


@njit(cache=True, nogil=True, inline="always")
def _dec_step(x, sym, fb, mask, scale_bits, data, pos, last_word, out, i):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Pop one symbol of state ``x`` into ``out[i]``; return the new (x, pos). Branch-free
    refill: the word is always loaded (from a clamped, in-bounds index) and kept only when the
    state underflowed; overrunning the stream is detected after the loop."""
    slot = np.uint64(x & mask)
    out[i] = sym[slot]
    e = np.int64(fb[slot])
    x = (e & 0xFFFF) * (x >> scale_bits) + (e >> 16)
    fl = np.int64(x < RANS_L)
    q = np.uint64(pos if pos < last_word else last_word)
    w = np.int64(data[q]) | np.int64(data[q + 1]) << 8
    x = (x << (fl << 4)) | (w & -fl)
    pos += fl << 1
    return x, pos


@njit(cache=True, nogil=True)
def decode(
    data: np.ndarray,
    start: int,
    n_words: int,
    freqs: np.ndarray,
    scale_bits: int,
    values: np.ndarray,
    out: np.ndarray,
) -> int:  # pragma: no cover - jit
    """Decode ``out.size`` symbols from ``n_words`` u16le words at ``data[start:]``; store values[sym].

    The caller has checked ``start + 2 * n_words <= data.size``; this re-checks and never reads
    past it. Returns OK or ERR_*.
    """
    n = out.size
    if n_words < STATE_WORDS or start < 0 or start + 2 * n_words > data.size:
        return ERR_TRUNCATED
    if freqs.size > values.size:
        return ERR_TABLE
    sym, fb = dec_tables(freqs, scale_bits, values)
    mask = (1 << scale_bits) - 1
    x0 = _read_state(data, start)
    x1 = _read_state(data, start + 4)
    x2 = _read_state(data, start + 8)
    x3 = _read_state(data, start + 12)
    for x in (x0, x1, x2, x3):
        if x < RANS_L or x >= (RANS_L << 16):
            return ERR_STATE
    pos = start + 16
    end = start + 2 * n_words
    n4 = n - (n & 3)
    last_word = end - 2
    for i in range(0, n4, 4):
        x0, pos = _dec_step(x0, sym, fb, mask, scale_bits, data, pos, last_word, out, i)
        x1, pos = _dec_step(x1, sym, fb, mask, scale_bits, data, pos, last_word, out, i + 1)
        x2, pos = _dec_step(x2, sym, fb, mask, scale_bits, data, pos, last_word, out, i + 2)
        x3, pos = _dec_step(x3, sym, fb, mask, scale_bits, data, pos, last_word, out, i + 3)
    for i in range(n4, n):  # the last < 4 symbols use states 0..2
        if i == n4:
            x0, pos = _dec_step(x0, sym, fb, mask, scale_bits, data, pos, last_word, out, i)
        elif i == n4 + 1:
            x1, pos = _dec_step(x1, sym, fb, mask, scale_bits, data, pos, last_word, out, i)
        else:
            x2, pos = _dec_step(x2, sym, fb, mask, scale_bits, data, pos, last_word, out, i)
    if pos > end:  # a refill past the last word (it read a clamped, in-bounds word)
        return ERR_TRUNCATED
    if x0 != RANS_L or x1 != RANS_L or x2 != RANS_L or x3 != RANS_L or pos != end:
        return ERR_STATE
    return OK
