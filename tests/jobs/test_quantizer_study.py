"""jobs.quantizer_study: the prototypes' error model, and a closed-loop run that can tell methods apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from jobs import quantizer_study as qs

BUCKETS = 64


def test_subtractive_dither_errs_uniformly_whatever_the_value():
    # The point of dither: the error is U(-step/2, step/2) and independent of x, so small
    # coordinates (below a step) get their value on average, not zero.
    half = BUCKETS * qs.BUCKET // 2
    x = torch.cat([torch.full((half,), 0.01), torch.linspace(-1, 1, half)])
    x[:: qs.BUCKET] = 1.0  # every bucket's max-abs is 1: one grid step 1/3 at 3 bits
    step = 1.0 / 3
    decoded, levels = qs.quantize_dither(x, 3, torch.Generator().manual_seed(0))
    err = decoded - x
    assert float(err.abs().max()) <= step / 2 + 1e-6
    assert levels.abs().max() <= 3 and torch.equal(levels, levels.round())
    small = err[:half][x[:half] == 0.01]
    assert abs(float(small.mean())) < 0.01 * step  # unbiased where nearest would send 0
    assert float(err.var()) == pytest.approx(step**2 / 12, rel=0.05)
    nearest, _ = qs.quantize_nearest(x, 3)
    # nearest sends 0 for every small coordinate: its whole value is the error
    assert float((nearest[:half] - x[:half]).abs().max()) == pytest.approx(0.01, rel=1e-4)


def test_dither_noise_is_a_twelfth_of_each_real_elements_squared_step():
    x = torch.zeros(qs.BUCKET + 10)
    x[0], x[qs.BUCKET] = 3.0, -6.0  # bucket steps at 3 bits: 1 and 2; the second has 10 real elements
    assert qs.dither_noise_sq(x, 3) == pytest.approx((qs.BUCKET * 1.0 + 10 * 4.0) / 12)


def test_an_all_zero_bucket_decodes_to_exactly_zero():
    # The embedding's rows of tokens not in the batch: dither must not give them noise (Adam
    # would turn it into full-size steps), nor count it against the budget.
    x = torch.zeros(3 * qs.BUCKET)
    x[qs.BUCKET] = 2.0
    decoded, levels = qs.quantize_dither(x, 3, torch.Generator().manual_seed(1))
    zero_rows = torch.cat([decoded[: qs.BUCKET], decoded[2 * qs.BUCKET :]])
    assert torch.equal(zero_rows, torch.zeros_like(zero_rows))
    assert int(levels[: qs.BUCKET].abs().sum()) == 0 and int(levels[2 * qs.BUCKET :].abs().sum()) == 0
    assert qs.dither_noise_sq(x, 3) == pytest.approx(qs.BUCKET * (2.0 / 3) ** 2 / 12)
    assert torch.equal(qs.quantize_nearest(x, 3)[0], x)


def _spiky(buckets: int = 8) -> torch.Tensor:
    """One spike per bucket (a grid of step 1 at 3 bits), the odd elements 1/16 of a step, the
    other even ones 0."""
    x = torch.zeros(buckets * qs.BUCKET)
    x[1::2] = 0.0625
    x[:: qs.BUCKET] = 3.0
    return x


@pytest.mark.parametrize("kind", ["anti-dither", "tdither"])
def test_antithetic_dither_pairs_cancel_where_the_values_are_far_below_a_step(kind):
    # anti-dither: rank 1 dithers with 1 - u of rank 0's u, so two ranks sending the same zeros
    # err by -e and e. tdither: each rank's odd step uses 1 - u of its own even step.
    x = _spiky()
    ex = qs.PrototypeExchange(qs.Method(kind, 3), seed=0, warmup=qs.Warmup(0))
    plain = qs.PrototypeExchange(qs.Method("dither", 3), seed=0, warmup=qs.Warmup(0))
    zeros = x == 0
    steps = (6,) if kind == "anti-dither" else (6, 7)

    def delivered(exchange: qs.PrototypeExchange) -> torch.Tensor:
        means = [exchange.deliver([{"w": x}, {"w": x.clone()}], s, lr=1e-3)[0]["w"] for s in steps]
        return sum(means) / len(means)

    mean, other = delivered(ex), delivered(plain)
    assert float((mean - x)[zeros].abs().max()) < 1e-6  # exact zeros cancel
    assert float((other - x)[zeros].abs().max()) > 0.1  # independent dither: ~a step / 2
    # Each rank's own error is still one dither: uniform on +-step/2, unbiased.
    assert float((mean - x).abs().max()) <= 0.5 + 1e-6
    # 1/16 of a step: the pair's errors cancel unless a draw falls within 1/16 of a level's
    # edge; the mean error's power is 2a(1 - 2a) / 4 (a = 1/16) against 1/24 for independent u.
    small = x == 0.0625
    paired_sq, plain_sq = float((mean - x)[small].square().mean()), float((other - x)[small].square().mean())
    assert paired_sq == pytest.approx(2 * 0.0625 * (1 - 2 * 0.0625) / 4 / len(steps), rel=0.25)
    assert plain_sq == pytest.approx(1 / 24 / len(steps), rel=0.25)


def test_auto_bits_are_the_smallest_within_the_engines_budget():
    # A bucket of one spike and small values: the dither noise falls ~4x per bit, and the
    # budget (tau of the engine's BudgetPolicy) decides where to stop.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8 * qs.BUCKET, generator=gen)
    x[:: qs.BUCKET] = 5.0  # nu_3 ~ 0.22: within the steady tau (0.25), not the warm-up's
    ex = qs.PrototypeExchange(qs.Method("dither"), seed=0, warmup=qs.Warmup(0))
    for step in (0, 200):  # warm-up: a tighter tau than the steady one
        bits = ex._bits("w", x, step)
        tau, power = ex.policy.tau("w", step), float(x.square().sum())
        assert qs.dither_noise_sq(x, bits) <= tau * power
        smaller = [b for b in ex.candidates if b < bits]
        assert smaller and qs.dither_noise_sq(x, smaller[-1]) > tau * power
    assert ex._bits("w", x, 0) > ex._bits("w", x, 200)


def test_methods_parse_and_refuse_with_what_is_accepted():
    assert qs.Method.parse("adam-dither-3") == qs.Method("adam-dither", 3)
    assert qs.Method.parse("anti-dither-3") == qs.Method("anti-dither", 3)
    assert qs.Method.parse("tdither-auto") == qs.Method("tdither")
    assert qs.Method.parse("tail").label == "tail"
    auto = qs.Method.parse("dither-auto")
    assert auto == qs.Method("dither") and auto.auto and auto.label == "dither-auto"
    assert not qs.Method.parse("nearest-4").auto and not qs.Method.parse("none").auto
    for bad in ("dither-1", "dither-9", "dither", "qsgd-4", "tail-auto"):
        with pytest.raises(ValueError, match="none, tail, or"):
            qs.Method.parse(bad)


def test_a_short_closed_loop_run_compares_to_none(tmp_path: Path, capsys):
    out = tmp_path / "runs" / "qs.json"
    methods = "none,nearest-8,dither-2,tail,adam-dither-auto"
    argv = ["--task", "lm", "--methods", methods, "--steps", "6", "--warmup-steps", "1"]
    assert qs.main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {r["method"]: r for r in doc["rows"]}
    assert rows["none"]["vs_none"] == 0.0 and rows["none"]["ratio"] == pytest.approx(1.0)
    # 8 bits with error feedback is all but exact; 2-bit dither is not, and sends far less.
    assert abs(rows["nearest-8"]["vs_none"]) < 0.2
    assert rows["nearest-8"]["final"] != rows["none"]["final"]
    assert rows["dither-2"]["ratio_2nd_half"] > 2 * rows["nearest-8"]["ratio_2nd_half"] > 2
    assert rows["tail"]["ratio"] > 1.5  # the engine's own payloads
    assert set(doc["summary"]) == {"none", "nearest-8", "dither-2", "tail", "adam-dither-auto"}
    # The budget's bits, as shares of the quantized elements of the second half
    auto = rows["adam-dither-auto"]["bits_2nd_half"]
    assert sum(auto.values()) == pytest.approx(1.0) and set(auto) <= {"2", "3", "4", "5", "6", "8"}
    assert rows["dither-2"]["bits_2nd_half"] == {"2": 1.0} and rows["none"]["bits_2nd_half"] == {}
    assert "vs none mean" in capsys.readouterr().out


def test_budget_settings_reach_the_auto_prototypes_only(tmp_path: Path):
    out = tmp_path / "qs.json"
    argv = ["--methods", "none,dither-auto", "--steps", "4", "--warmup-steps", "1", "--json", str(out)]
    assert qs.main([*argv, "--budget", '{"candidate_bits": [5]}']) == 0
    doc = json.loads(out.read_text())
    assert doc["budget"] == {"candidate_bits": [5]}
    assert {r["method"]: r["bits_2nd_half"] for r in doc["rows"]} == {"none": {}, "dither-auto": {"5": 1.0}}


def test_warmup_steps_go_at_the_warmup_bits(tmp_path: Path):
    out = tmp_path / "qs.json"
    argv = ["--methods", "none,dither-3", "--steps", "4", "--warmup-steps", "3", "--warmup-bits", "8"]
    assert qs.main([*argv, "--json", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    # the second half is steps 2 (warm-up: 8 bits) and 3 (the method's own 3 bits)
    assert rows["dither-3"]["bits_2nd_half"] == {"3": 0.5, "8": 0.5}


def test_bad_arguments_exit_2():
    for argv in (
        ["--methods", "none,foo-3"],
        ["--steps", "0"],
        ["--seeds", "x"],
        ["--budget", "x"],
        ["--budget", "[1]"],
        ["--budget", '{"noise_fraction": -1}'],
        ["--budget", '{"no_such_setting": 1}'],
        ["--warmup-bits", "16"],
    ):
        with pytest.raises(SystemExit) as exc:
            qs.main(argv)
        assert exc.value.code == 2
