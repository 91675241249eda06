"""The bucket-size study runs end to end on real captured gradients (tiny settings) and its
picks keep the promise they are named for: never more error than allowed, never more bytes."""

import json

import pytest

from jobs.bucket_study import main
from tests.jobs.job_run import run_job


def test_bucket_study_picks_within_the_error_and_prints_the_table(tmp_path):
    out = tmp_path / "study.json"
    args = ["--models", "digits_cnn", "--steps", "4", "--keep", "3", "--eval-steps", "1", "--json", str(out)]
    printed, summary = run_job(
        "jobs.bucket_study", *args, "--buckets", "256,512,1024", "--bits", "3,4", timeout_s=120
    )
    assert "equal error, fp32" in printed and "same tau, fp32" in printed
    shares = summary["digits_cnn"]["saved_share"]
    # The reference is always a candidate: no pick costs more than it, a looser limit no less.
    assert 0 <= shares["equal32"] <= shares["equal16"] and shares["equal32"] <= shares["tau32"]
    (res,) = json.loads(out.read_text())
    assert res["layers"] and res["payload_bytes"] > res["quantized_bytes"] > 0
    for row in res["layers"]:
        cells = row["cells"]
        ref = cells[f"512/{row['ctl_bits'][0]}"]
        assert row["ref_pair"] == [[512, row["ctl_bits"][0], 4]]
        for pick in ("equal32", "tau32"):
            (bucket, bits, width) = row[f"{pick}_pair"][0]
            assert width == 4 and row[f"{pick}_bytes"] <= row["ref_bytes"]
        (bucket, bits, _w) = row["equal32_pair"][0]
        assert cells[f"{bucket}/{bits}"]["err"] <= ref["err"]  # equal error: never more
        for bucket in (256, 512, 1024):
            c3, c4 = cells[f"{bucket}/3"], cells[f"{bucket}/4"]
            assert c3["scales32"] == 4 * -(-row["numel"] // bucket)  # one fp32 scale per bucket
            assert c4["err"] < c3["err"] and c4["levels"] > c3["levels"]  # a bit more: less error, more bytes
            assert abs(c4["meas"] - c4["err"]) < 0.5 * c4["err"]  # the kernel's draw near its expectation
        # At equal bits, smaller buckets: smaller max-abs, less error.
        assert cells["256/4"]["err"] < cells["512/4"]["err"] < cells["1024/4"]["err"]


def test_bucket_study_help_and_refuses_a_grid_without_the_reference(capsys):
    with pytest.raises(SystemExit) as help_exit:
        main(["--help"])
    assert help_exit.value.code == 0 and "equal error" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        main(["--buckets", "256,1024"])  # no 512: nothing to compare against
    assert bad.value.code == 2 and "must include 512" in capsys.readouterr().err
