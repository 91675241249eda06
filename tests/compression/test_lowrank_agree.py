"""One low-rank choice for every rank (bitwidth/lowrank_agree.py), through two simulated ranks.

Two TailCompressors with ``lowrank="on"`` stand for two workers: each compresses its own
gradients, then each aggregates both payloads (own=its rank), as the all-gather hook does. Their
gradients differ on purpose, so their choosers want different things at some steps; what they
SEND must still be the same kind and rank per layer at every step after the first exchange, and
each rank's residual must stay exactly M minus what the receivers reconstruct.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch

from tail_ray.bitwidth import lowrank_choice
from tail_ray.bitwidth.lowrank_agree import agreed_rank
from tail_ray.compression.lowrank import reconstruct
from tail_ray.compression.records import LowRankRecord, QuantRecord, RawRecord
from tail_ray.compression.tail import TailCompressor, TailConfig
from tail_ray.compression.wire import decode_payload, encode_payload
from tail_ray.errors import CodecError, ConfigError

STEPS = 40
_BASIS = torch.Generator().manual_seed(2024)
_U, _V = torch.randn(128, 6, generator=_BASIS), torch.randn(256, 6, generator=_BASIS)


def _grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    """Rank 0: a rank-2 matrix plus a little noise all along (its chooser wants rank 2 or 4).
    Rank 1: the same until step 12, then rank 6 (it wants a higher rank) until 22, then
    full-rank noise (it wants the quantizer) until 30, then rank 2 again. Plus a full-rank
    layer (quantized everywhere) and a bias (raw)."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    k = 6 if rank == 1 and 12 <= step < 22 else 2
    coeff = 1.0 + 0.1 * torch.randn(k, generator=gen)
    w = (_U[:, :k] * coeff) @ _V[:, :k].T + 0.01 * torch.randn(128, 256, generator=gen)
    if (rank == 1 and 22 <= step < 30) or (rank == 2 and 6 <= step < 30):
        w = torch.randn(128, 256, generator=gen)  # rank 2 (3-rank tests only): steps 6-29
    return {"w": w, "full": torch.randn(64, 512, generator=gen), "bias": torch.randn(64, generator=gen)}


def _pair(agree: str = "all", world_size: int = 2) -> list[TailCompressor]:
    settings: dict[str, Any] = {"lowrank": "on", "warmup_steps": 0, "redecide_every_steps": 4}
    configs = [TailConfig(**settings, lowrank_agree=agree, seed=7 + r) for r in range(world_size)]
    return [TailCompressor(config) for config in configs]


def _sent(payload: bytes) -> dict[str, tuple[str, int]]:
    """What a payload sends per layer: its kind and low-rank rank (0: not low-rank)."""
    return {
        rec.name: (type(rec).__name__, rec.rank if isinstance(rec, LowRankRecord) else 0)
        for rec in decode_payload(payload)
    }


def _run(comps: list[TailCompressor], *, alone: bool = False) -> list[list[bytes]]:
    """STEPS steps of both ranks, each aggregating both payloads; ``alone``: every rank sends
    its own chooser's choice (the agreement forgotten after each exchange: the choice before
    agreement existed, with the same budget from the peers). Checks every rank's residual of
    a low-rank layer against the decoded reconstruction, bit for bit."""
    steps = []
    for step in range(STEPS):
        payloads = []
        for rank, comp in enumerate(comps):
            grads = _grads(rank, step)
            assert comp.feedback is not None
            e_before = comp.feedback.buffer("w", 128 * 256).copy() if "w" in comp.feedback else 0
            payload = comp.compress(grads)
            rec = next(r for r in decode_payload(payload) if r.name == "w")
            if isinstance(rec, LowRankRecord):
                m = (grads["w"].reshape(-1).numpy() + e_before).astype(np.float32)
                assert np.array_equal(comp.feedback.buffer("w", rec.numel), m - reconstruct(rec)), step
            payloads.append(payload)
        for rank, comp in enumerate(comps):
            into = {name: torch.zeros_like(t) for name, t in _grads(rank, step).items()}
            comp.aggregate(payloads, into, own=rank)
            if alone:
                comp.agreement.agreed = None
        steps.append(payloads)
    return steps


def _wants(payload: bytes) -> int:
    rec = next(r for r in decode_payload(payload) if r.name == "w")
    assert isinstance(rec, QuantRecord | LowRankRecord)
    return rec.want


@pytest.mark.parametrize("agree", ["all", "half", "any"])
def test_two_ranks_with_different_gradients_send_the_same_kind_and_rank_every_step(agree: str) -> None:
    steps = _run(_pair(agree))
    for step, (p0, p1) in enumerate(steps):
        assert _sent(p0) == _sent(p1), f"step {step}: rank 0 sent {_sent(p0)}, rank 1 {_sent(p1)}"
    # The test is worth something only if the ranks wanted different things at some steps,
    # and low-rank was really sent.
    wants = [(_wants(p0), _wants(p1)) for p0, p1 in steps]
    assert any(w0 != w1 for w0, w1 in wants), wants
    assert any(w0 > 0 and w1 == 0 for w0, w1 in wants), wants  # rank 1 wanted the quantizer
    lowrank_steps = sum(_sent(p0)["w"][0] == "LowRankRecord" for p0, _ in steps)
    assert lowrank_steps >= 4, lowrank_steps
    # Each step sends what the previous step's wants agreed on, under the configured rule.
    for step in range(1, STEPS):
        _kind, rank = _sent(steps[step][0])["w"]
        assert rank == agreed_rank(list(wants[step - 1]), agree), (step, wants[step - 1], rank)


def test_three_ranks_follow_the_half_rule_not_one_rank_alone() -> None:
    """Rank 2 wants the quantizer over steps 6-29, rank 1 also over 22-29: "half" sends
    low-rank while 2 of 3 ranks want it, and quantizes when only rank 0 does ("any" would
    pull both others along)."""
    steps = _run(_pair("half", world_size=3))
    wants = [tuple(_wants(p) for p in payloads) for payloads in steps]
    for step, payloads in enumerate(steps):
        assert _sent(payloads[1]) == _sent(payloads[0]) == _sent(payloads[2]), step
    for step in range(1, STEPS):
        _kind, rank = _sent(steps[step][0])["w"]
        assert rank == agreed_rank(list(wants[step - 1]), "half"), (step, wants[step - 1], rank)
        assert (rank > 0) == (sum(w > 0 for w in wants[step - 1]) >= 2), (step, wants[step - 1])
    # Both cases happened: 2 of 3 wanting (sent low-rank) and 1 of 3 (quantized).
    two_of_three = [s for s in range(1, STEPS) if sum(w > 0 for w in wants[s - 1]) == 2]
    one_of_three = [s for s in range(1, STEPS) if sum(w > 0 for w in wants[s - 1]) == 1]
    assert two_of_three and one_of_three, wants
    assert all(_sent(steps[s][0])["w"][0] == "LowRankRecord" for s in two_of_three)
    assert all(_sent(steps[s][0])["w"] == ("QuantRecord", 0) for s in one_of_three)


def _sent_bytes(steps: list[list[bytes]]) -> int:
    """Bytes the ranks send, each step: the all-gather sends every payload at its exact size."""
    return sum(len(p) for payloads in steps for p in payloads)


def test_agreement_any_sends_less_than_each_rank_deciding_alone() -> None:
    alone = _run(_pair(), alone=True)
    # Alone, the ranks did send different kinds at some steps (what agreement removes).
    assert any(_sent(p0)["w"] != _sent(p1)["w"] for p0, p1 in alone)
    # "any": low-rank whenever one rank wants it, so a rank whose own chooser wanted the
    # quantizer sends the smaller factors too. Measured: 1,364,840 against 1,381,618 bytes over
    # the 40 steps, both ranks at exact sizes; when the all-gather padded every payload to the
    # longest (before stop 46) the same runs cost 850,173 against 1,042,605 a rank.
    agreed_any = _run(_pair("any"))
    assert _sent_bytes(agreed_any) < _sent_bytes(alone), (_sent_bytes(agreed_any), _sent_bytes(alone))
    # "all" is not asserted to: for the same wants, every rank's agreed payload is at least
    # its own choice (quantized if any rank wants that; else the largest wanted rank).


class _EagerChooser(lowrank_choice.LowRankChooser):
    """The reference: fits its own warm start from what was sent after every low-rank step (as
    the chooser did before the fit waited until it was needed)."""

    def observe_lowrank(self, name: str, q_next: torch.Tensor, **kwargs: Any) -> None:
        super().observe_lowrank(name, q_next, **kwargs)
        self.warm_start(name)


def test_a_rank_sent_above_its_own_choice_defers_its_fit_and_sends_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under "all" rank 0 wants rank 2 while rank 1 wants 16 (steps 28-32), so rank 0 sends 16:
    its own rank-2 warm start is needed only when 2 is sent again. Fitting it at once every step
    was an eigendecomposition per low-rank layer and step (issue 15's decision-cost regression);
    deferred, the payloads must be the same bytes, with fewer of them."""
    calls = {"n": 0}
    captured_energy = lowrank_choice.captured_energy

    def counted(q: torch.Tensor) -> Any:
        calls["n"] += 1
        return captured_energy(q)

    monkeypatch.setattr(lowrank_choice, "captured_energy", counted)
    results = {}
    for eager in (True, False):
        comps = _pair("all")
        if eager:
            for comp in comps:
                comp.lowrank.__class__ = _EagerChooser  # type: ignore[union-attr]
        calls["n"] = 0
        steps = _run(comps)
        results[eager] = (steps, calls["n"])
    (eager_steps, eager_calls), (lazy_steps, lazy_calls) = results[True], results[False]
    wants = [(_wants(p0), _wants(p1)) for p0, p1 in lazy_steps]
    assert any(0 < w0 < w1 for w0, w1 in wants), wants  # the case this test is about happened
    assert lazy_steps == eager_steps
    assert lazy_calls < eager_calls, (lazy_calls, eager_calls)


def test_the_first_step_and_a_resize_quantize_and_a_restart_continues() -> None:
    comps = _pair("any")
    steps = _run(comps)
    assert comps[0].agreement.agreed is not None and comps[0].agreement.agreed["w"] > 0
    state = comps[0].state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    same, resized = _pair("any")[0], _pair("any")[0]
    same.load_state_dict(state)
    resized.load_state_dict(state, residuals=False)
    assert same.agreement.agreed == comps[0].agreement.agreed
    grads = _grads(0, STEPS)
    assert same.compress(grads) == comps[0].compress(grads)  # the same workers go on exactly
    assert resized.agreement.agreed == {}
    assert _sent(resized.compress(grads))["w"] == ("QuantRecord", 0)  # a new world: quantized
    assert _sent(steps[0][0])["w"] == ("QuantRecord", 0)


def test_the_want_byte_round_trips_and_is_checked() -> None:
    levels = np.zeros(1024, dtype=np.int8)
    quant = QuantRecord("q", 4, 512, np.ones(2, dtype=np.float32), levels, want=16)
    raw = RawRecord("b", np.ones(8, dtype=np.float32))
    payload, _ = encode_payload([quant, raw])
    q, b = decode_payload(payload)
    assert isinstance(q, QuantRecord) and q.want == 16 and isinstance(b, RawRecord)
    # A payload without wants (every one before them) is the same bytes as before: want 0.
    scales = np.ones(2, dtype=np.float32)
    old, _ = encode_payload([QuantRecord("q", 4, 512, scales, levels), raw])
    assert old == encode_payload([QuantRecord("q", 4, 512, scales, levels, want=0), raw])[0]
    assert decode_payload(old)[0].want == 0  # type: ignore[union-attr]
    with pytest.raises(CodecError) as err:
        encode_payload([QuantRecord("q", 4, 512, np.ones(2, dtype=np.float32), levels, want=256)])
    assert err.value.field == "want"
    # A raw layer carrying a want is refused (the byte after ``bits`` is 0 for it).
    head = payload.index(b"\x01\x00b") + 3  # name_len 1, name "b": kind, code, bits, want follow
    bad = bytearray(payload[:-4])
    bad[head + 3] = 5
    from tail_ray.compression.wire import seal

    with pytest.raises(CodecError) as err:
        decode_payload(seal(bytes(bad)))
    assert err.value.field == "want"


def test_an_unknown_rule_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="lowrank_agree"):
        TailConfig(lowrank="auto", lowrank_agree="most")


def test_the_rule_itself() -> None:
    assert agreed_rank([8, 16], "all") == 16  # both want low-rank: the larger rank, for both
    assert agreed_rank([0, 16], "all") == 0  # one wants the quantizer: both quantize
    assert agreed_rank([0, 16], "any") == 16
    assert agreed_rank([0, 0], "any") == agreed_rank([], "all") == 0
    assert agreed_rank([4], "all") == 4  # one rank alone sends what it wants
    assert agreed_rank([0, 16], "half") == 16  # on 2 ranks "half" is "any"
    assert agreed_rank([0, 0, 8], "half") == 0  # 1 of 3: everyone quantizes
    assert agreed_rank([0, 4, 8], "half") == 8  # 2 of 3: the largest wanted rank
    assert agreed_rank([0, 0, 4, 8], "half") == 8  # exactly half
    assert agreed_rank([4], "half") == 4 and agreed_rank([0], "half") == 0
