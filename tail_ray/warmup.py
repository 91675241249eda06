"""Compile every numba kernel once, so that no training worker waits for the compiler.

``tail-ray warmup`` (and the demo, before it submits jobs) calls ``warmup()``: it runs the
codec's real code paths on small synthetic layers (every compressor, every code, decoding,
the rank means for 1 to ``max_world`` ranks, the controller's estimate), and numba writes each
compiled kernel to the shared cache (tail_ray/kernel_cache.py). Every later process on this
machine, Ray workers included, loads them in about a second instead of compiling for ~30 s.

With a warm cache the whole call takes a few seconds: it is safe to run on every start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from tail_ray.bitwidth.quant_error import relative_errors
from tail_ray.compression import make_compressor
from tail_ray.compression.dither import mean_undithered_into
from tail_ray.compression.fixedsum import sum_squares
from tail_ray.compression.lowrank import compress_lowrank
from tail_ray.compression.lowrank_kernels import captured_energy_arrays
from tail_ray.compression.peer_spread import peer_sums
from tail_ray.compression.quantize import quantize_finite
from tail_ray.compression.rank_mean import mean_dequantized_into, mean_into
from tail_ray.compression.record_tensors import sample_stack
from tail_ray.compression.records import QuantRecord
from tail_ray.compression.wire import decode_payload, encode_payload
from tail_ray.kernel_cache import prune_versions, version_dir

logger = logging.getLogger(__name__)

# The fused means are compiled per number of ranks (a tuple of arrays per rank); jobs with
# more ranks compile theirs on first use (about a second each).
DEFAULT_MAX_WORLD = 8


@dataclass
class WarmupReport:
    """What ``warmup`` did: seconds per stage, in order, and where the kernels are cached."""

    stages_s: dict[str, float] = field(default_factory=dict)
    cache_dir: str = ""

    @property
    def total_s(self) -> float:
        return sum(self.stages_s.values())


def _layers(rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """Layers that make the encoder pick every code: dense (rANS / pairs), flat (bit-pack),
    mostly zero with a bucket of subnormals (sparse rANS), tiny (raw). (No non-finite layer:
    it needs no kernel of its own, and would use up the process's few warnings about such.)"""
    n = 20_000
    sparse = np.zeros(n, np.float32)
    sparse[rng.choice(n, n // 200, replace=False)] = rng.standard_normal(n // 200)
    sparse[:512] = rng.standard_normal(512).astype(np.float32) * np.float32(1e-40)
    arrays = {
        "dense": rng.standard_normal(n).astype(np.float32),
        "flat": rng.uniform(-1, 1, 5_000).astype(np.float32),
        "sparse": sparse,
        "bias": rng.standard_normal(100).astype(np.float32),
    }
    return {name: torch.from_numpy(a) for name, a in arrays.items()}


def _compressors() -> None:
    rng = np.random.default_rng(0)
    grads = _layers(rng)
    for method, settings in (
        ("tail", {"seed": 0, "candidate_bits": (4,), "rounding": "nearest"}),  # error feedback
        ("tail", {"seed": 0, "candidate_bits": (8,)}),
        ("tail", {"seed": 0}),  # dither (rounding "auto"): its kernel and its decoder
        ("qsgd", {"bits": 4, "seed": 0}),
        ("topk", {"density": 0.01}),
        ("none", {}),
    ):
        comp = make_compressor(method, **settings)
        for _ in range(2):  # the second call runs with error feedback and a controller state
            payload = comp.compress(grads)
            comp.decompress(payload)
            decode_payload(payload)
    # Tail's low-rank layers (lowrank="auto"): factors, their product, the LOWRANK code.
    matrix = rng.standard_normal(64 * 96).astype(np.float32)
    q_warm = torch.from_numpy(rng.standard_normal((96, 4)).astype(np.float32))
    record, q_next, _product = compress_lowrank(
        "lowrank", matrix, 64, 96, q_warm, bits=8, bucket_size=512, seed=0
    )
    decode_payload(encode_payload([record])[0])
    captured_energy_arrays(q_next.numpy())  # the chooser's trials: Gram, Jacobi, rotation
    # Dither with a residual carried in (one left by low-rank, or a checkpoint of nearest).
    x = rng.standard_normal(4096).astype(np.float32)
    levels, scales = np.empty(x.size, np.int8), np.empty(8, np.float32)
    quantize_finite(x, x * np.float32(0.5), 4, 512, 0, levels, scales, rounding="dither")


def _means(max_world: int) -> None:
    rng = np.random.default_rng(1)
    n = 4_096
    levels = rng.integers(-7, 8, n).astype(np.int8)
    scales = rng.random(n // 512).astype(np.float32)
    values = rng.standard_normal(n).astype(np.float32)
    out = np.empty(n, np.float32)
    for world in range(1, max_world + 1):
        mean_dequantized_into([levels] * world, [scales] * world, [4] * world, [512] * world, out)
        mean_undithered_into([levels] * world, [scales] * world, [4] * world, [512] * world, [1] * world, out)
        mean_into([values] * world, out)


def _controller() -> None:
    rng = np.random.default_rng(2)
    g = rng.standard_normal(20_000).astype(np.float32)
    sum_squares(g)
    relative_errors(g, None, 512, (2, 3, 4, 5, 6, 8), sample_numel=4096, rng=rng)
    relative_errors(g, g * 0.1, 512, (2, 3, 4, 5, 6, 8), sample_numel=None, rng=rng)
    rec = QuantRecord("w", 4, 512, scales=np.abs(g[: -(-g.size // 512)]), levels=np.zeros(g.size, np.int8))
    sample_stack([rec, rec], 7)
    sample_stack([replace(rec, dither_seed=1), replace(rec, dither_seed=2)], 7)  # dither's sample
    peer_sums([rec, replace(rec, dither_seed=1)], 7)  # observe_peers' sums: one kernel, any world


def warmup(
    *, max_world: int = DEFAULT_MAX_WORLD, progress: Callable[[str, int, int, float], None] | None = None
) -> WarmupReport:
    """Compile (or load from the cache) every kernel; ``progress(stage, i, n, seconds)`` after
    each stage (default: an INFO log line). Returns what took how long."""
    if max_world < 1:
        raise ValueError(f"max_world must be >= 1, got {max_world}")
    stages: list[tuple[str, Callable[[], None]]] = [
        ("compressors and codes (tail, qsgd, topk, none; every wire code)", _compressors),
        (f"rank means for 1..{max_world} ranks", lambda: _means(max_world)),
        ("controller estimate and sampled view", _controller),
    ]
    report = WarmupReport(cache_dir=str(version_dir()))
    for old in prune_versions():
        logger.info("removed the cached kernels of an older tail_ray version: %s", old)
    logger.info("compiling tail_ray's kernels into %s (a few seconds when already cached)", report.cache_dir)
    for i, (label, run) in enumerate(stages, start=1):
        start = time.perf_counter()
        run()
        report.stages_s[label] = time.perf_counter() - start
        if progress is not None:
            progress(label, i, len(stages), report.stages_s[label])
        else:
            logger.info("warmup %d/%d %s: %.1f s", i, len(stages), label, report.stages_s[label])
    return report
