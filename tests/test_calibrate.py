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
