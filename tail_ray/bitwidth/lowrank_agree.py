"""One low-rank choice for every rank: each layer's kind and rank per step, from every rank's wants.

Why: while each rank's ``LowRankChooser`` decided alone from its own M = g + e, the ranks sent
one layer in different forms: rank 0 digits' fc1 at rank 16 (~12 KB), rank 1 quantized (~24
KB). The all-gather then padded every payload to the longest, so that step cost 24 KB a rank,
and a rank stepping down to rank 8 saved nothing while the other stayed at 16 (docs/engine.md,
"Stacked options" and "Agreed low-rank choice"). The all-gather sends exact sizes since stop
46; what agreement still saves is the bytes of a rank that would have sent the layer
quantized while others send factors (1.2 % over the 2-rank unit test's 40 steps).

How: each rank's chooser still decides what it WANTS for a layer from its own M; the want
travels in the layer's record (``QuantRecord.want`` / ``LowRankRecord.want``, one byte of the
layer header). Every rank decodes every rank's payload, so after step t's exchange all ranks
hold the same wants and apply the same rule (``agreed_rank``, ``TailConfig.lowrank_agree``):
"half" (the default), low-rank iff at least half the ranks want it, "any", iff some rank
does, or "all", iff every rank does, at the largest wanted rank; otherwise quantized. Step
t+1 sends that, on every rank. Only integers decoded from the same payloads go into it, so it
is the same on every rank and CPU.

A layer no exchange has shown yet (the first step, a new world after a resize, a peer whose
payload carries no want: an older build) is quantized: the safe choice, as every rank can send
it. A compressor that has never seen an exchange (a unit test, one compressor alone) sends its
own want, as before agreement existed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tail_ray.compression.records import LayerRecord, LowRankRecord, QuantRecord
from tail_ray.errors import ConfigError

AGREEMENT_FORMAT = 1


AGREE_RULES = ("all", "half", "any")


def agreed_rank(wants: Sequence[int], rule: str = "half") -> int:
    """The rank every rank sends next (0: quantized), from every rank's want.

    "all": low-rank iff every rank wants it, at the largest wanted rank (so no rank's residual
    is held above what its own chooser asked for); a step never costs more than the largest
    own choice, but one rank wanting the quantizer keeps every rank there.
    "any": low-rank iff some rank wants it, at the largest wanted rank: a rank whose chooser
    wants the quantizer sends factors too (its error feedback stays exact: what the factors
    miss is sent later), so every rank sends the smaller form whenever one rank's chooser
    finds it good enough.
    "half": low-rank iff at least half the ranks want it, at the largest wanted rank. The same
    as "any" on 2 ranks (where it was measured); on more, one rank's want no longer pulls
    W - 1 ranks whose choosers judged the factors too lossy for their own M along with it.
    """
    wanting = sum(1 for w in wants if w >= 1)
    too_few = {"all": wanting < len(wants), "half": 2 * wanting < len(wants), "any": False}[rule]
    if wanting == 0 or too_few:
        return 0
    return max(wants)


def want_of(rec: LayerRecord | None) -> int:
    """The rank a record's sender wants for its layer (0: quantize; raw / sparse / missing: 0)."""
    return int(rec.want) if isinstance(rec, QuantRecord | LowRankRecord) else 0


class RankAgreement:
    """The agreed rank per layer (``agreed``: None until the first exchange) and the warm start
    of the factors this rank last sent per layer (``sent_q``, cols x the agreed rank: its own
    chooser's keeps its own rank's width)."""

    def __init__(self, rule: str = "half") -> None:
        if rule not in AGREE_RULES:
            raise ConfigError(f"lowrank_agree must be one of {list(AGREE_RULES)}, got {rule!r}")
        self.rule = rule
        self.agreed: dict[str, int] | None = None
        self.sent_q: dict[str, torch.Tensor] = {}

    def rank(self, name: str, want: int) -> int:
        """The rank to send the layer at this step (0: quantize)."""
        if self.agreed is None:
            return want
        return self.agreed.get(name, 0)

    def observe(self, records_by_rank: Sequence[Mapping[str, LayerRecord]]) -> None:
        """One exchange's decoded records, every rank's (this rank's own included): the next
        step's rank of each layer in it. A DDP bucket's exchange holds some layers: the others
        keep theirs."""
        agreed = {} if self.agreed is None else self.agreed
        for name in sorted(set().union(*records_by_rank)):
            agreed[name] = agreed_rank([want_of(d.get(name)) for d in records_by_rank], self.rule)
            if agreed[name] == 0:
                self.sent_q.pop(name, None)
        self.agreed = agreed

    def reset(self) -> None:
        """A new world (resize): nothing agreed, every layer quantized until its first exchange."""
        self.agreed = {}
        self.sent_q.clear()

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": AGREEMENT_FORMAT,
            "agreed": None if self.agreed is None else dict(self.agreed),
            "sent_q": {name: q.detach().to("cpu", copy=True) for name, q in self.sent_q.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` (same workers continuing: the same next choices)."""
        if state["format"] != AGREEMENT_FORMAT:
            raise ConfigError(
                f"low-rank agreement format {state['format']!r}, this build reads {AGREEMENT_FORMAT}"
            )
        agreed = state["agreed"]
        self.agreed = None if agreed is None else {str(k): int(v) for k, v in dict(agreed).items()}
        self.sent_q = {
            str(k): torch.as_tensor(q).to(torch.float32, copy=True) for k, q in dict(state["sent_q"]).items()
        }
