"""What a Tail payload is made of, per layer: framing, scales, code tables, coded levels.

    python -m jobs.payload_anatomy [--models digits_cnn,char_transformer] [--steps N] [--keep K]
                                   [--raw-below-numel N ...] [--json PATH]

Trains each model with 2 simulated data-parallel workers (jobs/bench_codec.py's capture: each
worker its own batch, same weights), runs one Tail compressor per worker over the last
``--keep`` steps as the payload hook runs them (compress, then aggregate every worker's
payload: error feedback, the controller and its SGD-noise budget in their real state; keep
it past warm-up + recovery, 70 steps, for the steady state), then takes worker 0's payload
of the last step apart, every byte counted once:

  frame    the layer's framing: name, kind / code / bits bytes, numel, bucket size, counts
  scales   bucket scales (quantized layers: 2 bytes per bucket of ``bucket_size`` when the
           payload's scales are all on the 16-bit grid, as Tail's are; else 4)
  tables   the entropy code's frequency tables carried in the body (rANS codes)
  levels   the coded levels (rANS streams, gap slots and extra bits; bit-packed levels)
  values   raw fp32 values (layers below ``raw_below_numel`` under ``small_layer_bits=32``,
           and non-finite ones)

plus the payload's own header and checksum, the layer's share of the payload, and its levels
against their order-0 entropy bound (H0, the best a static per-layer model can do, taken on the
levels as the quantizer made them: a dithered layer's, coded sign-folded by their uniforms,
can go below it, docs/wire-format.md) and an
order-1 bound (H1: each level's entropy given its neighbours' magnitudes, ``context_bound_bytes``),
which says how much a context-modelling coder could gain over the order-0 one before its
larger tables.
``--raw-below-numel`` repeats the analysis with other thresholds (same gradients, same
compressor seed), to show what a small layer costs raw and quantized.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from jobs.bench_codec import Capture, add_capture_args, capture_gradients, models_of, run_workers
from jobs.output_path import output_file
from tail_ray.compression.base import Compressor
from tail_ray.compression.code_table import DEFAULT_CODES
from tail_ray.compression.codes import Code, LevelStats
from tail_ray.compression.entropy import entropy_bound_bytes, sparse_entropy_bound_bytes
from tail_ray.compression.records import QuantRecord
from tail_ray.compression.tail import TailCompressor, TailConfig
from tail_ray.compression.wire import PAYLOAD_OVERHEAD_BYTES, SCALES_16, decode_payload, wire_form


@dataclass
class LayerAnatomy:
    layer: str
    numel: int
    bits: int  # 32: raw fp32
    code: str
    frame: int
    scales: int
    tables: int
    levels: int  # coded levels (quantized) or raw values
    h0_levels: float  # order-0 bound of the levels (0 for raw layers)
    h1_levels: float = 0.0  # order-1 bound given neighbour magnitudes (context_bound_bytes)

    @property
    def total(self) -> int:
        return self.frame + self.scales + self.tables + self.levels


# Context of a level in ``context_bound_bytes``: a neighbour's |level|, capped here.
_CONTEXT_CAP = 2


def context_bound_bytes(levels: np.ndarray, row_len: int) -> float:
    """The order-1 empirical bound of ``levels``: sum over contexts of n_c * H0(levels in c) / 8
    bytes, a level's context being (min(|previous level|, 2), min(|level one row up|, 2)) in
    the tensor's memory order (rows of ``row_len``; zeros before the start): 9 contexts. The
    dependence a gradient could carry (row or column scales that the bucket's max-abs scale
    does not remove). Never above the order-0 bound; no table costs counted."""
    lv = np.asarray(levels, dtype=np.int64).reshape(-1)
    mag = np.minimum(np.abs(lv), _CONTEXT_CAP)
    prev = np.concatenate([[0], mag[:-1]])
    up = np.zeros_like(mag)
    if 0 < row_len < lv.size:
        up[row_len:] = mag[:-row_len]
    ctx = prev * (_CONTEXT_CAP + 1) + up
    total_bits = 0.0
    for c in np.unique(ctx):
        counts = np.bincount(lv[ctx == c] - lv.min()).astype(np.float64)
        counts = counts[counts > 0]
        total_bits -= float((counts * np.log2(counts / counts.sum())).sum())
    return total_bits / 8.0


def _row_len(shape: tuple[int, ...]) -> int:
    """Elements per row of a weight in memory order (a conv kernel's: in_channels * kh * kw)."""
    return int(np.prod(shape[1:])) if len(shape) >= 2 else 0


def _tables_bytes(code: str, stats: LevelStats) -> int:
    """Bytes of frequency tables at the head of a level code's body (see dense_codes.py /
    sparse_codes.py: rans and rans-pairs send the single-level table, sparse-rans the gap-slot
    and non-zero-level tables; bit-packing sends none)."""
    if code in (DEFAULT_CODES.name(Code.RANS), DEFAULT_CODES.name(Code.RANS_PAIRS)):
        assert stats.dense is not None
        return len(stats.dense.model.to_bytes())
    if code == DEFAULT_CODES.name(Code.SPARSE_RANS):
        stats.count_gaps_exactly()
        if stats.slot_fit is None or stats.nonzero_fit is None:
            return 0
        return len(stats.slot_fit.model.to_bytes()) + len(stats.nonzero_fit.model.to_bytes())
    return 0


def anatomy(comp: TailCompressor, grads: dict[str, torch.Tensor]) -> tuple[int, list[LayerAnatomy]]:
    """Compress ``grads`` once with ``comp`` and take the payload apart (payload size, layers)."""
    payload = comp.compress(grads)
    scale_width = 2 if payload[5] & SCALES_16 else 4  # the header's flags byte
    stats = {s.layer: s for s in comp.last_stats}
    rows = []
    for rec in decode_payload(payload):
        s = stats[rec.name]
        if isinstance(rec, QuantRecord):
            # What the body codes: a dithered layer's levels sign-folded (dither_fold.py); the
            # bounds stay those of the levels as the quantizer made them (what the fold beats).
            coded = wire_form(rec)[1]
            level_stats = LevelStats(coded.levels, coded.bits)
            scales = scale_width * int(rec.scales.size)
            code, _nnz, body = DEFAULT_CODES.encode(coded)
            assert DEFAULT_CODES.name(code) == s.code  # the same choice as the payload's
            tables = _tables_bytes(s.code, level_stats)
            h0 = min(entropy_bound_bytes(rec.levels), sparse_entropy_bound_bytes(rec.levels))
            h1 = min(h0, context_bound_bytes(rec.levels, _row_len(tuple(grads[rec.name].shape))))
            levels = len(body) - tables
        else:
            _code, _nnz, body = DEFAULT_CODES.encode(rec)
            scales = tables = 0
            levels, h0, h1 = len(body), 0.0, 0.0
        frame = s.encoded_bytes - scales - len(body)
        rows.append(LayerAnatomy(rec.name, rec.numel, s.bits, s.code, frame, scales, tables, levels, h0, h1))
    assert sum(r.total for r in rows) + PAYLOAD_OVERHEAD_BYTES == len(payload)
    return len(payload), rows


def run_model(cap: Capture, config: TailConfig) -> dict[str, Any]:
    comps: list[Compressor] = [TailCompressor(config) for _ in cap.grads[0]]
    for comp in comps:
        comp.set_linear_optimizer(cap.linear)  # the budget training on this optimizer gets
    run_workers(comps, cap.grads[:-1], cap.lr)
    assert isinstance(comps[0], TailCompressor)
    comps[0].set_lr(cap.lr)
    size, rows = anatomy(comps[0], cap.grads[-1][0])
    raw = sum(4 * r.numel for r in rows)
    return {
        "model": cap.model,
        "raw_below_numel": config.raw_below_numel,
        "payload_bytes": size,
        "raw_bytes": raw,
        "ratio": raw / size,
        "layers": [dataclasses.asdict(r) | {"total": r.total} for r in rows],
    }


def print_report(res: dict[str, Any]) -> None:
    size = res["payload_bytes"]
    print(
        f"\n=== {res['model']}, raw_below_numel={res['raw_below_numel']}: payload {size} B,"
        f" ratio {res['ratio']:.2f}x (worker 0, last step) ==="
    )
    hdr = (
        f"{'layer':<42} {'numel':>7} {'bits':>4} {'code':<11} {'bytes':>7} {'%pay':>6}"
        f" {'frame':>6} {'scales':>7} {'tables':>6} {'levels':>7} {'sc%':>6} {'hdr%':>6} {'lv/H0':>6}"
        f" {'H1/H0':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    # "bounded": the coded levels of layers with an entropy bound (quantized; not low-rank factors)
    tot = {"frame": 0, "scales": 0, "tables": 0, "levels": 0, "values": 0, "bounded": 0, "h0": 0.0, "h1": 0.0}
    for r in res["layers"]:
        quant = r["bits"] <= 8  # 16: a small layer as float16, 32: raw fp32
        shown_levels = r["levels"] if quant else f"{r['levels']}v"
        ratio_h0 = f"{r['levels'] / r['h0_levels']:.3f}" if quant and r["h0_levels"] > 0 else "-"
        h1_h0 = f"{r['h1_levels'] / r['h0_levels']:.3f}" if quant and r["h0_levels"] > 0 else "-"
        print(
            f"{r['layer'][-42:]:<42} {r['numel']:>7} {r['bits']:>4} {r['code'][:11]:<11} {r['total']:>7}"
            f" {r['total'] / size:>6.1%} {r['frame']:>6} {r['scales']:>7} {r['tables']:>6}"
            f" {shown_levels!s:>7} {r['scales'] / r['total']:>6.1%}"
            f" {(r['frame'] + r['tables']) / r['total']:>6.1%} {ratio_h0:>6} {h1_h0:>6}"
        )
        tot["frame"] += r["frame"]
        tot["scales"] += r["scales"]
        tot["tables"] += r["tables"]
        tot["levels" if quant else "values"] += r["levels"]
        if quant and r["h0_levels"] > 0:
            tot["bounded"] += r["levels"]
            tot["h0"] += r["h0_levels"]
            tot["h1"] += r["h1_levels"]
    overhead = PAYLOAD_OVERHEAD_BYTES
    print(
        f"payload: header+checksum {overhead} B ({overhead / size:.1%}), layer framing {tot['frame']} B"
        f" ({tot['frame'] / size:.1%}), scales {tot['scales']} B ({tot['scales'] / size:.1%}), code tables"
        f" {tot['tables']} B ({tot['tables'] / size:.1%}), coded levels {tot['levels']} B"
        f" ({tot['levels'] / size:.1%}; quantized {tot['bounded'] / max(tot['h0'], 1e-9):.3f}x H0),"
        f" raw values {tot['values']} B ({tot['values'] / size:.1%}); order-1 bound of the levels"
        f" {tot['h1'] / max(tot['h0'], 1e-9):.3f}x their H0"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jobs.payload_anatomy",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    add_capture_args(parser)
    parser.add_argument(
        "--raw-below-numel",
        type=int,
        action="append",
        help="Tail's raw_below_numel to analyse (repeatable; default: Tail's default)",
    )
    parser.add_argument("--seed", type=int, default=0, help="data / model seed (default %(default)s)")
    parser.add_argument("--json", type=output_file, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    models = models_of(parser, args.models)
    if not 2 <= args.keep <= args.steps:
        parser.error("--keep must be in 2..--steps")
    thresholds = args.raw_below_numel or [TailConfig().raw_below_numel]
    t0 = time.perf_counter()
    results = []
    for m in models:
        cap = capture_gradients(m, args.steps, args.keep, 2, seed=args.seed)
        for threshold in thresholds:
            res = run_model(cap, TailConfig(raw_below_numel=threshold, seed=1234))
            print_report(res)
            results.append(res)
    print(f"\npayload_anatomy finished in {time.perf_counter() - t0:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
