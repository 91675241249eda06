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


def _cost(layer: LayerCurve, nu: float) -> float:
    """The layer's share of the whole-model error budget at relative error ``nu``."""
    return layer.numel * nu / layer.tau


def allowed(
    layer: LayerCurve, candidate_bits: Sequence[int], *, layer_cap: float, tau_max: float
) -> list[int]:
    """Indices of the candidates this layer may use, ascending: nu within its cap, and always
    the largest candidate (accuracy first: nothing fits -> the most accurate)."""
    cap = min(tau_max, layer_cap * layer.tau)
    last = len(candidate_bits) - 1
    return [j for j in range(last) if layer.nu[j] <= cap] + [last]


def _hull(layer: LayerCurve, idx: list[int], candidate_bits: Sequence[int]) -> list[int]:
    """The lower convex hull of (bits, error cost) over the allowed candidates, from the
    largest bit-width down (always its first point): the only points a greedy walk by
    price should stop on; prices (error per bit saved) increase along it."""
    pts = sorted(idx, key=lambda j: -candidate_bits[j])  # descending bits
    hull: list[int] = []
    for j in pts:
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # Keep b only if stopping there is cheaper per bit than going on to j (this also
            # drops a b that j dominates: fewer bits at no more error).
            price_ab = (layer.nu[b] - layer.nu[a]) / (candidate_bits[a] - candidate_bits[b])
            price_aj = (layer.nu[j] - layer.nu[a]) / (candidate_bits[a] - candidate_bits[j])
            if price_ab >= price_aj:
                hull.pop()
            else:
                break
        hull.append(j)
    return hull


def _bytes(layers: Sequence[LayerCurve], choice: dict[str, int]) -> int:
    return sum(layer.numel * choice[layer.name] for layer in layers)  # in bits; /8 is common


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
    """
    bits = tuple(candidate_bits)
    top = len(bits) - 1
    every = sorted(layers, key=lambda c: c.name)
    # A layer over its own budget even at the largest candidate keeps it (as with the
    # per-layer rule) and stays out of the trade: its overspend is not charged to the others.
    pinned = {c.name: bits[top] for c in every if c.nu[top] > c.tau}
    curves = [c for c in every if c.name not in pinned]
    if not curves:
        return pinned
    budget = float(sum(c.numel for c in curves))
    current = {c.name: top for c in curves}
    spent = sum(_cost(c, c.nu[top]) for c in curves)
    segments: list[tuple[float, str, int, int, int]] = []  # (price, name, order, from, to)
    for c in curves:
        hull = _hull(c, allowed(c, bits, layer_cap=layer_cap, tau_max=tau_max), bits)
        for k in range(len(hull) - 1):
            a, b = hull[k], hull[k + 1]
            price = (c.nu[b] - c.nu[a]) / c.tau / (bits[a] - bits[b])
            segments.append((price, c.name, k, a, b))
    segments.sort()
    by_name = {c.name: c for c in curves}
    blocked: set[str] = set()
    for _price, name, _k, a, b in segments:
        if name in blocked or current[name] != a:
            continue
        c = by_name[name]
        extra = _cost(c, c.nu[b]) - _cost(c, c.nu[a])
        if spent + extra <= budget * (1 + 1e-12):
            spent += extra
            current[name] = b
        else:
            blocked.add(name)  # its later segments are pricier and come after this one
    greedy = {name: bits[j] for name, j in current.items()}
    per_layer = {c.name: pick_bits(np.asarray(c.nu), bits, c.tau) for c in curves}
    best = per_layer if _bytes(curves, per_layer) < _bytes(curves, greedy) else greedy
    return {**best, **pinned}


def trade_layers(layers: Iterable[LayerCurve], candidate_bits: Sequence[int]) -> list[LayerCurve]:
    """The layers that take part in the trade: within their own tau at the largest candidate."""
    top = len(candidate_bits) - 1
    return [c for c in layers if c.nu[top] <= c.tau]


def budget_used(layers: Iterable[LayerCurve], choice: dict[str, int], candidate_bits: Sequence[int]) -> float:
    """The share of the whole-model budget a choice spends (<= 1 within budget)."""
    curves = list(layers)
    total = sum(c.numel for c in curves)
    spent = sum(_cost(c, c.nu[list(candidate_bits).index(choice[c.name])]) for c in curves)
    return spent / total if total else 0.0
