"""Sourced GPU mechanisms of issue 28 (docs/h100_residuals.md, 'Implemented'), each on a hand-computed small case."""

from __future__ import annotations

import pytest

from costmodel.estimate import op_time
from costmodel.flops import Op
from hardware.catalog import load_hardware
from hardware.chip import Efficiency
from hardware.topology import AxisLink, collective_time, ring_latency

US = 1e-6


def _h100():
    return load_hardware("h100-sxm").with_efficiency(**vars(Efficiency()))  # default efficiencies


# ---- F3: only the linear layers' GEMMs run at the low-precision peak -----------------------------------------

@pytest.mark.parametrize("name", ["qkv_proj", "out_proj", "mlp_in", "mlp_out", "mla_down"])
def test_fp8_linear_ops_use_the_fp8_peak(name):
    chip = _h100()
    op = Op(name, 1e12, 8192, "")
    # matmul_peak 0.75, half-dim 64: eff = 0.75 * 8192 / (8192 + 64); fp8 peak 1,979 TF (lowp_gain 1)
    assert op_time(op, chip, 1.979e15) == pytest.approx(1e12 / (1.979e15 * 0.75 * 8192 / 8256))


@pytest.mark.parametrize("name", ["logits", "router"])
def test_fp8_logits_and_router_stay_bf16(name):
    chip = _h100()
    op = Op(name, 1e12, 8192, "")
    assert op_time(op, chip, 1.979e15) == pytest.approx(1e12 / (9.89e14 * 0.75 * 8192 / 8256))


def test_fp8_attention_stays_bf16():
    chip = _h100()
    op = Op("attention", 1e12, 128, "context", is_attention=True)
    # fused attention: matmul_peak 0.75 x attention 0.7 of the bf16 peak, whatever the job's precision
    assert op_time(op, chip, 1.979e15) == pytest.approx(1e12 / (9.89e14 * 0.75 * 0.7))
    assert op_time(op, chip, 1.979e15) == op_time(op, chip, 9.89e14)


# ---- H3: NCCL's ring latency on GPU levels -------------------------------------------------------------------

def _link(size: int, inner: int, outer: int) -> AxisLink:
    return AxisLink("dp", size, inner, outer, 4.5e11, 5e10, 3e-6, 5e-6, nccl_ring=(8.4 * US, 3.4 * US, 14 * US))


def test_nccl_ring_latency_by_hand():
    # 16 ranks on 2 nodes: base 8.4 + (16 - 2) x 3.4 (NVLink steps) + (2 - 1) x 14 (network step) = 70.0 us
    link = _link(16, 8, 2)
    assert ring_latency(link, "all-gather") == pytest.approx(70.0 * US)
    # all-reduce: nsteps 2(n - 1), nInterSteps 2(nodes - 1), the base once: 8.4 + 2 x 61.6 = 131.6 us
    assert ring_latency(link, "all-reduce") == pytest.approx(131.6 * US)
    # one node of 8: 8.4 + 7 x 3.4 = 32.2 us
    assert ring_latency(_link(8, 8, 1), "reduce-scatter") == pytest.approx(32.2 * US)


def test_nccl_collective_time_by_hand():
    link = _link(16, 8, 2)
    nbytes = 1.6e9
    # bandwidth: 7/8 of B over NVLink (450 GB/s x link 0.8), then 1/2 of B/8 over the network (50 GB/s x net 0.7)
    bw = 7 / 8 * nbytes / (4.5e11 * 0.8) + 1 / 2 * nbytes / 8 / (5e10 * 0.7)
    assert collective_time(link, "all-gather", nbytes, 0.8, 0.7) == pytest.approx(bw + 70.0 * US)
    assert collective_time(link, "all-reduce", nbytes, 0.8, 0.7) == pytest.approx(2 * bw + 131.6 * US)


def test_gpu_profiles_carry_ncclring_and_tpus_do_not():
    from costmodel.estimate import axis_links
    from costmodel.plan import Plan

    links = axis_links(load_hardware("h100-sxm"), Plan(dp=16))
    assert links["dp"].nccl_ring == pytest.approx((8.4 * US, 3.4 * US, 14 * US))
    tpu = axis_links(load_hardware("tpu-v5p"), Plan(dp=8))
    assert tpu["dp"].nccl_ring == ()


# ---- F1 / F2: a distributed optimizer's data-parallel sync as the framework runs it ---------------------------

def _dp_sync(framework: str, monkeypatch=None):
    from dataclasses import replace

    import costmodel.framework as fwmod
    from costmodel.catalog import load_model
    from costmodel.estimate import axis_links, estimate, stage_times
    from costmodel.job import Job
    from costmodel.memory import memory_terms
    from costmodel.plan import Plan

    if framework == "after-step":  # nanotron's ZeRO-1 (costed, in no record: docs/h100_residuals.md)
        monkeypatch.setitem(fwmod.REGISTRY, framework,
                            replace(fwmod.MEGATRON, name=framework, param_gather=fwmod.AFTER_STEP))
    m, chip = load_model("llama2-7b"), _h100()
    job, plan = Job(4096, 64, framework=framework), Plan(dp=16, tp=1, zero=1, micro_batch=1)
    cost = estimate(m, chip, job, plan)
    mem = memory_terms(m, chip, job, plan, cost.grad_accum)
    st = stage_times(m, chip, job, plan)
    return [c for c in cost.collectives if c.axis == "dp"], mem, st, axis_links(chip, plan)["dp"], chip


def test_megatron_zero1_is_one_all_reduce_behind_the_backward():
    colls, mem, st, link, chip = _dp_sync("megatron")
    (c,) = colls
    t = collective_time(link, "all-reduce", mem.grad_elems_for_reduce * 4, 0.8, 0.7)  # fp32 gradients
    assert c.kind == "all-reduce" and c.time_s == pytest.approx(t)
    assert c.exposed_s == pytest.approx(max(0.0, t - 0.85 * st.bwd))


def test_nanotron_zero1_gathers_the_parameters_after_the_step(monkeypatch):
    colls, mem, st, link, chip = _dp_sync("after-step", monkeypatch)
    rs, ag = colls
    elems = mem.grad_elems_for_reduce
    t_rs = collective_time(link, "reduce-scatter", elems * 4, 0.8, 0.7)  # fp32 gradients, behind the backward
    t_ag = collective_time(link, "all-gather", elems * 2, 0.8, 0.7)  # bf16 parameters, blocking
    assert (rs.kind, ag.kind) == ("reduce-scatter", "all-gather")
    assert rs.exposed_s == pytest.approx(max(0.0, t_rs - 0.85 * st.bwd))
    assert ag.exposed_s == pytest.approx(t_ag) and ag.time_s == pytest.approx(t_ag)


def test_nemo_zero1_gathers_behind_the_next_forward():
    colls, mem, st, link, chip = _dp_sync("nemo")
    rs, ag = colls
    elems = mem.grad_elems_for_reduce
    t_rs = collective_time(link, "reduce-scatter", elems * 4, 0.8, 0.7)  # fp32 gradients (no grad_sync_dtype)
    t_ag = collective_time(link, "all-gather", elems * 2, 0.8, 0.7)  # bf16 parameters (param_sync_dtype)
    assert rs.bytes_each == pytest.approx(elems * 4) and ag.bytes_each == pytest.approx(elems * 2)
    assert rs.exposed_s == pytest.approx(max(0.0, t_rs - 0.85 * st.bwd))
    assert ag.exposed_s == pytest.approx(max(0.0, t_ag - 0.85 * st.fwd))
