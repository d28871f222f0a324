"""Megatron-Core's fp8 parameters (Plan.fp8_param_gather, --fp8-param-gather) and Transformer Engine's fp8 weight
copies: weight bytes and the parameter all-gather by hand on a small model, Megatron's refusals as one-line errors
with exit 2, the plan file, the Megatron export/import round trip, MaxText's drop, the runs column and suggest."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from costmodel.constraints import fp8_params_allowed
from costmodel.estimate import estimate
from costmodel.framework import REGISTRY, te_weight_bytes
from costmodel.job import Job
from costmodel.model import ModelSpec
from costmodel.plan import FP8_PARAMS, Plan, parse_remat
from costmodel.published import load_cases
from hardware.catalog import load_hardware
from hardware.errors import InputError
from planner.export import export_result
from planner.import_configs import import_megatron
from planner.planfile import PlanFile, load_plan, planfile_text
from tests.cli_in_process import planner_in_process as _cli

# 8 layers, d 1024, 8 heads of 128 (no GQA), gated MLP 4096, vocabulary 256, untied tables
SMALL = ModelSpec("small", n_layers=8, d_model=1024, n_heads=8, n_kv_heads=8, ffn_dim=4096, vocab_size=256)
H100 = load_hardware("h100-sxm")
PLAN = Plan(dp=2, zero=1, remat=parse_remat("none"))  # the distributed optimizer over 2 ranks
# Per layer: attention 4 x 1024^2 = 4,194,304, MLP 3 x 1024 x 4096 = 12,582,912, norms 2 x 1024 = 2,048:
# 16,779,264; 8 layers 134,234,112. Tables: 2 x 256 x 1024 = 524,288. Each rank holds all 134,758,400.
LAYERS, TABLES = 134_234_112, 524_288
PARAMS = LAYERS + TABLES


def _est(precision: str, fp8_params: bool = False, framework: str = "megatron"):
    return estimate(SMALL, H100, Job(4096, 8, precision, framework), PLAN.with_(fp8_param_gather=fp8_params))


def test_bytes_per_gemm_weight():
    meg, mt = REGISTRY["megatron"], REGISTRY["maxtext"]
    assert te_weight_bytes(meg, "bf16", False, 2) == 2  # no fp8: the bf16 weight only
    assert te_weight_bytes(meg, "fp8", False, 2) == 4  # bf16 weight + cached fp8 copy + its transpose
    assert te_weight_bytes(meg, "fp8", True, 2) == 2  # fp8 weight + its transpose, no bf16 copy
    assert te_weight_bytes(mt, "fp8", False, 4) == 4  # no Transformer Engine cache outside Megatron-Core


def test_weight_memory_by_hand():
    assert _est("bf16").memory["weights"] == 2 * PARAMS == 269_516_800
    # plain fp8: the layers' weights carry 2 B of fp8 copies beside their 2 B bf16; the tables stay bf16
    assert _est("fp8").memory["weights"] == 2 * PARAMS + 2 * LAYERS == 537_985_024
    # fp8 parameters: 1 B weight + 1 B transpose on the layers, bf16 tables
    assert _est("fp8", True).memory["weights"] == 2 * LAYERS + 2 * TABLES == 269_516_800
    for term in ("gradients", "optimizer", "activations"):  # fp32 main grads, master weights and moments unchanged
        assert _est("fp8", True).memory[term] == _est("fp8").memory[term]


def _gather(cost) -> tuple[float, float]:
    (ag,) = [c for c in cost.collectives if c.kind == "all-gather" and c.axis == "dp"]
    return ag.bytes_each, ag.time_s


def test_parameter_all_gather_in_fp8():
    # NeMo gathers the updated parameters behind the next forward: bf16 2 B each, fp8 1 B on the layers' weights
    assert _gather(_est("fp8", framework="nemo"))[0] == 2 * PARAMS
    nbytes, t = _gather(_est("fp8", True, "nemo"))
    assert nbytes == LAYERS + 2 * TABLES == 135_282_688
    assert t < 0.55 * _gather(_est("fp8", framework="nemo"))[1]
    # Megatron (one all-reduce of the fp32 gradients): its all-gather half shrinks by the same fp8 / bf16 ratio
    base = [c for c in _est("fp8").collectives if c.axis == "dp"]
    assert [c.kind for c in base] == ["all-reduce"]
    rs, ag = [c for c in _est("fp8", True).collectives if c.axis == "dp"]
    assert rs.bytes_each == base[0].bytes_each == 4 * PARAMS
    assert ag.bytes_each == pytest.approx(4 * PARAMS * (LAYERS + 2 * TABLES) / (2 * PARAMS))


def test_off_is_today_and_bf16_untouched():
    a, b = _est("bf16"), estimate(SMALL, H100, Job(4096, 8, "bf16", "megatron"), PLAN)
    assert (a.step_time_s, a.memory) == (b.step_time_s, b.memory)
    assert _est("fp8", True).step_time_s <= _est("fp8").step_time_s


@pytest.mark.parametrize("job, plan, needle", [
    (Job(4096, 8, "fp8", "maxtext"), PLAN.with_(fp8_param_gather=True), "expected --framework megatron or nemo"),
    (Job(4096, 8, "bf16", "megatron"), PLAN.with_(fp8_param_gather=True), "expected --precision fp8, got bf16"),
    (Job(4096, 8, "fp8", "megatron"), PLAN.with_(zero=0, fp8_param_gather=True), "expected zero 1, 2 or 3"),
])
def test_errors_name_the_flag(job, plan, needle):
    with pytest.raises(InputError, match="--fp8-param-gather") as e:
        estimate(SMALL, H100, job, plan)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not fp8_params_allowed(job, plan)


def test_plan_field_refuses_a_non_bool():
    with pytest.raises(InputError, match=FP8_PARAMS):
        Plan(fp8_param_gather="yes")




BASE = ("estimate", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--global-batch", "64",
        "--dp", "8", "--framework", "megatron", "--fp8-param-gather")


@pytest.mark.parametrize("extra, needle", [
    (("--precision", "bf16", "--zero", "1"), "expected --precision fp8, got bf16"),
    (("--precision", "fp8"), "expected zero 1, 2 or 3"),
])
def test_cli_bad_input_one_line_exit_2(capsys, monkeypatch, extra, needle):
    code, _, err = _cli(capsys, monkeypatch, *BASE, *extra)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err and "--fp8-param-gather" in err


def test_cli_flag_sets_the_plan(capsys, monkeypatch):
    code, out, _ = _cli(capsys, monkeypatch, *BASE, "--precision", "fp8", "--zero", "1", "--json")
    assert code == 0 and f'"{FP8_PARAMS}": true' in out


def _pf(on: bool) -> PlanFile:
    return PlanFile(SMALL, H100, 2, Job(4096, 8, "fp8", "megatron"), PLAN.with_(fp8_param_gather=on), None,
                    "h100-sxm")


def test_plan_file_round_trip(tmp_path: Path):
    p = tmp_path / "p.yaml"
    p.write_text(planfile_text(_pf(True)))
    assert f"{FP8_PARAMS}: true" in p.read_text()
    assert load_plan(p).plan == PLAN.with_(fp8_param_gather=True)
    p.write_text(planfile_text(_pf(False)))
    assert FP8_PARAMS not in p.read_text()  # written only when set


def test_megatron_export_import_round_trip(tmp_path: Path):
    res = export_result(_pf(True), "megatron")
    assert "--fp8-param-gather" in res.text and "--fp8-format" in res.text and "--use-distributed-optimizer" in res.text
    f = tmp_path / "args.sh"
    f.write_text(res.text)
    back = import_megatron(f, hardware="h100-sxm").planfile
    assert back.plan.fp8_param_gather and back.job.precision == "fp8"
    assert "--fp8-param-gather" not in export_result(_pf(False), "megatron").text


def test_import_refuses_it_without_fp8(tmp_path: Path):
    text = export_result(_pf(True), "megatron").text.replace("--fp8-format hybrid", "")
    f = tmp_path / "args.sh"
    f.write_text(text)
    with pytest.raises(InputError, match="expected --precision fp8"):
        import_megatron(f, hardware="h100-sxm")


def test_maxtext_export_drops_it_with_a_note():
    res = export_result(_pf(True), "maxtext")
    assert any(f"{FP8_PARAMS}: MaxText stores its weights" in w for w in res.warnings)
    assert not res.adapted.plan.fp8_param_gather


def test_runs_column(tmp_path: Path):
    cases, skipped = load_cases("data/runs/mlperf-training.csv")
    on = {c.id for c in cases if c.plan.fp8_param_gather}
    assert not skipped and len(on) == 16 and all("405b" in i or "gpt3" in i for i in on)
    head = Path("data/runs/mlperf-training.csv").read_text().splitlines()[0]
    assert head.endswith(",fp8_param_gather")
    bad = tmp_path / "bad.csv"
    rows = Path("data/runs/mlperf-training.csv").read_text().splitlines()
    bad.write_text("\n".join([rows[0], rows[1] + "maybe"]) + "\n")  # rows[1] ends with an empty fp8 cell
    _, why = load_cases(bad)
    assert "fp8_param_gather: expected empty, true or false" in next(iter(why.values()))


def test_suggest_turns_it_on_where_allowed():
    from planner.candidates import Constraints, candidates

    meshes = list(candidates(SMALL, H100, Job(4096, 16, "fp8", "megatron"), 8, Constraints()))
    assert meshes and all(mesh.fp8_params == (mesh.zero >= 1 or mesh.fsdp > 1) for mesh in meshes)
    assert any(mesh.fp8_params for mesh in meshes)
    bf16 = list(candidates(SMALL, H100, Job(4096, 16, "bf16", "megatron"), 8, Constraints()))
    assert not any(mesh.fp8_params for mesh in bf16)


def test_suggest_table_marks_fp8_params():
    import subprocess
    from pathlib import Path

    planner = str(Path(sys.executable).parent / "planner")
    p = subprocess.run([planner, "suggest", "-m", "llama3-8b", "-H", "h100-sxm", "-n", "8", "--precision", "fp8",
                        "--top", "1"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "fp8 params" in p.stdout and "fp8 params: Megatron-Core's --fp8-param-gather" in p.stdout
