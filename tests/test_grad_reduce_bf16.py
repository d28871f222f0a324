"""Megatron-LM's --grad-reduce-in-bf16 (Plan.grad_reduce_in_bf16): gradient bytes on the device and on the wire by
hand on a small model, Megatron's refusals as one-line errors with exit 2, the plan file, the Megatron export/import
round trip, MaxText's drop, the runs column, and suggest never choosing it (docs/grad_reduce_bf16.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from costmodel.estimate import estimate
from costmodel.framework import MIXED_STATE, REGISTRY, bf16_grad_layout
from costmodel.job import Job
from costmodel.memory import memory_terms
from costmodel.model import ModelSpec
from costmodel.plan import GRAD_BF16, Plan, parse_remat
from costmodel.published import load_cases
from hardware.catalog import load_hardware
from hardware.errors import InputError
from planner.export import export_result
from planner.import_configs import import_megatron
from planner.planfile import PlanFile, load_plan, planfile_text
from tests.cli_in_process import planner_in_process as _cli

# 8 layers, d 1024, 8 heads of 128 (no GQA), gated MLP 4096, vocabulary 256, untied tables: per layer attention
# 4 x 1024^2 + MLP 3 x 1024 x 4096 + norms 2 x 1024 = 16,779,264; 8 layers + 2 x 256 x 1024 tables = 134,758,400
SMALL = ModelSpec("small", n_layers=8, d_model=1024, n_heads=8, n_kv_heads=8, ffn_dim=4096, vocab_size=256)
H100 = load_hardware("h100-sxm")
PLAN = Plan(dp=2, zero=1, remat=parse_remat("none"))  # the distributed optimizer over 2 ranks
PARAMS = 134_758_400  # every rank holds them all (no tp/pp)


def _est(on: bool, framework: str = "megatron", precision: str = "bf16", plan: Plan = PLAN):
    return estimate(SMALL, H100, Job(4096, 8, precision, framework), plan.with_(grad_reduce_in_bf16=on))


def test_layout():
    assert MEGATRON_LAYOUT == (2, 2, 12, 36)  # bf16 weights, bf16 grads, fp32 master + m + v; update reads 2 + 4 more
    assert REGISTRY["megatron"].state_bytes("float32") == MIXED_STATE  # off: fp32 main grads as before
    assert REGISTRY["nemo"].grad_reduce_in_bf16 and not REGISTRY["maxtext"].grad_reduce_in_bf16


MEGATRON_LAYOUT = tuple(bf16_grad_layout(MIXED_STATE))


def test_gradient_memory_by_hand():
    off, on = _est(False), _est(True)
    assert off.memory["gradients"] == 4 * PARAMS == 539_033_600  # fp32 main grads (zero 1 keeps them all)
    assert on.memory["gradients"] == 2 * PARAMS == 269_516_800  # the bf16 buffer
    for term in ("weights", "optimizer", "activations"):  # master weights and moments stay fp32, in the optimizer
        assert on.memory[term] == off.memory[term]
    mt = memory_terms(SMALL, H100, Job(4096, 8, "bf16", "megatron"), PLAN.with_(grad_reduce_in_bf16=True), 4)
    assert (mt.grad_reduce_bytes, mt.grad_bytes, mt.adam_bytes_per_param) == (2, 2, 36)


def _dp(cost) -> list:
    return [c for c in cost.collectives if c.axis == "dp"]


def test_gradients_on_the_wire_in_bf16():
    # Megatron (WITH_GRADS, one all-reduce of the gradient bytes): 4 B -> 2 B per parameter
    (a,), (b,) = _dp(_est(False)), _dp(_est(True))
    assert (a.kind, a.bytes_each, b.bytes_each) == ("all-reduce", 4 * PARAMS, 2 * PARAMS)
    assert b.time_s < 0.55 * a.time_s
    # NeMo: the gradients' reduce-scatter halves, the bf16 parameter all-gather does not change
    off = {c.kind: c.bytes_each for c in _dp(_est(False, "nemo"))}
    on = {c.kind: c.bytes_each for c in _dp(_est(True, "nemo"))}
    assert off == {"reduce-scatter": 4 * PARAMS, "all-gather": 2 * PARAMS}
    assert on == {"reduce-scatter": 2 * PARAMS, "all-gather": 2 * PARAMS}
    # plain data parallel (zero 0): the all-reduce halves too
    (z,) = _dp(_est(True, plan=PLAN.with_(zero=0)))
    assert z.bytes_each == 2 * PARAMS


def test_off_is_today():
    a, b = _est(False), estimate(SMALL, H100, Job(4096, 8, "bf16", "megatron"), PLAN)
    assert (a.step_time_s, a.memory) == (b.step_time_s, b.memory)
    # here the all-reduce hides behind the backward either way; what shows is the update's bf16 -> fp32 cast of
    # the gradient shard: 6 B more per optimizer parameter (PARAMS / 2 of them) of HBM traffic, ~0.1 ms
    assert 0 < _est(True).step_time_s - a.step_time_s < 1e-3


@pytest.mark.parametrize("framework, precision, plan, needle", [
    ("maxtext", "bf16", PLAN.with_(zero=0, fsdp=2, dp=1), "expected --framework megatron or nemo, got maxtext"),
    ("megatron", "fp16", PLAN, "expected --precision bf16 or fp8, got fp16"),
    ("megatron", "bf16", PLAN.with_(dp=1, fsdp=2, zero=0), "expected zero 0-2 and fsdp 1, got zero 0, fsdp 2"),
    ("megatron", "bf16", PLAN.with_(zero=3), "expected zero 0-2 and fsdp 1, got zero 3, fsdp 1"),
])
def test_errors_name_the_flag(framework, precision, plan, needle):
    with pytest.raises(InputError, match="--grad-reduce-in-bf16") as e:
        _est(True, framework, precision, plan)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_plan_field_refuses_a_non_bool():
    with pytest.raises(InputError, match=GRAD_BF16):
        Plan(grad_reduce_in_bf16="yes")




BASE = ("estimate", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--global-batch", "64",
        "--grad-reduce-in-bf16")


@pytest.mark.parametrize("extra, needle", [
    (("--dp", "8", "--framework", "maxtext"), "expected --framework megatron or nemo"),
    (("--dp", "8", "--framework", "megatron", "--precision", "fp16"), "expected --precision bf16 or fp8"),
    (("--fsdp", "8", "--framework", "megatron"), "expected zero 0-2 and fsdp 1"),
])
def test_cli_bad_input_one_line_exit_2(capsys, monkeypatch, extra, needle):
    code, _, err = _cli(capsys, monkeypatch, *BASE, *extra)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err and "--grad-reduce-in-bf16" in err


def test_cli_flag_sets_the_plan(capsys, monkeypatch):
    code, out, _ = _cli(capsys, monkeypatch, *BASE, "--dp", "8", "--framework", "megatron", "--zero", "1", "--json")
    assert code == 0 and f'"{GRAD_BF16}": true' in out


def _pf(on: bool) -> PlanFile:
    return PlanFile(SMALL, H100, 2, Job(4096, 8, "bf16", "megatron"), PLAN.with_(grad_reduce_in_bf16=on), None,
                    "h100-sxm")


def test_plan_file_round_trip(tmp_path: Path):
    p = tmp_path / "p.yaml"
    p.write_text(planfile_text(_pf(True)))
    assert f"{GRAD_BF16}: true" in p.read_text()
    assert load_plan(p).plan == PLAN.with_(grad_reduce_in_bf16=True)
    p.write_text(planfile_text(_pf(False)))
    assert GRAD_BF16 not in p.read_text()  # written only when set


def test_megatron_export_import_round_trip(tmp_path: Path):
    res = export_result(_pf(True), "megatron")
    assert "--grad-reduce-in-bf16" in res.text
    f = tmp_path / "args.sh"
    f.write_text(res.text)
    assert import_megatron(f, hardware="h100-sxm").planfile.plan.grad_reduce_in_bf16
    off = export_result(_pf(False), "megatron").text
    assert "--grad-reduce-in-bf16" not in off
    # the precision-aware optimizer's --main-grads-dtype bf16 leaves the same bf16 buffer (arguments.py)
    f.write_text(off.replace("--use-distributed-optimizer", "--use-distributed-optimizer --main-grads-dtype bf16"))
    assert import_megatron(f, hardware="h100-sxm").planfile.plan.grad_reduce_in_bf16


def test_maxtext_export_drops_it_with_a_note():
    res = export_result(_pf(True), "maxtext")
    assert any(f"{GRAD_BF16}: MaxText reduces" in w for w in res.warnings)
    assert not res.adapted.plan.grad_reduce_in_bf16


def test_runs_column(tmp_path: Path):
    cases, skipped = load_cases("data/runs/mlperf-training.csv")
    assert not skipped and len(cases) == 29 and all(c.plan.grad_reduce_in_bf16 for c in cases)
    head, *rows = Path("data/runs/mlperf-training.csv").read_text().splitlines()
    cols = head.split(",")
    i = cols.index(GRAD_BF16)
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join([head, _set(rows[0], i, "maybe")]) + "\n")
    _, why = load_cases(bad)
    assert f"{GRAD_BF16}: expected empty, true or false" in next(iter(why.values()))
    bad.write_text("\n".join([head, _set(rows[0], cols.index("framework"), "maxtext")]) + "\n")
    _, why = load_cases(bad)
    assert "expected --framework megatron or nemo" in next(iter(why.values()))


def _set(row: str, index: int, value: str) -> str:
    """The CSV row with cell `index` replaced."""
    import csv
    import io

    cells = next(csv.reader([row]))
    cells[index] = value
    out = io.StringIO()
    csv.writer(out, lineterminator="").writerow(cells)
    return out.getvalue()


def test_suggest_never_turns_it_on():
    from planner.candidates import Constraints, candidates

    meshes = list(candidates(SMALL, H100, Job(4096, 16, "bf16", "megatron"), 8, Constraints()))
    assert meshes and not any(mesh.plan().grad_reduce_in_bf16 for mesh in meshes)
