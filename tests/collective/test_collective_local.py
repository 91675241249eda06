"""Registration errors and the world-size-1 path, in one process (no process group needed)."""

import pytest
import torch
from torch import nn

from tail_ray.collective import METHODS, compress_gradients_locally, make_hook_state, register_tail_hook
from tail_ray.collective.state import linear_in_gradient
from tail_ray.errors import ConfigError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))


def _backward(model: nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 20, generator=gen), torch.randint(0, 5, (8,), generator=gen)
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_unknown_method_says_which_methods_exist():
    with pytest.raises(ConfigError, match="choose one of"):
        make_hook_state(_model(), "zip")


def test_settings_for_a_method_without_settings_are_rejected():
    with pytest.raises(ConfigError, match="takes no settings"):
        make_hook_state(_model(), "fp16", {"bits": 8})


def test_unknown_powersgd_setting_lists_the_known_ones():
    with pytest.raises(ConfigError, match="matrix_approximation_rank"):
        make_hook_state(_model(), "powersgd", {"rnak": 2})
    with pytest.raises(ConfigError, match=">= 1"):
        make_hook_state(_model(), "powersgd", {"rank": 0})


def test_config_must_be_a_mapping():
    with pytest.raises(ConfigError, match="mapping"):
        make_hook_state(_model(), "powersgd", [("rank", 2)])  # type: ignore[arg-type]


def test_register_needs_a_ddp_model():
    with pytest.raises(ConfigError, match="DistributedDataParallel"):
        register_tail_hook(_model(), "none")


def test_register_without_ddp_gives_a_local_state():
    model = _model()
    state = register_tail_hook(None, "fp16", model=model)
    _backward(model)
    compress_gradients_locally(state, model)
    assert len(state.drain_metrics().layers) == 4


def test_methods_are_the_documented_seven():
    assert set(METHODS) == {"none", "fp16", "bf16", "powersgd", "qsgd", "topk", "tail"}


def test_local_none_keeps_gradients_and_counts_layers():
    model = _model()
    state = make_hook_state(model, "none")
    before = _backward(model)
    compress_gradients_locally(state, model)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[n])
    met = state.drain_metrics()
    assert [s.layer for s in met.layers] == list(before)
    assert met.raw_bytes == 4 * sum(g.numel() for g in before.values())
    assert (met.bytes_sent, met.bytes_received, met.exchanges) == (0, 0, 0)
    assert state.drain_metrics().layers == []  # drained


@pytest.mark.parametrize(("method", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_local_cast_round_trip_is_the_cast(method, dtype):
    model = _model()
    state = make_hook_state(model, method)
    before = _backward(model)
    compress_gradients_locally(state, model)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[n].to(dtype).float())
    met = state.drain_metrics()
    assert all(s.bits == 16 and s.encoded_bytes == 2 * s.numel for s in met.layers)
    assert all(0.0 < s.rel_error < 1e-3 for s in met.layers)


def test_local_powersgd_is_low_rank_with_error_feedback():
    model = _model()
    state = make_hook_state(model, "powersgd", {"rank": 1, "start_powerSGD_iter": 2})
    for step in range(4):
        old_error = state.local_error.get("0.weight", torch.zeros(64, 20)).clone()
        before = _backward(model, seed=step)
        compress_gradients_locally(state, model)
    met = state.drain_metrics()
    w = model[0].weight.grad
    assert torch.linalg.matrix_rank(w) == 1  # compressing from step 2 on
    # Error-feedback invariant: compensated input == what was applied + new residual.
    new_error = state.local_error["0.weight"]
    torch.testing.assert_close(before["0.weight"] + old_error, w + new_error)
    assert torch.equal(model[0].bias.grad, before["0.bias"])  # vectors go uncompressed
    low_rank = [s for s in met.layers if s.code.startswith("rank")]
    assert {s.layer for s in low_rank} == {"0.weight", "2.weight"}
    assert all(s.encoded_bytes < s.raw_bytes for s in low_rank)
    assert all(0.0 < s.rel_error < 1.0 for s in low_rank)


def test_ring_allreduce_model_counts_two_w_minus_one_over_w():
    from tail_ray.collective import ring_allreduce_bytes

    assert ring_allreduce_bytes(1000, 1) == 0
    assert ring_allreduce_bytes(1000, 2) == 1000
    assert ring_allreduce_bytes(1000, 4) == 1500


def test_set_lr_reaches_the_compressor():
    state = make_hook_state(_model(), "tail")
    state.set_lr(0.1)
    state.set_lr(0.01)  # a drop: Tail's budget policy enters its lr-drop phase
    assert state.compressor.controller.policy.state_dict()["lr"] == 0.01
    make_hook_state(_model(), "none").set_lr(0.1)  # no compressor: a no-op, not an error


class _MySGD(torch.optim.SGD):
    """A user's subclass of SGD: still linear in the gradient."""


class _SignSGD(torch.optim.SGD):
    """An SGD subclass with its own step (sign-SGD, LARS, normalized SGD): not linear in it."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


@pytest.mark.parametrize(
    ("make", "linear"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1), True),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4), True),
        (lambda ps: _MySGD(ps, lr=0.1), True),
        (lambda ps: _SignSGD(ps, lr=0.1), False),
        (lambda ps: torch.optim.Adam(ps), False),
        (lambda ps: torch.optim.AdamW(ps), False),
        (lambda ps: torch.optim.RMSprop(ps), False),
        (lambda ps: torch.optim.Adagrad(ps), False),
    ],
)
def test_the_optimizer_sets_the_budget_of_every_stage(make, linear):
    model = _model()
    assert linear_in_gradient(make(model.parameters())) is linear
    state = make_hook_state(model, "tail")
    stage = state.compressor.second_stage()  # made before: told too
    state.set_optimizer(make(model.parameters()))
    later = state.compressor.second_stage()  # made after: inherits it
    for compressor in (state.compressor, stage, later):
        assert compressor.controller.policy.linear is linear
    make_hook_state(_model(), "none").set_optimizer(make(model.parameters()))  # a no-op


@pytest.mark.parametrize("method", ["qsgd", "topk", "tail"])
def test_local_round_trip_of_payload_compressors(method):
    model = _model()
    # raw_below_numel pinned: layers under 4096 elements go raw fp32, whatever the default
    # (Tail's small layers too: small_layer_bits 32).
    config = {"qsgd": {"bits": 8}, "topk": {"density": 0.1}, "tail": {"candidate_bits": (8,)}}[method]
    config = {**config, "raw_below_numel": 4096}
    if method == "tail":
        config["small_layer_bits"] = 32
    state = make_hook_state(model, method, config)
    before = _backward(model)
    compress_gradients_locally(state, model)
    met = state.drain_metrics()
    assert {s.layer for s in met.layers} == set(before)
    # Every layer here is under 4096 elements (the largest is 64x20): all raw, exact.
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[n]), n
    big = nn.Linear(128, 64)
    state = make_hook_state(big, method, config)
    gen = torch.Generator().manual_seed(0)
    big.weight.grad = torch.randn(64, 128, generator=gen)
    big.bias.grad = torch.randn(64, generator=gen)
    original = big.weight.grad.clone()
    compress_gradients_locally(state, big)
    stats = {s.layer: s for s in state.drain_metrics().layers}
    assert stats["weight"].encoded_bytes < stats["weight"].raw_bytes
    assert not torch.equal(big.weight.grad, original)  # really compressed, in place
    if method != "topk":  # 8-bit stochastic rounding: off by less than one step of the bucket's scale
        assert float((big.weight.grad - original).abs().max()) <= float(original.abs().max()) / 127


# -- the method table and the state families ------------------------------------------------------


def test_every_method_has_one_spec_and_a_state_of_its_family():
    from tail_ray.collective import (
        METHOD_SPECS,
        AllReduceState,
        Method,
        PayloadHookState,
        PowerSGDHookState,
    )

    assert list(METHOD_SPECS) == list(Method) and [m.value for m in Method] == list(METHODS)
    family = {"none": AllReduceState, "fp16": AllReduceState, "bf16": AllReduceState}
    family |= {"powersgd": PowerSGDHookState, "qsgd": PayloadHookState, "topk": PayloadHookState}
    family |= {"tail": PayloadHookState}
    for method, spec in METHOD_SPECS.items():
        state = make_hook_state(_model(), method)
        assert type(state) is family[method] and state.method == method
        assert spec.exchanges_payloads == (family[method] is PayloadHookState)
    # Exactly the methods with stochastic rounding take a seed (the runner derives one per rank).
    assert {m.value for m, spec in METHOD_SPECS.items() if spec.seeded} == {"qsgd", "tail"}


def test_the_docs_method_table_lists_every_method():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "collective.md").read_text()
    for method in METHODS:
        assert f"| `{method}`" in text, method


def _v1_checkpoint(state) -> dict:
    """What the one hook-state class of version 1 wrote: the family's keys, and PowerSGD's
    local memory (empty unless the method was powersgd) for every method."""
    return {"local_powersgd_error": {}, "local_powersgd_q": {}, **state.state_dict(), "version": 1}


@pytest.mark.parametrize("method", ["none", "powersgd", "tail"])
def test_version_1_checkpoints_still_load(method):
    model = _model()
    state = make_hook_state(model, method)
    for seed in range(3):
        _backward(model, seed)
        compress_gradients_locally(state, model)
    v1 = _v1_checkpoint(state)
    restored = make_hook_state(_model(), method)
    restored.load_state_dict(v1)
    assert restored.local_step == 3
    again = restored.state_dict()
    assert again["version"] == 2
    if method == "tail":
        assert again["compressor"]["layer_steps"] == state.state_dict()["compressor"]["layer_steps"]
    if method == "powersgd":
        assert set(again["local_powersgd_error"]) == {"0.weight", "2.weight"}
    with pytest.raises(ConfigError, match="version"):
        restored.load_state_dict({**v1, "version": 99})


def test_each_family_checkpoints_only_its_own_keys():
    common = {"version", "method", "local_step"}
    assert set(make_hook_state(_model(), "fp16").state_dict()) == common
    # payload methods: their compressor, and the collective's (its own compressors, and what
    # each compressor's residuals owe the mean, for a resize)
    payload = {"compressor", "world_size", "collective", "stages", "owed"}
    assert set(make_hook_state(_model(), "qsgd").state_dict()) == common | payload
    powersgd = {"powersgd_iter", "local_powersgd_error", "local_powersgd_q"}
    assert set(make_hook_state(_model(), "powersgd").state_dict()) == common | powersgd


def test_a_compressor_with_only_compress_and_decompress_plugs_into_the_payload_hook():
    """The contract's defaults are enough: a third-party compressor (here: send the sign of
    every element times the layer's mean magnitude) runs through the payload path as it is."""
    from tail_ray.collective import PayloadHookState
    from tail_ray.compression import Compressor, LayerStats
    from tail_ray.compression.raw import RawCompressor

    class SignCompressor(Compressor):
        name = "sign"

        def compress(self, grads):
            scaled = {n: g.sign() * g.abs().mean() for n, g in grads.items()}
            self._last_stats = [
                LayerStats(n, g.numel(), 1, 1.0, 4 * g.numel(), g.numel() // 8, 0.0, "sign")
                for n, g in grads.items()
            ]
            return RawCompressor().compress(scaled)

        def decompress(self, payload):
            return RawCompressor().decompress(payload)

    model = _model()
    state = PayloadHookState("qsgd", model, SignCompressor())
    before = _backward(model)
    state.set_lr(0.1)  # the contract's no-op
    compress_gradients_locally(state, model)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, before[n].sign() * before[n].abs().mean())
    assert {s.code for s in state.drain_metrics().layers} == {"sign"}
    assert state.state_dict()["compressor"] == {}
    state.load_state_dict(state.state_dict(), residuals=False)
