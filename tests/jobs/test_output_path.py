"""The jobs' --json/--plot paths: a missing folder is made when the flags are read, a bad path exits 2."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from jobs import collective_cost
from jobs.output_path import output_file


def test_a_job_writes_its_json_into_a_folder_that_did_not_exist(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "fresh" / "rows.json"  # `runs/` on a fresh clone
    argv = ["table", "--compress-gbps", "1", "--decode-gbps", "1", "--json", str(out)]
    assert collective_cost.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["ratio"] == 10.0 and doc["rows"]


def test_a_folder_given_as_the_file_exits_2_before_any_work(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        collective_cost.main(["table", "--compress-gbps", "1", "--decode-gbps", "1", "--json", str(tmp_path)])
    assert exc.value.code == 2
    assert "is a folder, not a file" in capsys.readouterr().err


def test_a_file_in_the_way_of_the_folder_says_so(tmp_path: Path) -> None:
    blocker = tmp_path / "runs"
    blocker.write_text("not a folder")
    with pytest.raises(argparse.ArgumentTypeError, match="cannot make the folder"):
        output_file(str(blocker / "out.json"))
    assert blocker.read_text() == "not a folder"  # nothing in the way is touched
