"""Plan files (planner/planfile.py): save/load round trips, one-line errors naming file and field, and the
`planner estimate --plan / --save-plan` flags."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from costmodel.catalog import load_model
from costmodel.estimate import estimate
from costmodel.job import Job
from costmodel.plan import REMAT_POLICIES, Plan, parse_remat
from hardware.catalog import load_hardware
from hardware.errors import InputError
from planner.planfile import VERSION, PlanFile, load_plan, planfile_text, save_plan

PLANNER = str(Path(sys.executable).with_name("planner"))


def planner(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PLANNER, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


JOB = Job(seq_len=4096, global_batch=256)
PLAN = Plan(fsdp=16, tp=4, remat=parse_remat("custom:qkv_proj=offload,out_proj=device"))


def _save(tmp_path: Path, name: str = "p.yaml", **kw) -> Path:
    args = dict(model="llama3-8b", chip_name="tpu-v5p", chips=64, job=JOB, plan=PLAN)
    args.update(kw)
    return save_plan(tmp_path / name, args.pop("model"), args.pop("chip_name"), **args)


def _edit(path: Path, fn) -> Path:
    data = yaml.safe_load(path.read_text())
    fn(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ---- round trips -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["p.yaml", "p.json"])
def test_save_load_round_trip(tmp_path, name):
    cost = estimate(load_model("llama3-8b"), load_hardware("tpu-v5p"), JOB, PLAN, 64)
    p = _save(tmp_path, name, cost=cost)
    pf = load_plan(p)
    assert pf.model == load_model("llama3-8b") and pf.model_ref == "llama3-8b"
    assert pf.hardware == load_hardware("tpu-v5p") and pf.hardware_ref == "tpu-v5p"
    assert (pf.chips, pf.job, pf.plan) == (64, JOB, PLAN)
    assert pf.predicted["step_time_s"] == pytest.approx(cost.step_time_s)
    assert pf.predicted["fits"] == cost.fits
    if name.endswith(".json"):
        assert json.loads(p.read_text())["version"] == VERSION


def test_every_plan_field_round_trips(tmp_path):
    plan = Plan(dp=2, fsdp=4, tp=2, cp=2, pp=2, ep=1, vpp=2, micro_batch=2, zero=1, sequence_parallel=False,
                remat=REMAT_POLICIES["save_dot_except_mlp"], offload_optimizer=True, offload_params=True, slices=2)
    job = Job(seq_len=8192, global_batch=512, precision="int8", framework="megatron")
    pf = load_plan(_save(tmp_path, chips=64, plan=plan, job=job))
    assert pf.plan == plan and pf.job == job


def test_inline_model_and_shorthand(tmp_path):
    spec = load_model("llama3-8b")
    from dataclasses import replace

    custom = replace(spec, name="my-model", n_layers=30, description="", source="")
    pf = load_plan(_save(tmp_path, "a.yaml", model=custom))
    assert pf.model == custom and pf.model_ref == ""
    assert isinstance(yaml.safe_load((tmp_path / "a.yaml").read_text())["model"], dict)
    big = load_model("1T")  # size shorthands are written as the shorthand, which reproduces them exactly
    p = _save(tmp_path, "b.yaml", model=big, chips=2048, plan=Plan(fsdp=256, tp=8),
              job=Job(seq_len=4096, global_batch=2048))
    assert yaml.safe_load(p.read_text())["model"] == "1T"
    assert load_plan(p).model == big


def test_relative_model_path_resolves_next_to_plan(tmp_path):
    d = tmp_path / "sub"
    d.mkdir()
    (d / "m.yaml").write_text(yaml.safe_dump({"name": "tiny", "n_layers": 4, "d_model": 512, "n_heads": 8,
                                              "ffn_dim": 2048, "vocab_size": 32000}))
    p = _save(d, model="m.yaml", chips=8, plan=Plan(fsdp=8), job=Job(seq_len=1024, global_batch=8))
    pf = load_plan(p)  # loaded from another working directory than the plan file's
    assert pf.model.name == "tiny" and pf.model_ref == "m.yaml"


def test_planfile_text_is_loadable(tmp_path):
    pf = load_plan(_save(tmp_path))
    for fmt, suffix in (("yaml", ".yaml"), ("json", ".json")):
        q = tmp_path / f"again{suffix}"
        q.write_text(planfile_text(pf, fmt))
        back = load_plan(q)
        assert (back.model, back.hardware, back.chips, back.job, back.plan) == \
            (pf.model, pf.hardware, pf.chips, pf.job, pf.plan)


def test_hand_written_minimal_file(tmp_path):
    p = tmp_path / "hand.yaml"
    p.write_text("version: 1\nmodel: llama3-8b\nhardware: h100-sxm\nchips: 8\n"
                 "job: {seq_len: 4096, global_batch: 64}\nplan:\n  degrees: {tp: 8}\n  remat: selective\n")
    pf = load_plan(p)
    assert pf.plan == Plan(tp=8, remat=REMAT_POLICIES["selective"])
    assert pf.job == Job(seq_len=4096, global_batch=64)


# ---- errors: one line, naming the file and the field -------------------------------------------------------

def _error(path: Path) -> str:
    with pytest.raises(InputError) as e:
        load_plan(path)
    msg = str(e.value)
    assert "\n" not in msg
    assert str(path) in msg
    return msg


@pytest.mark.parametrize("edit,field,expected", [
    (lambda d: d.pop("version"), "'version'", "integer"),
    (lambda d: d.update(version=0), "'version'", "older"),
    (lambda d: d.update(version=2), "'version'", "newer"),
    (lambda d: d.update(version="one"), "'version'", "the integer 1"),
    (lambda d: d.update(modle=d.pop("model")), "'modle'", "did you mean 'model'"),
    (lambda d: d.pop("chips"), "'chips'", "integer"),
    (lambda d: d.update(chips="many"), "'chips'", "positive integer"),
    (lambda d: d.update(chips=True), "'chips'", "positive integer"),
    (lambda d: d.update(hardware=5), "'hardware'", "preset name"),
    (lambda d: d.update(hardware="tpu-v9"), "'hardware'", "unknown hardware"),
    (lambda d: d.update(model="llama9-1b"), "'model'", "unknown model"),
    (lambda d: d.update(job=[1, 2]), "'job'", "a mapping"),
    (lambda d: d["job"].update(seq_len="long"), "job.seq_len", "integer"),
    (lambda d: d["job"].update(sequence_length=4096), "'sequence_length'", "unknown field"),
    (lambda d: d["job"].pop("global_batch"), "'global_batch'", "missing"),
    (lambda d: d["plan"].update(micro_bach=2), "'plan.micro_bach'", "did you mean 'micro_batch'"),
    (lambda d: d["plan"].pop("degrees"), "'plan.degrees'", "mapping"),
    (lambda d: d["plan"]["degrees"].update(tp=0), "'plan.degrees.tp'", "positive integer"),
    (lambda d: d["plan"]["degrees"].update(xp=2), "'plan.degrees.xp'", "unknown field"),
    (lambda d: d["plan"].update(zero=4), "'plan.zero'", "0, 1, 2 or 3"),
    (lambda d: d["plan"].update(sequence_parallel="yes"), "'plan.sequence_parallel'", "true or false"),
    (lambda d: d["plan"]["remat"].update(policy="minimall"), "plan.remat.policy", "did you mean 'minimal'"),
    (lambda d: d["plan"]["remat"]["tensors"].update(qkv_proj="keep"), "plan.remat.tensors.qkv_proj",
     "device, remat, offload"),
    (lambda d: d["plan"]["remat"].update(policy="minimal"), "plan.remat.tensors", "differ from policy"),
    (lambda d: d["plan"].update(ici={"fsdp": 8, "tp": 8}), "'plan.ici'", "expected {fsdp: 16, tp: 4}"),
    (lambda d: d.update(predicted={"mfu": "high"}), "'predicted.mfu'", "a number"),
    (lambda d: d["plan"]["degrees"].update(tp=8), "degrees", "must equal chips = 64"),
])
def test_bad_field_is_named(tmp_path, edit, field, expected):
    msg = _error(_edit(_save(tmp_path), edit))
    assert field in msg, msg
    assert expected in msg, msg


def test_malformed_files(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("version: 1\nmodel: [unclosed\n")
    assert "not valid YAML" in _error(p)
    p.write_text("- just\n- a list\n")
    assert "mapping" in _error(p)
    p.write_text("version: 1\n" + "# pad\n" * 200_000)
    assert "larger than" in _error(p)
    assert "not found" in _error(tmp_path / "missing.yaml")


def test_unsafe_yaml_is_refused(tmp_path):
    p = tmp_path / "evil.yaml"
    p.write_text("version: !!python/object/apply:os.system ['echo hi']\n")
    assert "not valid YAML" in _error(p)


def test_save_into_missing_folder(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        save_plan(tmp_path / "nope" / "p.yaml", "llama3-8b", "tpu-v5p", 64, JOB, PLAN)


def test_planfile_is_frozen(tmp_path):
    pf = load_plan(_save(tmp_path))
    assert isinstance(pf, PlanFile)
    with pytest.raises(AttributeError):
        pf.chips = 3  # type: ignore[misc]


# ---- CLI ---------------------------------------------------------------------------------------------------

def test_cli_estimate_save_and_plan(tmp_path):
    p = tmp_path / "p.yaml"
    r = planner("estimate", "-m", "llama3-8b", "-n", "64", "-b", "256", "--fsdp", "16", "--tp", "4",
                "--remat", "minimal", "--save-plan", str(p), "--json")
    assert r.returncode == 0, r.stderr
    direct = json.loads(r.stdout)
    pf = load_plan(p)
    assert pf.plan == Plan(fsdp=16, tp=4, remat=REMAT_POLICIES["minimal"])
    r = planner("estimate", "--plan", str(p), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step_time_s"] == pytest.approx(direct["step_time_s"])
    # flags given with --plan override the file's values
    r = planner("estimate", "--plan", str(p), "--micro-batch", "2", "--remat", "full", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["plan"]["micro_batch"] == 2 and out["plan"]["remat"] == "full"


def test_cli_estimate_needs_a_source(tmp_path):
    r = planner("estimate", "-n", "64")
    assert r.returncode == 2
    assert "--model" in r.stderr and "--plan" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_cli_estimate_bad_plan_file_exit_2(tmp_path):
    p = _edit(_save(tmp_path), lambda d: d.update(version=0))
    r = planner("estimate", "--plan", str(p))
    assert r.returncode == 2
    assert str(p) in r.stderr and "version" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = planner("estimate", "--plan", str(tmp_path / "absent.yaml"))
    assert r.returncode == 2 and "not found" in r.stderr


def test_cli_estimate_two_sources_refused(tmp_path):
    p = _save(tmp_path)
    r = planner("estimate", "--plan", str(p), "--from-maxtext", str(p))
    assert r.returncode == 2 and "only one" in r.stderr
