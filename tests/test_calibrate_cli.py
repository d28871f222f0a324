"""`planner calibrate` runs the shipped procedure (--weighting rows --priors) and is reproducible byte for byte: two
runs into two folders write the same overlay."""

from __future__ import annotations

import json
from pathlib import Path

from tests.test_cli_errors import planner

RUNS = Path(__file__).resolve().parents[1] / "data" / "runs"
SHIPPED = ("-f", str(RUNS / "runs_dev.csv"), "-f", str(RUNS / "maxtext2023-v5p.csv"), "-f", str(RUNS / "axlearn.csv"),
           "-f", str(RUNS / "marin-speedrun.csv"), "--weighting", "rows", "--priors", "-H", "tpu-v6e")


def test_calibrate_twice_writes_the_same_bytes(tmp_path, capsys, monkeypatch):
    written = []
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        code, out, err = planner(capsys, monkeypatch, "calibrate", *SHIPPED, "--overlay-dir", str(tmp_path / run),
                                 "--json")
        assert code == 0, err
        (fit,) = json.loads(out)
        assert fit["priors"] is True and fit["hardware"] == "tpu-v6e"
        written.append((tmp_path / run / "tpu-v6e.yaml").read_bytes())
    assert written[0] == written[1]
    assert b"priors: " in written[0]  # the overlay names the procedure it was fitted with
