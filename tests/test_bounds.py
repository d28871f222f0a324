"""Bounded work and consistent exit codes (issue 31, items 3 and 6): every count the user gives has a stated upper
bound checked before any work (one `error:` line, exit 2), a valid job that no plan fits exits 1 on every command,
and repeated or contradictory options are errors naming both. Loops over a count are closed forms, compared here
with the loops they replaced on small counts."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli.options import repeated_option
from costmodel import goodput as gp
from costmodel.job import Job
from costmodel.plan import Plan
from hardware.catalog import load_hardware
from hardware.errors import InputError
from planner import replan as rp
from planner.candidates import MAX_CHIPS, parse_fix
from planner.validate.scale import MAX_DEVICES
from tests.test_cli_errors import assert_one_line_error, planner

ROOT = Path(__file__).resolve().parents[1]
GOODPUT = ("goodput", "-m", "llama3-8b", "-H", "h100-sxm", "-n", "8", "--fsdp", "8")


# ---- counts past their bound: exit 2 before any work ----------------------------------------------------------

COUNTS = {
    "validate --devices 10^8": (("validate", "--devices", str(10**8)), "--devices", "4,096"),
    "validate --devices 0": (("validate", "--devices", "0"), "--devices"),
    "validate --steps -1": (("validate", "--steps", "-1"), "--steps"),
    "validate --steps 10^6": (("validate", "--steps", str(10**6)), "--steps", "1,000"),
    "validate --num-processes 0": (("validate", "--num-processes", "0"), "--num-processes"),
    "validate --num-processes 10^6": (("validate", "--num-processes", str(10**6)), "--num-processes", "4,096"),
    "validate --num-processes without --coordinator": (("validate", "--num-processes", "2"), "--coordinator"),
    "validate --d-model 10^6": (("validate", "--d-model", str(10**6)), "--d-model"),
    "validate --layers 10^4": (("validate", "--layers", str(10**4)), "--layers"),
    "validate --seq-len 10^9": (("validate", "--seq-len", str(10**9)), "--seq-len"),
    "validate --grad-accum 10^6": (("validate", "--grad-accum", str(10**6)), "--grad-accum"),
    "validate --plan-timeout inf": (("validate", "--plan-timeout", "inf"), "--plan-timeout"),
    "goodput --spares 10^12": ((*GOODPUT, "--spares", str(10**12)), "--spares", f"{MAX_CHIPS:,}"),
    "goodput --spares over the chips": ((*GOODPUT, "--spares", "9"), "--spares", "8 chips"),
    "goodput --chips 10^12": (("goodput", "-m", "llama3-8b", "-n", str(10**12)), "--chips", f"{MAX_CHIPS:,}"),
    "goodput degrees past the bound": (("goodput", "-m", "llama3-8b", "-n", "8", "--dp", str(2**20), "--tp",
                                        str(2**20)), "--dp", "--tp", "multiply"),
    "goodput --fsdp 10^7": ((*GOODPUT[:-2], "--fsdp", str(10**7)), "--fsdp"),
    "goodput --mtbf-hours 1e308": ((*GOODPUT, "--mtbf-hours", "1e308"), "--mtbf-hours"),
    "goodput --mtbf-hours nan": ((*GOODPUT, "--mtbf-hours", "nan"), "--mtbf-hours"),
    "goodput --restart-min inf": ((*GOODPUT, "--restart-min", "inf"), "--restart-min"),
    "goodput --repair-hours 1e-300": ((*GOODPUT, "--repair-hours", "1e-300"), "--repair-hours"),
    "goodput --ckpt-write-gbps 1e-300": ((*GOODPUT, "--ckpt-write-gbps", "1e-300"), "--ckpt-write-gbps"),
    "goodput --price inf": ((*GOODPUT, "--train-tokens", "1T", "--price-per-chip-hour", "inf"),
                            "--price-per-chip-hour"),
    "replan --chips 10^12 before the plan is read": (("replan", "--plan", "missing.yaml", "-n", str(10**12)),
                                                     "--chips", f"{MAX_CHIPS:,}"),
    "replan --mtbf-hours inf": (("replan", "--plan", "missing.yaml", "-n", "8", "--mtbf-hours", "inf"),
                                "--mtbf-hours"),
    "suggest --fix dp past the bound": (("suggest", "-m", "llama3-8b", "-H", "h100-sxm", "-n", "64", "--fix",
                                         f"dp={2 * MAX_CHIPS}"), "--fix dp"),
}


@pytest.mark.parametrize("case", COUNTS)
def test_counts_past_their_bound_exit_2_at_once(capsys, monkeypatch, case):
    args, *needles = COUNTS[case]
    start = time.perf_counter()
    code, _, err = planner(capsys, monkeypatch, *args)
    assert_one_line_error(code, err, *needles)
    assert time.perf_counter() - start < 5, case


def test_validate_devices_refused_before_jax_starts():
    """--devices 10^8 used to allocate host devices until the machine killed it (24 GB)."""
    script = ("import sys; sys.argv = ['planner', 'validate', '--devices', str(10**8)]\n"
              "from cli.main import main\n"
              "try:\n    main()\nexcept SystemExit as e:\n    print(e.code, 'jax' in sys.modules)\n")
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert time.perf_counter() - start < 10
    assert r.stdout.split() == ["2", "False"], r.stdout + r.stderr
    assert r.stderr.startswith("error: --devices") and "Traceback" not in r.stderr


def test_device_bound_is_stated():
    assert MAX_DEVICES == 4096 and MAX_CHIPS == 2**20


# ---- valid job, no plan fits: exit 1 on every command -----------------------------------------------------------

def test_goodput_nothing_fits_exits_1(capsys, monkeypatch):
    code, out, err = planner(capsys, monkeypatch, "goodput", "-m", "llama3-405b", "-H", "h100-sxm", "-n", "2")
    assert code == 1 and out == "", (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: llama3-405b on 2 x h100-sxm: no plan fits"), err
    assert "no plan fits: no plan fits" not in lines[0]


def test_replan_nothing_fits_exits_1(capsys, monkeypatch, tmp_path):
    from planner.planfile import save_plan

    src = save_plan(tmp_path / "p70.yaml", "llama3-70b", "tpu-v5p", 64, Job(seq_len=4096, global_batch=256),
                    Plan(fsdp=64))
    out = tmp_path / "new.yaml"
    code, stdout, err = planner(capsys, monkeypatch, "replan", "--plan", str(src), "-n", "8", "--out", str(out))
    assert code == 1 and stdout == "", (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no plan for llama3-70b fits on 8 x tpu-v5p"), err
    assert not out.exists()


def test_replan_out_checked_before_the_search(capsys, monkeypatch, tmp_path):
    code, _, err = planner(capsys, monkeypatch, "replan", "--plan", "missing.yaml", "-n", "8", "--out",
                           str(tmp_path))
    assert_one_line_error(code, err, "--out", "folder")


# ---- repeated and contradictory options: errors naming both ------------------------------------------------------

REPEATS = {
    "--fix tp twice": (("suggest", "-m", "llama3-8b", "-H", "h100-sxm", "-n", "64", "--fix", "tp=4,tp=8"),
                       "tp=4", "tp=8", "given twice"),
    "--fix alias twice": (("suggest", "-m", "llama3-8b", "-H", "h100-sxm", "-n", "64", "--fix", "mb=1,micro_batch=2"),
                          "mb=1", "micro_batch=2"),
    "--fix tp over --max-tp": (("suggest", "-m", "llama3-8b", "-H", "h100-sxm", "-n", "64", "--fix", "tp=8",
                                "--max-tp", "4"), "--fix tp=8", "--max-tp 4"),
    "--offload opt and optimizer": ((*GOODPUT, "--offload", "opt,optimizer"), "--offload opt", "--offload optimizer"),
    "--offload a tensor by both names": ((*GOODPUT, "--offload", "qkv_proj", "--offload", "query_proj"),
                                         "qkv_proj", "query_proj"),
    "--offload against a custom --remat": ((*GOODPUT, "--remat", "custom:qkv_proj=device", "--offload", "query_proj"),
                                           "--remat qkv_proj=device", "--offload query_proj"),
    "--remat names a tensor twice": ((*GOODPUT, "--remat", "custom:qkv_proj=device,query_proj=remat"),
                                     "qkv_proj=device", "query_proj=remat"),
    "goodput --plan with --model": (("goodput", "--plan", "missing.yaml", "-m", "llama3-8b", "--fsdp", "8"),
                                    "--plan", "--model", "--fsdp"),
    "validate --set with degrees": (("validate", "--set", "quick", "--tp", "2"), "--set", "--tp"),
    "validate --set with --plan": (("validate", "--set", "quick", "--plan", "missing.yaml"), "--set", "--plan"),
    "validate --target with --devices": (("validate", "--target", "tpu-v5p:2x2x2", "--devices", "4"), "--target",
                                         "--devices"),
}


@pytest.mark.parametrize("case", REPEATS)
def test_repeated_or_contradictory_options_name_both(capsys, monkeypatch, case):
    args, *needles = REPEATS[case]
    code, _, err = planner(capsys, monkeypatch, *args)
    assert_one_line_error(code, err, *needles)


def test_agreeing_offload_and_remat_are_accepted(capsys, monkeypatch):
    code, _, err = planner(capsys, monkeypatch, *GOODPUT, "-b", "8", "--remat", "custom:qkv_proj=offload",
                           "--offload", "query_proj,optimizer", "--json")
    assert code == 0, err


def test_parse_fix_repeats_and_bounds():
    with pytest.raises(InputError, match="tp=4 and tp=8: tp given twice"):
        parse_fix("tp=4,tp=8")
    with pytest.raises(InputError, match="remat=full and remat=none: remat given twice"):
        parse_fix("remat=full,remat=none")
    assert parse_fix("tp=4,dp=2", max_tp=4).fixed == {"tp": 4, "dp": 2}


def test_repeated_option_names_both_spellings():
    import typer

    from cli.main import _register, app

    _register()
    group = typer.main.get_command(app)
    assert repeated_option(group, ["goodput", "-m", "x", "--chips", "8", "-n", "16"]) == \
        "--chips 8 and -n 16: the same option given twice; give it once"
    assert "--chips=8 and --chips=16" in repeated_option(group, ["goodput", "--chips=8", "--chips=16"])
    assert "--fast-compile and --full-opt" in repeated_option(group, ["validate", "--fast-compile", "--full-opt"])
    assert "--spares -1 and --spares 2" in repeated_option(group, ["goodput", "--spares", "-1", "--spares", "2"])
    # multiple options repeat by design; a value that looks like an option is a value
    assert repeated_option(group, ["goodput", "--offload", "opt", "--offload", "params"]) is None
    assert repeated_option(group, ["goodput", "-m", "--chips", "--chips", "8"]) is None
    assert repeated_option(group, ["goodput", "--chips", "8", "--", "--chips"]) is None
    assert repeated_option(group, []) is None and repeated_option(group, ["no-such-command", "-n", "-n"]) is None


# ---- closed forms against the loops they replaced ----------------------------------------------------------------

def poisson_cdf_loop(k: int, mean: float) -> float:
    """The summation costmodel.goodput.poisson_cdf used to run: one term per spare host."""
    if k < 0:
        return 0.0
    term = total = math.exp(-mean)
    for i in range(1, k + 1):
        term *= mean / i
        total += term
    return min(1.0, total)


@pytest.mark.parametrize("mean", [0.0, 0.01, 0.5, 2.0, 10.0, 40.0])
def test_poisson_closed_form_equals_the_loop(mean):
    for k in range(-1, 60):
        assert gp.poisson_cdf(k, mean) == pytest.approx(poisson_cdf_loop(k, mean), rel=1e-10, abs=1e-300)


def test_poisson_closed_form_in_constant_time_and_past_underflow():
    start = time.perf_counter()
    assert gp.poisson_cdf(10**12, 5.0) == 1.0
    # 10^6 hosts in repair on average (standard deviation 10^3): 1,000 spare hosts never suffice, 2^20 always do
    assert gp.spare_coverage(1000, 1e3, 1e3) == 0.0 and gp.spare_coverage(MAX_CHIPS, 1e3, 1e3) == 1.0
    assert time.perf_counter() - start < 1
    # exp(-1000) underflows: the loop said 0 for any k; half the mass lies at or below the mean
    assert poisson_cdf_loop(2000, 1000.0) == 0.0
    assert gp.poisson_cdf(2000, 1000.0) == pytest.approx(1.0) and gp.poisson_cdf(1000, 1000.0) == pytest.approx(
        0.5, abs=0.02)


def test_goodput_refuses_more_spares_than_chips():
    ck = gp.CheckpointSize(1e12, 1e9, 12)
    h100 = load_hardware("h100-sxm")
    with pytest.raises(InputError, match="--spares: expected at most the job's 8 chips"):
        gp.goodput_from(10.0, 1e6, ck, h100, 8, gp.Reliability(spares=9))
    assert gp.goodput_from(10.0, 1e6, ck, h100, 8, gp.Reliability(spares=8)).spare_hosts == 1


def moved_bytes_loop(old, new, old_ranks: int, new_ranks: int, same: bool) -> tuple[float, float]:
    """The per-rank loop planner.replan.moved_bytes used to run."""
    per_rank = []
    for r in range(new_ranks):
        need = 0.0
        for key, (b_new, d_new) in new.items():
            if not same or r >= old_ranks:
                need += b_new
                continue
            need += b_new - float(rp.block_overlap(r, old[key][1], d_new)) * b_new * d_new
        per_rank.append(max(0.0, need))
    return max(per_rank), sum(per_rank) / len(per_rank)


@pytest.mark.parametrize("d_old,d_new,old_ranks,new_ranks", [(1, 1, 1, 1), (4, 8, 4, 8), (8, 4, 8, 4),
                                                            (6, 4, 12, 8), (3, 5, 6, 10), (16, 1, 16, 2)])
@pytest.mark.parametrize("same", [True, False])
def test_moved_bytes_array_equals_the_loop(d_old, d_new, old_ranks, new_ranks, same):
    old = {"weights": (2.0e9 / d_old, d_old), "optimizer": (4.0e9 / d_old, max(1, d_old // 2))}
    new = {"weights": (2.0e9 / d_new, d_new), "optimizer": (4.0e9 / d_new, max(1, d_new // 2))}
    got = rp.moved_bytes(old, new, old_ranks, new_ranks, same)
    assert got == pytest.approx(moved_bytes_loop(old, new, old_ranks, new_ranks, same), rel=1e-12)


def test_an_option_given_twice_is_refused_by_the_cli(capsys, monkeypatch):
    code, _, err = planner(capsys, monkeypatch, "estimate", "-m", "llama3-8b", "-n", "8", "-n", "16", "--fsdp", "8")
    assert_one_line_error(code, err, "-n 8 and -n 16", "given twice")


def test_remat_tensor_given_twice_with_different_choices():
    from costmodel.plan import parse_remat

    with pytest.raises(InputError, match="'qkv_proj' given twice with different choices"):
        parse_remat("custom:qkv_proj=save,query_proj=remat")
    # MaxText's query, key and value projections are all our qkv_proj: the same choice three times is one choice
    assert parse_remat("custom:query_proj=save,key_proj=save,value_proj=save").choices()["qkv_proj"] == "device"


def test_tpu_target_with_a_huge_side_is_one_line():
    from planner.validate.tpu import parse_target

    with pytest.raises(InputError, match="at most 4 digits a side"):
        parse_target("tpu-v5p:" + "9" * 5000 + "x2x2")
