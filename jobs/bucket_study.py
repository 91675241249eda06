"""Bucket size per layer (issue 15): at the error Tail's default buckets give, which bucket size
and bit-width send the fewest bytes?

    python -m jobs.bucket_study [--models digits_cnn,char_transformer] [--steps N] [--keep K]
                                [--eval-steps E] [--buckets 64,...] [--bits 2,3,4,5] [--json PATH]

Trains each model with 2 simulated data-parallel workers (jobs/bench_codec.py's capture), runs
one default Tail compressor per worker over the last ``--keep`` steps as the payload hook does
(error feedback, controller and SGD-noise budget in their real state), and on each of the last
``--eval-steps`` steps takes worker 0's compensated gradient x = g + e of every quantized layer
just before it is quantized, with the bits and the budget tau the controller chose for it.

On each x, for every bucket size B and bits b:
  err      expected relative error E||x - Q(x)||^2 / ||x||^2 of stochastic rounding (the
           controller's closed form over every bucket, exact); ``meas`` is one real
           quantize + dequantize draw of the project's kernel
  levels   the bytes of the levels as the payload codes them (the project's code table: rANS,
           rANS pairs, sparse, bit-packing, whichever is smallest; tables included), and their
           order-0 entropy bound H0
  scales   fp32: 4 bytes per bucket (the wire before version 4, whose 16-bit scales cost 2;
           this study predates them). fp16: 2 bytes per bucket (scale / layer max,
           rounded up to fp16, plus one fp32 layer max; its error is computed with the rounded
           scales: what fp16 scales would cost in error)

Then per layer, against the reference (B = 512 at the controller's bits, the error it gives):
  equal error  the cheapest (B, b) whose error is <= the reference's (what the issue asks)
  same tau     the cheapest (B, b) whose error is <= the controller's budget tau at that step
               (what a controller choosing B and b together would do)
and the whole payload's bytes with each layer at its cheapest pair (raw layers, framing and
header as they are). Sums are over the evaluated steps; the last line printed is the summary
as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from jobs.bench_codec import add_capture_args, capture_gradients, models_of
from jobs.output_path import output_file
from tail_ray.bitwidth.quant_error import bucket_errors
from tail_ray.compression.code_table import DEFAULT_CODES
from tail_ray.compression.device import LayerArray
from tail_ray.compression.entropy import entropy_bound_bytes, sparse_entropy_bound_bytes
from tail_ray.compression.grid import levels_max, n_buckets
from tail_ray.compression.quantize import dequantize, quantize
from tail_ray.compression.record_compressor import CompressedLayer
from tail_ray.compression.records import QuantRecord
from tail_ray.compression.tail import TailCompressor, TailConfig

DEFAULT_BUCKETS = (64, 128, 256, 512, 1024, 2048)
DEFAULT_BITS = (2, 3, 4, 5)
REF_BUCKET = 512


class _Probe(TailCompressor):
    """Tail's compressor, keeping each quantized layer's g + e and the controller's plan."""

    probing = False

    def __init__(self, config: TailConfig) -> None:
        super().__init__(config)
        self.seen: dict[str, tuple[np.ndarray, int, float]] = {}

    def compress_layer(self, name: str, g: LayerArray, sum_sq: float) -> CompressedLayer:
        x = None
        if self.probing and isinstance(g, np.ndarray):
            residual = self.residual_of(name, g)
            x = g.astype(np.float32) + (residual if isinstance(residual, np.ndarray) else np.float32(0))
        out = super().compress_layer(name, g, sum_sq)
        if x is not None and isinstance(out.record, QuantRecord):
            tau = self.controller.plans[name].tau
            self.seen[name] = (np.ascontiguousarray(x, dtype=np.float32), out.record.bits, tau)
        return out


def fp16_scales(scales: np.ndarray) -> np.ndarray:
    """The scales as fp16 would carry them: scale / layer max rounded UP to fp16 (so every
    value still fits its bucket), times the fp32 layer max, as float32."""
    top = float(scales.max()) if scales.size else 0.0
    if top <= 0.0:
        return scales.copy()
    ratio = (scales.astype(np.float64) / top).astype(np.float16)
    out = (ratio.astype(np.float64) * top).astype(np.float32)
    low = out < scales
    while low.any():  # rounding went down: one fp16 ulp up
        ratio[low] = np.nextafter(ratio[low], np.float16(np.inf))
        out = (ratio.astype(np.float64) * top).astype(np.float32)
        low = out < scales
    return out


def expected_error(x: np.ndarray, bucket: int, bits: int, scales: np.ndarray | None = None) -> float:
    """E||x - Q(x)||^2 / ||x||^2 of stochastic rounding with max-abs scales (or ``scales``):
    per element (s/L)^2 f (1 - f), f = frac(|x| L / s), in float64 (numpy; the controller's
    closed form, here for scales the kernel does not make)."""
    n = x.size
    nb = n_buckets(n, bucket)
    a = np.zeros(nb * bucket, dtype=np.float64)
    a[:n] = np.abs(x)
    a = a.reshape(nb, bucket)
    s = a.max(axis=1) if scales is None else scales.astype(np.float64)
    lmax = levels_max(bits)
    safe = np.where(s > 0, s, 1.0)
    t = a * (lmax / safe)[:, None]
    f = t - np.floor(t)
    num = float((((safe / lmax) ** 2)[:, None] * f * (1 - f)).sum())
    den = float((a * a).sum())
    return num / den if den > 0 else 0.0


@dataclass
class Cell:
    """One layer's x at one (bucket, bits)."""

    err: float  # expected relative error, fp32 max-abs scales (the controller's estimate, exact)
    err16: float  # the same with fp16 scales
    meas: float  # one real quantize + dequantize draw
    levels: int  # coded level bytes (the payload's code choice, tables included)
    h0: float  # order-0 bound of the levels
    scales32: int
    scales16: int

    def cost(self, fp16: bool) -> int:
        return self.levels + (self.scales16 if fp16 else self.scales32)


def measure(x: np.ndarray, bucket: int, bits: int, seed: int) -> Cell:
    n = x.size
    levels = np.empty(n, dtype=np.int8)
    scales = np.empty(n_buckets(n, bucket), dtype=np.float32)
    quantize(x, bits, bucket, seed, levels, scales)
    x64 = x.astype(np.float64)
    xx = float(np.dot(x64, x64))
    num, den, _ = bucket_errors(x, None, bucket, np.arange(scales.size, dtype=np.int64), (bits,))
    d = dequantize(levels, scales, bits, bucket).astype(np.float64)
    _code, _nnz, body = DEFAULT_CODES.encode(QuantRecord("layer", bits, bucket, scales, levels))
    return Cell(
        err=float(num[0]) / den if den > 0 else 0.0,
        err16=expected_error(x, bucket, bits, fp16_scales(scales)),
        meas=float(np.sum((x64 - d) ** 2)) / xx if xx > 0 else 0.0,
        levels=len(body),
        h0=min(entropy_bound_bytes(levels), sparse_entropy_bound_bytes(levels)),
        scales32=4 * scales.size,
        scales16=2 * scales.size + 4,
    )


def best_pair(cells: dict[tuple[int, int], Cell], limit: float, fp16: bool) -> tuple[int, int, int]:
    """(bucket, bits, scale bytes per bucket) of the cheapest cell whose error is <= ``limit``,
    scales in fp32 or (``fp16``) whichever of fp32 / fp16 is cheaper within the limit; ties go
    to the larger bucket, then fewer bits. The caller makes sure one cell fits."""
    ok = [(c.cost(False), -k[0], k[1], 4) for k, c in cells.items() if c.err <= limit]
    if fp16:
        ok += [(c.cost(True), -k[0], k[1], 2) for k, c in cells.items() if c.err16 <= limit]
    _cost, neg_bucket, bits, width = min(ok)
    return -neg_bucket, bits, width


def interpolated_bytes(cells: dict[tuple[int, int], Cell], bucket: int, err: float) -> float | None:
    """Bytes (levels + fp32 scales) at bucket ``bucket`` and exactly relative error ``err``,
    log-bytes linear in log-error between the two bit-widths around it (None: ``err`` is outside
    this bucket's range of bits). What a bucket size costs at equal error if bits were not
    whole numbers: the trade without the jumps of one bit (~5x in error)."""
    pts = sorted((c.err, c.cost(False)) for (bk, _b), c in cells.items() if bk == bucket and c.err > 0)
    for (e_lo, c_lo), (e_hi, c_hi) in itertools.pairwise(pts):
        if e_lo <= err <= e_hi:
            if e_hi == e_lo:
                return float(min(c_lo, c_hi))
            w = (np.log(err) - np.log(e_lo)) / (np.log(e_hi) - np.log(e_lo))
            return float(np.exp((1 - w) * np.log(c_lo) + w * np.log(c_hi)))
    return None


def study_model(
    model: str,
    steps: int,
    keep: int,
    eval_steps: int,
    buckets: tuple[int, ...],
    bits: tuple[int, ...],
    seed: int,
) -> dict[str, Any]:
    """Per evaluated step and quantized layer: every (bucket, bits) cell, the reference and the
    cheapest pairs; summed over steps per layer and for the whole payload."""
    cap = capture_gradients(model, steps, keep, 2, seed=seed)
    probe = _Probe(TailConfig(seed=1234))
    comps = [probe, TailCompressor(TailConfig(seed=4321))]
    for comp in comps:
        comp.set_linear_optimizer(cap.linear)  # the budget training on this optimizer gets
    n_warm = len(cap.grads) - eval_steps
    layers: dict[str, dict[str, Any]] = {}
    payload_bytes = 0
    choices = ("ref", "equal32", "equal16", "tau32", "tau16")
    for i, per_rank in enumerate(cap.grads):
        probe.probing = i >= n_warm
        probe.seen = {}
        payloads = []
        for comp, grads in zip(comps, per_rank, strict=True):
            comp.set_lr(cap.lr)
            payloads.append(comp.compress(grads))
        for rank, (comp, grads) in enumerate(zip(comps, per_rank, strict=True)):
            comp.aggregate(payloads, {n: torch.empty_like(g) for n, g in grads.items()}, own=rank)
        if not probe.probing:
            continue
        payload_bytes += len(payloads[0])
        for name, (x, b_ctl, tau) in probe.seen.items():
            cells = {
                (bucket, b): measure(x, bucket, b, seed=7919 * i + 31 * bucket + b)
                for bucket in buckets
                for b in sorted(set(bits) | {b_ctl})
            }
            ref = cells[(REF_BUCKET, b_ctl)]
            interp = {bk: interpolated_bytes(cells, bk, ref.err) for bk in buckets}
            picks = {
                "ref": (REF_BUCKET, b_ctl, 4),
                "equal32": best_pair(cells, ref.err, fp16=False),
                "equal16": best_pair(cells, ref.err, fp16=True),
                # The reference may be over tau (accuracy first: the largest candidate).
                "tau32": best_pair(cells, max(tau, ref.err), fp16=False),
                "tau16": best_pair(cells, max(tau, ref.err), fp16=True),
            }
            row = layers.setdefault(
                name,
                {
                    "layer": name,
                    "numel": x.size,
                    "ctl_bits": [],
                    "tau": [],
                    "cells": {},
                    "interp_bytes": {str(bk): 0.0 for bk in buckets},
                    **{f"{c}_pair": [] for c in choices},
                    **{f"{c}_bytes": 0 for c in choices},
                    **{f"{c}_err": 0.0 for c in choices},
                },
            )
            row["ctl_bits"].append(b_ctl)
            row["tau"].append(tau)
            for c, (bucket, b, width) in picks.items():
                cell = cells[(bucket, b)]
                fp16 = width == 2
                row[f"{c}_pair"].append([bucket, b, width])
                row[f"{c}_bytes"] += cell.cost(fp16)
                row[f"{c}_err"] += (cell.err16 if fp16 else cell.err) / eval_steps
            for bk, v in interp.items():  # None (out of range) poisons the sum: shown as "-"
                old = row["interp_bytes"][str(bk)]
                row["interp_bytes"][str(bk)] = None if v is None or old is None else old + v
            for (bucket, b), cell in cells.items():
                agg = row["cells"].setdefault(f"{bucket}/{b}", {"bucket": bucket, "bits": b, "n": 0})
                agg["n"] += 1
                for key, v in vars(cell).items():
                    agg[key] = agg.get(key, 0) + v
    for row in layers.values():
        for agg in row["cells"].values():  # errors: mean over steps; bytes: sums
            for key in ("err", "err16", "meas"):
                agg[key] /= agg["n"]
    totals = {c: sum(r[f"{c}_bytes"] for r in layers.values()) for c in choices}
    for r in layers.values():  # the cheapest bucket at the reference error, bits continuous
        fits = {int(k): v for k, v in r["interp_bytes"].items() if v is not None}
        r["interp_best"] = min(fits, key=lambda k: (fits[k], -k)) if fits else REF_BUCKET
    totals["interp"] = sum(
        r["interp_bytes"][str(r["interp_best"])] or r["ref_bytes"] for r in layers.values()
    )
    choices = (*choices, "interp")
    return {
        "model": model,
        "eval_steps": eval_steps,
        "payload_bytes": payload_bytes,  # worker 0's real payloads over the evaluated steps
        "quantized_bytes": totals["ref"],
        "saved": {c: totals["ref"] - totals[c] for c in choices if c != "ref"},
        "saved_share": {c: (totals["ref"] - totals[c]) / payload_bytes for c in choices if c != "ref"},
        "layers": list(layers.values()),
    }


def _pairs(pairs: list[list[int]]) -> str:
    """Distinct picks over the steps, most frequent first: bucket/bits (fp16 scales: "h")."""
    uniq = sorted({tuple(p) for p in pairs}, key=lambda p: -sum(1 for q in pairs if tuple(q) == p))
    return ",".join(f"{p[0]}/{p[1]}{'h' if len(p) > 2 and p[2] == 2 else ''}" for p in uniq)


def print_report(res: dict[str, Any], buckets: tuple[int, ...], bits: tuple[int, ...]) -> None:
    n = res["eval_steps"]
    print(
        f"\n=== {res['model']}: {n} evaluated steps, worker 0's payloads {res['payload_bytes']} B,"
        f" quantized layers at B={REF_BUCKET} {res['quantized_bytes']} B (levels + fp32 scales) ==="
    )
    print("per cell: expected error (mean over steps) / bytes per step (coded levels + fp32 scales)")
    for row in res["layers"]:
        ctl = ",".join(map(str, sorted(set(row["ctl_bits"]))))
        print(
            f"\n{row['layer']} ({row['numel']} elements; controller bits {ctl},"
            f" tau {min(row['tau']):.3f}-{max(row['tau']):.3f})"
        )
        hdr = (
            f"{'B':>6}"
            + "".join(f" {f'{b} bits: err / B':>20}" for b in bits)
            + f" {'sc16 err+':>9} {'lv/H0':>6} {'B@ref err':>9}"
        )
        print(hdr)
        for bucket in buckets:
            line = f"{bucket:>6}"
            for b in bits:
                c = row["cells"].get(f"{bucket}/{b}")
                cost = (c["levels"] + c["scales32"]) / n if c else 0.0
                line += f" {c['err']:>9.4f} / {cost:>8.0f}" if c else f" {'-':>20}"
            at = row["cells"][f"{bucket}/{row['ctl_bits'][-1]}"]  # at the controller's bits
            fp16_more = at["err16"] / max(at["err"], 1e-30) - 1
            line += f" {fp16_more:>8.2%} {at['levels'] / max(at['h0'], 1e-9):>6.3f}"
            ib = row["interp_bytes"][str(bucket)]
            print(line + (f" {ib / n:>9.0f}" if ib is not None else f" {'-':>9}"))
        for c, what in (
            ("ref", "reference"),
            ("equal32", "equal error, fp32"),
            ("equal16", "equal error, +fp16"),
            ("tau32", "same tau, fp32"),
            ("tau16", "same tau, +fp16"),
        ):
            print(
                f"  {what:<18} B/bits {_pairs(row[f'{c}_pair']):<22} err {row[f'{c}_err']:.4f}"
                f"  {row[f'{c}_bytes'] / n:>9.0f} B/step"
                f" ({(row[f'{c}_bytes'] - row['ref_bytes']) / max(row['ref_bytes'], 1):+.1%})"
            )
        print(f"  bits continuous: cheapest bucket at the reference error {row['interp_best']}")
    print(f"\n{res['model']}: whole payload ({res['payload_bytes'] / n:.0f} B/step) shrinks by")
    for c, v in res["saved"].items():
        print(f"  {c:<8} {v / n:>8.0f} B/step  {res['saved_share'][c]:>6.2%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jobs.bucket_study",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    add_capture_args(parser)
    parser.add_argument("--eval-steps", type=int, default=3, help="last steps analysed (default %(default)s)")
    parser.add_argument(
        "--buckets",
        default=",".join(map(str, DEFAULT_BUCKETS)),
        help=f"bucket sizes, comma list; must include {REF_BUCKET} (default %(default)s)",
    )
    parser.add_argument("--bits", default=",".join(map(str, DEFAULT_BITS)), help="default %(default)s")
    parser.add_argument("--seed", type=int, default=0, help="data / model seed (default %(default)s)")
    parser.add_argument("--json", type=output_file, help="also write the full results as JSON here")
    args = parser.parse_args(argv)
    models = models_of(parser, args.models)
    try:
        buckets = tuple(sorted({int(b) for b in args.buckets.split(",")}))
        bits = tuple(sorted({int(b) for b in args.bits.split(",")}))
    except ValueError:
        parser.error("--buckets and --bits are comma lists of integers")
    if REF_BUCKET not in buckets or min(buckets) < 1 or not all(2 <= b <= 8 for b in bits):
        parser.error(f"--buckets must include {REF_BUCKET}; --bits must be in 2..8")
    if not 1 <= args.eval_steps < args.keep <= args.steps:
        parser.error("need 1 <= --eval-steps < --keep <= --steps")
    t0 = time.perf_counter()
    results = []
    for m in models:
        res = study_model(m, args.steps, args.keep, args.eval_steps, buckets, bits, args.seed)
        print_report(res, buckets, bits)
        results.append(res)
    print(f"\nbucket_study finished in {time.perf_counter() - t0:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    summary = {
        r["model"]: {
            "payload_bytes_per_step": r["payload_bytes"] / r["eval_steps"],
            "saved_share": r["saved_share"],
            "pairs": {
                row["layer"]: {c: row[f"{c}_pair"][-1] for c in ("ref", "equal32", "tau32")}
                for row in r["layers"]
            },
        }
        for r in results
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
