"""The comm hook for payload compressors (qsgd, topk, tail): compress -> all-gather -> decode all.

Per DDP bucket:
    compress   each layer's gradient, keyed by parameter name, into ONE payload
    exchange   payloads of different sizes between ranks (transport.all_gather_bytes)
    decode     every rank's payload (any compressor instance decodes any payload)
    average    the decoded gradients and write them into the bucket's gradient views
               (quantized layers go from levels and scales to the mean in one pass, with no
               per-rank float32 copy: ``average_records_into``)
and return an already-completed future, which is what DDP waits on.

Unless plain all-reduce is faster on this link: the link-aware switch (gate.py) times whole
steps in both modes and, while all-reduce wins, sends the step's buckets uncompressed
(asynchronously, like method "none"), with the error-feedback residuals folded in.

Why synchronous: DDP calls bucket hooks in bucket-index order on every rank, from one
thread. If every collective is issued right here, before returning, every rank issues the
same collectives in the same order whatever the timing. Chaining collectives in future
callbacks (as PyTorch's powerSGD_hook does) lets callback threads of different buckets race,
and gloo then pairs mismatched collectives or hangs. The cost is that this bucket's exchange
does not overlap the rest of backward; the payload is small, which is the point.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's
# annotations with dist.GradBucket / Future[Tensor] objects, not strings.

import time

import numpy as np
import torch
import torch.distributed as dist

from tail_ray.collective.builtin import cast_allreduce
from tail_ray.collective.gate import Mode
from tail_ray.collective.state import TailHookState
from tail_ray.collective.transport import all_gather_bytes
from tail_ray.compression.layers import records_to_flat
from tail_ray.compression.quantize import mean_dequantized_into, mean_into
from tail_ray.compression.wire import Kind, LayerRecord
from tail_ray.errors import CodecError


def average_decoded(
    names: list[str], decoded_by_rank: list[dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Mean over ranks of each named layer (the grid's rank mean, tail_ray/compression/grid.py);
    a payload missing a layer is a CodecError."""
    out: dict[str, torch.Tensor] = {}
    for name in names:
        values: list[torch.Tensor] = []
        for rank, decoded in enumerate(decoded_by_rank):
            try:
                values.append(decoded[name])
            except KeyError:
                raise CodecError(
                    f"rank {rank}'s payload lacks this layer", layer=name, field="name"
                ) from None
        out[name] = _mean(values)
    return out


def _mean(values: list[torch.Tensor]) -> torch.Tensor:
    """The rank mean of decoded (CPU float32) tensors, flat, same arithmetic as the fused path."""
    out = np.empty(values[0].numel(), dtype=np.float32)
    mean_into([t.detach().to("cpu", torch.float32).reshape(-1).numpy() for t in values], out)
    return torch.from_numpy(out)


def observe_peers(state: TailHookState, decoded_by_rank: list[dict[str, torch.Tensor]]) -> None:
    """Let the compressor see every rank's decoded gradient (the controller's noise estimate)."""
    observe = getattr(state.compressor, "observe_peers", None)
    if callable(observe):
        observe(decoded_by_rank)


def decode_all(compressor: object, payloads: list[bytes], own_rank: int) -> list[dict[str, torch.Tensor]]:
    """Decode every rank's payload. This rank's own is taken from the compressor when it can
    give it (``decoded_last``: its levels and scales, no entropy decoding; bit-identical since
    the coding is lossless), which saves 1/W of the decoding."""
    own = getattr(compressor, "decoded_last", None)
    mine = own() if callable(own) else None
    decompress = compressor.decompress  # type: ignore[attr-defined]
    return [
        mine if rank == own_rank and mine is not None else decompress(p) for rank, p in enumerate(payloads)
    ]


def decode_average_into(
    state: TailHookState,
    payloads: list[bytes],
    names: list[str],
    grads: list[torch.Tensor],
    own_rank: int,
) -> None:
    """Decode every rank's payload, show them to the controller, and write the mean of each
    layer into ``grads`` (views of the bucket buffer, so this writes what DDP reads back).

    Compressors that hand out records (``decode_records``; ``records_last`` for this rank's
    own) take the fused path (``average_records_into``); any other decodes to tensors first.
    """
    compressor = state.compressor
    decode_records = getattr(compressor, "decode_records", None)
    if not callable(decode_records):
        decoded = decode_all(compressor, payloads, own_rank)
        observe_peers(state, decoded)
        for g, mean in zip(grads, average_decoded(names, decoded).values(), strict=True):
            g.copy_(mean.view(g.shape).to(device=g.device, dtype=g.dtype))
        return
    own = getattr(compressor, "records_last", None)
    mine = own() if callable(own) else None
    # A payload may describe at most this bucket's elements: a crafted or garbled one that
    # claims a huge (e.g. all-zero sparse) layer fails before anything that size is allocated.
    bucket_numel = sum(g.numel() for g in grads)
    records_by_rank = [
        {
            rec.name: rec
            for rec in (
                mine if rank == own_rank and mine is not None else decode_records(p, max_numel=bucket_numel)
            )
        }
        for rank, p in enumerate(payloads)
    ]
    # Before the averages are written: this rank's raw records alias its gradients.
    observe = getattr(compressor, "observe_peer_records", None)
    if callable(observe):
        observe(records_by_rank)
    elif callable(getattr(compressor, "observe_peers", None)):
        observe_peers(state, [records_to_flat(list(by_name.values())) for by_name in records_by_rank])
    average_records_into(names, records_by_rank, grads)


def average_records_into(
    names: list[str], records_by_rank: list[dict[str, LayerRecord]], grads: list[torch.Tensor]
) -> None:
    """Write the mean over ranks of each named layer into its gradient, bit-identical to
    ``average_decoded`` (+ ``copy_``) on the decoded tensors.

    A layer quantized on every rank is dequantized, summed and divided in one numba pass
    (``mean_dequantized_into``), straight into the gradient when it is CPU fp32 contiguous;
    any other layer (raw, sparse, or a mix, e.g. one rank sent a non-finite layer raw) is
    decoded to tensors and averaged as before. Every layer is checked before anything is
    written: a payload missing a layer or sized differently from its gradient is a CodecError.
    """
    layers: list[list[LayerRecord]] = []
    for name, g in zip(names, grads, strict=True):
        recs = []
        for rank, by_name in enumerate(records_by_rank):
            rec = by_name.get(name)
            if rec is None:
                raise CodecError(f"rank {rank}'s payload lacks this layer", layer=name, field="name")
            if rec.numel != g.numel():
                raise CodecError(
                    f"rank {rank}'s payload has {rec.numel} elements, the gradient {g.numel()}",
                    layer=name,
                    field="numel",
                )
            recs.append(rec)
        layers.append(recs)
    for g, recs in zip(grads, layers, strict=True):
        if all(r.kind == Kind.QUANT and r.levels is not None and r.scales is not None for r in recs):
            direct = g.device.type == "cpu" and g.dtype == torch.float32 and g.is_contiguous()
            out = g.detach().view(-1).numpy() if direct else np.empty(g.numel(), dtype=np.float32)
            mean_dequantized_into(
                [r.levels for r in recs],  # type: ignore[misc]
                [r.scales for r in recs],  # type: ignore[misc]
                [r.bits for r in recs],
                [r.bucket_size for r in recs],
                out,
            )
            if not direct:
                g.copy_(torch.from_numpy(out).view(g.shape))
            continue
        mean = _mean([records_to_flat([rec])[rec.name] for rec in recs])
        g.copy_(mean.view(g.shape).to(device=g.device, dtype=g.dtype))


def tail_hook(state: TailHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook for the payload compressors; register with ``register_tail_hook``."""
    compressor = state.compressor
    if compressor is None:
        raise RuntimeError("tail_hook needs a state built for a payload compressor (qsgd, topk, tail)")
    params = bucket.parameters()
    grads = bucket.gradients()
    names = [state.name_of(p) for p in params]

    if state.mode_for_bucket(bucket.index()) == Mode.ALLREDUCE:
        # The link is faster than the codec (measured: see gate.py). What error feedback still
        # owes rides along, so the switch loses nothing; the all-reduce stays asynchronous.
        fold = getattr(compressor, "fold_residuals", None)
        if callable(fold):
            fold(dict(zip(names, grads, strict=True)))
        return cast_allreduce(state, bucket, "none", "allreduce")

    start = time.perf_counter()
    payload = compressor.compress(dict(zip(names, grads, strict=True)))
    layers = list(compressor.last_stats)
    compressed = time.perf_counter()

    payloads, traffic = all_gather_bytes(payload, state.process_group, device=bucket.buffer().device)
    exchanged = time.perf_counter()

    decode_average_into(state, payloads, names, grads, dist.get_rank(state.process_group))
    decoded_at = time.perf_counter()

    state.record(
        layers=layers,
        bytes_sent=traffic.bytes_sent,
        bytes_received=traffic.bytes_received,
        compress_s=compressed - start,
        comm_s=exchanged - compressed,
        decode_s=decoded_at - exchanged,
        exchanges=1,
    )
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def local_round_trip(state: TailHookState, grads: list[tuple[str, torch.Tensor]]) -> None:
    """World size 1: compress -> decompress in place, same semantics and metrics, no exchange."""
    compressor = state.compressor
    assert compressor is not None
    names = [n for n, _ in grads]
    start = time.perf_counter()
    payload = compressor.compress(dict(grads))
    layers = list(compressor.last_stats)
    compressed = time.perf_counter()
    decoded = [compressor.decompress(payload)]
    observe_peers(state, decoded)
    for (_, g), mean in zip(grads, average_decoded(names, decoded).values(), strict=True):
        g.copy_(mean.view(g.shape).to(device=g.device, dtype=g.dtype))
    state.record(layers=layers, compress_s=compressed - start, decode_s=time.perf_counter() - compressed)
