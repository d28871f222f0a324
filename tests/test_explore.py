"""explain / sweep / plot: what-if logic, bottleneck naming, sweep grammar and rows, figures, CLI exit codes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from costmodel.catalog import load_model
from costmodel.estimate import estimate
from costmodel.job import Job
from costmodel.plan import REMAT_POLICIES, Plan
from hardware.catalog import load_hardware
from hardware.errors import InputError
from planner import explain as ex
from planner import sweep as sw

ROOT = Path(__file__).resolve().parents[1]
PLANNER = str(Path(sys.executable).parent / "planner")

M70 = load_model("llama3-70b")
V5P = load_hardware("tpu-v5p")
H100 = load_hardware("h100-sxm")
JOB = Job(seq_len=4096, global_batch=256)


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run([PLANNER, *args], capture_output=True, text=True, cwd=cwd or ROOT, env=env, timeout=600)


# ---- explain ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base() -> ex.Explanation:
    return ex.explain(M70, V5P, JOB, Plan(fsdp=64), 64)


def test_waterfall_sums_to_step_and_compute_groups_sum_to_compute(base):
    total = sum(t.seconds for t in base.waterfall)
    assert math.isclose(total, base.cost.step_time_s, rel_tol=1e-9)
    compute = sum(t.seconds for t in base.waterfall if t.key == "compute")
    assert math.isclose(compute, base.cost.time["compute"], rel_tol=1e-9)
    labels = [t.label for t in base.waterfall if t.key == "compute"]
    assert labels[0] == "MLP matmuls" and "attention core" in labels and "logits matmul" in labels
    # Bars are consecutive: each starts where the previous ended.
    for a, b in zip(base.waterfall, base.waterfall[1:], strict=False):
        assert math.isclose(b.start_s, a.start_s + a.seconds, rel_tol=1e-9)


def test_compute_groups_match_the_cost_model_before_scaling():
    groups = ex.compute_by_group(M70, V5P, JOB, Plan(fsdp=64), 4)
    cost = estimate(M70, V5P, JOB, Plan(fsdp=64), 64)
    assert math.isclose(sum(groups.values()), cost.time["compute"], rel_tol=1e-6)


def test_bottleneck_names_the_largest_time_term(base):
    assert base.bottleneck.term == max(base.cost.time, key=base.cost.time.get) == "compute"
    assert base.bottleneck.sentence.startswith("Compute-bound")
    rest = {k: v for k, v in base.cost.time.items() if k != "compute"}
    assert base.bottleneck.overhead_term == max(rest, key=rest.get) == "recompute"
    assert "recomputation" in base.bottleneck.sentence


def test_bottleneck_for_exposed_fsdp_over_the_network():
    job = Job(seq_len=4096, global_batch=512)
    e = ex.explain(load_model("llama3-405b"), H100, job, Plan(fsdp=64, tp=8), 512, with_what_ifs=False)
    top = max(e.cost.time, key=e.cost.time.get)
    assert e.bottleneck.term == top == "comm_fsdp"
    s = e.bottleneck.sentence
    assert s.startswith("Exposed FSDP") and "InfiniBand" in s and f"{e.bottleneck.share * 100:.0f}%" in s
    # The waterfall splits that axis by level.
    assert any(t.label == "fsdp comm (InfiniBand)" for t in e.waterfall)


def test_bottleneck_of_a_plan_that_does_not_fit():
    e = ex.explain(M70, V5P, Job(seq_len=4096, global_batch=32), Plan(fsdp=8, remat=REMAT_POLICIES["none"]), 8,
                   with_what_ifs=False)
    assert not e.cost.fits
    assert e.bottleneck.term == "memory" and e.bottleneck.sentence.startswith("Does not fit")


def _by_label(e: ex.Explanation) -> dict[str, ex.WhatIf]:
    return {w.label: w for w in e.what_ifs}


def test_what_if_tp_x2_has_the_expected_degrees(base):
    w = _by_label(base)["tp x2, fsdp /2"]
    assert (w.plan.tp, w.plan.fsdp, w.chips) == (2, 32, 64)
    assert w.cost is not None
    assert math.isclose(w.delta_pct, (w.cost.step_time_s / base.cost.step_time_s - 1) * 100)


def test_what_ifs_cover_the_nearest_changes(base):
    by = _by_label(base)
    assert by["micro-batch x2"].plan.micro_batch == 2
    assert by["remat save_qkv_proj (lighter)"].plan.remat.name == "save_qkv_proj"
    assert by["offload optimizer to host"].plan.offload_optimizer
    assert by["pp x2, fsdp /2"].plan.pp == 2
    more = next(w for w in base.what_ifs if w.label.startswith("+1 slice"))
    assert (more.plan.slices, more.plan.dp, more.chips) == (2, 2, 128)
    assert not any(w.label.startswith("tp /2") for w in base.what_ifs)  # tp is 1 already


def test_what_ifs_that_break_rules_are_skipped_with_the_reason():
    # 80 layers: pp 16 -> 32 does not divide them; 64 heads: tp 64 -> 128 does not either.
    plan = Plan(fsdp=2, tp=64, pp=16)
    e = ex.explain(M70, V5P, Job(seq_len=4096, global_batch=64), plan, 2048)
    by = _by_label(e)
    assert by["pp x2, fsdp /2"].cost is None and "n_layers" in by["pp x2, fsdp /2"].error
    assert by["tp x2, fsdp /2"].cost is None and "n_heads" in by["tp x2, fsdp /2"].error
    d = e.to_dict()
    assert {w["label"] for w in d["skipped_what_ifs"]} >= {"pp x2, fsdp /2", "tp x2, fsdp /2"}
    assert all("step_time_s" in w for w in d["what_ifs"])


def test_planner_what_if_keeps_the_mesh_and_is_at_least_as_fast_as_the_ladder(base):
    w = _by_label(base)[ex.PLANNER_WHAT_IF]
    assert w.cost is not None and w.cost.fits and w.detail
    assert (w.plan.degrees(), w.plan.micro_batch, w.chips) == (base.plan.degrees(), base.plan.micro_batch, 64)
    ladder = [x for x in base.costed_what_ifs if x.label.startswith("remat") and x.cost.fits]
    assert all(w.cost.step_time_s <= x.cost.step_time_s * (1 + 1e-9) for x in ladder)
    assert ex.PLANNER_WHAT_IF not in _by_label(ex.explain(M70, V5P, JOB, Plan(fsdp=64), 64, with_planner=False))


def test_best_what_if_stays_on_the_same_chips(base):
    best = base.best_what_if
    assert best is not None and best.chips == 64 and best.cost.fits
    assert best.cost.step_time_s < base.cost.step_time_s


@pytest.mark.parametrize("policy, framework, lighter, heavier", [
    ("full", "maxtext", "save_qkv_proj", None),
    ("save_qkv_proj", "maxtext", "minimal", "full"),
    ("minimal", "maxtext", "none", "save_qkv_proj"),
    ("none", "maxtext", None, "minimal"),
    ("selective", "megatron", "none", "save_qkv_proj"),
    ("minimal", "megatron", "none", "save_qkv_proj"),  # off the megatron ladder: placed by its remat count
    ("save_out_proj", "maxtext", "minimal", "full"),
])
def test_remat_ladder(policy, framework, lighter, heavier):
    job = Job(seq_len=4096, global_batch=8, framework=framework)
    assert ex.remat_neighbours(REMAT_POLICIES[policy], job) == (lighter, heavier)


def test_gpu_what_if_doubles_chips_and_the_explanation_is_json_ready():
    e = ex.explain(load_model("llama3-8b"), H100, Job(seq_len=4096, global_batch=64), Plan(fsdp=8), 8)
    more = next(w for w in e.what_ifs if w.label.startswith("2x chips"))
    assert (more.plan.dp, more.chips) == (2, 16)
    json.dumps(e.to_dict())


def test_invalid_base_plan_raises_input_error():
    with pytest.raises(InputError):
        ex.explain(M70, V5P, JOB, Plan(fsdp=64), 128)


# ---- sweep grammar ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, var, values", [
    ("chips=256,512,1024", "chips", (256, 512, 1024)),
    ("chips=256:8192:x2", "chips", (256, 512, 1024, 2048, 4096, 8192)),
    ("chips=256:1000:x2", "chips", (256, 512)),
    ("seq_len=2048:32768:x2", "seq_len", (2048, 4096, 8192, 16384, 32768)),
    ("global-batch=512:2048:+512", "global_batch", (512, 1024, 1536, 2048)),
    ("batch=512:512:x2", "global_batch", (512,)),
    ("model=8B,llama3-70b", "model", ("8B", "llama3-70b")),
    ("hardware=tpu-v5p, h100-sxm", "hardware", ("tpu-v5p", "h100-sxm")),
])
def test_parse_vary(text, var, values):
    axis = sw.parse_vary(text)
    assert (axis.name, axis.values) == (var, values)


@pytest.mark.parametrize("text, words", [
    ("chips=", "no values"),
    ("chips=1024:256:x2", "inverted"),
    ("chips=256:1024:x1", "greater than 1"),
    ("chips=8:1000000:x1.0001", "more than the 2000 points a sweep takes"),  # was cut off silently at 8, 9
    ("chips=256:1024", "start:stop"),
    ("chips=256,,512", "empty item"),
    ("chips=0,256", "positive"),
    ("chips=abc", "not a number"),
    ("chipz=256", "unknown variable 'chipz' (did you mean 'chips'?)"),
    ("chips", "VARIABLE=VALUES"),
    ("model=", "list of names"),
    ("hardware=tpu-v9", "unknown hardware"),
])
def test_parse_vary_errors(text, words):
    with pytest.raises(InputError, match=None) as err:
        sw.parse_vary(text)
    assert words in str(err.value)
    assert "\n" not in str(err.value)


def test_check_axes():
    base = sw.SweepBase(model="8B", chips=8)
    with pytest.raises(InputError, match="--chips"):
        sw.points(sw.SweepBase(model="8B"), [sw.parse_vary("seq_len=1024,2048")])
    with pytest.raises(InputError, match="--model"):
        sw.points(sw.SweepBase(chips=8), [sw.parse_vary("seq_len=1024,2048")])
    with pytest.raises(InputError, match="twice"):
        sw.points(base, [sw.parse_vary("chips=8"), sw.parse_vary("chips=16")])
    with pytest.raises(InputError, match="at most two"):
        sw.points(base, [sw.parse_vary("chips=8"), sw.parse_vary("seq_len=8"), sw.parse_vary("batch=8")])
    pts = sw.points(sw.SweepBase(model="8B"), [sw.parse_vary("chips=8,16"), sw.parse_vary("batch=32,64,96")])
    assert len(pts) == 6 and pts[1]["chips"] == 8 and pts[1]["global_batch"] == 64


# ---- sweep runs (with a stand-in search, so these tests do not depend on the planner's) ---------------------

def fsdp_search(m, chip, chips, job):
    """Stand-in search: pure FSDP over all chips, micro-batch 1 (InputError when the batch does not divide)."""
    plan = Plan(fsdp=chips)
    return plan, estimate(m, chip, job, plan, chips)


def nothing_fits(m, chip, chips, job):
    return None


def test_run_sweep_rows_and_infeasible_points():
    base = sw.SweepBase(model="llama3-8b", hardware="tpu-v5p", global_batch=80)
    rows = sw.run_sweep(base, [sw.parse_vary("chips=16,32")], fsdp_search)
    assert [r["chips"] for r in rows] == [16, 32]
    ok, bad = rows
    assert ok["feasible"] and ok["fsdp"] == 16 and ok["step_time_s"] > 0 and 0 < ok["mfu"] < 1
    assert ok["headroom_gib"] == pytest.approx(ok["usable_gib"] - ok["fit_memory_gib"])
    assert ok["fit_memory_gib"] <= ok["peak_memory_gib"]  # MaxText: the fit floor (costmodel.memory)
    assert not bad["feasible"] and "global_batch" in bad["reason"] and "step_time_s" not in bad
    rows = sw.run_sweep(base, [sw.parse_vary("chips=16")], nothing_fits)
    assert rows[0]["reason"] == "no plan fits in memory"
    # No global batch: the planner's default for each point (about 4M tokens).
    rows = sw.run_sweep(sw.SweepBase(model="llama3-8b", seq_len=4096), [sw.parse_vary("chips=16,32")], fsdp_search)
    assert [r["global_batch"] for r in rows] == [1024, 1024] and all(r["feasible"] for r in rows)


def test_parallel_sweep_matches_serial():
    base = sw.SweepBase(model="llama3-8b", hardware="tpu-v5p", seq_len=2048)
    axes = [sw.parse_vary("chips=8,16,32"), sw.parse_vary("global_batch=32,64,128")]
    seen = []
    par = sw.run_sweep(base, axes, fsdp_search, workers=2, on_done=lambda d, n: seen.append((d, n)))
    ser = sw.run_sweep(base, axes, fsdp_search, workers=1)
    strip = [{k: v for k, v in r.items() if k != "search_s"} for r in par]
    assert strip == [{k: v for k, v in r.items() if k != "search_s"} for r in ser]
    assert seen[-1] == (9, 9)


def test_write_table(tmp_path):
    pd = pytest.importorskip("pandas")
    base = sw.SweepBase(model="llama3-8b", global_batch=64)
    rows = sw.run_sweep(base, [sw.parse_vary("chips=8,16,48")], fsdp_search)
    path = sw.write_table(rows, tmp_path / "s.csv")
    df = pd.read_csv(path)
    assert list(df["chips"]) == [8, 16, 48] and list(df["feasible"]) == [True, True, False]
    with pytest.raises(InputError, match="does not exist"):
        sw.check_table_path(tmp_path / "nope" / "s.csv")
    with pytest.raises(InputError, match=r"\.csv or \.parquet"):
        sw.check_table_path(tmp_path / "s.xlsx")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        with pytest.raises(InputError, match="pyarrow"):
            sw.check_table_path(tmp_path / "s.parquet")


# ---- figures ----------------------------------------------------------------------------------------------

def test_plot_explanation_and_sweep(tmp_path, base):
    pytest.importorskip("matplotlib")
    from planner.plots import check_figure_path, plot_explanation, plot_sweep

    for ext in ("png", "svg"):
        p = plot_explanation(base, tmp_path / f"plan.{ext}")
        assert p.stat().st_size > 1000
    rows = sw.run_sweep(sw.SweepBase(model="llama3-8b", global_batch=64), [sw.parse_vary("chips=8,16,48")],
                        fsdp_search)
    assert plot_sweep(rows, "chips", None, tmp_path / "sweep.png").stat().st_size > 1000
    with pytest.raises(InputError, match="does not exist"):
        check_figure_path(tmp_path / "missing" / "a.png")
    with pytest.raises(InputError, match="extension"):
        check_figure_path(tmp_path / "a.jpg")


# ---- the command line -------------------------------------------------------------------------------------

EXPLAIN = ["--model", "llama3-70b", "--hardware", "tpu-v5p", "--chips", "64", "--global-batch", "256",
           "--fsdp", "64"]


def test_cli_explain_text_and_json():
    r = run_cli("explain", *EXPLAIN)
    assert r.returncode == 0, r.stderr
    assert "Bottleneck:" in r.stdout and "what if" in r.stdout and "MLP matmuls" in r.stdout
    r = run_cli("explain", *EXPLAIN, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["bottleneck"]["term"] == "compute" and d["chips"] == 64
    assert any(w["label"] == "tp x2, fsdp /2" and w["plan"]["tp"] == 2 for w in d["what_ifs"])
    assert math.isclose(sum(t["seconds"] for t in d["waterfall"]), d["step_time_s"], rel_tol=1e-9)


def test_cli_explain_takes_estimates_vocab_tiles_and_weight_dtype():
    """explain costs the same plan as estimate, with MaxText's vocab tiling and bf16 weights too."""
    args = ["--model", "llama3-8b", "--chips", "8", "--global-batch", "8", "--fsdp", "8"]
    extra = ["--vocab-tiles", "4", "--weight-dtype", "bfloat16"]
    est = json.loads(run_cli("estimate", *args, *extra, "--json").stdout)
    r = run_cli("explain", *args, *extra, "--json", "--no-what-ifs")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["cost"]["peak_memory_bytes"] == est["peak_memory_bytes"]
    plain = json.loads(run_cli("explain", *args, "--json", "--no-what-ifs").stdout)
    assert plain["cost"]["peak_memory_bytes"] > est["peak_memory_bytes"]  # fp32 weights, whole logits
    bad = run_cli("explain", *args, "--vocab-tiles", "0")
    assert bad.returncode == 2 and "--vocab-tiles" in bad.stderr


def test_cli_plot(tmp_path):
    r = run_cli("plot", *EXPLAIN, "--out", str(tmp_path / "p.svg"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "p.svg").stat().st_size > 1000


@pytest.mark.parametrize("args, words", [
    (["explain", "--model", "llama3-70b", "--chips", "64"], "--global-batch"),
    (["explain", *EXPLAIN[:-1], "48"], "degrees"),
    (["plot", *EXPLAIN, "--out", "/nonexistent-dir/p.png"], "does not exist"),
    (["plot", *EXPLAIN, "--out", "p.gif"], "must end in"),
    (["sweep", "--model", "8B", "--global-batch", "64", "--vary", "chips="], "no values"),
    (["sweep", "--model", "8B", "--global-batch", "64", "--vary", "chips=1024:256:x2"], "inverted"),
    (["sweep", "--model", "8B", "--global-batch", "64", "--vary", "flops=1,2"], "unknown variable"),
    (["sweep", "--model", "8B", "--global-batch", "64", "--vary", "chips=8,16", "--plot", "/nonexistent-dir/s.png"],
     "does not exist"),
    (["sweep", "--model", "8B", "--global-batch", "64", "--vary", "chips=8,16", "--out", "/nonexistent-dir/s.csv"],
     "does not exist"),
    (["sweep", "--model", "8B", "--vary", "seq_len=1024,2048"], "--chips"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args, words):
    r = run_cli(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], r.stderr


def test_cli_sweep_with_the_planner_search(tmp_path):
    pytest.importorskip("planner.solve")
    out, fig = tmp_path / "s.csv", tmp_path / "s.png"
    r = run_cli("sweep", "--model", "llama3-8b", "--hardware", "tpu-v5p", "--vary", "chips=8,12",
                "--vary", "seq_len=2048,4096", "--global-batch", "32", "--out", str(out), "--plot", str(fig), "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert [(x["chips"], x["seq_len"]) for x in rows] == [(8, 2048), (8, 4096), (12, 2048), (12, 4096)]
    assert all(x["feasible"] for x in rows[:2]) and all(x["dp"] * x["fsdp"] * x["tp"] * x["cp"] * x["pp"] * x["ep"]
                                                         == 8 for x in rows[:2])
    # 12 chips: v5p cannot form that slice; the rows say so instead of failing the sweep.
    assert not any(x["feasible"] for x in rows[2:]) and all("12" in x["reason"] for x in rows[2:])
    assert out.read_text().count("\n") == 5 and fig.stat().st_size > 1000
