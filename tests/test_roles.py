"""Collectives carry a role; the planner's solver finds them by role, so their labels are free to change."""

from __future__ import annotations

import itertools
from dataclasses import asdict, replace

import pytest

import planner.remat as remat
from costmodel.catalog import load_model
from costmodel.cost import Cost, Role
from costmodel.estimate import estimate
from costmodel.job import FRAMEWORKS, Job
from costmodel.model import ModelSpec
from costmodel.plan import REMAT_POLICIES, Plan, parse_remat
from hardware.catalog import load_hardware
from hardware.errors import InputError
from planner.candidates import Constraints, Mesh

LLAMA7 = load_model("llama2-7b")
SMALL_MOE = ModelSpec("small-moe", n_layers=8, d_model=2048, n_heads=16, n_kv_heads=4, ffn_dim=5632,
                      vocab_size=32000, n_experts=8, experts_per_token=2, moe_ffn_dim=1408)
V5P = load_hardware("tpu-v5p")
H100 = load_hardware("h100-sxm")
# Which axis label each role's collectives go over (host traffic: 'host').
ROLE_AXES = {
    Role.TP_ACTIVATION: {"tp"}, Role.TP_VOCAB: {"tp"}, Role.SP_REGATHER: {"tp"},
    Role.WEIGHT_GATHER: {"fsdp"}, Role.WEIGHT_REGATHER: {"fsdp"}, Role.LAYER_GRAD_REDUCE: {"fsdp"},
    Role.GRAD_REDUCE: {"dp", "ep", "dp+ep", "fsdp", "pp", "dp+pp", "ep+pp", "dp+ep+pp"},
    Role.TABLE_GATHER: {"fsdp"}, Role.TABLE_GRAD_REDUCE: {"fsdp"}, Role.EMBEDDING_EXCHANGE: {"fsdp"},
    Role.CONTEXT_KV: {"cp"}, Role.EXPERT_EXCHANGE: {"ep"}, Role.PIPELINE_TRANSFER: {"pp"},
    Role.ACTIVATION_OFFLOAD: {"host"}, Role.OPTIMIZER_OFFLOAD: {"host"}, Role.PARAM_OFFLOAD: {"host"},
}


def _plans():
    """A grid over every axis, the offloads and the remat policies, under every framework."""
    offl = parse_remat("custom:layer_input=offload,context=offload,mlp_in=remat")
    for fw, (dp, fsdp, tp, cp, pp, ep), remat_, (oo, op) in itertools.product(
            FRAMEWORKS, [(2, 2, 2, 1, 1, 1), (1, 4, 1, 2, 2, 1), (2, 1, 2, 1, 2, 2), (1, 2, 2, 1, 1, 4),
                         (2, 2, 1, 2, 1, 2)],
            [REMAT_POLICIES["none"], REMAT_POLICIES["full"], REMAT_POLICIES["selective"], offl],
            [(False, False), (True, False), (False, True)]):
        yield (Job(4096, 64, framework=fw),
               Plan(dp=dp, fsdp=fsdp, tp=tp, cp=cp, pp=pp, ep=ep, zero=1 if dp > 1 else 0, remat=remat_,
                    offload_optimizer=oo, offload_params=op))


def test_every_collective_has_a_role_over_its_axis():
    seen = set()
    costed = 0
    for job, plan in _plans():
        try:
            cost = estimate(SMALL_MOE, V5P if job.framework == "maxtext" else H100, job, plan)
        except InputError:
            continue
        costed += 1
        for c in cost.collectives:
            assert isinstance(c.role, Role), c
            assert c.axis in ROLE_AXES[c.role], (c.role, c.axis, c.purpose)
            seen.add(c.role)
    assert costed > 100
    assert seen == set(Role), set(Role) - seen  # every role is produced somewhere
    # the JSON view is unchanged: a collective's fields less its role
    d = estimate(LLAMA7, V5P, Job(4096, 64), Plan(fsdp=4, tp=2)).to_dict()
    assert "role" not in d["collectives"][0] and "purpose" in d["collectives"][0]


def _relabelled(cost: Cost) -> Cost:
    """The same cost with every collective's label reworded (and two labels swapped)."""
    swap = {"grads": "weights bwd", "weights bwd": "grads", "activations": "tokens", "tokens": "activations"}
    return replace(cost, collectives=tuple(replace(c, purpose=swap.get(c.purpose, f"renamed: {c.purpose[::-1]}"))
                                           for c in cost.collectives))


CASES = [  # (model, chip, job, mesh, the surrogate terms read off role-found collectives that must be non-zero)
    (LLAMA7, V5P, Job(1024, 64), Mesh(1, 4, 2, 1, 1, 1, 1, 1, 0, 1), ("g0", "kappa", "n_tau")),  # grads, SP
    (LLAMA7, V5P, Job(512, 64), Mesh(1, 16, 1, 1, 2, 1, 1, 1, 0, 1), ("g0", "n_tau")),  # pipeline re-gathers
    (SMALL_MOE, V5P, Job(4096, 64), Mesh(1, 2, 1, 1, 1, 4, 1, 1, 0, 1), ("kappa", "n_tau")),  # expert exchange
    (LLAMA7, H100, Job(4096, 64, framework="megatron"), Mesh(1, 8, 2, 1, 1, 1, 1, 1, 0, 1), ("g0", "n_tau")),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_renaming_labels_cannot_change_the_solver(case, monkeypatch):
    m, chip, job, mesh, terms = CASES[case]
    s1, calls1 = remat.probe(m, chip, job, mesh)
    r1 = remat.solve_mesh(m, chip, job, mesh, Constraints())
    assert s1.exact and not r1.brute_force
    for name in terms:  # the roles matter here
        assert any(getattr(s1, name).values()) if name == "n_tau" else getattr(s1, name) > 0, name
    real = remat.estimate
    monkeypatch.setattr(remat, "estimate", lambda *a, **k: _relabelled(real(*a, **k)))
    s2, calls2 = remat.probe(m, chip, job, mesh)
    r2 = remat.solve_mesh(m, chip, job, mesh, Constraints())
    assert r2.cost.collectives[0].purpose.startswith("renamed") or r2.cost.collectives[0].purpose in (
        "weights bwd", "grads", "tokens", "activations")
    assert asdict(s2) == asdict(s1) and calls2 == calls1
    assert (r2.choice, r2.estimates, r2.brute_force, r2.resolves) == (r1.choice, r1.estimates, False, r1.resolves)
    assert r2.cost.step_time_s == r1.cost.step_time_s
