"""Dot-product (non-flash) attention: Job.attention, the runs column, its FLOPs, score traffic and memory."""

from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.estimate import estimate
from costmodel.flops import layer_ops, score_accesses
from costmodel.job import Job
from costmodel.memory import memory_terms
from costmodel.model import ModelSpec
from costmodel.plan import REMAT_POLICIES, Plan
from costmodel.published import load_cases
from hardware.catalog import load_hardware
from hardware.errors import InputError

M = ModelSpec("m", n_layers=4, d_model=512, n_heads=8, ffn_dim=2048, vocab_size=1000)
V5P = load_hardware("tpu-v5p")


def test_score_accesses_follow_flash_attention_algorithms_0_and_3():
    assert score_accesses("flash", 1.0) == 0.0
    assert score_accesses("dot_product", 0.0) == 4 + 7  # forward writes/reads S and P; backward 7
    assert score_accesses("dot_product", 1.0) == 4 + 7 + 4  # the scores are rerun with the layer


def test_dot_product_scores_every_pair_as_plain_matmuls():
    flash = {op.name: op for op in layer_ops(M, 1024, 1024, 2, 1, False)}
    dot = {op.name: op for op in layer_ops(M, 1024, 1024, 2, 1, False, "dot_product")}
    # causal flash: s/2 keys per query (mean_attended_keys); dot product: all s, QK^T and PV, 2 FLOPs a MAC
    assert flash["attention"].flops == pytest.approx(2 * 1024 * 512 * (512 + 512) / 2)
    assert dot["attention"].flops == pytest.approx(2 * 1024 * 1024 * (512 + 512) / 2)
    assert flash["attention"].is_attention and not dot["attention"].is_attention
    assert {k: v.flops for k, v in flash.items() if k != "attention"} == \
        {k: v.flops for k, v in dot.items() if k != "attention"}


def test_score_traffic_in_the_memory_bound_time_by_hand():
    job = Job(seq_len=1024, global_batch=8, framework="maxtext")
    plan = Plan(fsdp=8, remat=REMAT_POLICIES["none"])
    a = estimate(M, V5P, job, plan)
    b = estimate(M, V5P, replace(job, attention="dot_product"), plan)
    tokens = 1024  # one sequence per chip, one micro-step
    by_hand = M.n_layers * tokens * M.n_heads * 1024 * 11 * 2 / (V5P.hbm_bw_Bps * V5P.eff.hbm)
    assert b.time["memory_bound"] - a.time["memory_bound"] == pytest.approx(by_hand, rel=1e-9)
    assert b.step_time_s > a.step_time_s


def test_a_policy_keeping_the_context_reruns_the_scores():
    job = Job(seq_len=1024, global_batch=8, framework="maxtext", attention="dot_product")
    keep_ctx = Plan(fsdp=8, remat=REMAT_POLICIES["save_dot_with_context_except_mlp"])
    flash = estimate(M, V5P, replace(job, attention="flash"), keep_ctx)
    dot = estimate(M, V5P, job, keep_ctx)
    qk = 2 * 1024 * 1024 * 512  # QK^T of one sequence per layer, all pairs (tp 1)
    # hardware FLOPs = the model's + the recomputed: the rerun QK^T of every layer and sequence
    assert dot.hardware_flops_per_step - flash.hardware_flops_per_step == pytest.approx(M.n_layers * 8 * qk)
    assert dot.time["recompute"] > flash.time["recompute"]


def test_saved_probabilities_and_working_scores_in_memory():
    job = Job(seq_len=1024, global_batch=8, framework="maxtext")
    dot = replace(job, attention="dot_product")
    none, full = Plan(fsdp=8, remat=REMAT_POLICIES["none"]), Plan(fsdp=8, remat=REMAT_POLICIES["full"])
    p = M.n_heads * 1024 * 1024 * 2  # bf16 P of one sequence per layer

    def part(j: Job, plan: Plan, name: str) -> float:
        return memory_terms(M, V5P, j, plan, 1).breakdown[name]

    assert part(dot, none, "activations") - part(job, none, "activations") == pytest.approx(M.n_layers * p)
    assert part(dot, full, "activations") == part(job, full, "activations")
    assert part(dot, full, "activation_working") - part(job, full, "activation_working") == pytest.approx(3 * p)


def test_bad_attention_names_the_field():
    with pytest.raises(InputError, match="attention must be one of flash, dot_product, got 'sdpa'"):
        Job(seq_len=128, global_batch=1, attention="sdpa")


def test_runs_column(tmp_path):
    head = open("data/runs/axlearn.csv").readline().strip()
    assert head.endswith(",attention")
    cases, skipped = load_cases("data/runs/axlearn.csv")
    kinds = {c.id: c.job.attention for c in cases}
    assert kinds["axlearn-fuji-7B-v1-v4-512"] == "dot_product" and kinds["axlearn-fuji-70B-v2-v6e-256"] == "flash"
    rows = open("data/runs/axlearn.csv").read().splitlines()
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join([rows[0], rows[1].rsplit(",", 1)[0] + ",sdpa"]) + "\n")
    cases, skipped = load_cases(str(bad))
    assert not cases and len(skipped) == 1
    assert "attention: expected one of flash, dot_product or blank, got 'sdpa'" in str(skipped)
