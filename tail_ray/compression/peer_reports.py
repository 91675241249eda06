"""Peer reports: the SGD-noise measurements one rank made, for the ranks that did not.

In the sharded exchanges each layer slice is decoded by its owner only, so only the owner can
measure the slice's between-worker spread (``TailCompressor.observe_peers``). Owners send
(spread, compression, grad_sq, numel) per layer as float64 (NaN where unmeasured); the others
fold them into their budgets, one observation per layer per step."""

from __future__ import annotations

import logging
import math
from collections.abc import Container, Mapping, Sequence

import numpy as np

log = logging.getLogger(__name__)

_NAN4 = (math.nan,) * 4


def encode_report(measured: Mapping[str, tuple[float, float, float, float]], names: Sequence[str]) -> bytes:
    """(spread, compression, grad_sq, numel) per name as little-endian float64."""
    values = [v for name in names for v in measured.get(name, _NAN4)]
    return np.asarray(values, dtype="<f8").tobytes()


def merge_reports(
    reports: Sequence[tuple[Sequence[str], bytes]], skip: Container[str]
) -> dict[str, tuple[float, float, float]]:
    """Per layer not in ``skip`` (those this rank measured itself): (spread, compression,
    grad_sq), the numel-weighted mean of the slices reported (several owners may hold slices
    of one layer). A report of the wrong size is ignored with a warning: it only informs the
    budget."""
    merged: dict[str, list[float]] = {}
    for names, blob in reports:
        if len(blob) != 32 * len(names):
            log.warning("peer report of %d bytes for %d layers: ignored", len(blob), len(names))
            continue
        values = np.frombuffer(blob, dtype="<f8")
        for name, (spread, compression, grad_sq, numel) in zip(names, values.reshape(-1, 4), strict=True):
            if name in skip or not all(math.isfinite(v) for v in (spread, compression, grad_sq)):
                continue
            acc = merged.setdefault(name, [0.0, 0.0, 0.0, 0.0])
            for i, v in enumerate((spread, compression, grad_sq)):
                acc[i] += float(v) * float(numel)
            acc[3] += float(numel)
    return {
        name: (spread / weight, compression / weight, grad_sq / weight)
        for name, (spread, compression, grad_sq, weight) in merged.items()
        if weight > 0
    }
