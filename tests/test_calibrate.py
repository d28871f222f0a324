"""Calibration recovers efficiency parameters from step times the model itself generated."""

from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.calibrate import _fit_group, write_overlay
from costmodel.estimate import estimate
from costmodel.job import Job
from costmodel.model import ModelSpec
from costmodel.plan import REMAT_POLICIES, Plan
from costmodel.published import Case
from hardware.catalog import load_hardware
from hardware.chip import Efficiency
from hardware.yamlio import read_yaml


def _cases(chip):
    out = []
    for i, (d, layers, seq, fsdp, tp, remat) in enumerate([
        (2048, 16, 2048, 8, 1, "full"), (4096, 32, 4096, 16, 1, "none"), (4096, 32, 8192, 8, 2, "full"),
        (8192, 40, 2048, 32, 4, "selective"), (1024, 12, 16384, 8, 1, "none"), (5120, 24, 4096, 64, 1, "full"),
        (6144, 48, 2048, 16, 4, "full"), (3072, 24, 32768, 8, 1, "full"),
    ]):
        m = ModelSpec(f"m{i}", n_layers=layers, d_model=d, n_heads=d // 128, ffn_dim=4 * d, vocab_size=32000)
        job = Job(seq_len=seq, global_batch=fsdp * 4)
        plan = Plan(fsdp=fsdp, tp=tp, micro_batch=4, zero=3, remat=REMAT_POLICIES[remat])
        t = estimate(m, chip, job, plan).step_time_s
        out.append(Case(f"c{i}", "synthetic", m, replace(chip, eff=Efficiency()), job, plan, t))
    return out


def test_fit_recovers_generating_parameters():
    truth = Efficiency(matmul_peak=0.6, attention=0.5)
    chip = replace(load_hardware("h100-sxm"), eff=truth)
    effs, stats = _fit_group(_cases(chip))
    eff = effs["h100-sxm"]
    assert stats["mape_pct"] < 2.0
    assert eff.matmul_peak == pytest.approx(0.6, abs=0.05)


def test_overlay_written_and_read(tmp_path):
    path = write_overlay("h100-sxm", Efficiency(matmul_peak=0.5), {"rows": 3, "mape_pct": 1.0, "worst_pct": 2.0},
                         "synthetic", directory=tmp_path)
    data = read_yaml(path)
    assert data["eff"]["matmul_peak"] == 0.5 and data["rows"] == 3


def test_runs_csv_rows_with_bad_numbers_are_skipped_with_the_reason(tmp_path):
    """A runs CSV row with a non-number or an infinite number, a degree, length or model dimension that is not
    positive (NaN reads as missing), or a measured time that is not a positive number of seconds is skipped with the
    column named; good rows are kept, NaN in an optional column (how pandas writes a missing value) included."""
    import csv
    from pathlib import Path

    from costmodel.published import load_cases

    src = Path(__file__).resolve().parents[1] / "benchmarks" / "runs_v5p_maxtext.csv"  # the same schema, in the repo
    good = next(csv.DictReader(src.open()))
    bad = {"inf-seq": ("seq_len", "inf"), "zero-tp": ("tp", "0"), "nan-dmodel": ("d_model", "nan"),
           "inf-time": ("measured_step_time_s", "inf"), "zero-time": ("measured_step_time_s", "0"),
           "text-batch": ("global_batch", "many")}
    path = tmp_path / "runs.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(good))
        w.writeheader()
        w.writerow(good)
        w.writerow({**good, "id": "nan-vpp", "vpp": "NaN"})
        for rid, (key, value) in bad.items():
            w.writerow({**good, "id": rid, key: value})
    cases, skipped = load_cases(path)
    assert [c.id for c in cases] == [good["id"], "nan-vpp"] and cases[1].plan == cases[0].plan
    assert skipped == {
        "inf-seq": "seq_len: expected a finite number, got 'inf'",
        "zero-tp": "tp: expected a positive integer, got '0'",
        "nan-dmodel": "d_model: expected a positive integer, got 'nan'",
        "inf-time": "measured_step_time_s: expected a finite number, got 'inf'",
        "zero-time": "measured_step_time_s: expected a positive number of seconds, got '0'",
        "text-batch": "global_batch: expected a number, got 'many'"}
