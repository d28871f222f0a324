"""`suggest` searches Megatron-Core's --account-for-embedding/loss-in-pipeline-split (issue 29, item 1): under a
Megatron-Core framework each (pp, vpp) is tried with every flag setting Megatron's checks accept, one plan per
layout keeps the setting the cost model prefers, the pruned search agrees with the exhaustive one, and MaxText
(or DeepSpeed) never gets the flags. Layer counts hand-checked in the comments (docs/pipeline_split.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.catalog import load_model
from costmodel.estimate import estimate
from costmodel.job import Job
from costmodel.model import ModelSpec
from costmodel.plan import SPLIT_FLAGS, plan_split
from hardware.catalog import load_hardware
from planner.candidates import Constraints, Mesh, candidates, split_settings
from planner.export_megatron import megatron_constraints
from planner.remat import brute_force
from planner.solve import _lb0, search

PLANNER = str(Path(sys.executable).parent / "planner")
H100 = load_hardware("h100-sxm")
V5P = load_hardware("tpu-v5p")
L405 = load_model("llama3-405b")  # 126 layers
# 62 layers: over pp 4 x vpp 8 only with both flags (64 / 4 = 16 per rank, 2 per chunk: 15 / 16 / 15)
TINY62 = ModelSpec("tiny-62", n_layers=62, d_model=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256)
MEGATRON = Job(4096, 64, framework="megatron")


def suggest_json(*args: str) -> dict:
    p = subprocess.run([PLANNER, "suggest", *args, "--json"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_split_settings_hand_checked():
    job = Job(4096, 64, framework="megatron")
    # 8 x 8: no uneven split without the flags (c = 16: the end stages would need 14 of 8-multiples, first <= 16);
    # both flags: 128 / 8 = 16 per rank, 2 per chunk, end chunks 1 -> 15 / 16 / 15
    assert split_settings(L405, job, 8, 8) == ((1, 1),)
    # 16 x 2: Megatron's uneven split 8 / 8 / 6 (c = 8, end stages share 14), or both flags 7 / 8 / 7;
    # one flag leaves 127 layers, which 16 does not divide
    assert split_settings(L405, job, 16, 2) == ((0, 0), (1, 1))
    # pp 1: nothing to split
    assert split_settings(L405, job, 1, 1) == ((0, 0),)
    # an even split (80 / 2) keeps (0, 0); both flags give 82 / 2 = 41 per rank, 40 / 40 too
    assert split_settings(load_model("llama3-70b"), job, 2, 1) == ((0, 0), (1, 1))
    # frameworks that are not Megatron-Core never get the flags (DeepSpeed splits unevenly, MaxText only evenly)
    for fw in ("maxtext", "deepspeed", "pytorch-fsdp"):
        assert all(s == (0, 0) for pp, vpp in ((8, 8), (16, 2), (2, 1))
                   for s in split_settings(L405, replace(job, framework=fw), pp, vpp))
    assert split_settings(L405, replace(job, framework="nemo"), 8, 8) == ((1, 1),)


def test_405b_pp8_vpp8_found_with_both_flags():
    """Before: '--fix: ... vpp=8 binds'. Now the MLPerf layout, 15 / 16 / 15 layers, both flags in the JSON."""
    out = suggest_json("-m", "llama3-405b", "-n", "8192", "-H", "h100-sxm", "--framework", "megatron",
                       "--fix", "pp=8,vpp=8")
    assert out["plans"]
    for p in out["plans"]:
        q = p["plan"]
        assert (q["pp"], q["vpp"]) == (8, 8) and all(q.get(f) is True for f in SPLIT_FLAGS)
    q = out["plans"][0]["plan"]
    mesh = Mesh(q["dp"], q["fsdp"], q["tp"], q["cp"], q["pp"], q["ep"], q["vpp"], q["micro_batch"], q["zero"],
                q["slices"], (1, 1))
    assert plan_split(L405.n_layers, mesh.plan()) == (15, 16, 15)


def test_table_shows_the_flags():
    p = subprocess.run([PLANNER, "suggest", "-m", "llama3-405b", "-n", "8192", "-H", "h100-sxm", "--framework",
                        "megatron", "--fix", "pp=8,vpp=8", "-k", "1"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "split=emb+loss" in p.stdout and "--account-for-embedding/loss-in-pipeline-split" in p.stdout
    assert "15 / 16 / 15" in p.stdout  # the best plan's layers per stage


def test_even_split_gets_no_flags_when_they_do_not_help():
    """llama3-70b over pp 2: both flags give the same 40 / 40 layers and the same cost; the tie goes to no flags
    (the canonical mesh order), though the flagged meshes were candidates."""
    m = load_model("llama3-70b")
    cons = megatron_constraints(Constraints(fixed={"pp": 2}))
    meshes = list(candidates(m, H100, MEGATRON, 64, cons))
    assert {x.split for x in meshes} == {(0, 0), (1, 1)}
    flagged = next(x for x in meshes if x.split == (1, 1))
    assert estimate(m, H100, MEGATRON, flagged.plan()).step_time_s == \
        estimate(m, H100, MEGATRON, flagged.layout.plan()).step_time_s
    s = search(m, H100, MEGATRON, 64, cons, top=5)
    assert s.plans and all(r.mesh.split == (0, 0) for r in s.plans)


def test_one_plan_per_layout_with_its_best_flags():
    """Each listed plan's flags are the best of its layout's settings (brute force over each setting's remat
    choices), and no layout is listed twice."""
    cons = megatron_constraints(Constraints(fixed={"pp": 4}))
    s = search(TINY62, H100, MEGATRON, 16, cons, top=4)
    layouts = [r.mesh.layout for r in s.plans]
    assert len(set(layouts)) == len(layouts)
    assert any(r.mesh.split != (0, 0) for r in s.plans)
    for r in s.plans:
        times = [brute_force(TINY62, H100, MEGATRON, replace(r.mesh, split=sp), cons).cost
                 for sp in split_settings(TINY62, MEGATRON, r.mesh.pp, r.mesh.vpp)]
        assert r.cost.step_time_s == min(c.step_time_s for c in times if c is not None)


@pytest.mark.parametrize("cons", [megatron_constraints(Constraints(fixed={"pp": 4})), Constraints(fixed={"pp": 4})],
                         ids=["megatron-space", "any-remat"])
def test_search_matches_exhaustive_with_flags(cons):
    """62 layers over pp 4: the best plan is vpp 8 with both flags (only reachable with them); the pruned search,
    the exhaustive one and (in Megatron's space) brute force over every assignment agree."""
    fast = search(TINY62, H100, MEGATRON, 16, cons, top=3)
    full = search(TINY62, H100, MEGATRON, 16, cons, top=3, exhaustive=True)
    assert fast.stats.solved < full.stats.solved == full.stats.candidates
    assert [r.key() for r in fast.plans] == [r.key() for r in full.plans]
    best = fast.plans[0]
    assert (best.plan.vpp, best.mesh.split) == (8, (1, 1))
    assert plan_split(TINY62.n_layers, best.plan) == (15, 16, 15)


def test_lower_bound_cache_sees_the_split():
    """LB0 is cached per stage layout: with a shared cache every mesh gets the bound it gets alone. 62 layers over
    pp 4: 15 / 16 / 15 at vpp 1 (with or without both flags), 16 / 16 / 14 at vpp 2 without them; the last stage's
    logits (about 2.4 layers here) make it the slowest, so a cache keyed without vpp (as before) gave the vpp 2
    meshes the vpp 1 bound, above their step time's floor."""
    cons = megatron_constraints(Constraints(fixed={"pp": 4}))
    meshes = list(candidates(TINY62, H100, MEGATRON, 16, cons))
    assert {(x.vpp, x.split) for x in meshes} == {(1, (0, 0)), (1, (1, 1)), (2, (0, 0)), (2, (1, 1)), (4, (1, 1)),
                                                  (8, (1, 1))}
    shared: dict = {}
    for x in meshes:
        assert _lb0(TINY62, H100, MEGATRON, x, shared) == _lb0(TINY62, H100, MEGATRON, x, {})


def test_maxtext_never_gets_the_flags():
    out = suggest_json("-m", "llama3-405b", "-n", "1024", "-H", "tpu-v5p", "-k", "3")
    assert out["job"]["framework"] == "maxtext" and out["plans"]
    assert not any(p["plan"].get(f) for p in out["plans"] for f in SPLIT_FLAGS)
    job = Job(4096, 256)
    assert all(x.split == (0, 0) for x in candidates(L405, V5P, job, 256))


def test_saved_plan_exports_the_flags_to_megatron(tmp_path):
    """suggest --save keeps the flags; export --format megatron writes them (no uneven-split arguments)."""
    plan = tmp_path / "p.yaml"
    p = subprocess.run([PLANNER, "suggest", "-m", "llama3-405b", "-n", "8192", "-H", "h100-sxm", "--fix",
                        "pp=8,vpp=8", "-k", "1", "--save", str(plan)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    e = subprocess.run([PLANNER, "export", "--plan", str(plan), "--format", "megatron"], capture_output=True,
                       text=True)
    assert e.returncode == 0, e.stderr
    args = e.stdout.split()
    assert "--account-for-embedding-in-pipeline-split" in args and "--account-for-loss-in-pipeline-split" in args
    assert args[args.index("--num-virtual-stages-per-pipeline-rank") + 1] == "8"
    assert not any(a.startswith("--decoder-first-pipeline-num-layers") for a in args)
