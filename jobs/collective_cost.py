"""The collectives' cost model, as tables: predictions to 1024 workers, and a check against measurements.

    python -m jobs.collective_cost table     [--params 1e8] [--ratio 10] [--markdown]
    python -m jobs.collective_cost simulate  [--model gpt2_small] [--max-world-size 1024]
    python -m jobs.collective_cost check     runs/net_w2.json runs/net_w4.json runs/net_w8.json

``table``: ``tail_ray.collective.cost.collective_cost`` for ring fp32 all-reduce, all-gather,
sharded and hierarchical (8 ranks per node) at W = 2..1024 and 1 / 10 / 100 Gbit/s links:
bytes per rank and milliseconds per step (link + codec; compute is the same for all). The
codec speeds are measured first on this machine (Tail on the synthetic MLP's gradient) unless
given.

``simulate``: the REAL shard layout (tail_ray.collective.shards) of a model's layers at W up to
1024, with every layer compressed at the same ratio: the mean and the busiest rank's bytes
per step, in units of one rank's payload. Shows that per-rank traffic stays flat in W for the
sharded and hierarchical collectives, where the all-gather's grows as W-1.

``check``: the model's predictions against ``jobs.bench_network`` results (their JSON):
bytes per rank (interface counters) and communication + codec milliseconds per step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jobs.output_path import output_file
from tail_ray.collective.cost import COLLECTIVES, RING, Codec, Link, collective_cost
from tail_ray.collective.shards import MIN_SLICE_NUMEL, model_layout

WORLD_SIZES = [2**k for k in range(1, 11)]  # 2 .. 1024
LINKS_GBIT = [1.0, 10.0, 100.0]
RANKS_PER_NODE = 8  # the hierarchical rows: nodes of 8 ranks (GPUs) sharing one link
QUANT_BUCKET = 512  # Tail's default bucket: the slices' alignment


# -- codec speeds, measured -------------------------------------------------------------------


def measure_codec(repeats: int = 5) -> tuple[Codec, float]:
    """Tail's compress and decode speeds (GB/s of fp32 gradient) on the synthetic MLP's real
    gradient, one thread; and the compression ratio it got."""
    import torch

    from tail_ray.compression import make_compressor
    from tail_ray.runner.datasets import make_dataset
    from tail_ray.runner.models import loss_fn, make_model

    torch.set_num_threads(1)
    ds = make_dataset("synthetic", seed=0)
    model = make_model("synthetic_mlp", ds, seed=0)
    x, y = ds.batch(seed=0, step=0, rank=0, world_size=1, batch_size=32)
    loss_fn(ds, model(x), y).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    g_bytes = 4 * sum(t.numel() for t in grads.values())
    compressor = make_compressor("tail", seed=1)
    payload = compressor.compress(grads)  # JIT, controller's first decisions
    compress_s, decode_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        payload = compressor.compress(grads)
        compress_s.append(time.perf_counter() - t0)
        into = {n: t.clone() for n, t in grads.items()}
        t0 = time.perf_counter()
        compressor.aggregate([payload, payload], into)  # two payloads decoded and averaged
        decode_s.append((time.perf_counter() - t0) / 2)
    codec = Codec(g_bytes / min(compress_s) / 1e9, g_bytes / min(decode_s) / 1e9)
    return codec, g_bytes / len(payload)


# -- table -----------------------------------------------------------------------------------


def table_rows(params: float, ratio: float, codec: Codec, alpha_s: float) -> list[dict[str, Any]]:
    g = 4 * params
    rows = []
    for gbit in LINKS_GBIT:
        link = Link(gbit, alpha_s=alpha_s)
        for w in WORLD_SIZES:
            row: dict[str, Any] = {"link_gbit": gbit, "world_size": w}
            for name in COLLECTIVES:
                local = min(RANKS_PER_NODE, w) if name == "hierarchical" else 1
                cost = collective_cost(
                    name,
                    world_size=w,
                    gradient_bytes=g,
                    ratio=ratio,
                    link=link,
                    codec=codec,
                    local_world_size=local,
                )
                row[name] = {
                    "bytes": cost.bytes_sent,
                    "link_bytes": cost.link_bytes,
                    "ms": 1e3 * cost.total_s,
                }
            rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]], payload_bytes: float) -> None:
    names = {
        RING: "ring fp32 MB/rank",
        "allgather": "all-gather MB/rank",
        "sharded": "sharded MB/rank",
        "hierarchical": "hier. 8/node MB/node",
    }
    print("| link | W | " + " | ".join(f"{names[n]}, ms" for n in COLLECTIVES) + " |")
    print("|---:|---:|" + "---:|" * len(COLLECTIVES))
    for row in rows:
        cells = []
        for name in COLLECTIVES:
            c = row[name]
            # Hierarchical: what the node's link carries (its L ranks share it).
            shown = c["link_bytes"] if name == "hierarchical" else c["bytes"]
            cells.append(f"{shown / 1e6:.1f}, {c['ms']:.0f}")
        print(f"| {row['link_gbit']:g} Gbit/s | {row['world_size']} | " + " | ".join(cells) + " |")
    print(f"\n(one rank's payload: {payload_bytes / 1e6:.1f} MB)")


# -- simulation ------------------------------------------------------------------------------


def gpt2_small_layers() -> list[tuple[str, int]]:
    """GPT-2 small's parameter tensors (124M): embeddings, 12 blocks, final norm."""
    d, vocab, ctx = 768, 50257, 1024
    layers = [("wte", vocab * d), ("wpe", ctx * d)]
    for i in range(12):
        layers += [
            (f"h{i}.ln1.w", d), (f"h{i}.ln1.b", d),
            (f"h{i}.attn.qkv.w", d * 3 * d), (f"h{i}.attn.qkv.b", 3 * d),
            (f"h{i}.attn.proj.w", d * d), (f"h{i}.attn.proj.b", d),
            (f"h{i}.ln2.w", d), (f"h{i}.ln2.b", d),
            (f"h{i}.mlp.fc.w", d * 4 * d), (f"h{i}.mlp.fc.b", 4 * d),
            (f"h{i}.mlp.proj.w", 4 * d * d), (f"h{i}.mlp.proj.b", d),
        ]  # fmt: skip
    return [*layers, ("ln_f.w", d), ("ln_f.b", d)]


def synthetic_mlp_layers() -> list[tuple[str, int]]:
    dims = [256, 1024, 1024, 1024, 1024]
    layers = []
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        layers += [(f"net.{2 * i}.weight", a * b), (f"net.{2 * i}.bias", b)]
    return [*layers, ("net.8.weight", 1024 * 10), ("net.8.bias", 10)]


SIM_MODELS = {"gpt2_small": gpt2_small_layers, "synthetic_mlp": synthetic_mlp_layers}


def _sharded_sent(layers: Sequence[tuple[str, int]], world: int) -> list[float]:
    """Elements each rank sends per step in the sharded exchange (stage one: every slice it does
    not own; stage two: its own slices, to each of the W-1 others), from the real layout."""
    total = sum(n for _, n in layers)
    owned = [0.0] * world
    for pieces in model_layout(
        layers, world, alignment=QUANT_BUCKET, min_slice_numel=MIN_SLICE_NUMEL
    ).values():
        for piece in pieces:
            owned[piece.owner] += piece.stop - piece.start
    return [(total - mine) + (world - 1) * mine for mine in owned]


def simulate(layers: Sequence[tuple[str, int]], max_world: int) -> list[dict[str, float]]:
    """Per-rank bytes in payloads (one rank's compressed gradient = 1), mean and busiest rank."""
    total = float(sum(n for _, n in layers))
    out = []
    for w in [x for x in WORLD_SIZES if x <= max_world]:
        sharded = [s / total for s in _sharded_sent(layers, w)]
        row = {
            "world_size": w,
            "allgather": float(w - 1),
            "sharded_mean": statistics.mean(sharded),
            "sharded_max": max(sharded),
        }
        local = min(RANKS_PER_NODE, w)
        nodes = w // local
        if nodes > 1:
            # Each rank's part of the node (the model cut over L), then that part over N nodes.
            parts: dict[int, list[tuple[str, int]]] = {r: [] for r in range(local)}
            for name, pieces in model_layout(layers, local, alignment=QUANT_BUCKET).items():
                for piece in pieces:
                    parts[piece.owner].append((name, piece.stop - piece.start))
            rail_sent = {r: _sharded_sent(parts[r], nodes) if parts[r] else [0.0] * nodes for r in parts}
            per_node = [sum(rail_sent[r][n] for r in parts) / total for n in range(nodes)]
            row["hierarchical_node_mean"] = statistics.mean(per_node)
            row["hierarchical_node_max"] = max(per_node)
        out.append(row)
    return out


def print_simulation(rows: list[dict[str, float]], model: str, n_params: int) -> None:
    print(f"per-step bytes in payloads (1 = one rank's compressed gradient), {model} ({n_params / 1e6:.0f}M)")
    head = f"{'W':>5} {'all-gather':>10} {'sharded mean':>12} {'sharded max':>11}"
    print(f"{head} {'hier. node mean':>15} {'max':>6}")
    for r in rows:
        hier = (
            f"{r['hierarchical_node_mean']:15.2f} {r['hierarchical_node_max']:6.2f}"
            if "hierarchical_node_mean" in r
            else f"{'(one node)':>15} {'':>6}"
        )
        flat = (
            f"{r['world_size']:5d} {r['allgather']:10.0f} {r['sharded_mean']:12.2f} {r['sharded_max']:11.2f}"
        )
        print(f"{flat} {hier}")


# -- check against measurements ------------------------------------------------------------------

_COLLECTIVE_OF = {"none": RING, "tail-allgather": "allgather", "tail-sharded": "sharded"}


def check(paths: Sequence[Path], codec: Codec, alpha_s: float) -> list[dict[str, Any]]:
    out = []
    for path in paths:
        data = json.loads(path.read_text())
        for r in data["results"]:
            name = _COLLECTIVE_OF.get(r["method"])
            if name is None or not r["link"].endswith("Mbit"):
                continue
            w = int(r.get("world_size", data.get("world_size", 2)))
            g = float(r["raw_bytes_per_step"])
            ratio = g / r["encoded_bytes_per_step"] if r.get("encoded_bytes_per_step") else 1.0
            link = Link(float(r["link"].removesuffix("Mbit")) / 1000, alpha_s=alpha_s)
            cost = collective_cost(name, world_size=w, gradient_bytes=g, ratio=ratio, link=link, codec=codec)
            measured_ms = 1e3 * (r["comm_s_median"] + r["compress_s_median"] + r["decode_s_median"])
            out.append(
                {
                    "W": w,
                    "link": r["link"],
                    "method": r["method"],
                    "pred_MB": cost.bytes_sent / 1e6,
                    "iface_MB": r["bytes_per_step_interface"] / 1e6,
                    "pred_ms": 1e3 * cost.total_s,
                    "meas_ms": measured_ms,
                    "step_ms": 1e3 * r["step_s_median"],
                }
            )
    return out


def print_check(rows: list[dict[str, Any]]) -> None:
    head = f"{'W':>2} {'link':>9} {'method':>15} {'pred MB':>8} {'iface MB':>9}"
    print(f"{head} {'pred ms':>8} {'meas ms':>8} {'step ms':>8}")
    for r in rows:
        print(
            f"{r['W']:>2} {r['link']:>9} {r['method']:>15} {r['pred_MB']:8.3f} {r['iface_MB']:9.3f} "
            f"{r['pred_ms']:8.1f} {r['meas_ms']:8.1f} {r['step_ms']:8.1f}"
        )
    print("meas ms: the hook's comm + compress + decode medians (plain all-reduce: launch to completion,")
    print("overlapping backward); step ms: the whole step, compute included.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jobs.collective_cost",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    sub = parser.add_subparsers(dest="command", required=True)
    table = sub.add_parser("table", help="predicted bytes and ms per step, W = 2..1024, 1/10/100 Gbit/s")
    table.add_argument(
        "--params", type=float, default=124e6, help="gradient elements (default GPT-2 small's)"
    )
    table.add_argument(
        "--ratio",
        type=float,
        default=10.0,
        help="compression ratio (default %(default)s: Tail's steady state on this project's models; "
        "the ratio of one fresh compress is lower, the controller starts tight)",
    )
    table.add_argument(
        "--compress-gbps", type=float, help="codec speeds in GB/s of fp32 (default: measured here, now)"
    )
    table.add_argument("--decode-gbps", type=float)
    table.add_argument("--alpha-us", type=float, default=50.0, help="latency per message round (µs)")
    table.add_argument("--json", type=output_file, help="also write the rows here")
    sim = sub.add_parser("simulate", help="real shard layout to 1024 ranks: bytes per rank in payloads")
    sim.add_argument("--model", choices=sorted(SIM_MODELS), default="gpt2_small")
    sim.add_argument("--max-world-size", type=int, default=1024)
    chk = sub.add_parser("check", help="predictions against jobs.bench_network JSON results")
    chk.add_argument("results", type=Path, nargs="+")
    chk.add_argument("--alpha-us", type=float, default=50.0)
    args = parser.parse_args(argv)

    if args.command == "simulate":
        layers = SIM_MODELS[args.model]()
        print_simulation(simulate(layers, args.max_world_size), args.model, sum(n for _, n in layers))
        return 0
    if args.command == "table" and args.compress_gbps and args.decode_gbps:
        codec, ratio = Codec(args.compress_gbps, args.decode_gbps), args.ratio
    else:
        codec, measured_ratio = measure_codec()
        ratio = args.ratio if args.command == "table" else measured_ratio
        print(
            f"codec measured here (Tail, synthetic MLP, 1 thread): compress {codec.compress_gbps:.2f} GB/s, "
            f"decode {codec.decode_gbps:.2f} GB/s per payload, ratio {measured_ratio:.1f}x",
            file=sys.stderr,
        )
    if args.command == "table":
        rows = table_rows(args.params, ratio, codec, args.alpha_us * 1e-6)
        print_table(rows, 4 * args.params / ratio)
        if args.json:
            args.json.write_text(
                json.dumps({"codec": codec.__dict__, "ratio": ratio, "rows": rows}, indent=2)
            )
        return 0
    print_check(check(args.results, codec, args.alpha_us * 1e-6))
    return 0


if __name__ == "__main__":
    sys.exit(main())
