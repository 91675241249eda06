"""Digest of every numeric kernel's output bits on fixed inputs, for the cross-CPU test.

``python tests/compression/isa_digest.py`` prints one JSON object {kernel: sha256 of its
output bytes}. test_grid.py runs it under ``NUMBA_CPU_NAME=generic`` (plain x86-64: SSE2, no
FMA) and ``haswell`` (AVX2 + FMA) and compares with this process's own build (the host CPU,
AVX-512 on the development machine): any kernel whose rounding depends on the instruction set
shows up as a differing entry. The inputs include huge finite values (up to float32's max),
subnormal buckets and lengths that leave scalar tails, where ISA differences hide.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tail_ray.bitwidth.lowrank_rows import rows_lost_share
from tail_ray.bitwidth.quant_error import relative_errors
from tail_ray.compression.dither import mean_undithered_into
from tail_ray.compression.fixedsum import sum_squares
from tail_ray.compression.lowrank import reconstruct
from tail_ray.compression.lowrank_kernels import captured_energy_arrays, power_step_arrays
from tail_ray.compression.peer_spread import peer_sums
from tail_ray.compression.quantize import dequantize, n_buckets, quantize, quantize_finite
from tail_ray.compression.rank_mean import mean_dequantized_into, mean_into
from tail_ray.compression.record_tensors import sample_stack
from tail_ray.compression.records import LowRankRecord, QuantRecord
from tail_ray.compression.tail import TailCompressor, TailConfig

F32_MAX = float(np.finfo(np.float32).max)


def _gradient(n: int, seed: int) -> np.ndarray:
    """Heavy-tailed values with a few awkward buckets: huge, subnormal, all-zero."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_t(3, size=n) * 1e-3).astype(np.float32)
    x[:300] = rng.uniform(-F32_MAX, F32_MAX, 300).astype(np.float32)  # huge (first bucket)
    x[512:1024] = (rng.standard_normal(512) * 1e-40).astype(np.float32)  # subnormal bucket
    x[1024:1536] = 0.0
    return x


def _digest(parts: list[np.ndarray | bytes | float | int]) -> str:
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, bytes):
            h.update(p)
        elif isinstance(p, np.ndarray):
            h.update(np.ascontiguousarray(p).tobytes())
        else:
            h.update(np.float64(p).tobytes())
    return h.hexdigest()


def _rows_lost(g: np.ndarray) -> list[np.ndarray | bytes | float | int]:
    """The low-rank trial's rows check on rows whose ratios straddle its limit: finite values
    only (the huge first bucket's squares would count as lost everywhere)."""
    p = g[2048 : 2048 + 500 * 16].reshape(500, 16)
    return [rows_lost_share(p, bits, bucket) for bits in (2, 4, 8) for bucket in (64, 512)]


def digests() -> dict[str, str]:
    out: dict[str, str] = {}
    n = 70_001  # not a multiple of any bucket or vector width: scalar tails everywhere
    g = _gradient(n, 1)

    def record(name: str, fn: Callable[[], list[np.ndarray | bytes | float | int]]) -> None:
        out[name] = _digest(fn())

    record("sum_squares", lambda: [sum_squares(g), sum_squares(g[:1001])])
    record("low-rank rows lost", lambda: _rows_lost(g))
    record("controller decisions", _decisions)

    quantized: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    dithered: dict[int, QuantRecord] = {}
    for bits in (2, 3, 4, 8):
        levels = np.empty(n, np.int8)
        scales = np.empty(n_buckets(n, 512), np.float32)
        nnz = quantize(g, bits, 512, 5, levels, scales)
        quantized[bits] = (levels, scales)
        out[f"quantize_{bits}b"] = _digest([levels, scales, nnz])

        residual = np.zeros(n, np.float32)
        parts: list[np.ndarray | bytes | float | int] = []
        for step in range(3):  # the residual feeds back: three steps of error feedback
            nnz, err = quantize_finite(g, residual, bits, 512, 10 + step, levels, scales)
            parts += [levels.copy(), scales.copy(), residual.copy(), nnz, err]
        out[f"quantize_ef_{bits}b"] = _digest(parts)

        # Round-to-nearest (issue 15): levels, then three steps of error feedback.
        near_levels = np.empty(n, np.int8)
        nnz = quantize(g, bits, 512, 5, near_levels, scales, rounding="nearest")
        residual = np.zeros(n, np.float32)
        parts = [near_levels.copy(), scales.copy(), nnz]
        for step in range(3):
            nnz, err = quantize_finite(g, residual, bits, 512, 10 + step, levels, scales, rounding="nearest")
            parts += [levels.copy(), scales.copy(), residual.copy(), nnz, err]
        out[f"quantize_nearest_{bits}b"] = _digest(parts)

        # Subtractive dither (issue 15): levels, the decoded values, and the residual folded once.
        dith_levels = np.empty(n, np.int8)
        nnz = quantize(g, bits, 512, 5, dith_levels, scales, rounding="dither")
        parts = [dith_levels, scales.copy(), nnz, dequantize(dith_levels, scales, bits, 512, dither_seed=5)]
        residual = g * np.float32(0.25)
        nnz_e, _ = quantize_finite(g, residual, bits, 512, 6, levels, scales, rounding="dither")
        out[f"quantize_dither_{bits}b"] = _digest([*parts, levels, scales, nnz_e, residual])
        dithered[bits] = QuantRecord("w", bits, 512, scales.copy(), levels.copy(), dither_seed=6)

    for bits, bucket in ((2, 512), (4, 7), (8, 100), (8, 1000)):
        rng = np.random.default_rng(bits + bucket)
        lmax = (1 << (bits - 1)) - 1
        lv = rng.integers(-lmax, lmax + 1, n).astype(np.int8)
        sc = rng.random(n_buckets(n, bucket)).astype(np.float32)
        sc[:3] = (F32_MAX, 1e-40, 3e38)
        out[f"dequantize_{bits}b_{bucket}"] = _digest([dequantize(lv, sc, bits, bucket)])

    # The low-rank product every receiver (and the sender's residual) computes: decoded
    # factors, huge and subnormal scales, a column count that leaves scalar tails.
    rng = np.random.default_rng(7)
    rows, cols, rank = 67, 131, 5
    scales_p = rng.random(n_buckets(rank * rows, 64)).astype(np.float32)
    scales_q = rng.random(n_buckets(rank * cols, 64)).astype(np.float32)
    scales_p[:2] = (3e38, 1e-40)
    scales_q[:2] = (1e-20, 3e30)
    low = LowRankRecord(
        "w",
        rows,
        cols,
        rank,
        8,
        64,
        scales_p,
        rng.integers(-127, 128, rank * rows).astype(np.int8),
        scales_q,
        rng.integers(-127, 128, rank * cols).astype(np.int8),
    )
    out["lowrank_reconstruct"] = _digest([reconstruct(low)])

    ranks = [quantized[b] for b in (2, 3, 4, 8)]
    for world in (2, 3, 4):
        mean = np.empty(n, np.float32)
        sums = mean_dequantized_into(  # with the spread sample the mean pass reads
            [r[0] for r in ranks[:world]],
            [r[1] for r in ranks[:world]],
            [2, 3, 4, 8][:world],
            [512] * world,
            mean,
            sample_stride=7,
        )
        decoded = [
            dequantize(lv, sc, b, 512) for (lv, sc), b in zip(ranks[:world], (2, 3, 4, 8), strict=False)
        ]
        plain = np.empty(n, np.float32)
        mean_into(decoded, plain)
        out[f"mean_{world}_ranks"] = _digest([mean, plain, sums])

    # The dithered rank mean (fused) and the controller's sample of dithered layers.
    dith = [dithered[b] for b in (2, 3, 4, 8)]
    for world in (2, 4):
        mean = np.empty(n, np.float32)
        sums = mean_undithered_into(
            [r.levels for r in dith[:world]],
            [r.scales for r in dith[:world]],
            [r.bits for r in dith[:world]],
            [512] * world,
            [6 + i for i in range(world)],
            mean,
            sample_stride=7,
        )
        out[f"mean_dither_{world}_ranks"] = _digest([mean, sums])
    record("sample_stack_dither", lambda: [sample_stack(dith, s).numpy() for s in (1, 7)])

    records = [
        QuantRecord("w", b, 512, scales=sc, levels=lv)
        for (lv, sc), b in zip(ranks, (2, 3, 4, 8), strict=True)
    ]
    record("sample_stack", lambda: [sample_stack(records, s).numpy() for s in (1, 7)])
    # observe_peers' sums: plain, dithered and mixed ranks, fixed lanes.
    groups = (records, dith, [dith[0], records[1], dith[2]])
    record("peer_sums", lambda: [np.array(peer_sums(recs, s)[:3]) for recs in groups for s in (1, 7)])

    record(
        "relative_errors",
        lambda: [
            relative_errors(
                g, None, 512, (2, 3, 4, 5, 6, 8), sample_numel=None, rng=np.random.default_rng(0)
            ),
            relative_errors(g, g * 0.5, 512, (2, 4, 8), sample_numel=4096, rng=np.random.default_rng(0)),
        ],
    )
    record(
        "relative_errors_nearest",
        lambda: [
            relative_errors(
                g,
                None,
                512,
                (2, 3, 4, 8),
                sample_numel=None,
                rng=np.random.default_rng(0),
                rounding="nearest",
            ),
            relative_errors(
                g, g * 0.5, 512, (2, 4), sample_numel=4096, rng=np.random.default_rng(0), rounding="nearest"
            ),
        ],
    )

    record(
        "relative_errors_dither",
        lambda: [
            relative_errors(
                g, None, 512, (2, 4, 8), sample_numel=None, rng=np.random.default_rng(0), rounding="dither"
            ),
        ],
    )

    # The whole pipeline: controller, quantizer, error feedback, codes, wire; and decoding.
    for suffix, rounding in (("", "stochastic"), ("_nearest", "nearest"), ("_dither", "dither")):
        payloads, decoded_bits = _tail_steps(TailConfig(seed=3, rounding=rounding))
        out[f"tail_payloads{suffix}"] = _digest(payloads)
        out[f"tail_decoded{suffix}"] = _digest(decoded_bits)
    out["sharded"] = _digest(_sharded_steps())
    out["lowrank_kernels"] = _digest(_lowrank_kernel_outputs())
    out["tail_lowrank_agreed"] = _digest(_lowrank_steps())
    return out


def _lowrank_kernel_outputs() -> list[np.ndarray | bytes | float | int]:
    """The low-rank path's power step and energy (lowrank_kernels.py) on awkward shapes: row
    counts that leave a partial block of four, a warm start with a repeated column (a zero
    direction) and a layer of huge values."""
    rng = np.random.default_rng(11)
    parts: list[np.ndarray | bytes | float | int] = []
    for rows, cols, rank, scale in ((131, 257, 8, 1e-2), (64, 1000, 16, 3e30), (7, 5, 3, 1.0)):
        m = (rng.standard_t(3, size=(rows, cols)) * scale).astype(np.float32)
        q = rng.standard_normal((cols, rank)).astype(np.float32)
        q[:, -1] = q[:, 0]
        p, q_next = power_step_arrays(m, q)
        captured, basis = captured_energy_arrays(q_next)
        parts += [p, q_next, captured, basis]
    return parts


def _lowrank_steps() -> list[np.ndarray | bytes | float | int]:
    """Two ranks with ``lowrank="on"`` (agreed choice) on a rank-2 matrix plus noise: the
    choosers' trials, the agreement, the factors and their error feedback, 24 steps."""
    settings = {"lowrank": "on", "warmup_steps": 0, "redecide_every_steps": 4}
    ranks = [TailCompressor(TailConfig(**settings, seed=7 + r)) for r in range(2)]  # type: ignore[arg-type]
    rng = np.random.default_rng(12)
    u, v = rng.standard_normal((128, 2)), rng.standard_normal((256, 2))
    parts: list[np.ndarray | bytes | float | int] = []
    for _ in range(24):
        payloads = []
        for comp in ranks:
            w = (u @ v.T + 0.01 * rng.standard_normal((128, 256))).astype(np.float32)
            grads = {"w": torch.from_numpy(w), "b": torch.from_numpy(w[0, :64].copy())}
            payloads.append(comp.compress(grads))
            parts.append(repr([(s.layer, s.code, s.encoded_bytes) for s in comp.last_stats]).encode())
        for r, comp in enumerate(ranks):
            into = {"w": torch.zeros(128, 256), "b": torch.zeros(64)}
            comp.aggregate(payloads, into, own=r)
            parts.append(into["w"].numpy())
        parts += payloads
    return parts


def _tail_steps(config: TailConfig) -> tuple[list[np.ndarray | bytes | float | int], ...]:
    """Three steps of a Tail compressor: its payloads and stats, and every payload decoded."""
    comp = TailCompressor(config)
    payloads: list[np.ndarray | bytes | float | int] = []
    decoded_bits: list[np.ndarray | bytes | float | int] = []
    rng = np.random.default_rng(4)
    for _ in range(3):
        grads = {
            "huge": torch.from_numpy(_gradient(20_000, 5)),
            "w": torch.from_numpy((rng.standard_normal(50_000) * 1e-2).astype(np.float32)),
            "sparse": torch.from_numpy(
                np.where(rng.random(40_000) < 0.02, rng.standard_normal(40_000), 0).astype(np.float32)
            ),
            "bias": torch.from_numpy(rng.standard_normal(64).astype(np.float32)),
        }
        payload = comp.compress(grads)
        payloads.append(payload)
        payloads += [
            repr([(s.layer, s.bits, s.density, s.encoded_bytes, s.code) for s in comp.last_stats]).encode()
        ]
        decoded_bits += [t.numpy() for t in TailCompressor().decompress(payload).values()]
    return payloads, decoded_bits


def _sharded_steps() -> list[np.ndarray | bytes | float | int]:
    """The sharded collective's arithmetic on one owner: 3 ranks cut each step into 3 shards
    (compress_shards), the owner of shard 1 averages the 3 slices it gets (aggregate, which
    also feeds its controller and its second stage's budget) and re-compresses the mean with
    its second stage; then every rank decodes that compressed mean."""
    ranks = [TailCompressor(TailConfig(seed=10 + r)) for r in range(3)]
    stage_two = ranks[1].second_stage()
    shards = [
        {"w": slice(0, 16_384)},
        {"w": slice(16_384, 50_000), "bias": slice(0, 64)},
        {"huge": slice(0, 20_000)},
    ]
    rng = np.random.default_rng(6)
    common = (rng.standard_normal(50_000) * 1e-2).astype(np.float32)
    parts: list[np.ndarray | bytes | float | int] = []
    for _ in range(3):
        sliced = [
            comp.compress_shards(
                {
                    "huge": torch.from_numpy(_gradient(20_000, 7 + r)),
                    "w": torch.from_numpy(common + (rng.standard_normal(50_000) * 1e-2).astype(np.float32)),
                    "bias": torch.from_numpy(rng.standard_normal(64).astype(np.float32)),
                },
                shards,
                own_shard=1,
            )
            for r, comp in enumerate(ranks)
        ]
        mean = {"w": torch.zeros(50_000 - 16_384), "bias": torch.zeros(64)}
        ranks[1].aggregate([payloads[1] for payloads in sliced], mean, own=1)
        summed = stage_two.compress(mean)
        into = {name: torch.zeros_like(t) for name, t in mean.items()}
        ranks[0].aggregate([summed], into)
        parts += [p for payloads in sliced for p in payloads]
        parts += [t.numpy() for t in mean.values()] + [summed] + [t.numpy() for t in into.values()]
    return parts


def _decisions() -> list[np.ndarray | bytes | float | int]:
    """The bit controller's decisions on the seeded gradients of the decision-digest test
    (both allocations): whatever numpy, torch or numba code a decision goes through."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bitwidth"))
    from test_decision_digest import _controller_trace

    return list(_controller_trace("layer") + _controller_trace("model"))


if __name__ == "__main__":
    print(json.dumps(digests(), sort_keys=True))
