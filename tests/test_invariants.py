"""Invariants of the cost model, checked over random models, presets and plans (generalising the fixed cases in
test_costmodel.py). Default budget small; HYPOTHESIS_PROFILE=fuzz multiplies it by 20."""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from costmodel.estimate import estimate
from costmodel.flops import tp_replicated_flops_per_token
from costmodel.job import FRAMEWORKS, PRECISIONS, Job
from costmodel.model import ModelSpec
from costmodel.plan import REMAT_POLICIES, Plan
from hardware.catalog import load_hardware, preset_names
from hardware.errors import InputError

FUZZ = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"


def budget(n: int) -> settings:
    return settings(max_examples=n * (20 if FUZZ else 1), deadline=None, derandomize=not FUZZ,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


PRESETS = preset_names()
CHIPS = {name: load_hardware(name) for name in PRESETS}
GPUS = [n for n in PRESETS if CHIPS[n].scale_up.kind != "torus" and CHIPS[n].max_chips >= 4096]
TPUS = [n for n in PRESETS if CHIPS[n].scale_up.kind == "torus"]


@st.composite
def models(draw) -> ModelSpec:
    """Power-of-two-friendly shapes so that tp/pp/ep degrees of 2..8 usually divide them."""
    n_heads = draw(st.sampled_from([8, 16, 32, 64, 96, 128]))
    head_dim = draw(st.sampled_from([64, 128]))
    kw: dict = dict(name="inv", n_layers=draw(st.sampled_from([8, 16, 32, 48, 64, 96])), d_model=n_heads * head_dim,
                    n_heads=n_heads, n_kv_heads=draw(st.sampled_from([1, 8, n_heads])),
                    ffn_dim=draw(st.integers(256, 65536)), vocab_size=draw(st.sampled_from([1000, 32000, 256000])),
                    gated_mlp=draw(st.booleans()), tied_embeddings=draw(st.booleans()))
    if draw(st.booleans()):
        n_exp = draw(st.sampled_from([8, 16, 64]))
        kw.update(n_experts=n_exp, experts_per_token=draw(st.integers(1, 8)), moe_ffn_dim=draw(st.integers(256, 8192)),
                  n_dense_layers=draw(st.integers(0, 3)), n_shared_experts=draw(st.integers(0, 1)))
    return ModelSpec(**kw)


@st.composite
def jobs(draw) -> Job:
    return Job(seq_len=draw(st.sampled_from([128, 2048, 4096, 32768, 131072, 1 << 20])),
               global_batch=draw(st.sampled_from([256, 512, 1024, 4096])),
               precision=draw(st.sampled_from(PRECISIONS)), framework=draw(st.sampled_from(FRAMEWORKS)))


SMALL = st.sampled_from([1, 2, 4, 8])


@st.composite
def plans(draw, m: ModelSpec, remat: str | None = None) -> Plan:
    return Plan(dp=draw(SMALL), fsdp=draw(st.sampled_from([1, 2, 4, 8, 16, 64])), tp=draw(SMALL), cp=draw(SMALL),
                pp=draw(SMALL), ep=draw(SMALL) if m.is_moe else 1, micro_batch=draw(st.sampled_from([1, 2])),
                zero=draw(st.integers(0, 3)), sequence_parallel=draw(st.booleans()),
                remat=REMAT_POLICIES[remat or draw(st.sampled_from(sorted(REMAT_POLICIES)))],
                offload_optimizer=draw(st.booleans()), offload_params=draw(st.booleans()))


def costed(m, chip, job, plan):
    """estimate(), or discard the example when the plan breaks a rule (InputError)."""
    try:
        return estimate(m, chip, job, plan)
    except InputError:
        assume(False)


@budget(40)
@given(st.data(), models(), jobs(), st.sampled_from(GPUS))
def test_model_flops_do_not_depend_on_plan(data, m, job, chip_name):
    chip = CHIPS[chip_name]
    a = costed(m, chip, job, data.draw(plans(m)))
    b = costed(m, CHIPS[data.draw(st.sampled_from(PRESETS))], job, data.draw(plans(m)))
    assert a.model_flops_per_step == b.model_flops_per_step
    assert a.model_flops_per_step > 0


@budget(40)
@given(st.data(), models(), jobs(), st.sampled_from(PRESETS))
def test_recompute_zero_without_remat_and_grows_selective_to_full(data, m, job, chip_name):
    chip = CHIPS[chip_name]
    base = data.draw(plans(m, remat="none"))
    assume(base.chips <= chip.max_chips)
    by = {}
    for name in ("none", "selective", "full"):
        by[name] = costed(m, chip, job, replace(base, remat=REMAT_POLICIES[name]))
    none, sel, full = by["none"], by["selective"], by["full"]
    assert none.time["recompute"] == 0
    # without remat the hardware does the model's FLOPs, plus what every tp rank repeats (MLA down-projections,
    # MoE routers: 3 passes x (tp - 1) copies)
    per_token = (m.n_dense_mlp_layers * tp_replicated_flops_per_token(m, False)
                 + m.n_moe_layers * tp_replicated_flops_per_token(m, True))
    repeated = 3 * (base.tp - 1) * job.tokens * per_token
    assert none.hardware_flops_per_step == pytest.approx(none.model_flops_per_step + repeated)
    assert none.hfu >= none.mfu
    rec = {k: c.hardware_flops_per_step - c.model_flops_per_step - repeated for k, c in by.items()}
    assert rec["none"] == pytest.approx(0, abs=1e-6 * none.model_flops_per_step)
    assert rec["none"] < rec["selective"] < rec["full"]
    assert 0 < sel.time["recompute"] < full.time["recompute"]
    for c in by.values():
        assert 0 < c.mfu <= c.hfu <= 1


@budget(40)
@given(st.data(), models(), jobs(), st.sampled_from(GPUS), st.sampled_from(["fsdp", "tp", "pp"]))
def test_state_memory_per_chip_does_not_grow_with_sharding(data, m, job, chip_name, axis):
    chip = CHIPS[chip_name]
    plan = data.draw(plans(m))
    k = data.draw(st.sampled_from([2, 4]))
    job = replace(job, global_batch=job.global_batch * 64)  # stays divisible when fsdp grows
    small = costed(m, chip, job, plan)
    big = costed(m, chip, job, replace(plan, **{axis: getattr(plan, axis) * k}))
    for term in ("weights", "gradients", "optimizer"):
        assert big.memory[term] <= small.memory[term] * (1 + 1e-12), (term, small.memory[term], big.memory[term])


@budget(40)
@given(st.data(), models(), jobs(), st.sampled_from(PRESETS), st.floats(1.0, 16.0))
def test_a_plan_that_fits_still_fits_with_more_memory(data, m, job, chip_name, factor):
    chip = CHIPS[chip_name]
    plan = data.draw(plans(m))
    c = costed(m, chip, job, plan)
    bigger = replace(chip, hbm_bytes=chip.hbm_bytes * factor, host_mem_bytes=chip.host_mem_bytes * factor)
    d = estimate(m, bigger, job, plan)
    assert d.peak_memory_bytes == c.peak_memory_bytes
    assert d.overflow_bytes <= c.overflow_bytes
    assert c.fits <= d.fits
    assert d.step_time_s == c.step_time_s  # memory capacity alone changes no time


@budget(40)
@given(st.data(), models(), jobs(), st.sampled_from(PRESETS))
def test_doubling_global_batch_does_not_lower_throughput(data, m, job, chip_name):
    chip = CHIPS[chip_name]
    plan = data.draw(plans(m))
    c1 = costed(m, chip, job, plan)
    c2 = estimate(m, chip, replace(job, global_batch=2 * job.global_batch), plan)
    assert c2.grad_accum == 2 * c1.grad_accum
    assert c2.tokens_per_s >= c1.tokens_per_s * (1 - 1e-12)
    assert c2.model_flops_per_step == 2 * c1.model_flops_per_step


@budget(30)
@given(models(), jobs(), st.sampled_from(PRESETS), st.sampled_from(sorted(REMAT_POLICIES)))
def test_mfu_at_most_one_and_hfu_at_least_mfu_single_chip(m, job, chip_name, remat):
    """One chip, no communication: the best case for MFU, which still must not pass 1."""
    chip = CHIPS[chip_name]
    job = replace(job, global_batch=1, seq_len=min(job.seq_len, 8192))
    c = costed(m, chip, job, Plan(remat=REMAT_POLICIES[remat]))
    assert 0 < c.mfu <= c.hfu <= 1
    assert math.isclose(c.tflops_per_chip * 1e12, c.mfu * chip.peak_flops(job.precision), rel_tol=1e-9)
