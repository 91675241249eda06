"""Micro-benchmark of the level coder: size vs the order-0 bound, and speed vs a plain copy.

    python -m jobs.bench_coding [--quick]

Synthetic quantized gradients (peaked, roughly symmetric level histograms, as stochastic
rounding of Gaussian-ish gradients gives) at every bit-width, plus row-sparse layers. Speed
is single-thread GB/s of the ORIGINAL fp32 gradient (4 * numel bytes / s); the copy columns
time np.copyto and torch.clone of a 4 * numel-byte buffer in the same run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from tail_ray.compression.entropy import entropy_bound_bytes
from tail_ray.compression.levelcode import CODE_NAMES, decode_levels, encode_levels


def best_time_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: JIT load, page faults
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def synthetic(n: int, bits: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    half = (1 << (bits - 1)) - 1
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    sizes = [1 << 16, 1 << 20] if args.quick else [1 << 16, 1 << 20, 1 << 22]
    repeats = 3 if args.quick else 7
    print(
        f"{'layer':<22}{'numel':>9} {'code':<12}{'bytes':>9}{'bound':>10}{'/bound':>8}"
        f"{'enc GB/s':>9}{'dec GB/s':>9}{'copy np':>8}{'copy pt':>8}{'enc/pt':>7}{'dec/pt':>7}"
    )
    for n in sizes:
        src = rng.standard_normal(n).astype(np.float32)
        dst = np.empty_like(src)
        t_np = best_time_s(lambda: np.copyto(dst, src), repeats)
        src_t = torch.from_numpy(src)
        t_pt = best_time_s(lambda: src_t.clone(), repeats)
        gbs = lambda t: 4 * n / t / 1e9  # noqa: E731
        for kind in ("peaked", "rows"):
            for bits in (2, 3, 4, 6, 8):
                levels = synthetic(n, bits, kind, rng)
                code, nnz, body = encode_levels(levels, bits)
                arr = np.frombuffer(body, np.uint8)
                t_enc = best_time_s(lambda: encode_levels(levels, bits), repeats)  # noqa: B023
                t_dec = best_time_s(lambda: decode_levels(code, arr, n, bits, nnz, layer="b"), repeats)  # noqa: B023
                out = decode_levels(code, arr, n, bits, nnz, layer="b")
                assert np.array_equal(out, levels)
                bound = entropy_bound_bytes(levels)
                print(
                    f"{kind + f'-{bits}bit':<22}{n:>9} {CODE_NAMES[code]:<12}{len(body):>9}{bound:>10.0f}"
                    f"{len(body) / max(bound, 1):>8.4f}{gbs(t_enc):>9.2f}{gbs(t_dec):>9.2f}"
                    f"{gbs(t_np):>8.1f}{gbs(t_pt):>8.1f}{t_pt / t_enc:>7.1%}{t_pt / t_dec:>7.1%}"
                )


if __name__ == "__main__":
    main()
