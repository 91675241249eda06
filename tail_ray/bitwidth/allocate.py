"""Whole-model bit allocation: one error budget over every layer, spent where a byte buys the most.

The per-layer rule (``pick_bits``) gives each layer the smallest b with nu_b <= tau_l.
Bit-widths are coarse (one bit less multiplies nu by ~5), so in practice each layer lands far
below its budget: at 4 bits nu ~ 0.05 against tau ~ 0.2, a quarter of what it may spend, and
the slack of one layer cannot pay for another.

Here the budget is the WHOLE model's (as L-GreCo allocates compression per layer under one
total error, there by dynamic programming; here by a greedy walk on each layer's convex hull):

    minimize   sum_l bytes_l(b_l)                  bytes_l(b) = numel_l * b / 8
    subject to sum_l numel_l * nu_l(b_l) / tau_l <= sum_l numel_l
               nu_l(b_l) <= min(tau_max, layer_cap * tau_l)   (or b_l = the largest candidate)

nu_l / tau_l is the layer's compression noise in units of what it may add (tau_l =
noise_fraction * its relative SGD noise * the phase factor), so the constraint says: averaged
over the model's coordinates, compression noise stays within noise_fraction of SGD noise,
exactly the per-layer rule's promise, kept on average instead of in every layer. Weighting by
numel and by 1/tau makes the trade scale-free (a layer's gradient magnitude does not matter,
which suits Adam's per-coordinate normalisation as much as SGD) and the budget follows
training through tau: critical phases halve every tau_l, so the whole budget tightens.
``layer_cap`` bounds how far one layer may exceed its own share, and tau_max keeps error
feedback stable (nu < 1).

Bytes are nominal (b bits per element; the entropy coder saves roughly the same fraction at
every b, and scales do not depend on b), so a move's price is its error increase per bit
saved per element: layers whose nu curve is flat relative to tau (much SGD noise, or a
benign distribution) give up bits first.

Deterministic: the result depends only on the set of (name, numel, tau, nu) given, not on
their order (ties broken by name), so ranks holding the same statistics pick the same bits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


def pick_bits(nu_by_bits: np.ndarray, candidate_bits: tuple[int, ...], tau: float) -> int:
    """The per-layer rule: the smallest candidate b with estimated error nu_b <= tau, else the
    largest candidate (accuracy first)."""
    order = sorted(range(len(candidate_bits)), key=lambda j: candidate_bits[j])
    for j in order:
        if nu_by_bits[j] <= tau:
            return candidate_bits[j]
    return candidate_bits[order[-1]]


@dataclass(frozen=True)
class LayerCurve:
    """One layer's estimated relative error at every candidate bit-width, and its budget."""

    name: str
    numel: int
    tau: float
    nu: tuple[float, ...]  # nu at candidate_bits[j], candidates ascending


def allowed(
    layer: LayerCurve, candidate_bits: Sequence[int], *, layer_cap: float, tau_max: float
) -> list[int]:
    """Indices of the candidates this layer may use, ascending: nu within its cap, and always
    the largest candidate (accuracy first: nothing fits -> the most accurate)."""
    cap = min(tau_max, layer_cap * layer.tau)
    last = len(candidate_bits) - 1
    return [j for j in range(last) if layer.nu[j] <= cap] + [last]


def _lower_hull(nu: Sequence[float], bits: Sequence[int], *, cap: float) -> list[int]:
    """Candidate indices on the lower convex hull in (bits, nu), from the largest width down,
    skipping candidates whose error is over ``cap``."""
    top = len(bits) - 1
    hull = [top]
    for j in range(top - 1, -1, -1):
        if nu[j] > cap:
            continue
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # Keep b only if stopping there is cheaper per bit than going on to j (this
            # also drops a b that j dominates: fewer bits at no more error).
            if (nu[b] - nu[a]) * (bits[a] - bits[j]) >= (nu[j] - nu[a]) * (bits[a] - bits[b]):
                hull.pop()
            else:
                break
        hull.append(j)
    return hull


def allocate_bits(
    layers: Iterable[LayerCurve],
    candidate_bits: Sequence[int],
    *,
    layer_cap: float,
    tau_max: float,
) -> dict[str, int]:
    """Bits per layer under one whole-model budget (see the module docstring).

    Greedy on convex hulls: every layer starts at its largest candidate; the hull segments of
    all layers (each a step down in bits) are taken cheapest first (error cost per bit saved)
    while the total stays within budget. The result is compared with the per-layer rule's
    choice (feasible too) and the one with fewer bytes is returned, so this never sends more
    than the per-layer rule under the same budget. Layers over their own tau even at the
    largest candidate keep it and are left out of the budget (``trade_layers``).

    ``candidate_bits`` ascending (TailConfig sorts them). Plain loops, no sorting per layer:
    it runs once per step in the controller (~0.1 ms for a dozen layers).
    """
    bits = tuple(candidate_bits)
    top = len(bits) - 1
    pinned: dict[str, int] = {}
    budget = spent = 0.0
    segments: list[tuple[float, str, int, int, int]] = []  # (price, name, order, from, to)
    weights: dict[str, float] = {}
    nus: dict[str, tuple[float, ...]] = {}
    numels: dict[str, int] = {}
    per_layer_bits = 0
    per_layer: dict[str, int] = {}
    for c in sorted(layers, key=lambda c: c.name):
        nu, tau = c.nu, c.tau
        if nu[top] > tau:
            # Over its own budget even at the largest candidate: keeps it (as with the
            # per-layer rule) and stays out of the trade, its overspend not charged to others.
            pinned[c.name] = bits[top]
            continue
        w = c.numel / tau
        weights[c.name], nus[c.name], numels[c.name] = w, nu, c.numel
        budget += c.numel
        spent += w * nu[top]
        j = 0
        while nu[j] > tau:  # the per-layer rule; stops at top at the latest
            j += 1
        per_layer[c.name] = bits[j]
        per_layer_bits += c.numel * bits[j]
        hull = _lower_hull(nu, bits, cap=min(tau_max, layer_cap * tau))
        for k in range(len(hull) - 1):
            a, b = hull[k], hull[k + 1]
            segments.append(((nu[b] - nu[a]) / tau / (bits[a] - bits[b]), c.name, k, a, b))
    if not weights:
        return pinned
    segments.sort()
    current = dict.fromkeys(weights, top)
    blocked: set[str] = set()
    limit = budget * (1 + 1e-12)
    for _price, name, _k, a, b in segments:
        if name in blocked or current[name] != a:
            continue
        extra = weights[name] * (nus[name][b] - nus[name][a])
        if spent + extra <= limit:
            spent += extra
            current[name] = b
        else:
            blocked.add(name)  # its later segments are pricier and come after this one
    greedy = {name: bits[j] for name, j in current.items()}
    greedy_bits = sum(numels[name] * b for name, b in greedy.items())
    best = per_layer if per_layer_bits < greedy_bits else greedy
    return {**best, **pinned}


def trade_layers(layers: Iterable[LayerCurve], candidate_bits: Sequence[int]) -> list[LayerCurve]:
    """The layers that take part in the trade: within their own tau at the largest candidate."""
    top = len(candidate_bits) - 1
    return [c for c in layers if c.nu[top] <= c.tau]


def budget_used(layers: Iterable[LayerCurve], choice: dict[str, int], candidate_bits: Sequence[int]) -> float:
    """The share of the whole-model budget a choice spends (<= 1 within budget)."""
    curves = list(layers)
    total = sum(c.numel for c in curves)
    index = {b: j for j, b in enumerate(candidate_bits)}
    spent = sum(c.numel * c.nu[index[choice[c.name]]] / c.tau for c in curves)
    return spent / total if total else 0.0
