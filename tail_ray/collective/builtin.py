"""The peers that run on PyTorch's own hooks: none / fp16 / bf16 (all-reduce) and powersgd.

Each wrapper calls PyTorch's hook unchanged and only adds what tail-ray needs around it:
layer names, per-layer and traffic metrics, and (for PowerSGD) a fixed collective order.

Traffic of all-reduce is counted with the ring model (transport.ring_allreduce_bytes):
2*(W-1)/W of the reduced tensor's bytes sent by each rank, and as many received.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's
# annotations with dist.GradBucket / Future[Tensor] objects, not strings.

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from tail_ray.collective.state import TailHookState
from tail_ray.collective.transport import ring_allreduce_bytes
from tail_ray.compression.stats import LayerStats
from tail_ray.errors import ConfigError

_CAST_DTYPES: dict[str, torch.dtype] = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_CAST_BITS = {"none": 32, "fp16": 16, "bf16": 16}
_CODE = {"none": "fp32", "fp16": "fp16", "bf16": "bf16"}

# Settings for "powersgd" and their defaults. `rank` is accepted as the short name of
# matrix_approximation_rank. start_powerSGD_iter defaults to 2 (PyTorch's smallest legal value
# with error feedback), not PyTorch's 1000: a comparison run should compress from the start,
# as every other method does.
POWERSGD_DEFAULTS: dict[str, Any] = {
    "matrix_approximation_rank": 1,
    "start_powerSGD_iter": 2,
    "min_compression_rate": 2,
    "use_error_feedback": True,
    "warm_start": True,
    "orthogonalization_epsilon": 0.0,
    "random_seed": 0,
}


def check_no_settings(method: str, settings: Mapping[str, Any]) -> None:
    if settings:
        raise ConfigError(f"method {method!r} takes no settings, got {sorted(settings)}; pass config=None")


def make_powersgd_state(
    settings: Mapping[str, Any], process_group: dist.ProcessGroup | None
) -> PowerSGDState:
    merged = dict(POWERSGD_DEFAULTS)
    for key, value in settings.items():
        name = "matrix_approximation_rank" if key == "rank" else key
        if name not in POWERSGD_DEFAULTS:
            raise ConfigError(
                f"unknown powersgd setting {key!r}; choose from {['rank', *sorted(POWERSGD_DEFAULTS)]}"
            )
        merged[name] = value
    rank = merged["matrix_approximation_rank"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ConfigError(f"powersgd rank must be an integer >= 1, got {rank!r}")
    start = merged["start_powerSGD_iter"]
    if not isinstance(start, int) or start < 2:
        raise ConfigError(
            f"powersgd start_powerSGD_iter must be an integer >= 2 (PyTorch's rule), got {start!r}"
        )
    # compression_stats_logging_frequency: PyTorch logs every N iterations; keep it quiet.
    return PowerSGDState(process_group=process_group, compression_stats_logging_frequency=1 << 30, **merged)


def _finish(start: float, state: TailHookState):  # type: ignore[no-untyped-def]
    def record_comm(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        state.record(comm_s=time.perf_counter() - start)
        return fut.value()

    return record_comm


def _bucket_layers(state: TailHookState, bucket: dist.GradBucket) -> list[tuple[str, torch.Tensor]]:
    return [(state.name_of(p), g) for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)]


def _cast_error(g: torch.Tensor, dtype: torch.dtype, world_size: int) -> float:
    """Relative squared error of the cast the hook applies to this rank's share (g / W)."""
    if dtype == torch.float32:
        return 0.0
    share = g.detach() / world_size
    norm = float(share.pow(2).sum())
    if norm == 0.0:
        return 0.0
    return float((share.to(dtype).to(share.dtype) - share).pow(2).sum()) / norm


def allreduce_peer_hook(state: TailHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """none / fp16 / bf16: PyTorch's own hooks, with layer metrics and comm time recorded.

    Each issues exactly one collective per bucket from DDP's calling thread, so the order is
    the same on every rank and the collective may stay asynchronous (overlapping backward).
    """
    return cast_allreduce(state, bucket, state.method, _CODE[state.method])


def cast_allreduce(
    state: TailHookState, bucket: dist.GradBucket, method: str, code: str
) -> torch.futures.Future[torch.Tensor]:
    """One asynchronous all-reduce of ``bucket`` cast per ``method`` (none/fp16/bf16), with its
    metrics; ``code`` names it in the per-layer records (the link-aware switch uses
    "allreduce" so a plain step of a compressing method is told apart from method none)."""
    world_size = state.world_size
    dtype = _CAST_DTYPES[method]
    layers = [
        LayerStats(
            name,
            g.numel(),
            _CAST_BITS[method],
            1.0,
            4 * g.numel(),
            g.numel() * _CAST_BITS[method] // 8,
            _cast_error(g, dtype, world_size),
            code,
        )
        for name, g in _bucket_layers(state, bucket)
    ]
    wire_bytes = bucket.buffer().numel() * _CAST_BITS[method] // 8
    moved = ring_allreduce_bytes(wire_bytes, world_size)
    start = time.perf_counter()
    if method == "none":
        fut = default_hooks.allreduce_hook(state.group, bucket)
    elif method == "fp16":
        fut = default_hooks.fp16_compress_hook(state.group, bucket)
    else:
        fut = default_hooks.bf16_compress_hook(state.group, bucket)
    state.record(layers=layers, bytes_sent=moved, bytes_received=moved, exchanges=1)
    return fut.then(_finish(start, state))


def _powersgd_layer(state: PowerSGDState, name: str, g: torch.Tensor, compressing: bool) -> LayerStats:
    """Per-layer wire size exactly as powerSGD_hook decides it (its `_should_compress` rule)."""
    n = g.shape[0] if g.dim() > 0 else 1
    m = g.numel() // max(n, 1)
    r = min(n, m, state.matrix_approximation_rank)
    low_rank = compressing and (n + m) * r * state.min_compression_rate < n * m
    if low_rank:
        # rel_error is filled in once the approximation is known (_with_powersgd_errors).
        return LayerStats(name, g.numel(), 32, 1.0, 4 * g.numel(), 4 * (n + m) * r, 0.0, f"rank{r}")
    return LayerStats(name, g.numel(), 32, 1.0, 4 * g.numel(), 4 * g.numel(), 0.0, "fp32")


def _with_powersgd_errors(
    layers: list[LayerStats], grads: list[torch.Tensor], output: torch.Tensor, residual: torch.Tensor
) -> list[LayerStats]:
    """rel_error of each low-rank layer: ||input - output||^2 / ||input||^2 on this rank.

    ``input`` is what PowerSGD approximated here (gradient + fed-back error) and ``output``
    the averaged low-rank result: so this is the relative size of PowerSGD's own residual,
    which includes the spread between workers' gradients as well as the low-rank error.
    """
    out: list[LayerStats] = []
    offset = 0
    for stats, g in zip(layers, grads, strict=True):
        n = g.numel()
        if stats.code.startswith("rank"):
            res = residual[offset : offset + n]
            inp = output[offset : offset + n] + res
            norm = float(inp.pow(2).sum())
            err = float(res.pow(2).sum()) / norm if norm > 0 else 0.0
            stats = dataclasses.replace(stats, rel_error=err)
        out.append(stats)
        offset += n
    return out


def powersgd_peer_hook(state: TailHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's PowerSGDState + powerSGD_hook, serialised bucket by bucket.

    Why serialised: powerSGD_hook issues its 2nd and 3rd all-reduce from future callbacks,
    which run on gloo's worker threads as soon as the previous collective of THAT bucket
    finishes. With several buckets in flight, rank 0 may issue bucket 3's P all-reduce before
    bucket 4's first all-reduce while rank 1 does the opposite: gloo then pairs different
    collectives ("Received data size doesn't match expected size") or waits forever. Waiting
    here for the whole chain before returning means only one bucket's chain exists at a time,
    so every rank issues the same collectives in the same order. The price is no overlap of
    PowerSGD's communication with the rest of backward.
    """
    ps = state.powersgd
    compressing = ps.iter >= ps.start_powerSGD_iter
    world_size = state.world_size
    named = _bucket_layers(state, bucket)
    layers = [_powersgd_layer(ps, name, g, compressing) for name, g in named]
    # Without error feedback PowerSGD keeps no copy of its input; keep one to measure the error.
    before = bucket.buffer().detach().clone() if compressing and not ps.use_error_feedback else None
    # All-reduced bytes: uncompressed layers as they are, compressed ones as P (n*r) and Q (m*r).
    moved = sum(ring_allreduce_bytes(layer.encoded_bytes, world_size) for layer in layers)
    start = time.perf_counter()
    result = powerSGD_hook(ps, bucket).wait()
    if compressing:
        # With error feedback powerSGD_hook stored input + old error - output: its residual.
        residual = before - result if before is not None else ps.error_dict[bucket.index()]
        layers = _with_powersgd_errors(layers, [g for _, g in named], result, residual)
    state.record(
        layers=layers, bytes_sent=moved, bytes_received=moved, comm_s=time.perf_counter() - start, exchanges=1
    )
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(result)
    return done


# -- world size 1: the same round trips with nothing to communicate --------------------------


def local_cast_round_trip(state: TailHookState, grads: list[tuple[str, torch.Tensor]]) -> None:
    method = state.method
    dtype = _CAST_DTYPES[method]
    layers = []
    start = time.perf_counter()
    for name, g in grads:
        err = _cast_error(g, dtype, 1)
        if dtype != torch.float32:
            g.copy_(g.to(dtype).to(g.dtype))
        n = g.numel()
        layers.append(
            LayerStats(
                name, n, _CAST_BITS[method], 1.0, 4 * n, n * _CAST_BITS[method] // 8, err, _CODE[method]
            )
        )
    state.record(layers=layers, compress_s=time.perf_counter() - start)


def _orthonormalize(m: torch.Tensor) -> torch.Tensor:
    # Orthonormal columns spanning m's, as PowerSGD's Gram-Schmidt gives (QR is the same basis).
    q, _ = torch.linalg.qr(m)
    return q


def local_powersgd_round_trip(state: TailHookState, grads: list[tuple[str, torch.Tensor]]) -> None:
    """PowerSGD with one worker: the same low-rank approximation + error feedback, keyed by name."""
    ps = state.powersgd
    compressing = state.local_step >= ps.start_powerSGD_iter
    layers = []
    start = time.perf_counter()
    for name, g in grads:
        stats = _powersgd_layer(ps, name, g, compressing)
        layers.append(stats)
        if stats.code == "fp32":
            continue
        n = g.shape[0]
        m = g.numel() // n
        r = min(n, m, ps.matrix_approximation_rank)
        mat = g.detach().reshape(n, m)
        if ps.use_error_feedback:
            mat = mat + state.local_powersgd_error.get(name, torch.zeros_like(mat))
        q = state.local_powersgd_q.get(name) if ps.warm_start else None
        if q is None or q.shape != (m, r):
            gen = torch.Generator().manual_seed(int(ps.rng.randint(1_000_000_000)))
            q = torch.randn(m, r, generator=gen, dtype=mat.dtype).to(mat.device)
        q = _orthonormalize(q)
        p = _orthonormalize(mat @ q)
        q = mat.T @ p
        approx = p @ q.T
        norm = float(mat.pow(2).sum())
        err = float((mat - approx).pow(2).sum()) / norm if norm > 0 else 0.0
        layers[-1] = dataclasses.replace(stats, rel_error=err)
        if ps.use_error_feedback:
            state.local_powersgd_error[name] = mat - approx
        state.local_powersgd_q[name] = q
        g.copy_(approx.reshape(g.shape))
    state.record(layers=layers, compress_s=time.perf_counter() - start)
