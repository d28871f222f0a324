"""The plan flags resolved once (cli.plan_flags): every plan-taking command accepts a plan file and the MaxText /
Megatron-LM imports with flags over them, --offload has one parser, the framework defaults by vendor and says so,
and the help text is plain (one style for defaults, no type noise), with `planner --version`."""

from __future__ import annotations

import json
import re
from importlib.metadata import version

import pytest
import typer

from cli.plan_flags import PlanFlags, resolve_plan
from costmodel.plan import parse_remat
from hardware.errors import InputError
from tests.test_cli_errors import assert_one_line_error, planner

TPU_JOB = ("-m", "llama3-8b", "-H", "tpu-v5p", "-n", "8", "--fsdp", "8", "-b", "16")
GPU_JOB = ("-m", "llama3-8b", "-H", "h100-sxm", "-n", "8", "--tp", "8", "-b", "16")


def run(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    return planner(capsys, monkeypatch, *args)


def ok_json(capsys, monkeypatch, *args: str) -> dict:
    code, out, err = run(capsys, monkeypatch, *args, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.fixture
def sources(tmp_path, capsys, monkeypatch) -> dict[str, tuple[str, ...]]:
    """{flag: the source flags}: a plan file (TPU), its MaxText export, and a GPU plan's Megatron-LM export."""
    plan, gpu = tmp_path / "p.yaml", tmp_path / "g.yaml"
    for job, path in ((TPU_JOB, plan), (GPU_JOB, gpu)):
        code, _, err = run(capsys, monkeypatch, "estimate", *job, "--framework", "maxtext", "--save-plan", str(path))
        assert code == 0, err
    mt, mg = tmp_path / "mt.yml", tmp_path / "mg.sh"
    for src, fmt, out in ((plan, "maxtext", mt), (gpu, "megatron", mg)):
        code, _, err = run(capsys, monkeypatch, "export", "--plan", str(src), "-f", fmt, "-o", str(out))
        assert code == 0, err
    return {"--plan": ("--plan", str(plan)), "--from-maxtext": ("--from-maxtext", str(mt)),
            "--from-megatron": ("--from-megatron", str(mg), "-H", "h100-sxm"), "gpu plan": ("--plan", str(gpu))}


@pytest.mark.parametrize("source", ["--plan", "--from-maxtext", "--from-megatron"])
def test_every_plan_command_takes_each_source_with_flags_over_it(source, sources, tmp_path, capsys, monkeypatch):
    src = sources[source]
    base = ok_json(capsys, monkeypatch, "estimate", *src)
    over = ok_json(capsys, monkeypatch, "estimate", *src, "--micro-batch", "2", "--remat", "minimal")
    assert over["plan"]["micro_batch"] == 2 and over["plan"]["remat"] == "minimal"
    assert over["plan"]["micro_batch"] != base["plan"]["micro_batch"]
    ex = ok_json(capsys, monkeypatch, "explain", *src, "--micro-batch", "2", "--remat", "minimal", "--no-what-ifs")
    assert ex["cost"]["step_time_s"] == over["step_time_s"]  # the same plan as estimate's
    code, _, err = run(capsys, monkeypatch, "plot", *src, "--micro-batch", "2", "-o", str(tmp_path / "f.svg"))
    assert code == 0 and (tmp_path / "f.svg").stat().st_size > 1000, err
    out = tmp_path / "x.json"
    code, _, err = run(capsys, monkeypatch, "export", *src, "--micro-batch", "2", "-f", "json", "-o", str(out))
    assert code == 0, err
    again = ok_json(capsys, monkeypatch, "estimate", "--plan", str(out))
    assert again["step_time_s"] == pytest.approx(ok_json(capsys, monkeypatch, "estimate", *src, "--micro-batch",
                                                         "2")["step_time_s"])
    # validate resolves the same source before jax starts: too few devices is said at once
    code, _, err = run(capsys, monkeypatch, "validate", *src, "--devices", "4")
    assert_one_line_error(code, err, "needs 8 devices")


def test_sweep_takes_a_plan_source(sources, capsys, monkeypatch):
    d = ok_json(capsys, monkeypatch, "sweep", *sources["--plan"], "--vary", "seq_len=2048,4096")
    assert [(r["chips"], r["global_batch"], r["seq_len"], r["framework"]) for r in d["rows"]] == \
        [(8, 16, 2048, "maxtext"), (8, 16, 4096, "maxtext")]
    assert d["notes"] == []  # the file's framework
    code, _, err = run(capsys, monkeypatch, "sweep", *sources["--plan"], "--vary", "chips=8,16", "-n", "8")
    assert_one_line_error(code, err, "--vary chips and --chips")


def test_one_offload_parser(sources, capsys, monkeypatch):
    """--offload over a plan source is checked as over flags: repeats and contradictions named (the plan-file path
    used to accept them)."""
    for cmd in ("estimate", "explain"):
        code, _, err = run(capsys, monkeypatch, cmd, *sources["--plan"], "--offload", "opt,optimizer")
        assert_one_line_error(code, err, "--offload opt", "--offload optimizer")
        code, _, err = run(capsys, monkeypatch, cmd, *sources["--plan"], "--remat", "custom:qkv_proj=device",
                           "--offload", "query_proj")
        assert_one_line_error(code, err, "--remat qkv_proj=device", "--offload query_proj")
    a = ok_json(capsys, monkeypatch, "estimate", *sources["--plan"], "--offload", "query_proj,optimizer")
    b = ok_json(capsys, monkeypatch, "estimate", *TPU_JOB, "--framework", "maxtext", "--offload", "query_proj",
                "--offload", "optimizer")
    assert a["plan"] == b["plan"] and a["plan"]["remat_tensors"]["qkv_proj"] == "offload"
    assert a["plan"]["offload_optimizer"] and a["step_time_s"] == b["step_time_s"]


def test_framework_defaults_by_vendor_and_says_so(sources, capsys, monkeypatch):
    gpu = ok_json(capsys, monkeypatch, "estimate", *GPU_JOB)
    named = ok_json(capsys, monkeypatch, "estimate", *GPU_JOB, "--framework", "megatron")
    assert gpu["notes"] == ["framework megatron: the default on GPUs (--framework to change)"]
    assert named["notes"] == [] and gpu["step_time_s"] == named["step_time_s"]
    tpu = ok_json(capsys, monkeypatch, "explain", *TPU_JOB, "--no-what-ifs")
    assert tpu["job"]["framework"] == "maxtext" and "the default on TPUs" in tpu["notes"][0]
    code, out, err = run(capsys, monkeypatch, "estimate", *GPU_JOB)
    assert code == 0 and "note: framework megatron: the default on GPUs" in err and "note:" not in out
    # a plan file keeps its own framework, without a note
    kept = ok_json(capsys, monkeypatch, "explain", *sources["gpu plan"], "--no-what-ifs")
    assert kept["job"]["framework"] == "maxtext" and kept["notes"] == []


def test_sweep_framework_by_each_points_vendor(capsys, monkeypatch):
    d = ok_json(capsys, monkeypatch, "sweep", "-m", "llama3-8b", "-n", "8", "-b", "8", "--vary",
                "hardware=tpu-v5p,h100-sxm")
    assert [(r["hardware"], r["framework"]) for r in d["rows"]] == [("tpu-v5p", "maxtext"), ("h100-sxm", "megatron")]
    assert len(d["notes"]) == 2


def test_resolve_plan_rules(tmp_path):
    r = resolve_plan(PlanFlags(model="llama3-8b", chips=8, global_batch=8, fsdp=8, offload=("optimizer",)))
    assert (r.chips, r.plan.fsdp, r.plan.offload_optimizer, r.job.seq_len, r.job.framework) == \
        (8, 8, True, 4096, "maxtext")
    with pytest.raises(InputError, match="--chips, --global-batch: required"):
        resolve_plan(PlanFlags(model="llama3-8b"))
    with pytest.raises(InputError, match="--plan and --from-maxtext: give only one plan source"):
        resolve_plan(PlanFlags(plan_file="a.yaml", from_maxtext="b.yml"))
    # not required (validate): the chips follow the degrees, one micro-batch per batch shard
    r = resolve_plan(PlanFlags(model="llama3-8b", dp=2, tp=2, micro_batch=3), required=())
    assert (r.chips, r.job.global_batch) == (4, 6)
    assert r.plan.remat == parse_remat("full")


def test_validate_takes_flags_over_a_plan_file(sources):
    from cli.validate_cmds import resolve_validated

    r = resolve_validated(PlanFlags(plan_file=sources["--plan"][1], model="llama3-70b", fsdp=4, chips=4), "cpu-host")
    assert (r.model.name, r.plan.fsdp, r.chip.name) == ("llama3-70b", 4, "cpu-host")
    with pytest.raises(InputError, match="--chips 16: the plan's degrees multiply to 8"):
        resolve_validated(PlanFlags(plan_file=sources["--plan"][1], chips=16), "cpu-host")


# ---- help and --version ------------------------------------------------------------------------------------------

def _commands() -> list[tuple[str, ...]]:
    from cli.main import _register, app

    _register()
    out = []

    def walk(cmd, path):
        subs = getattr(cmd, "commands", {})
        out.append(path)
        for name, sub in subs.items():
            walk(sub, (*path, name))

    walk(typer.main.get_command(app), ())
    return out


@pytest.mark.parametrize("path", _commands(), ids=lambda p: " ".join(p) or "planner")
def test_help_is_plain_and_shows_defaults_one_way(path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run(capsys, monkeypatch, *path, "--help")
    assert code == 0 and out.startswith("Usage:"), err
    text = " ".join(out.split())  # (lines wrap at the terminal's width)
    for noise in ("<bool>", "<int>", "<str>", "<float>", "list[", "(default", "[default: ]"):
        assert noise not in text, (noise, out)
    assert not re.search(r" [.,;](\s|$)", text), out  # a stray " ." (rich markup once ate "[...]" before it)
    if "Commands:" in out:  # each command's summary whole in 80 columns (click cuts a long one with '...')
        assert "..." not in out.split("Commands:")[1], out
    shown = text.replace("[default: ", "").replace("; default: ", "")  # (click: "[env var: X; default: 1]")
    assert "default" not in shown.replace("default search", ""), out


def test_version(capsys, monkeypatch):
    code, out, _ = run(capsys, monkeypatch, "--version")
    assert code == 0 and out.strip() == f"planner {version('llm-planner')}"


def test_no_arguments_prints_the_help(capsys, monkeypatch):
    code, out, _ = run(capsys, monkeypatch)
    assert code == 0 and "Usage: planner" in out and "estimate" in out


def test_plan_commands_share_one_flag_group(capsys, monkeypatch):
    """estimate, explain, plot and export take the same plan flags, spelled and explained the same."""
    from cli.main import _register, app

    _register()
    group = typer.main.get_command(app)

    def plan_opts(name: str) -> dict[str, tuple]:
        return {p.name: (tuple(p.opts), p.help) for p in group.commands[name].params
                if p.name not in ("out", "as_json", "save_plan_to", "no_what_ifs", "fmt", "force")}

    ref = plan_opts("estimate")
    assert len(ref) == 32 and all(plan_opts(c) == ref for c in ("explain", "plot", "export"))
