"""Step-time intervals (costmodel.interval) over evidence (costmodel.evidence), and how suggest ranks by them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from costmodel import evidence
from costmodel.catalog import load_model
from costmodel.estimate import estimate
from costmodel.interval import MIN_SOURCES, step_time_interval
from costmodel.job import Job
from costmodel.plan import REMAT_POLICIES, Plan
from hardware.catalog import load_hardware
from hardware.errors import InputError

PLANNER = str(Path(sys.executable).parent / "planner")
V5P = load_hardware("tpu-v5p")
M = load_model("llama2-7b")
JOB = Job(seq_len=4096, global_batch=64)
PLAN = Plan(fsdp=16, remat=REMAT_POLICIES["full"])


def fam_doc(**kw) -> dict:
    doc = {"chips": ["tpu-v5p"], "sources": ["a", "b", "c"], "rows": 9, "max_chips": 64,
           "max_degree": {"fsdp": 64, "tp": 8, "cp": 1, "pp": 1, "ep": 1, "vpp": 1}, "precisions": ["bf16"],
           "frameworks": ["maxtext"], "remat": ["full"], "offload": False,
           "best_mfu": {"bf16": {"mfu": 0.9, "row": "r1 (a)"}},
           "residuals": {"log_residual_p10": -0.2, "log_residual_p90": 0.1, "sources": 3}}
    doc.update(kw)
    return doc


def ev(pooled=(-0.5, 0.4), **kw) -> evidence.Evidence:
    return evidence.parse({"families": {"tpu-v5p": fam_doc(**kw)},
                           "pooled": {"log_residual_p10": pooled[0], "log_residual_p90": pooled[1], "sources": 9}})


@pytest.fixture(scope="module")
def cost():
    return estimate(M, V5P, JOB, PLAN)


def test_width_from_the_family_residuals(cost):
    iv = step_time_interval(cost, V5P, JOB, PLAN, ev())
    t = cost.step_time_s
    assert iv.low_s == pytest.approx(t / math.exp(0.1)) and iv.high_s == pytest.approx(t / math.exp(-0.2))
    assert iv.extrapolations == () and iv.family == "tpu-v5p" and "3 sources" in iv.basis


def test_more_chips_than_any_run_widens_to_the_pooled_residuals(cost):
    iv = step_time_interval(cost, V5P, JOB, PLAN, ev(max_chips=8))
    t = cost.step_time_s
    assert iv.low_s == pytest.approx(t / math.exp(0.4)) and iv.high_s == pytest.approx(t / math.exp(-0.5))
    assert iv.extrapolations == ("16 chips: more than the largest calibrated run on tpu-v5p (8)",)


def test_each_way_outside_the_evidence_is_named(cost):
    plan = PLAN.with_(remat=REMAT_POLICIES["minimal"], offload_optimizer=True)
    job = replace(JOB, precision="fp8")
    iv = step_time_interval(estimate(M, V5P, job, plan), V5P, job, plan,
                            ev(max_degree={"fsdp": 8}, frameworks=["megatron"]))
    text = " | ".join(iv.extrapolations)
    for phrase in ("fsdp=16: beyond the calibrated runs on tpu-v5p (fsdp up to 8)", "precision fp8",
                   "framework maxtext", "remat policy minimal", "host offload: never measured"):
        assert phrase in text


def test_slow_end_never_above_the_best_measured_mfu(cost):
    best = cost.mfu / 2
    iv = step_time_interval(cost, V5P, JOB, PLAN, ev(best_mfu={"bf16": {"mfu": best, "row": "r9 (b)"}}))
    assert iv.high_s == pytest.approx(cost.step_time_s * 2)
    assert iv.best_mfu == best and "above the best measured on tpu-v5p" in iv.extrapolations[-1]


def test_few_sources_take_the_pooled_spread_too(cost):
    few = {"log_residual_p10": -0.1, "log_residual_p90": 0.6, "sources": MIN_SOURCES - 1}
    iv = step_time_interval(cost, V5P, JOB, PLAN, ev(residuals=few))
    t = cost.step_time_s
    assert iv.low_s == pytest.approx(t / math.exp(0.6)) and iv.high_s == pytest.approx(t * math.exp(0.5))
    assert iv.extrapolations == () and "only 2 source(s)" in iv.basis


def test_chip_without_runs_is_said():
    shipped = evidence.shipped()
    for name, word in (("h800", "no measured runs of h800: efficiencies from the h100-sxm fit"),
                       ("h200", "no fitted runs of h200: efficiencies from the h100-sxm fit")):
        chip = load_hardware(name)
        job = Job(seq_len=4096, global_batch=64, framework="megatron")
        plan = Plan(dp=8, tp=2, zero=1, remat=REMAT_POLICIES["selective"])
        iv = step_time_interval(estimate(M, chip, job, plan), chip, job, plan, shipped)
        assert word in iv.extrapolations and iv.low_s < iv.high_s


def test_shipped_evidence_covers_every_calibrated_family():
    shipped = evidence.shipped()
    assert {"a100", "h100-sxm", "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e"} <= set(shipped.families)
    assert shipped.pooled is not None and shipped.pooled.p10 < 0 < shipped.pooled.p90
    v5p = shipped.families["tpu-v5p"]
    assert v5p.residuals.sources >= MIN_SOURCES and 0.5 < v5p.best_mfu["bf16"][0] < 0.8


def test_malformed_evidence_names_the_field():
    with pytest.raises(InputError, match="families.tpu-v5p: malformed"):
        evidence.parse({"families": {"tpu-v5p": {"max_chips": "many"}}})
    with pytest.raises(InputError, match="expected 'families'"):
        evidence.parse({"families": [1]})


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PLANNER, *args], capture_output=True, text=True)


def test_estimate_json_carries_the_interval():
    r = run("estimate", "-m", "llama2-7b", "-n", "16", "-b", "64", "--fsdp", "16", "--json")
    d = json.loads(r.stdout)
    lo, hi = d["step_time_interval_s"]
    assert r.returncode == 0 and lo < hi and d["interval_level"] == 0.8 and isinstance(d["extrapolations"], list)


def test_suggest_ranks_by_the_slow_end_and_keeps_headroom():
    r = run("suggest", "-m", "llama2-7b", "-n", "16", "-b", "64", "--top", "4", "--json")
    d = json.loads(r.stdout)
    assert r.returncode == 0 and d["ranked_by"] == "conservative" and d["headroom"] == 0.05
    highs = [p["step_time_interval_s"][1] for p in d["plans"] if p["within_headroom"]]
    assert highs == sorted(highs)
    for p in d["plans"]:
        assert p["within_headroom"] == (p["fit_memory_bytes"] <= 0.95 * p["hbm_usable_bytes"])
    e = json.loads(run("suggest", "-m", "llama2-7b", "-n", "16", "-b", "64", "--top", "4", "--json",
                       "--rank", "expected").stdout)
    times = [p["step_time_s"] for p in e["plans"]]
    assert e["ranked_by"] == "expected" and times == sorted(times)


def test_conservative_rank_falls_back_when_the_evidence_backs_no_plan():
    # 1T on 18,432 v5p (3 slices): every plan needs cp > 1, which no v5p calibration run split, so the extra
    # evidence-backed search finds nothing; the default ranking must still return the main search's plans
    r = run("suggest", "-m", "1T", "-n", "18432", "--top", "1", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["ranked_by"] == "conservative" and d["plans"][0]["degrees"]["cp"] > 1


def test_suggest_default_framework_follows_the_vendor():
    gpu = json.loads(run("suggest", "-m", "llama2-7b", "-H", "h100-sxm", "-n", "16", "-b", "64", "--top", "1",
                         "--json").stdout)
    assert gpu["job"]["framework"] == "megatron" and any("default on GPUs" in n for n in gpu["notes"])
    assert all(p["degrees"]["fsdp"] == 1 for p in gpu["plans"])  # Megatron-LM has no fsdp axis
    tpu = json.loads(run("suggest", "-m", "llama2-7b", "-n", "16", "-b", "64", "--top", "1", "--json").stdout)
    assert tpu["job"]["framework"] == "maxtext"


@pytest.mark.parametrize("flag,value,word", [("--headroom", "100", "--headroom: expected a percent"),
                                             ("--headroom", "nan", "--headroom"),
                                             ("--rank", "fastest", "--rank: expected one of conservative, expected")])
def test_suggest_bad_ranking_flags(flag, value, word):
    r = run("suggest", "-m", "llama2-7b", "-n", "16", "-b", "64", flag, value)
    assert r.returncode == 2 and word in r.stderr and "Traceback" not in r.stderr
