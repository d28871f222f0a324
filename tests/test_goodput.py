"""Goodput (failures, checkpoints, time/cost/energy to train) and elastic re-planning; CLI exit codes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from costmodel import goodput as gp
from costmodel.catalog import load_model
from costmodel.constraints import check_plan
from costmodel.estimate import estimate
from costmodel.job import Job
from costmodel.plan import Plan
from hardware.catalog import load_hardware
from hardware.errors import InputError
from planner import replan as rp

ROOT = Path(__file__).resolve().parents[1]
PLANNER = str(Path(sys.executable).parent / "planner")

H100 = load_hardware("h100-sxm")
V5P = load_hardware("tpu-v5p")
M70 = load_model("llama3-70b")
JOB70 = Job(seq_len=4096, global_batch=256)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "160"}
    return subprocess.run([PLANNER, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


# ---- formulas, hand-computed ------------------------------------------------------------------------------------

def test_young_interval_hand_computed():
    # C = 50 s, M = 10,000 s: sqrt(2 * 50 * 10,000) = sqrt(1e6) = 1000 s.
    assert gp.young_interval_s(50, 10_000) == pytest.approx(1000.0)
    # 1,000 chips at 50,000 h each fail every 50 h = 180,000 s; C = 60 s -> sqrt(2 * 60 * 180,000) = 4647.58 s.
    m = gp.job_mtbf_s(50_000, 1000)
    assert m == pytest.approx(180_000.0)
    assert gp.young_interval_s(60, m) == pytest.approx(4647.580015, rel=1e-9)


def test_daly_close_to_young_when_checkpoints_are_cheap():
    # C << M: Daly = sqrt(2CM)(1 + sqrt(C/2M)/3 + C/18M) - C.
    c, m = 50.0, 10_000.0
    x = c / (2 * m)
    assert gp.daly_interval_s(c, m) == pytest.approx(1000 * (1 + math.sqrt(x) / 3 + x / 9) - c)
    assert gp.daly_interval_s(30_000, 10_000) == 10_000  # C >= 2M: checkpoint every MTBF


def test_goodput_fraction_hand_computed():
    # tau = 1000, C = 50, R = 200, M = 10,000: 1000/1050 * (1 - (200 + 525)/10,000) = 0.9275/1.05.
    assert gp.goodput_fraction(1000, 50, 200, 10_000) == pytest.approx(0.9275 / 1.05)
    assert gp.goodput_fraction(1000, 50, 20_000, 10_000) == 0.0  # clamped


def test_young_interval_maximises_goodput():
    c, r, m = 30.0, 600.0, 50_000.0
    best = gp.goodput_fraction(gp.young_interval_s(c, m), c, r, m)
    for f in (0.25, 0.5, 0.8, 1.25, 2.0, 4.0):
        assert gp.goodput_fraction(f * gp.young_interval_s(c, m), c, r, m) < best


def test_poisson_and_spare_coverage():
    assert gp.poisson_cdf(0, 2.0) == pytest.approx(math.exp(-2))
    assert gp.poisson_cdf(2, 2.0) == pytest.approx(math.exp(-2) * (1 + 2 + 2))
    assert gp.poisson_cdf(-1, 2.0) == 0.0
    # One spare host, 0.1 failures/h, 10 h repair: free with probability P(Poisson(1) = 0) = e^-1.
    assert gp.spare_coverage(1, 0.1, 10) == pytest.approx(math.exp(-1))
    assert gp.spare_coverage(0, 0.1, 10) == 0.0


def test_llama3_default_mtbf():
    assert gp.LLAMA3_CHIP_MTBF_H == pytest.approx(16384 * 1296 / 419)
    assert gp.Reliability().chip_mtbf_h(H100) == pytest.approx(50_677.0, rel=1e-4)
    # 16,384 chips -> one interruption every 1296/419 = 3.09 h, as the paper reports ("every 3 hours").
    assert gp.job_mtbf_s(gp.LLAMA3_CHIP_MTBF_H, 16384) / 3600 == pytest.approx(1296 / 419)


def test_goodput_time_cost_energy_hand_computed():
    # 1,000 H100 (700 W), 10 s steps of 1e6 tokens; chip MTBF 10,000 h -> M = 36,000 s.
    # Checkpoint 1e12 B at 1e9 B/s x 1000 chips = 1 s; restore at 2e9 B/s x 1000 = 0.5 s; R = 300 + 0.5.
    # Young = sqrt(2 * 1 * 36,000) = 268.3 s -> 27 steps = 270 s.
    rel = gp.Reliability(mtbf_h=10_000, restart_s=300, replace_s=0, ckpt_write_Bps=1e9, ckpt_read_Bps=2e9,
                         ckpt_aggregate_Bps=1e15)
    ck = gp.CheckpointSize(total_bytes=1e12, per_chip_state_bytes=1e9, bytes_per_param=12)
    g = gp.goodput_from(10.0, 1e6, ck, H100, 1000, rel, train_tokens=3.6e11, price_per_chip_hour=2.0)
    assert g.job_mtbf_h == pytest.approx(10.0)
    assert g.checkpoint_write_s == pytest.approx(1.0)
    assert g.checkpoint_restore_s == pytest.approx(0.5)
    assert g.young_interval_s == pytest.approx(math.sqrt(72_000))
    assert g.interval_s == pytest.approx(270.0)
    expected = 270 / 271 * (1 - (300.5 + 135.5) / 36_000)
    assert g.goodput == pytest.approx(expected)
    assert g.tokens_per_s == pytest.approx(1e5)
    assert g.effective_tokens_per_day == pytest.approx(1e5 * 86400 * expected)
    # 3.6e11 tokens at 1e5 tokens/s = 1,000 h of compute; wall = 1000 / g hours.
    assert g.ideal_days == pytest.approx(1000 / 24)
    assert g.days_to_train == pytest.approx(1000 / 24 / expected)
    assert g.chip_hours == pytest.approx(1e6 / expected)
    assert g.cost == pytest.approx(2e6 / expected)
    assert g.energy_kwh == pytest.approx(1000 * 0.7 * 1000 / expected)  # chips x kW x hours
    assert g.checkpoint_overhead + g.failure_overhead + g.goodput == pytest.approx(1.0)


def test_energy_unknown_without_power_and_spares_are_billed():
    ck = gp.CheckpointSize(1e12, 1e9, 12)
    g = gp.goodput_from(10.0, 1e6, ck, V5P, 1024, gp.Reliability(spares=64), train_tokens=1e12,
                        price_per_chip_hour=1.0)
    assert V5P.power_w == 0 and g.energy_kwh is None
    assert g.spare_hosts == 16  # 4 chips per v5p host
    assert g.chip_hours == pytest.approx((1024 + 64) * g.days_to_train * 24)


def test_more_failures_lower_goodput():
    ck = gp.CheckpointSize(5e12, 1e9, 12)
    values = [gp.goodput_from(20.0, 4e6, ck, H100, 16384, gp.Reliability(mtbf_h=h)).goodput
              for h in (400_000, 200_000, 100_000, 50_000, 20_000)]
    assert all(a > b for a, b in zip(values, values[1:], strict=False))
    # Restart longer than the job MTBF: no progress at all.
    assert gp.goodput_from(20.0, 4e6, ck, H100, 16384, gp.Reliability(mtbf_h=2_000)).goodput == 0.0


def test_llama3_scale_sanity():
    # 16,384 H100 at the Llama 3 failure rate with spares covering failures: Meta reports > 90% effective
    # training time; the model gives about 92% (restart 10 min + restore, checkpoints of a 405B model).
    ck = gp.CheckpointSize(405e9 * 14, 1e9, 14)
    g = gp.goodput_from(20.0, 16e6, ck, H100, 16384, gp.Reliability(spares=256))
    assert g.job_mtbf_h == pytest.approx(1296 / 419)
    assert 0.88 < g.goodput < 0.96


def test_spares_reduce_restart_and_raise_goodput():
    ck = gp.CheckpointSize(5e12, 1e9, 12)
    runs = [gp.goodput_from(20.0, 4e6, ck, H100, 16384, gp.Reliability(spares=k), train_tokens=15e12)
            for k in (0, 8, 32, 128)]
    restarts = [g.restart_s for g in runs]
    assert all(a > b for a, b in zip(restarts, restarts[1:], strict=False))
    assert all(a.goodput < b.goodput for a, b in zip(runs, runs[1:], strict=False))
    assert runs[0].spare_coverage == 0.0 and runs[-1].spare_coverage > 0.99
    # With every failure covered the restart is restart + restore only.
    assert runs[-1].restart_s == pytest.approx(gp.DEFAULT_RESTART_S + runs[-1].checkpoint_restore_s
                                               + (1 - runs[-1].spare_coverage) * gp.DEFAULT_REPLACE_S)


def test_parse_count():
    assert gp.parse_count("15T") == 15e12
    assert gp.parse_count("300B") == 3e11
    assert gp.parse_count("2.5e12") == 2.5e12
    assert gp.parse_count("1_000M") == 1e9
    for bad in ("abc", "0", "-1T", "1X", "inf"):
        with pytest.raises(InputError):
            gp.parse_count(bad)


@pytest.mark.parametrize("kw", [{"mtbf_h": 0}, {"mtbf_h": -1.0}, {"ckpt_write_Bps": 0}, {"spares": -1},
                                {"restart_s": -5}, {"interval_s": 0}])
def test_reliability_rejects_bad_values(kw):
    with pytest.raises(InputError):
        gp.Reliability(**kw)


def test_goodput_rejects_bad_tokens_and_price():
    ck = gp.CheckpointSize(1e12, 1e9, 12)
    with pytest.raises(InputError):
        gp.goodput_from(10.0, 1e6, ck, H100, 8, train_tokens=0)
    with pytest.raises(InputError):
        gp.goodput_from(10.0, 1e6, ck, H100, 8, train_tokens=1e12, price_per_chip_hour=-1)


def test_checkpoint_size_counts_unique_state_once():
    # maxtext: 4 B weights + 8 B Adam = 12 B per parameter, whatever the replication.
    a = gp.checkpoint_size(M70, V5P, JOB70, Plan(fsdp=64))
    b = gp.checkpoint_size(M70, V5P, JOB70, Plan(dp=4, fsdp=16))
    assert a.total_bytes == b.total_bytes == pytest.approx(M70.total_params() * 12)
    assert b.per_chip_state_bytes == pytest.approx(4 * a.per_chip_state_bytes)  # weights+opt replicated over dp
    meg = gp.checkpoint_size(M70, H100, Job(4096, 256, framework="megatron"), Plan(fsdp=64))
    assert meg.bytes_per_param == 14  # bf16 weights + fp32 master and moments


def test_rank_by_time_to_train_orders_by_days():
    plans = [Plan(fsdp=64), Plan(fsdp=32, tp=2), Plan(fsdp=16, tp=4), Plan(dp=2, fsdp=32)]
    results = [(p, estimate(M70, V5P, JOB70, p, 64)) for p in plans]
    ranked = gp.rank_by_time_to_train(results, M70, V5P, JOB70, 1e12, price_per_chip_hour=1.0)
    assert ranked and all(item[1].fits for item, _ in ranked)
    days = [g.days_to_train for _, g in ranked]
    assert days == sorted(days)
    assert all(g.cost == pytest.approx(g.chip_hours) for _, g in ranked)


# ---- replan -----------------------------------------------------------------------------------------------------

def test_block_overlap_and_moved_bytes():
    assert rp.block_overlap(0, 2, 4) == pytest.approx(0.25)
    assert rp.block_overlap(1, 2, 4) == 0.0
    assert rp.block_overlap(3, 4, 4) == pytest.approx(0.25)
    same = {"weights": (10.0, 4), "optimizer": (20.0, 4)}
    assert rp.moved_bytes(same, same, 4, 4, True) == (0.0, 0.0)
    # 4 -> 8 ranks: ranks 4..7 are new and receive everything (15 B); rank 0 keeps its first half.
    new = {"weights": (5.0, 8), "optimizer": (10.0, 8)}
    busiest, mean = rp.moved_bytes(same, new, 4, 8, True)
    assert busiest == pytest.approx(15.0)
    assert rp.moved_bytes(same, new, 4, 8, False)[1] == pytest.approx(15.0)  # layout change: all moves


@pytest.mark.parametrize("new_chips", [128, 32])
def test_replan_satisfies_every_plan_constraint(new_chips):
    old = Plan(fsdp=64)
    r = rp.replan(M70, V5P, JOB70, old, new_chips)
    check_plan(M70, V5P, r.new_job, r.new_plan, new_chips)  # raises on any violated rule
    assert r.new_plan.chips == new_chips and r.new_cost.fits
    assert r.batch_kept and r.new_job.global_batch == JOB70.global_batch
    cost = estimate(M70, V5P, r.new_job, r.new_plan, new_chips)
    assert cost.step_time_s == pytest.approx(r.new_cost.step_time_s)
    rs = r.reshard
    assert 0 <= rs.moved_bytes_per_chip <= rs.new_state_bytes_per_chip + 1e-6
    assert rs.checkpoint_bytes == pytest.approx(M70.total_params() * 12)
    assert rs.recommended in ("reshard", "checkpoint")
    assert not rs.replicas_survive_loss  # pure fsdp: no replica of a lost shard


def test_replan_fallback_scales_data_axes_and_changes_batch_when_needed():
    old = Plan(fsdp=16)
    job = Job(4096, 256)
    m = load_model("llama3-8b")
    r = rp.replan(m, H100, job, old, 24, use_search=False)
    check_plan(m, H100, r.new_job, r.new_plan, 24)
    assert r.searched == "scaled data axes" and r.new_cost.fits
    assert not r.batch_kept and r.new_job.global_batch % 24 == 0
    assert abs(r.new_job.global_batch - 256) <= rp.MAX_BATCH_CHANGE * 256
    assert "global batch 256" in r.batch_note


def test_replan_to_unformable_count_raises():
    with pytest.raises(InputError, match="nearest valid chip counts"):
        rp.replan(M70, H100, JOB70, Plan(fsdp=64), 12)


# ---- CLI ----------------------------------------------------------------------------------------------------------

GP = ("goodput", "--model", "llama3-70b", "--hardware", "tpu-v5p", "--chips", "64", "--fsdp", "64",
      "--global-batch", "256")


def test_cli_goodput_json():
    p = run_cli(*GP, "--train-tokens", "2T", "--price-per-chip-hour", "2.5", "--spares", "8", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    g = d["goodput"]
    assert 0 < g["goodput"] < 1 and g["train_tokens"] == 2e12 and g["spare_hosts"] == 2
    assert g["cost"] == pytest.approx(g["chip_hours"] * 2.5)
    assert g["days_to_train"] > g["ideal_days"]


def test_cli_goodput_table():
    p = run_cli(*GP, "--train-tokens", "300B")
    assert p.returncode == 0, p.stderr
    assert "goodput" in p.stdout and "time to train" in p.stdout and "Young" in p.stdout


@pytest.mark.parametrize("extra", [
    ("--mtbf-hours", "0"), ("--mtbf-hours", "-3"), ("--price-per-chip-hour", "0", "--train-tokens", "1T"),
    ("--train-tokens", "0"), ("--train-tokens", "-5T"), ("--train-tokens", "lots"), ("--spares", "-1"),
    ("--ckpt-write-gbps", "0"), ("--checkpoint-min", "-1"), ("--mtbf-hours", "inf"), ("--restart-min", "nan"),
])
def test_cli_goodput_bad_input_one_line_exit_2(extra):
    p = run_cli(*GP, *extra)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {extra[0]}:"), p.stderr


def test_cli_goodput_of_a_plan_file_whose_path_rich_could_read_as_markup(tmp_path):
    from planner.planfile import save_plan

    # The table title shows the plan's source in brackets: '[/path]' is a closing tag to rich unless escaped.
    src = save_plan(tmp_path / "[x]plan.yaml", "llama3-70b", "tpu-v5p", 64, JOB70, Plan(fsdp=64))
    p = run_cli("goodput", "--plan", str(src))
    assert p.returncode == 0, p.stderr
    assert f"[{src}]" in p.stdout.replace("\n", "")


def test_cli_replan(tmp_path):
    from planner.planfile import load_plan, save_plan

    src = save_plan(tmp_path / "old.yaml", "llama3-70b", "tpu-v5p", 64, JOB70, Plan(fsdp=64))
    out = tmp_path / "new.yaml"
    p = run_cli("replan", "--plan", str(src), "--chips", "128", "--out", str(out), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["new_chips"] == 128 and d["batch_kept"] and d["new_fits"]
    pf = load_plan(out)
    assert pf.chips == 128 and pf.plan.chips == 128
    bad = run_cli("replan", "--plan", str(src), "--chips", "100000")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    h = save_plan(tmp_path / "h.yaml", "llama3-70b", "h100-sxm", 64, JOB70, Plan(fsdp=64))
    bad = run_cli("replan", "--plan", str(h), "--chips", "12")
    assert bad.returncode == 2 and "nearest valid chip counts" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_suggest_ranks_by_days_to_train():
    r = run_cli("suggest", "--model", "8B", "--chips", "16", "--hardware", "tpu-v5p", "--top", "3",
                "--train-tokens", "1T", "--price", "2", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    days = [p["days_to_train"] for p in d["plans"]]
    assert d["ranked_by"] == "days_to_train" and days == sorted(days)
    # Days at least the ideal tokens / throughput; cost = chips x hours x price.
    best = d["plans"][0]
    assert best["days_to_train"] * 86400 >= 1e12 / best["tokens_per_s"]
    assert best["cost"] == pytest.approx(16 * best["days_to_train"] * 24 * 2, rel=0.05)


def test_suggest_train_tokens_bad_input():
    r = run_cli("suggest", "--model", "8B", "--chips", "16", "--train-tokens", "lots")
    assert r.returncode == 2 and "--train-tokens" in r.stderr and "Traceback" not in r.stderr


def test_cli_goodput_without_a_plan_takes_the_batch_suggest_would():
    # 16,384 H100s: the default ~4M-token batch (1024 x 4096) leaves no mesh; suggest doubles it, so does goodput.
    p = run_cli("goodput", "--model", "llama3-405b", "--hardware", "h100-sxm", "--chips", "16384", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["global_batch"] == 2048 and d["plan_source"] == "planner search (fastest step)"
