"""planner.explain's 'planner's remat on the same mesh' keeps the plan's pipeline-split flags (Megatron-Core's
--account-for-embedding/loss-in-pipeline-split): 126 layers over pp 8 x vpp 8 split only with both flags."""

from __future__ import annotations

from costmodel.catalog import load_model
from costmodel.job import Job
from costmodel.plan import Plan, plan_split
from hardware.catalog import load_hardware
from planner.explain import best_remat_for_mesh


def test_best_remat_for_a_flagged_mesh_keeps_the_split():
    m, chip = load_model("llama3-405b"), load_hardware("h100-sxm")
    job = Job(8192, 1024, framework="megatron")
    plan = Plan(dp=16, tp=8, pp=8, vpp=8, micro_batch=1, zero=1, account_for_embedding_in_pipeline_split=True,
                account_for_loss_in_pipeline_split=True)
    assert plan_split(m.n_layers, plan) == (15, 16, 15)  # (126 + 2) / 8 = 16 per rank, end ranks one fewer
    best = best_remat_for_mesh(m, chip, job, plan)
    assert best is not None  # without the flags pp 8 x vpp 8 has no split, and nothing was solved
    assert best.split_accounting == (1, 1) and plan_split(m.n_layers, best) == (15, 16, 15)



def test_best_remat_solves_the_mesh_with_fp8_param_gather(monkeypatch):
    """The CP-SAT program sees the plan's fp8 parameters (2 B per GEMM weight instead of 4 B with TE's cache)."""
    import planner.remat as remat

    seen = []
    real = remat.solve_mesh
    monkeypatch.setattr(remat, "solve_mesh", lambda m, chip, job, mesh, cons: seen.append(mesh) or real(
        m, chip, job, mesh, cons))
    m, chip = load_model("llama3-70b"), load_hardware("h100-sxm")
    job = Job(8192, 256, precision="fp8", framework="megatron")
    plan = Plan(dp=8, tp=8, pp=1, micro_batch=1, zero=1, fp8_param_gather=True)
    assert best_remat_for_mesh(m, chip, job, plan) is not None
    assert [mesh.fp8_params for mesh in seen] == [True]
