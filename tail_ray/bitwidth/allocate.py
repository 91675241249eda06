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

import math
from bisect import bisect_left, insort
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

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


# (price, name, order on the hull, from, to, extra): a step down the layer's hull, and the
# whole-model budget it spends (numel / tau * (nu_to - nu_from)). The key is unique per
# segment before ``extra``, so sorting these orders the steps as (price, name, order) does.
Segment = tuple[float, str, int, int, int, float]


@dataclass(frozen=True)
class _LayerTerms:
    """What one layer contributes to an allocation: a function of its curve alone, so it is
    kept between allocations and recomputed only when the layer's curve changes."""

    curve: LayerCurve
    pinned: bool  # over its own tau even at the largest candidate: keeps it, out of the trade
    spent_top: float  # numel / tau * nu at the largest candidate
    per_layer: int  # the per-layer rule's bits
    segments: tuple[Segment, ...]  # its lower hull's steps down in bits


def _layer_terms(c: LayerCurve, bits: tuple[int, ...], *, layer_cap: float, tau_max: float) -> _LayerTerms:
    nu, tau = c.nu, c.tau
    top = len(bits) - 1
    if nu[top] > tau:
        return _LayerTerms(c, True, 0.0, bits[top], ())
    w = c.numel / tau
    j = 0
    while nu[j] > tau:  # the per-layer rule; stops at top at the latest
        j += 1
    hull = _lower_hull(nu, bits, cap=min(tau_max, layer_cap * tau))
    segments = tuple(
        ((nu[b] - nu[a]) / tau / (bits[a] - bits[b]), c.name, k, a, b, w * (nu[b] - nu[a]))
        for k, (a, b) in enumerate(pairwise(hull))
    )
    return _LayerTerms(c, False, w * nu[top], bits[j], segments)


class ModelAllocator:
    """``allocate_bits`` for a controller that calls it again and again on curves of which only
    a few changed since the last call (the controller re-allocates at most every few steps,
    after one or a few layers were re-estimated). Kept between calls: each layer's terms (hull,
    price segments with their budget cost, per-layer rule), recomputed only for a replaced
    curve, and all segments in sorted order, updated by bisection for the replaced ones.

    The result is ``allocate_bits``'s, bit for bit: the sums run over the layers in the same
    (name) order; the segments' sort key is unique per segment (price, name, order on the
    hull) and totally ordered while every price is finite, so the kept list is the order a
    fresh sort gives (a non-finite price, which finite estimates never give, makes it sort
    afresh in the original order); the greedy walk is the same. Measured on the char LM's
    controller (11 layers, its real sequence of allocations, replayed): ~30 -> ~13 us per
    allocation. tests/bitwidth/test_decision_digest.py holds it to the decisions main made.
    """

    def __init__(self, candidate_bits: Sequence[int], *, layer_cap: float, tau_max: float) -> None:
        self.bits = tuple(candidate_bits)
        self.layer_cap = layer_cap
        self.tau_max = tau_max
        self._terms: dict[str, _LayerTerms] = {}
        self._names: list[str] = []  # sorted keys of _terms
        self._segments: list[Segment] = []  # every layer's segments, sorted

    def _update(self, layers: Iterable[LayerCurve]) -> None:
        terms: dict[str, _LayerTerms] = {}
        added: list[Segment] = []
        for c in layers:
            old = self._terms.get(c.name)
            if old is not None and old.curve is c:  # the controller replaces a re-estimated curve
                terms[c.name] = old
            else:
                new = _layer_terms(c, self.bits, layer_cap=self.layer_cap, tau_max=self.tau_max)
                terms[c.name] = new
                added += new.segments
        removed = [s for name, t in self._terms.items() if terms.get(name) is not t for s in t.segments]
        if terms.keys() != self._terms.keys():
            self._names = sorted(terms)
        self._terms = terms
        kept = self._segments
        if len(added) + len(removed) > len(kept) // 2 or not all(math.isfinite(s[0]) for s in added):
            # Many changed, or an unordered price: sort afresh, in allocate_bits' order.
            self._segments = [s for name in self._names for s in terms[name].segments]
            self._segments.sort()
            return
        for s in removed:
            del kept[bisect_left(kept, s)]
        for s in added:
            insort(kept, s)

    def allocate(self, layers: Iterable[LayerCurve]) -> dict[str, int]:
        """Bits per layer under one whole-model budget: see ``allocate_bits``."""
        self._update(layers)
        bits = self.bits
        top = len(bits) - 1
        pinned: dict[str, int] = {}
        budget = spent = 0.0
        per_layer_bits = 0
        per_layer: dict[str, int] = {}
        numels: dict[str, int] = {}
        for name in self._names:  # sorted: the sums below are added in one fixed order
            t = self._terms[name]
            if t.pinned:
                pinned[name] = t.per_layer
                continue
            numel = numels[name] = t.curve.numel
            budget += numel
            spent += t.spent_top
            per_layer[name] = t.per_layer
            per_layer_bits += numel * t.per_layer
        if not numels:
            return pinned
        # Each traded layer's position on its hull; ~a once blocked (negative: no segment
        # starts there, so its later, pricier segments are skipped by the same test).
        current = dict.fromkeys(numels, top)
        limit = budget * (1 + 1e-12)
        for _price, name, _k, a, b, extra in self._segments:
            if current[name] != a:
                continue
            if spent + extra <= limit:
                spent += extra
                current[name] = b
            else:
                current[name] = ~a
        greedy = {name: bits[j if j >= 0 else ~j] for name, j in current.items()}
        greedy_bits = sum(numels[name] * b for name, b in greedy.items())
        best = per_layer if per_layer_bits < greedy_bits else greedy
        return {**best, **pinned}


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

    ``candidate_bits`` ascending (TailConfig sorts them). The controller keeps a
    ``ModelAllocator`` instead, which reuses the terms of unchanged layers between calls.
    """
    return ModelAllocator(candidate_bits, layer_cap=layer_cap, tau_max=tau_max).allocate(layers)


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
