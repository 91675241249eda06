"""Turn the benchmarks' JSON into PNG plots a user can look at.

    python -m jobs.report [--results runs/] [--out docs/img/]

Reads the newest ``bench_convergence*.json``, ``bench_network*.json`` and
``bench_codec*.json`` under --results (whichever exist) and writes:
- traffic_vs_accuracy.png: bytes sent per worker per step vs final metric, per method;
- bits_per_layer.png: Tail's chosen bits per layer over steps;
- step_time_vs_link.png: median step time per method against link speed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger("report")


def newest(results_dir: Path, prefix: str) -> Path | None:
    found = sorted(results_dir.glob(f"{prefix}*.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def plot_step_time_vs_link(data: dict[str, Any], out: Path) -> Path:
    import matplotlib.pyplot as plt

    rows = data["results"]
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r["model"] == model]
        links = list(dict.fromkeys(r["link"] for r in mine))
        for method in dict.fromkeys(r["method"] for r in mine):
            ys = [
                next(
                    (1e3 * r["step_s_median"] for r in mine if r["link"] == lk and r["method"] == method),
                    float("nan"),
                )
                for lk in links
            ]
            ax.plot(links, ys, marker="o", label=method)
        ax.set_yscale("log")
        ax.set_xlabel("link")
        ax.set_ylabel("median step time (ms, log)")
        ax.set_title(f"{model}: step time vs link speed (2 ranks, gloo)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "step_time_vs_link.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_traffic_vs_accuracy(rows: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.5), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        mine = [r for r in rows if r["task"] == task]
        metric = "val_accuracy" if "val_accuracy" in mine[0]["final"] else "val_loss"
        for r in mine:
            y = r["final"][metric] * (100 if metric == "val_accuracy" else 1)
            ax.scatter(r["bytes_sent_per_step"] / 1e3, y, s=50)
            ax.annotate(
                r["label"],
                (r["bytes_sent_per_step"] / 1e3, y),
                textcoords="offset points",
                xytext=(5, 4),
                fontsize=9,
            )
        ax.set_xscale("log")
        ax.set_xlabel("KB sent per worker per step (log)")
        ax.set_ylabel("validation accuracy (%)" if metric == "val_accuracy" else "validation loss")
        ax.set_title(f"{task}: traffic vs final metric ({mine[0]['steps']} steps, 2 workers)")
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path = out / "traffic_vs_accuracy.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bits_per_layer(rows: list[dict[str, Any]], out: Path) -> Path | None:
    """``bits_per_layer.png`` under ``out``: see ``write_bits_plot``."""
    return write_bits_plot(rows, out / "bits_per_layer.png")


def write_bits_plot(
    rows: list[dict[str, Any]], path: Path, titles: dict[str, str] | None = None
) -> Path | None:
    """One heat map per tail row: quantized layers down, steps across, colour = bits chosen,
    or one colour of its own for a step the layer went as low-rank factors (overlapping step
    lines of a dozen layers could not be told apart). ``titles`` names a row's label in words
    (e.g. the settings of a ``tail*1`` variant). None without tail rows."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import BoundaryNorm, ListedColormap

    tails = [r for r in rows if r["method"] == "tail" and r.get("tail_bits_history")]
    if not tails:
        return None
    widths = (2, 3, 4, 5, 6, 7, 8)
    lowrank = widths[-1] + 1  # the grid value of a low-rank step (its "bits" are the factors')
    colours = [*plt.get_cmap("viridis")(np.linspace(0, 1, len(widths))), (0.84, 0.15, 0.16, 1.0)]
    cmap = ListedColormap(colours)
    norm = BoundaryNorm([b - 0.5 for b in (*widths, lowrank)] + [lowrank + 0.5], cmap.N)
    fig, axes = plt.subplots(len(tails), 1, figsize=(10, 1.2 + 2.6 * len(tails)), squeeze=False)
    for ax, r in zip(axes[:, 0], tails, strict=True):
        # Layers never quantized (raw fp32, or small layers as float16 throughout) are not the
        # controller's choice: left out.
        layers = {k: v for k, v in r["tail_bits_history"].items() if min(v) <= widths[-1]}
        steps = max(len(v) for v in layers.values())
        ranks = r.get("tail_lowrank_history") or {}
        grid = np.full((len(layers), steps), np.nan)
        for i, (name, bits) in enumerate(layers.items()):
            sent = ranks.get(name, [0] * len(bits))
            grid[i, : len(bits)] = [
                lowrank if rank else (b if b <= widths[-1] else np.nan)
                for b, rank in zip(bits, sent, strict=False)
            ]
        changes = sum(int(np.count_nonzero(np.diff(row[~np.isnan(row)]))) for row in grid)
        im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
        ax.set_yticks(range(len(layers)), list(layers), fontsize=6)
        ax.set_xlabel("step")
        label = (titles or {}).get(r["label"], r["label"])
        ax.set_title(f"{r['task']} ({label}): bits per layer over training, {changes} changes", fontsize=9)
        bar = fig.colorbar(im, ax=ax, ticks=(*widths, lowrank), label="bits")
        bar.ax.set_yticklabels([*map(str, widths), "low-rank"])
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # long layer names on the y axis
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="runs", help="folder with benchmark JSON (default: %(default)s)")
    parser.add_argument("--out", default="docs/img", help="folder for the PNGs (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")

    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    results, out = Path(args.results), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    net = newest(results, "bench_network")
    if net is not None:
        made.append(plot_step_time_vs_link(json.loads(net.read_text()), out))
    conv = newest(results, "bench_convergence")
    if conv is not None:
        rows = json.loads(conv.read_text())
        made.append(plot_traffic_vs_accuracy(rows, out))
        bits = plot_bits_per_layer(rows, out)
        if bits is not None:
            made.append(bits)
    if not made:
        logger.error(
            "no benchmark JSON found under %s: run jobs.bench_* with --json %s/<name>.json first",
            results,
            results,
        )
        return 1
    for path in made:
        logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
