"""Several seeds of bench_convergence in one table: every method against none, mean and worst.

    python -m jobs.bench_convergence --tasks digits,lm --methods none,tail --seeds 0-4

Why: one run says little here. The LM's final loss moves by up to 0.7 % when only float16
rounding is added (docs/engine.md, "The benchmark's own noise"), and Tail's rounding seed is
random per run, so issue 15 judges a setting on five seeds or more and quotes every figure as
the mean and the worst seed. This module turns the runs of several seeds into those figures:

    vs none      per seed, against none of the SAME seed (% of its loss, or accuracy points);
                 mean, worst (the highest loss, the lowest accuracy) and standard deviation
    reduction    none's bytes per step over the method's, mean and range over the seeds (and
                 the second half's mean: after the warm-up phases)
    deciding     Tail's decision share after the first steps, the largest over the seeds
    paired       a ``tail*N`` variant against the default ``tail`` row of the same runs: the
                 mean per-seed difference and its standard error (both rows share the seed's
                 data, model and ``none``, so the seed-to-seed spread cancels)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ACCURACY = "val_accuracy"


def parse_seeds(text: str) -> list[int]:
    """ "0-4", "0,2,5" or "0-2,7" as a list of distinct seeds in that order; a ValueError that
    says what is accepted otherwise."""
    seeds: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"seeds must be like 0-4 or 0,2,5 (non-negative integers), got {text!r}")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise ValueError(f"seed range {part!r} runs backwards")
        seeds += range(lo, hi + 1)
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds {text!r} name a seed twice")
    return seeds


def vs_none(value: float, base: float, metric: str) -> float:
    """A result against none's: accuracy in points, a loss in % of none's."""
    return 100.0 * (value - base) if metric == ACCURACY else 100.0 * (value / base - 1.0)


@dataclass(frozen=True)
class SeedSummary:
    """One (task, method row) over the seeds; tuples are in seed order."""

    task: str
    label: str
    metric: str
    seeds: tuple[int, ...]
    vs_none: tuple[float, ...]
    reduction: tuple[float, ...]
    reduction_2nd_half: tuple[float, ...]
    decision_share_steady: tuple[float, ...] = ()  # Tail rows only
    paired_vs_tail: tuple[float, ...] = ()  # tail*N rows: this row's vs_none less tail's, per seed

    @property
    def mean(self) -> float:
        return statistics.mean(self.vs_none)

    @property
    def worst(self) -> float:
        return min(self.vs_none) if self.metric == ACCURACY else max(self.vs_none)

    @property
    def sd(self) -> float:
        return statistics.stdev(self.vs_none) if len(self.vs_none) > 1 else 0.0

    @property
    def paired(self) -> tuple[float, float] | None:
        """(mean, standard error) of ``paired_vs_tail``; None for a row with no pairing."""
        if not self.paired_vs_tail:
            return None
        n = len(self.paired_vs_tail)
        se = statistics.stdev(self.paired_vs_tail) / math.sqrt(n) if n > 1 else math.nan
        return statistics.mean(self.paired_vs_tail), se


def summarize(
    results_by_seed: Mapping[int, Sequence[Mapping[str, Any]]], metrics: Mapping[str, str]
) -> list[SeedSummary]:
    """Every non-none row of every task, over the seeds, in the first seed's order.

    ``results_by_seed``: bench_convergence's rows per seed, each seed's with a ``none`` row per
    task (the baseline of every figure: a ValueError otherwise). ``metrics``: task -> metric."""
    seeds = list(results_by_seed)
    per: dict[tuple[str, str], dict[str, list[float]]] = {}
    for seed in seeds:
        rows = results_by_seed[seed]
        for task in dict.fromkeys(r["task"] for r in rows):
            mine = [r for r in rows if r["task"] == task]
            base = next((r for r in mine if r["method"] == "none"), None)
            if base is None:
                raise ValueError(f"seed {seed}, task {task}: no 'none' row to compare against")
            metric = metrics[task]
            tail = next((r for r in mine if r["label"] == "tail"), None)
            for r in mine:
                if r["method"] == "none":
                    continue
                got = per.setdefault(
                    (task, r["label"]), {k: [] for k in ("vs", "red", "late", "dec", "pair")}
                )
                got["vs"].append(vs_none(r["final"][metric], base["final"][metric], metric))
                got["red"].append(base["bytes_sent_per_step"] / r["bytes_sent_per_step"])
                got["late"].append(base["bytes_sent_per_step_2nd_half"] / r["bytes_sent_per_step_2nd_half"])
                if r.get("tail_decision_share_steady") is not None:
                    got["dec"].append(r["tail_decision_share_steady"])
                if tail is not None and r["label"].startswith("tail*"):
                    own = got["vs"][-1]
                    got["pair"].append(own - vs_none(tail["final"][metric], base["final"][metric], metric))
    summaries = []
    for (task, label), got in per.items():
        if len(got["vs"]) != len(seeds):
            raise ValueError(f"{task} / {label} ran on {len(got['vs'])} of {len(seeds)} seeds")
        summaries.append(
            SeedSummary(
                task=task,
                label=label,
                metric=metrics[task],
                seeds=tuple(seeds),
                vs_none=tuple(got["vs"]),
                reduction=tuple(got["red"]),
                reduction_2nd_half=tuple(got["late"]),
                decision_share_steady=tuple(got["dec"]),
                paired_vs_tail=tuple(got["pair"]),
            )
        )
    return summaries


def format_summary(summaries: Sequence[SeedSummary]) -> list[str]:
    """The summary as printed lines: one per (task, method), then the variants' pairings."""
    if not summaries:
        return []
    seeds = summaries[0].seeds
    lines = [
        f"\n== over {len(seeds)} seeds ({', '.join(map(str, seeds))}): "
        "each method against none of the same seed",
        f"{'task':<8} {'method':<12} {'vs none, per seed':<44} {'mean':>8} {'worst':>8} {'sd':>6} "
        f"{'reduction (range)':>20} {'2nd half':>9} {'deciding':>9}",
    ]
    for s in summaries:
        unit = "pt" if s.metric == ACCURACY else "%"
        each = " ".join(f"{v:+.2f}" for v in s.vs_none) + f" {unit}"
        red = f"{statistics.mean(s.reduction):.1f}x ({min(s.reduction):.1f}-{max(s.reduction):.1f}x)"
        late = f"{statistics.mean(s.reduction_2nd_half):.1f}x"
        dec = f"{100 * max(s.decision_share_steady):.2f}%" if s.decision_share_steady else "-"
        lines.append(
            f"{s.task:<8} {s.label:<12} {each:<44} {f'{s.mean:+.2f}{unit}':>8} {f'{s.worst:+.2f}{unit}':>8} "
            f"{s.sd:>6.2f} {red:>20} {late:>9} {dec:>9}"
        )
    for s in summaries:
        paired = s.paired
        if paired is not None:
            unit = "points" if s.metric == ACCURACY else "points of %"
            lines.append(
                f"{s.task} {s.label} against tail, paired over the seeds: {paired[0]:+.2f} {unit} "
                f"(s.e. {paired[1]:.2f})"
            )
    lines.append("(deciding: the largest over the seeds of Tail's decision share after the first steps)")
    return lines
