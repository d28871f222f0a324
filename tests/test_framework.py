"""Frameworks as data (costmodel.framework): the records are the only place a framework's name decides anything,
so a record registered under a new name costs, checks and solves exactly as the one it copies."""

from __future__ import annotations

import itertools
import re
from dataclasses import replace
from pathlib import Path

import pytest

import costmodel.framework as fwmod
from costmodel.catalog import load_model
from costmodel.constraints import check_plan
from costmodel.estimate import estimate
from costmodel.framework import MEGATRON, PYTORCH_FSDP, REGISTRY, StateBytes, framework
from costmodel.job import FRAMEWORKS, Job
from costmodel.memory import state_convention
from costmodel.model import ModelSpec
from costmodel.plan import REMAT_POLICIES, Plan, parse_remat
from hardware.catalog import load_hardware
from hardware.errors import InputError
from planner.candidates import Constraints, Mesh
from planner.remat import solve_mesh

ROOT = Path(__file__).resolve().parents[1]
LLAMA7 = load_model("llama2-7b")
LLAMA405 = load_model("llama3-405b")
SMALL_MOE = ModelSpec("small-moe", n_layers=8, d_model=2048, n_heads=16, n_kv_heads=4, ffn_dim=5632,
                      vocab_size=32000, n_experts=8, experts_per_token=2, moe_ffn_dim=1408, n_dense_layers=1)
V5P = load_hardware("tpu-v5p")
H100 = load_hardware("h100-sxm")


def test_registry_names_every_framework_once():
    assert FRAMEWORKS == tuple(REGISTRY) == ("maxtext", "megatron", "pytorch-fsdp", "deepspeed", "nemo")
    for name, fw in REGISTRY.items():
        assert fw.name == name and framework(name) is fw and Job(4096, 8, framework=name).fw is fw
    with pytest.raises(InputError, match="framework must be one of maxtext, megatron, pytorch-fsdp, deepspeed, nemo"):
        Job(4096, 8, framework="torchtitan")


def test_state_layouts_by_hand():
    # fp32 weights + moments: 4 + 4 + 8 B, update 7 x 4 B; Megatron: bf16 + fp32 grads + 12 B, 7 x 4 + 2 B
    assert state_convention(Job(4096, 8)) == StateBytes(4, 4, 8, 28)
    assert state_convention(Job(4096, 8, framework="megatron")) == (2, 4, 12, 30)
    assert state_convention(Job(4096, 8, weight_dtype="bfloat16")) == (2, 4, 4, 16)
    with pytest.raises(InputError, match="weight_dtype bfloat16 is a maxtext setting; framework 'deepspeed'"):
        Job(4096, 8, framework="deepspeed", weight_dtype="bfloat16")


def _grid():
    """Plans over every axis, the offloads, the remat policies and vocab tiles."""
    offl = parse_remat("custom:layer_input=offload,context=offload,mlp_in=remat")
    for m, degrees, remat_, (oo, op), vt in itertools.product(
            (LLAMA7, SMALL_MOE), [(2, 2, 2, 1, 1, 1, 1), (1, 4, 1, 2, 2, 1, 2), (2, 1, 2, 1, 2, 2, 1),
                                  (1, 2, 2, 1, 1, 4, 1), (1, 2, 1, 2, 4, 2, 1)],
            [REMAT_POLICIES["none"], REMAT_POLICIES["full"], REMAT_POLICIES["minimal"], offl],
            [(False, False), (True, False), (False, True)], (1, 2)):
        dp, fsdp, tp, cp, pp, ep, vpp = degrees
        if ep > 1 and not m.is_moe:
            continue
        yield m, Plan(dp=dp, fsdp=fsdp, tp=tp, cp=cp, pp=pp, ep=ep, vpp=vpp, zero=1 if dp > 1 else 0, remat=remat_,
                      offload_optimizer=oo, offload_params=op, vocab_tiles=vt)


def _outcome(m, chip, job, plan):
    try:
        d = estimate(m, chip, job, plan).to_dict()
    except InputError as e:
        return str(e).replace(job.framework, "<fw>")
    d.pop("convention")
    return d


@pytest.mark.parametrize("name", list(REGISTRY))
def test_a_copy_under_a_new_name_costs_the_same(name, monkeypatch):
    """No code path compares framework names: the same record under another name gives the same costs, the same
    refusals (names aside) and the same solver choices."""
    copy = replace(REGISTRY[name], name="copy-" + name)
    monkeypatch.setitem(fwmod.REGISTRY, copy.name, copy)
    chip = V5P if name == "maxtext" else H100
    job, job2 = Job(4096, 64, framework=name), Job(4096, 64, framework=copy.name)
    costed = 0
    for m, plan in _grid():
        a = _outcome(m, chip, job, plan)
        assert a == _outcome(m, chip, job2, plan), (m.name, plan)
        costed += isinstance(a, dict)
    assert costed > 50
    for m, mesh in ((LLAMA7, Mesh(1, 4, 2, 1, 1, 1, 1, 1, 0, 1)), (SMALL_MOE, Mesh(1, 2, 1, 1, 2, 2, 1, 1, 0, 1))):
        r1, r2 = (solve_mesh(m, chip, j, mesh, Constraints()) for j in (job, job2))
        assert (r1.choice, r1.estimates, r1.brute_force) == (r2.choice, r2.estimates, r2.brute_force)


def test_fields_decide(monkeypatch):
    """A field flipped in a record changes what it states, through the registry alone."""
    def reg(fw):
        monkeypatch.setitem(fwmod.REGISTRY, fw.name, fw)
        return Job(4096, 64, framework=fw.name)

    # logits: 6 B (bf16 + fp32 upcast) -> 4 B
    plan = Plan(dp=8)
    six = estimate(LLAMA7, H100, Job(4096, 64, framework="megatron"), plan).memory["logits"]
    four = estimate(LLAMA7, H100, reg(replace(MEGATRON, name="m4", logit_bytes=4)), plan).memory["logits"]
    assert four == pytest.approx(six * 4 / 6)
    # uneven pipeline split: 126 layers over 8 stages refused by an even-split framework, costed by an uneven one
    p8 = Plan(dp=8, pp=8)
    with pytest.raises(InputError, match="splits the layers evenly"):
        check_plan(LLAMA405, H100, Job(4096, 64, framework="pytorch-fsdp"), p8)
    check_plan(LLAMA405, H100, reg(replace(PYTORCH_FSDP, name="uneven", uneven_pp=True)), p8)
    # interleaving refused where the framework has none
    with pytest.raises(InputError, match="vpp: DeepSpeed's pipeline engine has no interleaved schedule"):
        check_plan(LLAMA7, H100, Job(4096, 64, framework="deepspeed"), Plan(dp=4, pp=2, vpp=2))
    with pytest.raises(InputError, match="vpp: X's pipeline engine"):
        check_plan(LLAMA7, H100, reg(replace(MEGATRON, name="x", display="X", interleaved_pp=False)),
                   Plan(dp=4, pp=2, vpp=2))
    # weight-sharding axes: MaxText's cp shards the weights (gathered over fsdp x cp), Megatron's does not
    cp = Plan(fsdp=2, cp=2)
    mt = estimate(LLAMA7, V5P, Job(4096, 64), cp)
    like = estimate(LLAMA7, V5P, reg(replace(MEGATRON, name="cp-shards", weight_shard_axes=("fsdp", "cp"))), cp)
    meg = estimate(LLAMA7, V5P, Job(4096, 64, framework="megatron"), cp)
    assert like.memory["weights"] == pytest.approx(meg.memory["weights"] / 2)
    assert mt.memory["optimizer"] == pytest.approx(like.memory["optimizer"] * 8 / 12)  # 8 B vs 12 B per param


FRAMEWORK_TEST = re.compile(r"""framework\s*(==|!=|\bin\b|\bnot in\b)\s*[("']|maxtext_pipeline""")
# The exporters name their own target format, and verify compiles MaxText's own config of the plan.
PENDING = {"planner/export_maxtext.py", "planner/export_megatron.py", "planner/verify.py"}


def test_no_framework_name_comparisons_outside_the_registry():
    found = set()
    for path in itertools.chain((ROOT / "costmodel").rglob("*.py"), (ROOT / "planner").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel != "costmodel/framework.py" and FRAMEWORK_TEST.search(path.read_text()):
            found.add(rel)
    assert found <= PENDING, found - PENDING


def test_offloaded_optimizer_step_runs_at_host_dram_bandwidth_under_megatron():
    """Megatron-Core's HybridDeviceOptimizer updates offloaded state on the CPU: the Adam bytes over the host's DRAM
    share (not free), gradients down and parameters up; MaxText brings the state up, updates on the device and
    writes it back."""
    from costmodel.catalog import load_model
    from costmodel.estimate import estimate
    from costmodel.job import Job
    from costmodel.memory import memory_terms
    from costmodel.plan import Plan, remat_policy
    from hardware.catalog import load_hardware

    m, chip = load_model("llama3-8b"), load_hardware("h100-sxm")
    job = Job(4096, 64, framework="megatron")
    plan = Plan(dp=8, micro_batch=1, zero=1, remat=remat_policy("full"), offload_optimizer=True)
    cost = estimate(m, chip, job, plan)
    mem = memory_terms(m, chip, job, plan, cost.grad_accum)
    expected = mem.optimizer_param_elems * mem.adam_bytes_per_param / 7.68e10
    assert cost.time["optimizer"] == pytest.approx(expected) and expected > 0.1
    mt_job, mt_plan = Job(4096, 64, framework="maxtext"), Plan(fsdp=8, micro_batch=8, remat=remat_policy("full"),
                                                               offload_optimizer=True)
    mt = estimate(m, chip, mt_job, mt_plan)
    mt_mem = memory_terms(m, chip, mt_job, mt_plan, mt.grad_accum)
    # MaxText brings the optimizer state (fp32 mu and nu: 8 B per parameter) up and back down, and updates on
    # the device (train_step's device_put of the state before the update)
    assert mt.time["optimizer"] == pytest.approx(
        mt_mem.optimizer_param_elems * mt_mem.adam_bytes_per_param / (chip.hbm_bw_Bps * chip.eff.hbm))
    (moved,) = [c for c in mt.collectives if c.axis == "host" and c.purpose == "optimizer"]
    assert moved.bytes_each == pytest.approx(2 * 8 * mt_mem.optimizer_param_elems)
    (zero_offload,) = [c for c in cost.collectives if c.axis == "host" and c.purpose == "optimizer"]
    assert zero_offload.bytes_each == pytest.approx(mem.optimizer_param_elems * (mem.grad_bytes + 2))


def test_maxtext_optimizer_offload_saves_no_device_memory():
    """MaxText device_puts the offloaded state back for the update on the device: the device peak keeps the state
    (the compiles: +7.4 and -7.0 GiB on two plans, docs/memory.md); the host holds it between steps."""
    from costmodel.catalog import load_model
    from costmodel.estimate import estimate
    from costmodel.job import Job
    from costmodel.plan import Plan, remat_policy
    from hardware.catalog import load_hardware

    m, chip = load_model("llama2-7b"), load_hardware("tpu-v5p")
    job = Job(2048, 4, framework="maxtext")
    on = estimate(m, chip, job, Plan(fsdp=4, micro_batch=1, remat=remat_policy("full"), offload_optimizer=True))
    off = estimate(m, chip, job, Plan(fsdp=4, micro_batch=1, remat=remat_policy("full")))
    assert on.memory == off.memory and on.peak_memory_bytes == off.peak_memory_bytes
    assert on.host_memory_bytes >= off.memory["optimizer"] > 0
    mg = Job(2048, 4, framework="megatron")  # the CPU updates: the state leaves the device
    mg_on = estimate(m, load_hardware("h100-sxm"), mg, Plan(dp=4, zero=1, micro_batch=1,
                                                            remat=remat_policy("full"), offload_optimizer=True))
    assert mg_on.memory["optimizer"] == 0.0
