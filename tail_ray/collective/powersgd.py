"""Method powersgd: PyTorch's PowerSGDState + powerSGD_hook, serialised, with names and metrics.

The hook calls PyTorch's unchanged and adds per-layer metrics (the wire size exactly as
powerSGD_hook decides it, and the relative size of its error-feedback residual) and a fixed
collective order (see ``powersgd_hook``). With world size 1 the same low-rank approximation
and error feedback run locally, keyed by parameter name.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's
# annotations with dist.GradBucket / Future[Tensor] objects, not strings.

import dataclasses
import time
from collections.abc import Mapping
from typing import Any, Self

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from tail_ray.collective.state import Group, HookState, Settings
from tail_ray.collective.topology import NodeLayout
from tail_ray.collective.transport import ring_allreduce_bytes
from tail_ray.compression.stats import LayerStats
from tail_ray.errors import ConfigError
from tail_ray.methods import Method
from tail_ray.settings import setting_names


@dataclasses.dataclass(frozen=True)
class PowerSGDSettings:
    """Settings of "powersgd": PyTorch's PowerSGDState arguments; ``rank`` is accepted as the
    short name of ``matrix_approximation_rank``.

    start_powerSGD_iter defaults to 2 (PyTorch's smallest legal value with error feedback),
    not PyTorch's 1000: a comparison run should compress from the start, as every other
    method does.
    """

    matrix_approximation_rank: int = 1
    start_powerSGD_iter: int = 2
    min_compression_rate: float = 2
    use_error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0.0
    random_seed: int = 0

    def __post_init__(self) -> None:
        rank = self.matrix_approximation_rank
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ConfigError(f"powersgd rank must be an integer >= 1, got {rank!r}")
        start = self.start_powerSGD_iter
        if not isinstance(start, int) or start < 2:
            raise ConfigError(
                f"powersgd start_powerSGD_iter must be an integer >= 2 (PyTorch's rule), got {start!r}"
            )

    @classmethod
    def from_mapping(cls, settings: Mapping[str, Any] | None) -> "PowerSGDSettings":
        if settings is None:
            settings = {}
        if not isinstance(settings, Mapping):
            raise ConfigError(f"method 'powersgd': settings must be a mapping, got {type(settings).__name__}")
        known = setting_names(cls)
        values: dict[str, Any] = {}
        for key, value in settings.items():
            name = "matrix_approximation_rank" if key == "rank" else key
            if name not in known:
                raise ConfigError(f"unknown powersgd setting {key!r}; choose from {['rank', *sorted(known)]}")
            values[name] = value
        return cls(**values)

    def torch_state(self, process_group: dist.ProcessGroup | None) -> PowerSGDState:
        # compression_stats_logging_frequency: PyTorch logs every N iterations; keep it quiet.
        return PowerSGDState(
            process_group=process_group,
            compression_stats_logging_frequency=1 << 30,
            **dataclasses.asdict(self),
        )


class PowerSGDHookState(HookState):
    """State of "powersgd": PyTorch's ``PowerSGDState`` (``powersgd``) and, for world size 1,
    the same memory keyed by parameter name (``local_q``, ``local_error``).

    Only PowerSGD's step counter and the local memory are checkpointed: PyTorch keys its own
    error-feedback and warm-start memory by bucket index, which a rebuilt or resized job does
    not share, so after a restore they start from zero (as at PowerSGD's own start).
    """

    def __init__(
        self,
        model: nn.Module,
        powersgd: PowerSGDState,
        *,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(Method.POWERSGD, model, process_group=process_group)
        if not isinstance(powersgd, PowerSGDState):
            raise ConfigError(f"powersgd must be a PowerSGDState, got {type(powersgd).__name__}")
        self.powersgd = powersgd
        self.local_q: dict[str, torch.Tensor] = {}
        self.local_error: dict[str, torch.Tensor] = {}

    @classmethod
    def from_settings(
        cls,
        method: Method,
        model: nn.Module,
        settings: Settings,
        group: Group,
        *,
        layout: NodeLayout | None = None,
    ) -> Self:
        if method != Method.POWERSGD:
            raise ConfigError(f"PowerSGDHookState runs method 'powersgd', not {method.value!r}")
        ps = PowerSGDSettings.from_mapping(settings).torch_state(group)
        return cls(model, ps, process_group=group)

    # -- checkpoints (keys as in version 1) -------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "powersgd_iter": int(self.powersgd.iter),
            "local_powersgd_error": {k: v.clone() for k, v in self.local_error.items()},
            "local_powersgd_q": {k: v.clone() for k, v in self.local_q.items()},
        }

    def _load_family_state(self, state: Mapping[str, Any], *, residuals: bool) -> None:
        self.powersgd.iter = int(state["powersgd_iter"])
        if not residuals:
            self.local_error, self.local_q = {}, {}
            return
        self.local_error = {k: v.clone() for k, v in state["local_powersgd_error"].items()}
        self.local_q = {k: v.clone() for k, v in state["local_powersgd_q"].items()}

    # -- pickling --------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """The PowerSGDState is flattened to its slots by hand: its own ``__setstate__`` asks for
        the default process group, which a process that only reads a checkpoint lacks."""
        out = super().__getstate__()
        out["powersgd"] = {
            slot: getattr(self.powersgd, slot)
            for slot in type(self.powersgd).__slots__
            if slot != "process_group"
        }
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        slots = state.pop("powersgd")
        super().__setstate__(state)
        ps = object.__new__(PowerSGDState)
        ps.process_group = None  # powerSGD_hook falls back to the default group
        for slot, value in slots.items():
            setattr(ps, slot, value)
        self.powersgd = ps


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


def powersgd_hook(state: PowerSGDHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
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
    named = state.bucket_layers(bucket)
    layers = [_powersgd_layer(ps, name, g, compressing) for name, g in named.items()]
    # Without error feedback PowerSGD keeps no copy of its input; keep one to measure the error.
    before = bucket.buffer().detach().clone() if compressing and not ps.use_error_feedback else None
    # All-reduced bytes: uncompressed layers as they are, compressed ones as P (n*r) and Q (m*r).
    moved = sum(ring_allreduce_bytes(layer.encoded_bytes, world_size) for layer in layers)
    start = time.perf_counter()
    result = powerSGD_hook(ps, bucket).wait()
    if compressing:
        # With error feedback powerSGD_hook stored input + old error - output: its residual.
        residual = before - result if before is not None else ps.error_dict[bucket.index()]
        layers = _with_powersgd_errors(layers, list(named.values()), result, residual)
    state.metrics.add(
        layers=layers, bytes_sent=moved, bytes_received=moved, comm_s=time.perf_counter() - start, exchanges=1
    )
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(result)
    return done


def _orthonormalize(m: torch.Tensor) -> torch.Tensor:
    # Orthonormal columns spanning m's, as PowerSGD's Gram-Schmidt gives (QR is the same basis).
    q, _ = torch.linalg.qr(m)
    return q


def local_powersgd_round_trip(state: PowerSGDHookState, grads: list[tuple[str, torch.Tensor]]) -> None:
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
            mat = mat + state.local_error.get(name, torch.zeros_like(mat))
        q = state.local_q.get(name) if ps.warm_start else None
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
            state.local_error[name] = mat - approx
        state.local_q[name] = q
        g.copy_(approx.reshape(g.shape))
    state.metrics.add(layers=layers, compress_s=time.perf_counter() - start)
