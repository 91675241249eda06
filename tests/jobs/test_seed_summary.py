"""jobs.seed_summary: several seeds of bench_convergence as each method's mean and worst against none."""

from __future__ import annotations

import json

import pytest

from jobs import bench_convergence
from jobs.seed_summary import format_summary, parse_seeds, summarize, vs_none

METRICS = {"digits": "val_accuracy", "lm": "val_loss"}


def _row(task: str, label: str, final: float, sent: float, *, decision: float | None = None) -> dict:
    metric = METRICS[task]
    return {
        "task": task,
        "label": label,
        "method": label.split("*")[0],
        "final": {metric: final},
        "bytes_sent_per_step": sent,
        "bytes_sent_per_step_2nd_half": sent / 2 if label != "none" else sent,
        "tail_decision_share_steady": decision,
    }


def _seed(lm_none: float, lm_tail: float, lm_variant: float, digits_tail: float) -> list[dict]:
    return [
        _row("digits", "none", 0.97, 1000.0),
        _row("digits", "tail", digits_tail, 25.0, decision=0.02),
        _row("lm", "none", lm_none, 2000.0),
        _row("lm", "tail", lm_tail, 100.0, decision=0.03),
        _row("lm", "tail*1", lm_variant, 80.0, decision=0.01),
    ]


def test_seeds_parse_as_ranges_and_lists_and_refuse_with_what_is_accepted():
    assert parse_seeds("0-4") == [0, 1, 2, 3, 4]
    assert parse_seeds("0,2,5") == [0, 2, 5]
    assert parse_seeds("0-2, 7") == [0, 1, 2, 7]
    assert parse_seeds("3") == [3]
    for bad, message in (("a", "like 0-4"), ("-1", "like 0-4"), ("4-2", "backwards"), ("1,0-2", "twice")):
        with pytest.raises(ValueError, match=message):
            parse_seeds(bad)


def test_each_seed_is_compared_with_its_own_none_and_the_worst_follows_the_metric():
    # Seed 1's none is worse than seed 0's: each method is measured against its seed's none.
    by_seed = {0: _seed(2.0, 2.02, 2.01, 0.97), 1: _seed(2.2, 2.2, 2.244, 0.96)}
    got = {(s.task, s.label): s for s in summarize(by_seed, METRICS)}
    assert set(got) == {("digits", "tail"), ("lm", "tail"), ("lm", "tail*1")}  # none is the baseline
    lm = got["lm", "tail"]
    assert lm.vs_none == pytest.approx((1.0, 0.0)) and lm.mean == pytest.approx(0.5)
    assert lm.worst == pytest.approx(1.0)  # the higher loss
    digits = got["digits", "tail"]
    assert digits.vs_none == pytest.approx((0.0, -1.0))
    assert digits.worst == pytest.approx(-1.0)  # the lower accuracy
    assert lm.reduction == (20.0, 20.0) and lm.reduction_2nd_half == (40.0, 40.0)
    assert lm.decision_share_steady == (0.03, 0.03) and lm.paired is None
    # The variant against tail of the same seed: +0.5 - 1.0 and +2.0 - 0.0 points.
    variant = got["lm", "tail*1"]
    assert variant.paired_vs_tail == pytest.approx((-0.5, 2.0))
    mean, se = variant.paired
    assert mean == pytest.approx(0.75) and se == pytest.approx(1.25)
    text = "\n".join(format_summary(list(got.values())))
    assert "over 2 seeds (0, 1)" in text and "+1.00 +0.00 %" in text
    assert "+0.75 points of % (s.e. 1.25)" in text
    assert "20.0x (20.0-20.0x)" in text and "3.00%" in text


def test_a_seed_without_none_or_a_missing_row_is_refused():
    with pytest.raises(ValueError, match="no 'none' row"):
        summarize({0: [_row("lm", "tail", 2.0, 100.0)]}, METRICS)
    short = _seed(2.0, 2.0, 2.0, 0.97)[:4]  # seed 1 lacks tail*1
    with pytest.raises(ValueError, match="ran on 1 of 2 seeds"):
        summarize({0: _seed(2.0, 2.0, 2.0, 0.97), 1: short}, METRICS)


def test_vs_none_is_points_for_accuracy_and_percent_for_a_loss():
    assert vs_none(0.9, 0.95, "val_accuracy") == pytest.approx(-5.0)
    assert vs_none(2.2, 2.0, "val_loss") == pytest.approx(10.0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seeds", "0-x"], "like 0-4"),
        (["--seeds", "0-1", "--methods", "tail"], "add none to --methods"),
        (["--seeds", "0-1", "--plot", "bits.png"], "use it with --seed"),
        (["--seeds", "0-1", "--seed", "3"], "not allowed with argument"),
    ],
)
def test_bad_seeds_are_refused_before_any_run(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_convergence.main(["--tasks", "digits", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_two_seeds_run_in_turn_and_end_with_the_summary(tmp_path, capsys):
    out = tmp_path / "seeds.json"
    argv = ["--tasks", "digits", "--methods", "none,tail", "--steps", "3", "--seeds", "4,2"]
    bench_convergence.main([*argv, "--timeout-s", "300", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "#### seed 4 (1 of 2)" in printed and "#### seed 2 (2 of 2)" in printed
    assert "== over 2 seeds (4, 2)" in printed
    doc = json.loads(out.read_text())
    assert doc["seeds"] == [4, 2]
    assert {r["seed"] for r in doc["runs"]["4"]} == {4} and {r["seed"] for r in doc["runs"]["2"]} == {2}
    (tail,) = doc["summary"]
    assert tail["label"] == "tail" and tail["seeds"] == [4, 2] and len(tail["vs_none"]) == 2
    assert all(r > 1 for r in tail["reduction"])
