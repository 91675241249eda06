"""Micro-benchmark of the level coder: size vs the order-0 bound, and speed vs a plain copy.

    pip install -e ".[bench]"   # constriction, the reference coder, lives in the bench extra
    python -m jobs.bench_coding [--quick]

Synthetic quantized gradients (peaked, roughly symmetric level histograms, as stochastic
rounding of Gaussian-ish gradients gives) at every bit-width, plus row-sparse layers. Speed
is single-thread GB/s of the ORIGINAL fp32 gradient (4 * numel bytes / s); the copy columns
time np.copyto and torch.clone of a 4 * numel-byte buffer in the same run.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import numpy as np
import torch

try:
    import constriction
except ModuleNotFoundError:  # only this benchmark uses it, so only the bench extra installs it
    raise SystemExit('jobs.bench_coding needs constriction: pip install -e ".[bench]"') from None

from tail_ray.compression.code_table import CODE_NAMES, decode_levels, encode_levels
from tail_ray.compression.entropy import entropy_bound_bytes
from tail_ray.compression.grid import levels_max


def best_time_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: JIT load, page faults
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def synthetic(n: int, bits: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    half = levels_max(bits)
    if kind == "peaked":
        # max-abs bucket scaling puts most mass near 0: sigma ~ L/4 of the bucket max
        x = rng.standard_normal(n) * (half / 4.0 if bits > 2 else 0.5)
        lo = np.floor(x)
        return np.clip(lo + (rng.random(n) < x - lo), -half, half).astype(np.int8)
    rows = n // 256
    out = np.zeros((rows, 256), np.int8)
    hot = rng.random(rows) < 0.05
    out[hot] = synthetic(int(hot.sum()) * 256, bits, "peaked", rng).reshape(-1, 256)
    return out.reshape(-1)


def constriction_row(levels: np.ndarray, bits: int, repeats: int) -> tuple[int, float, float]:
    """(bytes, encode s, decode s) of constriction's rANS with a Categorical model, for reference."""
    half = levels_max(bits)
    sym = levels.astype(np.int32) + half
    probs = np.bincount(sym, minlength=2 * half + 1) / sym.size
    model = constriction.stream.model.Categorical(probs.astype(np.float64), perfect=False)

    def enc() -> np.ndarray:
        coder = constriction.stream.stack.AnsCoder()
        coder.encode_reverse(sym, model)
        return coder.get_compressed()

    compressed = enc()
    t_enc = best_time_s(enc, repeats)

    def dec() -> np.ndarray:
        return constriction.stream.stack.AnsCoder(compressed).decode(model, sym.size)

    t_dec = best_time_s(dec, repeats)
    assert np.array_equal(dec(), sym)
    return 4 * compressed.size, t_enc, t_dec


def print_row(label: str, n: int, code: str, size: int, bound: float, times_s: tuple[float, ...]) -> None:
    """times_s = (encode, decode, np.copyto, torch.clone), all for the same 4 * n bytes."""
    t_enc, t_dec, t_np, t_pt = times_s
    enc, dec, cp_np, cp_pt = (4 * n / t / 1e9 for t in times_s)
    print(
        f"{label:<22}{n:>9} {code:<12}{size:>9}{bound:>10.0f}{size / max(bound, 1):>8.4f}"
        f"{enc:>9.2f}{dec:>9.2f}{cp_np:>8.1f}{cp_pt:>8.1f}"
        f"{t_pt / t_enc:>7.1%}{t_pt / t_dec:>7.1%}{t_np / t_enc:>7.1%}{t_np / t_dec:>7.1%}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    sizes = [1 << 16, 1 << 20] if args.quick else [1 << 16, 1 << 20, 1 << 22]
    repeats = 3 if args.quick else 7
    print(
        f"{'layer':<22}{'numel':>9} {'code':<12}{'bytes':>9}{'bound':>10}{'/bound':>8}"
        f"{'enc GB/s':>9}{'dec GB/s':>9}{'copy np':>8}{'copy pt':>8}"
        f"{'enc/pt':>7}{'dec/pt':>7}{'enc/np':>7}{'dec/np':>7}"
    )
    for n in sizes:
        src = rng.standard_normal(n).astype(np.float32)
        t_np = best_time_s(functools.partial(np.copyto, np.empty_like(src), src), repeats)
        t_pt = best_time_s(torch.from_numpy(src).clone, repeats)
        for kind in ("peaked", "rows"):
            for bits in (2, 3, 4, 6, 8):
                levels = synthetic(n, bits, kind, rng)
                code, nnz, body = encode_levels(levels, bits)
                arr = np.frombuffer(body, np.uint8)
                decode = functools.partial(decode_levels, code, arr, n, bits, nnz, layer="bench")
                t_enc = best_time_s(functools.partial(encode_levels, levels, bits), repeats)
                t_dec = best_time_s(decode, repeats)
                assert np.array_equal(decode(), levels)
                bound = entropy_bound_bytes(levels)
                times_s = (t_enc, t_dec, t_np, t_pt)
                print_row(f"{kind}-{bits}bit", n, CODE_NAMES[code], len(body), bound, times_s)
                if kind == "peaked" and bits == 4:
                    size, c_enc, c_dec = constriction_row(levels, bits, repeats)
                    print_row("  constriction ref", n, "ans-categ", size, bound, (c_enc, c_dec, t_np, t_pt))


if __name__ == "__main__":
    main()
