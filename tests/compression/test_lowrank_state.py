"""The low-rank chooser's state (and the controller's sampling RNG) through a checkpoint.

A restored compressor must continue exactly where the saved one was: the same payload bytes,
step by step, as the original that never stopped (issue 15: a restore used to drop every
low-rank layer back to quantization and re-run its trials from a cold start).
"""

from __future__ import annotations

import dataclasses
import io
import logging
from typing import Any

import pytest
import torch

from tail_ray.compression.records import LowRankRecord, QuantRecord
from tail_ray.compression.tail import TailCompressor, TailConfig
from tail_ray.compression.wire import decode_payload
from tail_ray.errors import ConfigError

_CONFIG: dict[str, Any] = {"lowrank": "on", "warmup_steps": 0, "redecide_every_steps": 4, "seed": 7}
_BASIS = torch.Generator().manual_seed(1234)
_U, _V = torch.randn(256, 2, generator=_BASIS), torch.randn(128, 2, generator=_BASIS)
_U2, _V2 = torch.randn(96, 2, generator=_BASIS), torch.randn(192, 2, generator=_BASIS)
_U3, _V3 = torch.randn(96, 4, generator=_BASIS), torch.randn(192, 4, generator=_BASIS)


def _grads(step: int) -> dict[str, torch.Tensor]:
    """One step's gradients: two rank-2 matrices plus small noise (low-rank candidates; from
    step 20 on the second one grows to rank 6, so it steps up to a higher rank, whose new
    directions the chooser's generator draws), a full-rank matrix (quantized, its bits
    estimated on a sample: the controller's RNG), and a bias (raw)."""
    gen = torch.Generator().manual_seed(100 + step)
    coeff = 1.0 + 0.1 * torch.randn(2, generator=gen)
    b = (_U2 * coeff) @ _V2.T + 0.01 * torch.randn(96, 192, generator=gen)
    if step >= 20:
        b = b + 0.5 * _U3 @ _V3.T
    return {
        "a.weight": (_U * coeff) @ _V.T + 0.01 * torch.randn(256, 128, generator=gen),
        "b.weight": b,
        "c.weight": torch.randn(64, 512, generator=gen),
        "a.bias": torch.randn(128, generator=gen),
    }


def _tail(**extra: Any) -> TailCompressor:
    return TailCompressor(TailConfig(**(_CONFIG | extra)))


def _through_disk(state: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint file gives back (weights_only: plain tensors, numbers and strings)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    restored: dict[str, Any] = torch.load(buf, weights_only=True)
    return restored


def _trained(steps: int) -> TailCompressor:
    comp = _tail()
    for step in range(steps):
        comp.compress(_grads(step))
    assert comp.lowrank is not None
    ranks = comp.lowrank.ranks()
    assert ranks["a.weight"] > 0 and ranks["b.weight"] > 0, ranks  # the state worth keeping
    assert ranks["c.weight"] == 0
    return comp


def test_a_restored_compressor_continues_bit_for_bit() -> None:
    original = _trained(12)
    state = _through_disk(original.state_dict())
    assert state["format"] == 3
    restored = _tail()
    restored.load_state_dict(state)
    assert restored.lowrank is not None and restored.lowrank.ranks() == original.lowrank.ranks()  # type: ignore[union-attr]
    lowrank_steps, b_ranks = 0, set()
    for step in range(12, 40):
        grads = _grads(step)
        sent = original.compress(grads)
        assert restored.compress(grads) == sent, f"payloads differ at step {step}"
        lowrank_steps += any(isinstance(rec, LowRankRecord) for rec in decode_payload(sent))
        b_ranks.add(original.lowrank.rank_of("b.weight"))  # type: ignore[union-attr]
    assert lowrank_steps >= 20  # the continuation really ran low-rank layers
    assert max(b_ranks) > 2, b_ranks  # ... and stepped one up a rank (the generator's part)


def test_the_default_restored_before_its_optimizer_speaks_keeps_the_saved_answer() -> None:
    """lowrank "auto" under SGD: a resumed run compresses its first step before the trainer's
    optimizer hook tells it "linear" again; the checkpoint's answer (the budget's) holds until
    then, so the low-rank layers continue bit for bit."""
    original = _tail(lowrank="auto")
    original.set_linear_optimizer(True)
    for step in range(12):
        original.compress(_grads(step))
    restored = _tail(lowrank="auto")  # not told: without the checkpoint it would quantize all
    restored.load_state_dict(_through_disk(original.state_dict()))
    lowrank_steps = 0
    for step in range(12, 24):
        sent = original.compress(_grads(step))
        assert restored.compress(_grads(step)) == sent, f"payloads differ at step {step}"
        lowrank_steps += any(isinstance(rec, LowRankRecord) for rec in decode_payload(sent))
    assert lowrank_steps == 12


def _format_1(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint as format 1 wrote it: no chooser state, no controller RNG."""
    old = {k: v for k, v in state.items() if k != "lowrank"} | {"format": 1}
    old["controller"] = {k: v for k, v in state["controller"].items() if k != "rng"}
    return old


def test_a_format_1_state_restores_everything_but_the_chooser() -> None:
    original = _trained(12)
    restored = _tail()
    restored.load_state_dict(_through_disk(_format_1(original.state_dict())))
    assert restored.step == original.step == 12
    assert restored.controller.plans == original.controller.plans
    assert restored.feedback is not None and original.feedback is not None
    assert restored.feedback.names() == original.feedback.names()
    assert restored.lowrank is not None and restored.lowrank.ranks() == {}  # starts fresh
    restored.compress(_grads(12))  # and runs on


def test_a_layer_whose_shape_changed_drops_its_state_and_re_trials(caplog: pytest.LogCaptureFixture) -> None:
    original = _trained(12)
    restored = _tail()
    restored.load_state_dict(_through_disk(original.state_dict()))
    grads = _grads(12)
    grads["a.weight"] = grads["a.weight"].reshape(128, 256)  # same numel, another matrix
    with caplog.at_level(logging.WARNING, logger="tail_ray.bitwidth.lowrank_choice"):
        records = {rec.name: rec for rec in decode_payload(restored.compress(grads))}
    assert any("a.weight" in r.getMessage() and "256x128" in r.getMessage() for r in caplog.records)
    assert isinstance(records["a.weight"], QuantRecord)  # dropped: quantized until a trial says otherwise
    assert isinstance(records["b.weight"], LowRankRecord)  # the other layer's state was kept


def test_an_inconsistent_layer_state_is_dropped_at_load(caplog: pytest.LogCaptureFixture) -> None:
    original = _trained(12)
    state = _through_disk(original.state_dict())
    layer = state["lowrank"]["layers"]["a.weight"]
    layer["q_warm"] = layer["q_warm"][:, :1].contiguous()  # not (cols x rank)
    restored = _tail()
    with caplog.at_level(logging.WARNING, logger="tail_ray.bitwidth.lowrank_choice"):
        restored.load_state_dict(state)
    assert any("a.weight" in r.getMessage() for r in caplog.records)
    assert restored.lowrank is not None
    assert restored.lowrank.ranks() == {"b.weight": original.lowrank.rank_of("b.weight"), "c.weight": 0}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "changed",
    [{"lowrank_ranks": (2, 4, 8)}, {"lowrank_bits": 6}, {"lowrank_target": "budget"}, {"bucket_size": 256}],
)
def test_other_lowrank_settings_start_the_chooser_fresh_and_restore_the_rest(
    changed: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    original = _trained(12)
    restored = _tail(**changed)
    with caplog.at_level(logging.WARNING):
        restored.load_state_dict(_through_disk(original.state_dict()))
    (setting,) = changed
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(setting in m and "a.weight" in m for m in messages), messages
    assert restored.lowrank is not None and restored.lowrank.ranks() == {}
    # Plans are restored; each quantizes at the restored compressor's own bucket size.
    bucket = restored.config.bucket_size
    assert restored.controller.plans == {
        n: dataclasses.replace(p, bucket_size=bucket) for n, p in original.controller.plans.items()
    }
    assert restored.step == 12
    restored.compress(_grads(12))


def test_lowrank_on_and_off_across_a_restore() -> None:
    original = _trained(12)
    off = TailCompressor(TailConfig(**(_CONFIG | {"lowrank": "off"})))
    off.load_state_dict(_through_disk(original.state_dict()))  # the chooser's state is ignored
    assert off.lowrank is None and off.controller.plans == original.controller.plans
    assert all(
        isinstance(rec, QuantRecord) or rec.name == "a.bias"
        for rec in decode_payload(off.compress(_grads(12)))
    )

    quantized = TailCompressor(TailConfig(**(_CONFIG | {"lowrank": "off"})))
    for step in range(12):
        quantized.compress(_grads(step))
    state = _through_disk(quantized.state_dict())
    assert state["lowrank"] is None
    on = _tail()
    on.load_state_dict(state)  # nothing to restore: the chooser starts fresh
    assert on.lowrank is not None and on.lowrank.ranks() == {}
    on.compress(_grads(12))


def test_what_is_not_a_chooser_state_is_a_config_error() -> None:
    comp = _tail()
    assert comp.lowrank is not None
    with pytest.raises(ConfigError, match="format"):
        comp.lowrank.load_state_dict({"format": 99})
    with pytest.raises(ConfigError, match="incomplete"):
        comp.lowrank.load_state_dict({"format": 1, "settings": {}})
    with pytest.raises(ConfigError, match="format 4"):
        comp.load_state_dict({**comp.state_dict(), "format": 4})


def test_a_warm_start_still_to_be_fitted_is_saved_as_the_fit() -> None:
    """Sent above its own rank (another rank wanted more), a layer's own warm start is fitted
    only when needed (lowrank_choice.warm_start); a checkpoint taken before then must hold
    that fit (cols x rank, the best directions of what was sent), which the restore accepts."""
    from tail_ray.bitwidth.lowrank_choice import LowRankChooser, LowRankSettings
    from tail_ray.bitwidth.lowrank_energy import captured_energy
    from tail_ray.bitwidth.lowrank_state import LayerState

    chooser = LowRankChooser(LowRankSettings(), bucket_size=512, seed=3)
    chooser._layers["w"] = LayerState(128, 256, rank=2, q_warm=torch.zeros(256, 2), quant_bytes=9e4)
    sent_q = torch.randn(256, 16, generator=torch.Generator().manual_seed(5))
    chooser.observe_lowrank("w", sent_q, e_sq=0.01, g_sq=1.0, m_sq=1.0, nu_quant=0.1, step=30)
    assert chooser._layers["w"].q_wide is sent_q  # not fitted yet
    saved = _through_disk(chooser.state_dict())
    expected = captured_energy(sent_q)[1][:, :2]
    assert torch.equal(saved["layers"]["w"]["q_warm"], expected)
    restored = LowRankChooser(LowRankSettings(), bucket_size=512, seed=3)
    restored.load_state_dict(saved)
    assert restored.rank_of("w") == 2
    assert torch.equal(restored.warm_start("w"), expected)  # type: ignore[arg-type]
