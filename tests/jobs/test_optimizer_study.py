"""The optimizer study runs end to end on real captured gradients (tiny settings): a lossless
setting gives the optimizer exactly the true steps, and Tail's error shows up in Adam's second
moment and step, and not in SGD's direction on average."""

import json

import pytest

from jobs.optimizer_study import main
from tests.jobs.job_run import run_job

LOSSLESS = '{"raw_below_numel": 1000000000, "small_layer_bits": 32}'  # every layer raw fp32


def test_a_lossless_setting_gives_the_optimizers_the_true_steps(tmp_path):
    out = tmp_path / "study.json"
    args = ["--models", "digits_cnn,char_transformer", "--steps", "8", "--keep", "6", "--json", str(out)]
    printed, summary = run_job("jobs.optimizer_study", *args, "--tail-variant", LOSSLESS, timeout_s=180)
    assert "step along true" in printed and "whole model" in printed
    results = {r["model"]: r for r in json.loads(out.read_text())}
    assert results["digits_cnn"]["optimizer"] == "SGD" and results["char_transformer"]["optimizer"] == "Adam"
    for res in results.values():
        assert summary[res["model"]]["along"] == pytest.approx(1.0, abs=1e-6)
        # Raw fp32 plus the payload's framing: a little more than the gradients' own bytes.
        assert 0.9 < res["ratio"] < 1.0 and res["payload_bytes_per_step"] > 0
        for row in res["layers"]:
            assert row["along"] == pytest.approx(1.0, abs=1e-5) and row["cos"] == pytest.approx(1.0, abs=1e-5)
            if res["optimizer"] == "Adam":
                assert row["v_median"] == pytest.approx(1.0, abs=1e-5)
            else:
                assert row["v_median"] is None  # SGD keeps no second moment


def test_tails_error_inflates_adams_second_moment_and_shortens_its_step():
    _printed, summary = run_job(
        "jobs.optimizer_study",
        *("--models", "digits_cnn,char_transformer", "--steps", "12", "--keep", "10"),
        # nearest: error feedback's 3-4 bit noise from step 0 (dither sends its first steps at 8 bits)
        *("--tail-variant", '{"warmup_steps": 0, "rounding": "nearest"}'),
        timeout_s=180,
    )
    adam, sgd = summary["char_transformer"], summary["digits_cnn"]
    # 3-4 bit layers: the error's square adds to v, so m / sqrt(v) is shorter than the true step.
    assert 0.5 < adam["along"] < 0.97 and 0.7 < adam["cos"] < 0.99
    # SGD's step is linear in the gradient: the error turns it (cos < 1), it does not shorten it.
    assert sgd["along"] == pytest.approx(1.0, abs=0.02) and sgd["cos"] < 0.9999
    assert adam["along"] < sgd["along"] - 0.03
    assert adam["ratio"] > 4 and sgd["ratio"] > 4  # and what those steps cost on the wire


def test_optimizer_study_help_and_refuses_a_bad_variant(capsys):
    with pytest.raises(SystemExit) as help_exit:
        main(["--help"])
    assert help_exit.value.code == 0 and "second moment" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        main(["--tail-variant", '{"bits": 3}'])
    assert bad.value.code == 2 and "--tail-variant" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad_keep:
        main(["--steps", "5", "--keep", "9"])
    assert bad_keep.value.code == 2 and "--keep" in capsys.readouterr().err
