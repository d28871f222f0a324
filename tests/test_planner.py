"""The auto-parallel planner: candidate rules, the CP-SAT remat/offload program against brute force, the pruned
search against the exhaustive one, infeasible jobs, and `planner suggest` on the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from costmodel.catalog import load_model
from costmodel.constraints import check_plan
from costmodel.estimate import dcn_split, estimate
from costmodel.job import Job
from costmodel.model import ModelSpec
from hardware.catalog import load_hardware
from hardware.errors import InputError
from planner.candidates import (
    Constraints,
    Mesh,
    candidates,
    check_chips,
    default_batch_for,
    default_global_batch,
    default_slices,
    parse_fix,
)
from planner.cpsat import Program
from planner.remat import all_choices, brute_force, probe, solve_mesh
from planner.solve import search

PLANNER = str(Path(sys.executable).parent / "planner")
LLAMA7 = load_model("llama2-7b")
SMALL_MOE = ModelSpec("small-moe", n_layers=8, d_model=2048, n_heads=16, n_kv_heads=4, ffn_dim=5632,
                      vocab_size=32000, n_experts=8, experts_per_token=2, moe_ffn_dim=1408)
A100 = load_hardware("a100-80gb")
A100_40 = load_hardware("a100-40gb")
V5P = load_hardware("tpu-v5p")
H100 = load_hardware("h100-sxm")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PLANNER, "suggest", *args], capture_output=True, text=True)


# ---- candidates ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("m,chip,chips,batch", [(LLAMA7, A100, 16, 64), (SMALL_MOE, V5P, 16, 32),
                                                (LLAMA7, V5P, 512, 512), (LLAMA7, H100, 64, 128)])
def test_every_candidate_satisfies_the_rules(m, chip, chips, batch):
    job = Job(4096, batch)
    meshes = list(candidates(m, chip, job, chips))
    assert meshes and len(set(meshes)) == len(meshes)
    for mesh in meshes:
        plan = mesh.plan()
        check_plan(m, chip, job, plan, chips)
        assert plan.chips == chips
        if chip.scale_up.kind == "torus":
            dcn_split(plan)  # only dp, pp, fsdp span slices
        else:
            assert 8 % (mesh.tp * mesh.cp) == 0  # tp and cp inside one NVLink node
        assert mesh.vpp == 1 or (mesh.pp > 1 and (batch // (mesh.batch_shards * mesh.micro_batch)) % mesh.pp == 0)
        assert mesh.zero in ((0, 1) if mesh.dp > 1 else (0,))
        assert m.is_moe or mesh.ep == 1


def test_multislice_candidates_span_slices_only_with_dp_pp_fsdp():
    m, job = load_model("1T"), Job(4096, 1152)
    assert default_slices(V5P, 18432) == 3  # 6144-chip slices, the largest v5p slice
    meshes = list(candidates(m, V5P, job, 18432))
    assert meshes and all(mesh.slices == 3 for mesh in meshes)
    for mesh in meshes:
        dcn = dcn_split(mesh.plan())
        assert dcn["dp"] * dcn["pp"] * dcn["fsdp"] == 3


def test_slices_and_chip_counts():
    assert default_slices(V5P, 1024) == 1
    assert default_slices(load_hardware("tpu-v5e"), 512) == 2
    assert default_slices(H100, 4096) == 1
    with pytest.raises(InputError, match="nearest valid chip counts: 92, 96, 100, 104"):
        check_chips(V5P, 97)
    with pytest.raises(InputError, match="whole nodes; nearest valid chip counts: 7, 8, 16, 24"):
        check_chips(H100, 12)
    with pytest.raises(InputError, match="positive"):
        check_chips(V5P, 0)
    with pytest.raises(InputError, match="maximum of 18432"):
        check_chips(V5P, 20000)


def test_default_global_batch_is_about_4m_tokens_and_divisible():
    assert default_global_batch(1024, 4096) == 1024
    assert default_global_batch(8, 4096) == 1024
    assert default_global_batch(18432, 4096) == 1152  # a multiple of 576 = 18432 / 32
    assert default_global_batch(1024, 2048, 8 * 2**20) == 4096


def test_default_batch_grows_when_no_plan_takes_it():
    m = load_model("llama3-405b")
    b, note = default_batch_for(m, H100, 16384, 4096, "bf16", "maxtext", Constraints())
    assert b == 2048 and "default 1024" in note  # MaxText pipelines need grad_accum divisible by pp
    b, note = default_batch_for(m, H100, 16384, 4096, "bf16", "megatron", Constraints())
    assert b == 1024 and note == ""
    # a batch the user asked for is never changed behind a note (issue 29): the error names the one that works
    with pytest.raises(InputError, match=r"1024 sequences .* no valid plan .* 2048 sequences \(8M tokens\)"):
        default_batch_for(m, H100, 16384, 4096, "bf16", "maxtext", Constraints(), tokens_per_batch=4 * 2**20)


def test_tokens_per_batch_shorthand():
    from cli.suggest_cmds import parse_tokens

    assert parse_tokens("4M") == 4 * 2**20 and parse_tokens("65536") == 65536 and parse_tokens(None) is None
    assert parse_tokens("1e9") == 10**9 and parse_tokens("2.5E6") == 2_500_000  # as --train-tokens accepts
    with pytest.raises(InputError, match="tokens-per-batch"):
        parse_tokens("lots")


def test_parse_fix():
    c = parse_fix("dp=2, tp=4, mb=2, remat=full, offload_optimizer=0", max_tp=8)
    assert c.fixed == {"dp": 2, "tp": 4, "micro_batch": 2}
    assert c.remat.name == "full" and c.offload_optimizer is False and c.max_tp == 8
    for bad, msg in (("foo=1", "unknown key 'foo'"), ("tp", "axis=value"), ("tp=x", "integer"),
                     ("zero=5", "0..3"), ("remat=nope", "remat policy")):
        with pytest.raises(InputError, match=msg):
            parse_fix(bad)


# ---- the inner program: CP-SAT over the probed surrogate vs brute force ------------------------------------------

INNER = [
    (LLAMA7, A100, Job(4096, 16, framework="megatron"), Mesh(2, 1, 2, 1, 2, 1, 2, 1, 1, 1)),  # pp + vpp
    (LLAMA7, A100, Job(4096, 16), Mesh(1, 8, 1, 1, 1, 1, 1, 2, 0, 1)),  # fsdp, maxtext
    (LLAMA7, A100_40, Job(4096, 8, framework="megatron"), Mesh(1, 1, 1, 1, 4, 1, 1, 2, 0, 1)),  # tight memory
    (load_model("llama2-13b"), V5P, Job(4096, 32), Mesh(8, 1, 1, 1, 2, 1, 2, 1, 0, 1)),  # first-stage peak
    (SMALL_MOE, V5P, Job(4096, 16), Mesh(1, 2, 2, 1, 1, 4, 1, 2, 0, 1)),  # MoE, ep
    (load_model("llama2-70b"), H100, Job(4096, 64, framework="megatron"), Mesh(2, 4, 2, 1, 2, 1, 1, 2, 0, 1)),
    # a MaxText pipeline under weight sharding: recompute hides part of the backward's weight re-gathers, never the
    # stage gradients' reduce-scatter after the loop (planner.remat.hideable; the surrogate had missed by 4 %)
    (load_model("mixtral-8x22b"), H100, Job(4096, 1024), Mesh(8, 2, 1, 2, 2, 8, 2, 2, 0, 1)),
]


@pytest.mark.parametrize("m,chip,job,mesh", INNER)
def test_cpsat_matches_brute_force_on_one_mesh(m, chip, job, mesh):
    cons = Constraints()
    s, _ = probe(m, chip, job, mesh)
    assert s.exact, s.mismatch  # the surrogate reproduces every probe
    fast = solve_mesh(m, chip, job, mesh, cons)
    ref = brute_force(m, chip, job, mesh, cons)
    # 2 * 3^5 tensor choices x optimizer/parameter offload (Megatron forbids optimizer offload without zero 1)
    assert ref.estimates == len(all_choices(cons.for_mesh(m, chip, job, mesh))) in (2 * 3**5 * 2, 2 * 3**5 * 4)
    assert (fast.cost is None) == (ref.cost is None)
    if ref.cost is not None:
        assert fast.cost.step_time_s == pytest.approx(ref.cost.step_time_s, rel=1e-9)
        assert fast.cost.fits and not fast.brute_force
        assert fast.estimates < 25


@pytest.mark.parametrize("m,job,mesh", [
    (load_model("llama3-70b"), Job(4096, 64), Mesh(1, 32, 2, 1, 1, 1, 1, 2, 0, 1)),  # tp: stack > gradients
    (load_model("llama3-8b"), Job(4096, 32), Mesh(1, 4, 2, 1, 1, 1, 1, 1, 0, 1)),  # tp: both branches
    (load_model("mixtral-8x22b"), Job(4096, 512), Mesh(1, 256, 1, 1, 1, 1, 1, 2, 0, 1)),
    (load_model("deepseek-v3-671b"), Job(4096, 1024), Mesh(1, 64, 4, 1, 1, 16, 1, 1, 0, 1)),  # MoE with ep, tp
])
def test_surrogate_is_exact_on_every_assignment(m, job, mesh):
    """Under MaxText the fit check is on the floor XLA compiles into (costmodel.memory.fit_floor_bytes: the
    larger of the logits and the layer loop's phase; under tp the loop's min(stack, gradient stack) buffer, not
    linear in the kept tensors), the sequence-parallel re-gather appears once anything is recomputed (kappa),
    and a MoE layer reruns its expert output matmul only with its expert input (mu): the surrogate models all of
    them, so memory and time are exact on every assignment, not just at its probes."""
    from planner.remat import evaluate

    cons = Constraints().for_mesh(m, V5P, job, mesh)
    s, _ = probe(m, V5P, job, mesh, cons=cons)
    assert s.xla_floor and s.exact and s.loop_G > 0
    branches = set()
    for ch in all_choices(cons):
        c = evaluate(m, V5P, job, mesh, ch)
        assert s.hbm(ch) == pytest.approx(c.fit_memory_bytes, rel=1e-9), ch
        assert s.time(ch) == pytest.approx(c.step_time_s, rel=1e-9), ch
        assert c.fit_memory_bytes < c.peak_memory_bytes
        loop = s.loop(ch)
        branches.add("G" if loop and loop == pytest.approx(s.loop_G) else "S" if loop else "-")
    # under tp: the gradient stack or the smaller checkpoint stack, nothing when nothing is rerun; without tp none
    assert branches == ({"-"} if mesh.tp == 1 else {"G", "-"} if m.n_layers == 80 or m.is_moe else {"G", "S", "-"})
    assert (s.mu > 0) == m.is_moe and (s.kappa > 0) == (mesh.tp > 1)
    fast, ref = solve_mesh(m, V5P, job, mesh, Constraints()), brute_force(m, V5P, job, mesh, Constraints())
    assert fast.cost.step_time_s == pytest.approx(ref.cost.step_time_s, rel=1e-9)


def test_pinned_remat_and_offload_are_respected():
    m, job, mesh = LLAMA7, Job(4096, 16), Mesh(1, 8, 1, 1, 1, 1, 1, 2, 0, 1)
    cons = parse_fix("remat=full,offload_params=1")
    r = solve_mesh(m, A100, job, mesh, cons)
    assert r.choice.remat.choices() == load_full().choices() and r.choice.offload_params
    ref = brute_force(m, A100, job, mesh, cons)
    assert r.cost.step_time_s == pytest.approx(ref.cost.step_time_s, rel=1e-9)


def load_full():
    from costmodel.plan import REMAT_POLICIES

    return REMAT_POLICIES["full"]


def test_program_is_deterministic_and_exact():
    p = Program()
    xs = [p.bool() for _ in range(6)]
    p.add([(x, 1) for x in xs], lb=3)
    p.add([(xs[0], 1), (xs[1], 1)], ub=1)
    p.minimize([(x, c) for x, c in zip(xs, (5, 1, 4, 2, 9, 3), strict=True)])
    a, b = p.solve(), p.solve()
    assert a == b and p.value(a) == 1 + 2 + 3
    p.add([(xs[0], 1)], lb=2)  # infeasible
    assert p.solve() is None


# ---- the outer search: pruned vs exhaustive ------------------------------------------------------------------------

SEARCHES = [
    (LLAMA7, A100, 8, Job(4096, 8, framework="megatron")),
    (LLAMA7, A100, 16, Job(4096, 16)),
    (LLAMA7, V5P, 8, Job(4096, 8)),
    (LLAMA7, V5P, 16, Job(4096, 16)),
    (SMALL_MOE, V5P, 8, Job(4096, 8)),
    (LLAMA7, A100_40, 4, Job(4096, 4, framework="megatron")),
    (SMALL_MOE, H100, 16, Job(1024, 64, framework="megatron")),  # ep meshes bounded by their all-to-alls first
]


@pytest.mark.parametrize("m,chip,chips,job", SEARCHES)
def test_search_matches_exhaustive(m, chip, chips, job):
    fast = search(m, chip, job, chips, top=3)
    full = search(m, chip, job, chips, top=3, exhaustive=True, brute=False)
    assert fast.plans and full.stats.solved == full.stats.candidates
    assert fast.stats.solved < full.stats.solved
    assert [r.cost.step_time_s for r in fast.plans] == pytest.approx([r.cost.step_time_s for r in full.plans],
                                                                     rel=1e-9)
    for r in fast.plans:  # every returned plan is valid, fits, and is what estimate() says
        check_plan(m, chip, job, r.plan, chips)
        cost = estimate(m, chip, job, r.plan, chips)
        assert cost.fits and cost.step_time_s == r.cost.step_time_s
    times = [r.cost.step_time_s for r in fast.plans]
    assert times == sorted(times)


def test_expert_exchange_floor_is_below_every_assignment():
    """The search's ep bound: the all-to-alls with nothing rerun, never more than what estimate() charges."""
    from costmodel.estimate import expert_exchange_floor_s

    job = Job(2048, 64)
    for mesh in (Mesh(2, 2, 1, 1, 1, 4, 1, 1, 0, 1), Mesh(1, 2, 2, 1, 2, 4, 1, 1, 0, 1)):
        accum = job.global_batch // (mesh.batch_shards * mesh.micro_batch)
        floor = expert_exchange_floor_s(SMALL_MOE, V5P, job, mesh.plan(), accum)
        assert floor > 0
        for ch in all_choices(Constraints())[::97]:
            cost = estimate(SMALL_MOE, V5P, job, mesh.plan(ch.remat, ch.offload_optimizer, ch.offload_params))
            assert floor <= cost.time["comm_ep"] * (1 + 1e-12)
    assert expert_exchange_floor_s(LLAMA7, V5P, job, Mesh(8, 1, 1, 1, 1, 1, 1, 1, 0, 1).plan(), 8) == 0.0


def test_fix_and_max_tp_constrain_the_search():
    s = search(LLAMA7, A100, Job(4096, 16), 16, parse_fix("tp=2,pp=2", max_tp=2))
    assert s.plans and all(r.plan.tp == 2 and r.plan.pp == 2 for r in s.plans)
    s = search(LLAMA7, A100, Job(4096, 16), 16, Constraints(max_tp=1))
    assert s.plans and all(r.plan.tp == 1 for r in s.plans)


def test_infeasible_job_is_explained():
    s = search(load_model("1T"), V5P, Job(4096, 1024), 64)
    assert not s.plans and s.infeasible is not None
    assert "no plan fits" in s.infeasible.reason and "GiB" in s.infeasible.reason
    # The suggested chip count is larger and really fits.
    tip = next(t for t in s.infeasible.suggestions if "--chips" in t)
    more = int(tip.split("--chips ")[1].split()[0])
    assert more > 64 and search(load_model("1T"), V5P, Job(4096, 1024), more).plans


def test_infeasible_tip_smaller_global_batch_really_fits():
    # Mixtral 8x7B on 8 v5p at 4096 sequences under MaxText: the gradient accumulation (an fp32 accumulator and a
    # parameter copy beside the gradients) or the pipeline (logits for the whole batch) does not fit. The tip
    # names the largest halved global batch that does, and a search at that batch finds a fitting plan.
    mixtral = load_model("mixtral-8x7b")
    s = search(mixtral, V5P, Job(4096, 4096), 8)
    assert not s.plans
    tip = next(t for t in s.infeasible.suggestions if "smaller global batch" in t)
    b = int(tip.split("--global-batch ")[1].split()[0])
    assert b < 4096 and 4096 % b == 0
    fits = search(mixtral, V5P, Job(4096, b), 8, top=1)
    assert fits.plans and fits.plans[0].cost.fits
    assert not search(mixtral, V5P, Job(4096, 2 * b), 8, top=1).plans  # and it is the largest such halving


def test_infeasible_tip_more_chips_really_fits():
    # Mixtral 8x7B on 8 H100 under MaxText: its 47 B parameters' state does not fit 8 GPUs at any batch (MaxText
    # brings an offloaded optimizer state back for the update); the tip names more chips, where a plan fits.
    mixtral = load_model("mixtral-8x7b")
    s = search(mixtral, H100, Job(4096, 1024), 8)
    assert not s.plans and "more chips: --chips 16 (2x) fits" in s.infeasible.suggestions
    fits = search(mixtral, H100, Job(4096, 1024), 16, top=1)
    assert fits.plans and fits.plans[0].cost.fits


def test_batch_too_small_is_an_input_error():
    with pytest.raises(InputError, match="too small"):
        search(LLAMA7, H100, Job(4096, 4), 2048)  # one sequence spans at most tp8 * pp32 = 256 GPUs
    with pytest.raises(InputError, match="nearest usable global batches"):
        search(load_model("1T"), V5P, Job(4096, 100), 1024)


# ---- the command line ---------------------------------------------------------------------------------------------

def test_suggest_json_is_deterministic_and_complete():
    args = ("--model", "llama2-7b", "--chips", "8", "--hardware", "a100-80gb", "--global-batch", "16", "--json")
    a, b = cli(*args), cli(*args)
    assert a.returncode == 0 and a.stdout == b.stdout
    out = json.loads(a.stdout)
    assert out["model"] == "llama2-7b" and out["hardware"] == "a100-80gb" and out["chips"] == 8
    assert out["job"]["global_batch"] == 16 and len(out["plans"]) == 5
    p = out["plans"][0]
    for key in ("degrees", "micro_batch", "remat", "offload_optimizer", "offload_params", "step_time_s", "mfu",
                "tokens_per_s", "peak_memory_bytes", "fit_memory_bytes", "fits", "plan"):
        assert key in p
    assert p["fits"] and p["rank"] == 1
    assert p["fit_memory_bytes"] <= p["hbm_usable_bytes"] and p["fit_memory_bytes"] <= p["peak_memory_bytes"]


def test_maxtext_suggestions_fit_the_floor_not_the_total():
    """llama3-70b at 8k on 64 v6e: the best plans' MaxText totals are over the usable HBM, the floor XLA compiles
    into (costmodel.memory.fit_floor_bytes) is under it; the table shows what the fit check reads."""
    r = cli("--model", "llama3-70b", "--chips", "64", "--hardware", "tpu-v6e", "--seq-len", "8192", "--top", "2",
            "--json")
    plans = json.loads(r.stdout)["plans"]
    assert r.returncode == 0 and len(plans) == 2
    for p in plans:
        assert p["fits"] and p["fit_memory_bytes"] <= p["hbm_usable_bytes"] < p["peak_memory_bytes"]
    table = cli("--model", "llama3-70b", "--chips", "64", "--hardware", "tpu-v6e", "--seq-len", "8192", "--top", "1")
    gib = plans[0]["fit_memory_bytes"] / 2**30
    usable = plans[0]["hbm_usable_bytes"] / 2**30
    assert "GiB need/usable" in table.stdout and f"{gib:.1f}/{usable:.1f}" in table.stdout
    assert "least memory XLA needs" in table.stdout


def test_suggest_tables_and_infeasible_exit_1(tmp_path):
    r = cli("--model", "llama2-7b", "--chips", "8", "--hardware", "a100-80gb", "--top", "2")
    assert r.returncode == 0 and "top 2 plans" in r.stdout and "step time breakdown" in r.stdout
    assert "why #1" in r.stdout
    # Nothing fits: the full answer (reason, suggestions) still prints, but the exit code is 1 and no plan file
    # is written, so that `suggest --save p.yaml && planner export p.yaml` stops here.
    saved = tmp_path / "p.yaml"
    r = cli("--model", "1T", "--chips", "64", "--json", "--save", str(saved))
    assert r.returncode == 1 and not saved.exists()
    out = json.loads(r.stdout)
    assert out["plans"] == [] and out["infeasible"]["suggestions"]
    r = cli("--model", "1T", "--chips", "64")
    assert r.returncode == 1 and "no plan fits" in r.stdout and "GiB" in r.stdout


@pytest.mark.parametrize("args,msg", [
    (("--model", "1T", "--chips", "0"), "--chips"),
    (("--model", "1T", "--chips", "-8"), "--chips"),
    (("--model", "1T", "--chips", "97"), "nearest valid chip counts"),
    (("--model", "llama2-7b", "--chips", "2048", "--hardware", "h100-sxm", "--global-batch", "4"), "too small"),
    (("--model", "llama2-7b", "--chips", "8", "--fix", "bogus=1"), "unknown key"),
    (("--model", "llama2-7b", "--chips", "16", "--slices", "3"), "--slices"),
])
def test_bad_input_exits_2_with_one_line(args, msg):
    r = cli(*args)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and msg in lines[0]


def test_suggest_save_and_export(tmp_path):
    plan_file, cfg = tmp_path / "best.yaml", tmp_path / "maxtext.yml"
    r = cli("--model", "llama2-7b", "--chips", "8", "--global-batch", "16", "--top", "1", "--save", str(plan_file),
            "--export", "maxtext", "--out", str(cfg))
    assert r.returncode == 0, r.stderr
    from planner.planfile import load_plan

    pf = load_plan(plan_file)
    assert pf.chips == 8 and pf.job.global_batch == 16 and cfg.read_text().strip()


def test_suggest_export_megatron_searches_only_what_megatron_runs(tmp_path):
    # The maxtext-convention search picks fsdp and per-tensor remat/offload for llama3-70b on 64 H100, which
    # Megatron-LM cannot express (export would fall back to full recompute, 105 GiB: does not fit). With
    # --export megatron the search keeps to Megatron's space, so the exported plan is the costed plan.
    plan_file, args_file = tmp_path / "best.yaml", tmp_path / "megatron.sh"
    r = cli("--model", "llama3-70b", "--chips", "64", "--hardware", "h100-sxm", "--top", "3", "--json",
            "--save", str(plan_file), "--export", "megatron", "--out", str(args_file))
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr  # nothing had to be converted
    out = json.loads(r.stdout)
    assert out["job"]["framework"] == "megatron" and "remat in full|selective|none" in out["constraints"]
    for p in out["plans"]:
        assert p["degrees"]["fsdp"] == 1 and p["plan"]["remat"] in ("full", "selective", "none")
        assert not p["offload_params"] and p["plan"]["zero"] in (0, 1) and p["fits"]
    from planner.export_megatron import megatron_plan
    from planner.planfile import load_plan

    pf = load_plan(plan_file)
    assert megatron_plan(pf).plan == pf.plan and megatron_plan(pf).notes == ()
    text = args_file.read_text()
    assert f"--tensor-model-parallel-size {pf.plan.tp}" in text and f"--micro-batch-size {pf.plan.micro_batch}" in text


def test_megatron_constraints_search_matches_brute_force():
    from planner.export_megatron import megatron_constraints
    from planner.remat import all_choices, min_memory_choice

    cons = megatron_constraints(Constraints())
    # 3 policies x optimizer offload on/off, parameters on the GPU; the least-memory one is full recompute
    assert len(all_choices(cons)) == 6 and min_memory_choice(cons).remat.name == "full"
    job = Job(4096, 64, framework="megatron")
    fast = search(LLAMA7, H100, job, 16, cons, top=3)
    brute = search(LLAMA7, H100, job, 16, cons, top=3, exhaustive=True, brute=True)
    assert [r.cost.step_time_s for r in fast.plans] == [r.cost.step_time_s for r in brute.plans]
    assert all(r.plan.fsdp == 1 and r.plan.remat.name in ("full", "selective", "none") for r in fast.plans)


@pytest.mark.parametrize("args,msg", [
    (("--fix", "fsdp=2"), "--fix fsdp=2: Megatron-LM has no fully-sharded axis"),
    (("--fix", "remat=save_qkv_proj"), "--fix remat=save_qkv_proj: Megatron-LM recomputes"),
    (("--fix", "offload_params=1"), "--fix offload_params=1"),
    (("--fix", "zero=3"), "--fix zero=3"),
    (("--framework", "maxtext"), "--framework maxtext: --export megatron searches under megatron's conventions"),
    (("--precision", "int8"), "--precision int8"),
])
def test_suggest_export_megatron_bad_pins_exit_2(args, msg):
    r = cli("--model", "llama2-7b", "--chips", "8", "--hardware", "h100-sxm", "--export", "megatron", *args)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and msg in lines[0]


def test_suggest_export_megatron_infeasible_tips_keep_megatron_limits(tmp_path):
    # Nothing Megatron runs fits llama3-70b on 8 H100: the reason names the framework's limits, the tips are
    # checked under them (the chip count it names has a Megatron plan), and Megatron's own limits (fsdp=1, ...)
    # are not offered as pins to drop.
    r = cli("--model", "llama3-70b", "--chips", "8", "--hardware", "h100-sxm", "--export", "megatron", "--json",
            "--out", str(tmp_path / "args.sh"))
    assert r.returncode == 1
    inf = json.loads(r.stdout)["infeasible"]
    assert "framework's remat policies" in inf["reason"]
    assert not any("drop --fix" in t for t in inf["suggestions"])
    tip = next(t for t in inf["suggestions"] if "--chips" in t)
    more = tip.split("--chips ")[1].split()[0]
    r = cli("--model", "llama3-70b", "--chips", more, "--hardware", "h100-sxm", "--export", "megatron", "--json",
            "--out", str(tmp_path / "args.sh"), "--top", "1")
    assert r.returncode == 0 and json.loads(r.stdout)["plans"][0]["degrees"]["fsdp"] == 1


def test_infeasibility_hints_keep_the_jobs_settings(monkeypatch):
    """The 'what would fit' hints re-cost the job with more chips, shorter sequences or a smaller batch: MaxText's
    weight_dtype and scan_layers must travel with it (they change the memory)."""
    import planner.solve as solve

    seen = []
    monkeypatch.setattr(solve, "_any_fits", lambda m, chip, job, n, cons: seen.append(job))
    job = Job(4096, 64, weight_dtype="bfloat16", scan_layers=False)
    solve.explain_infeasible(load_model("llama3-70b"), load_hardware("tpu-v5e"), job, 8, Constraints(), 1e12, None)
    assert seen and all(j.weight_dtype == "bfloat16" and not j.scan_layers for j in seen)
    assert {j.seq_len for j in seen} == {4096, 2048}


def test_fix_on_an_impossible_degree_names_the_allowed_values():
    from planner.candidates import explain_no_candidates

    m = load_model("llama3-8b")  # 32 heads, 8 KV heads
    err = explain_no_candidates(m, V5P, Job(4096, 1024), 64, Constraints(fixed={"tp": 3}))
    assert "satisfies tp=3" in str(err) and "(here tp is one of 1, 2, 4, 8, 16, 32)" in str(err)
    assert "tp=3 binds (nearest that exists: tp=2)" in str(err)
    err = explain_no_candidates(m, V5P, Job(4096, 1024), 64, Constraints(fixed={"ep": 4}))
    assert "(here ep is one of 1)" in str(err)  # a dense model has no expert axis
