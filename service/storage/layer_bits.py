"""Per-layer bits over steps: each layer's bit-width history, cut into at most N step windows.

What the dashboard's bits heat map and ``GET /v1/jobs/{id}/metrics/layers/bits`` serve. Ranks
decide their bits independently (each from a sample of its own gradient plus residual; the
payload says its bits per layer, so nothing requires them to agree), so a window reports the
mean over every record in it (all ranks, all steps) and the min and max: ``min_bits <
max_bits`` shows a change inside the window or ranks that disagree. A layer sent as low-rank
factors (code ``lowrank-r<rank>``) reports the factors' bits (8), which says nothing about
the layer's own: ``lowrank_share`` is the fraction of the window's records sent that way, so
the heat map can show the kind, not a false "8 bits".

Windows are aligned to multiples of a width w (steps ``k*w .. k*w + w - 1``), w chosen so
that the job's step range fits in ``max_points`` windows (``window_width``): the same job read
twice with the same width cuts the same windows; a growing job re-cuts when the width grows.
A rank that re-ran a step after a restart counts each of its records (the newest-only rule of
the other reads would need a window function over every record; each record's bits were
really sent, and min/max cannot double count).

Cost: one pass over the job's layer records (in key order: the primary key finds them;
retention bounds how many stay), grouped by (window, layer) in the database, so the answer is
at most layers x ``max_points`` rows whatever the job's length. At 200k records (50 layers,
2 ranks, 2,000 steps) that pass took ~0.15 s on SQLite and ~0.12-0.22 s on PostgreSQL here,
before ``lowrank_share``; the share adds about a fifth (best of 7, side by side at 200k
records, 10 of 50 layers low-rank: SQLite 149 -> 176 ms, PostgreSQL 89 -> 120 ms), once per
ingest version (the read cache): cheap for a finished job, a real cost for a large
running one, hence the dashboard's throttle.
"""

from __future__ import annotations

from typing import Any

from service.storage.sql import SqlBase

# The job's step range: its first step (one seek of the (job_id, step) index), and the newest
# from layer_newest (kept by the ingest transaction).
_SPAN = """
SELECT (SELECT MIN(m.step) FROM layer_metrics m WHERE m.job_id = ?) AS lo, MAX(n.step) AS hi
FROM layer_newest n WHERE n.job_id = ?
"""

# Integer division on both backends (both operands BIGINT): step / w never overflows, unlike
# (step - lo) * points on a hostile step near 2**63. Workers count steps from 0; a negative
# step (a worker's bug) counts in step 0's window, so every window is aligned at 0 (SQL's
# division truncates toward zero, which would merge the windows either side of 0).
# GROUP BY w first: grouping by layer first made SQLite's planner walk the layer index and
# look up every record by key (0.45 s at 200k records); this way it scans the table in key
# order and sorts (0.15 s, measured side by side). The order of the rows does not matter: Python orders them.
_WINDOWS = """
SELECT layer, (CASE WHEN step < 0 THEN 0 ELSE step END) / CAST(? AS BIGINT) AS w,
       MIN(seq) AS first_seq, MAX(step) AS step, MAX(numel) AS numel,
       CAST(AVG(bits) AS DOUBLE PRECISION) AS bits, MIN(bits) AS min_bits, MAX(bits) AS max_bits,
       CAST(AVG(CASE WHEN SUBSTR(code, 1, 8) = 'lowrank-' THEN 1.0 ELSE 0.0 END) AS DOUBLE PRECISION)
         AS lowrank_share
FROM layer_metrics WHERE job_id = ?
GROUP BY w, layer
"""
_BIGINT_MAX = 2**63 - 1


def window_width(lo: int, hi: int, max_points: int) -> int:
    """The smallest width w >= 1 whose windows aligned at 0 cover steps ``lo..hi`` (negative
    ones count as 0) in at most ``max_points`` >= 2 windows.

    Windows over n = hi - lo + 1 steps number at most ceil(n / w) + 1 (the range may start
    mid-window), so w = ceil(n / (max_points - 1)) suffices. Capped at BIGINT's maximum: only
    a range of every non-negative step reaches it, and that is two windows."""
    if max_points < 2:
        raise ValueError(f"max_points must be >= 2, got {max_points}")
    lo, hi = max(lo, 0), max(hi, 0)
    n = hi - lo + 1
    if n <= max_points:
        return 1
    return min(-(-n // (max_points - 1)), _BIGINT_MAX)


class LayerBitsSql(SqlBase):
    def layer_bits(self, job_id: str, max_points: int) -> dict[str, Any]:
        """``{"first_step", "last_step", "step_width", "layers": [...]}``: per layer (in the
        order it first reported, i.e. the model's), its windows oldest first as parallel
        lists ``steps`` (each window's newest step), ``bits`` (mean), ``min_bits``,
        ``max_bits``, ``lowrank_share`` (the fraction of its records sent as low-rank
        factors). Empty ``layers`` and null steps before the first record."""
        with self._read() as tx:
            span = tx.one(_SPAN, (job_id, job_id))
            if span is None or span["lo"] is None or span["hi"] is None:
                return {"first_step": None, "last_step": None, "step_width": 1, "layers": []}
            lo, hi = int(span["lo"]), int(span["hi"])
            width = window_width(lo, hi, max_points)
            rows = tx.all(_WINDOWS, (width, job_id))
        layers: dict[str, dict[str, Any]] = {}
        for r in sorted(rows, key=lambda r: (r["layer"], r["w"])):
            series = layers.get(r["layer"])
            if series is None:
                series = layers[r["layer"]] = {
                    "layer": r["layer"], "numel": 0, "first_seq": r["first_seq"],
                    "steps": [], "bits": [], "min_bits": [], "max_bits": [], "lowrank_share": [],
                }  # fmt: skip
            series["first_seq"] = min(series["first_seq"], r["first_seq"])
            series["numel"] = max(series["numel"], int(r["numel"]))
            series["steps"].append(int(r["step"]))
            series["bits"].append(float(r["bits"]))
            series["min_bits"].append(int(r["min_bits"]))
            series["max_bits"].append(int(r["max_bits"]))
            series["lowrank_share"].append(float(r["lowrank_share"]))
        ordered = sorted(layers.values(), key=lambda s: (s["first_seq"], s["layer"]))
        for series in ordered:
            del series["first_seq"]
        return {"first_step": lo, "last_step": hi, "step_width": width, "layers": ordered}
