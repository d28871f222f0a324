"""Names are data, never code (issue 31, item 1). A model or hardware name, or a plan file's hardware reference,
may hold anything when built in Python; the exports must still parse to exactly the planner's keys (MaxText,
read back with yaml.safe_load) and run nothing when sourced (Megatron, sourced by bash in an empty folder). From
files, the loader refuses such names first: one `error:` line naming the field, exit 2, nothing written. Text
rich would read as markup prints as written."""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from costmodel.catalog import load_model
from costmodel.job import Job
from costmodel.plan import Plan, parse_remat
from hardware.catalog import load_hardware
from hardware.yamlio import to_dict
from planner.export import export
from planner.export_megatron import megatron_args
from planner.planfile import PlanFile, save_plan
from tests.test_cli_errors import assert_one_line_error, planner

INJECTED = "INJECTED"
# Line breaks of bash, YAML 1.1 and Unicode; terminal escapes; quotes; shell expansions; YAML syntax; a forged
# `# planner:` hint; a trailing backslash (no line continuation in a comment); a NUL (not a path to look up).
HOSTILE = (
    f"x\necho {INJECTED} > pwned.txt\n#",
    "y\nrun_name: injected\nbase_output_directory: gs://elsewhere",
    f"c\r\necho {INJECTED} > pwned.txt\r#",
    f"u\u2028run_name: injected\u2029echo {INJECTED}",
    "n\x85run_name: injected",
    "e\x1b[31mred\x1b[0m\x1b]8;;http://e.example\x07",
    f"q\"'; echo {INJECTED} > pwned.txt; '\"",
    "$(touch pwned2)",
    "`touch pwned3`",
    "k: v # not a comment {a: [b]}",
    "back\\",
    "m hardware=evil.yaml chips=1 model=evil",
    "[red]x[/red][link=http://e.example]y[/link]",
    "nul\x00byte",
)
CLEAN = "clean-model"
NOT_PRINTABLE = tuple(n for n in HOSTILE if not n.isprintable())


def _planfile(fmt: str, model_name: str, hw_name: str, hw_ref: str) -> PlanFile:
    """llama3-8b on 64 chips (h100-sxm for Megatron, tpu-v5p for MaxText) with the given names."""
    hw = "h100-sxm" if fmt == "megatron" else "tpu-v5p"
    model = replace(load_model("llama3-8b"), name=model_name)
    chip = replace(load_hardware(hw), name=hw_name)
    if fmt == "megatron":
        return PlanFile(model, chip, 64, Job(4096, 256, framework="megatron"),
                        Plan(dp=16, tp=4, zero=1, remat=parse_remat("selective")), "", hw_ref)
    return PlanFile(model, chip, 64, Job(4096, 256), Plan(fsdp=16, tp=4, remat=parse_remat("full")), "", hw_ref)


def _check_hint(text: str, name: str, hw_ref: str) -> None:
    """The `# planner:` line as import_configs reads it (whitespace-separated key=value) holds only what the
    planner wrote: no key forged by a name with spaces, no value cut short."""
    (line,) = [ln for ln in text.splitlines() if ln.startswith("# planner:")]
    hint = dict(kv.split("=", 1) for kv in line.removeprefix("# planner:").split() if "=" in kv)
    assert hint.get("model", name) == name and hint.get("hardware", hw_ref) == hw_ref and hint["chips"] == "64"


def _same_lines(text: str, clean: str) -> None:
    """Line for line `text` is the clean export except inside `# ` comments, and holds no line break or control
    character of any kind (str.splitlines breaks at \\r, \\x85, U+2028, ... as well as at \\n)."""
    lines, want = text.splitlines(), clean.splitlines()
    assert lines == text.split("\n")[:-1] and all(ln.isprintable() for ln in lines)
    assert len(lines) == len(want)
    for got, line in zip(lines, want, strict=True):
        assert got == line or (got.startswith("# ") and line.startswith("# ")), (got, line)


@pytest.mark.parametrize("name", HOSTILE)
def test_maxtext_export_keeps_exactly_the_planner_keys(name):
    clean = export(_planfile("maxtext", CLEAN, "clean-chip", "/profiles/clean.yaml"), "maxtext", warn=None)
    text = export(_planfile("maxtext", name, name, f"/profiles/{name}.yaml"), "maxtext", warn=None)
    _check_hint(text, name, f"/profiles/{name}.yaml")
    assert yaml.safe_load(text) == yaml.safe_load(clean)
    _same_lines(text, clean)


@pytest.mark.parametrize("name", HOSTILE)
def test_megatron_export_runs_nothing_when_sourced(tmp_path, name):
    pf = _planfile("megatron", name, name, f"/profiles/{name}.yaml")
    text = export(pf, "megatron", warn=None)
    _same_lines(text, export(_planfile("megatron", CLEAN, "h100-sxm", "/profiles/clean.yaml"), "megatron", warn=None))
    _check_hint(text, name, f"/profiles/{name}.yaml")
    (tmp_path / "args.sh").write_text(text)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    r = subprocess.run(["bash", "-c", 'source ./args.sh; printf "%s\\n" "${MEGATRON_ARGS[@]}"'], cwd=tmp_path,
                       capture_output=True, text=True, timeout=10, env=env)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert sorted(os.listdir(tmp_path)) == ["args.sh"]
    assert INJECTED not in r.stdout
    assert r.stdout.splitlines() == megatron_args(pf)[0]


def test_megatron_warning_escapes_the_hardware_name():
    tpu = replace(load_hardware("tpu-v5p"), name="tpu\nx\x1b[31m")
    pf = replace(_planfile("megatron", CLEAN, "", ""), hardware=tpu)
    warnings: list[str] = []
    export(pf, "megatron", warn=warnings.append)
    assert any("tpu\\nx\\x1b[31m" in w for w in warnings) and all(w.isprintable() for w in warnings)


# ---- from files: the loader refuses the name first -----------------------------------------------------------

def _model_file(tmp_path: Path, name: str) -> Path:
    p = tmp_path / "m.yaml"
    p.write_text(yaml.safe_dump({**to_dict(replace(load_model("llama3-8b"), name="mine")), "name": name}))
    return p


@pytest.mark.parametrize("name", NOT_PRINTABLE)
def test_cli_refuses_a_model_file_with_a_hostile_name(tmp_path, capsys, monkeypatch, name):
    m = str(_model_file(tmp_path, name))
    plan = tmp_path / "p.yaml"
    plan.write_text(f"version: 1\nmodel: {m}\nhardware: h100-sxm\nchips: 8\njob: {{seq_len: 4096, global_batch: 8}}\n"
                    "plan: {degrees: {dp: 8}}\n")
    before = set(os.listdir(tmp_path))
    job = ("-H", "h100-sxm", "-n", "8", "-b", "8", "--seq-len", "4096")
    for args in (("estimate", "-m", m, *job, "--dp", "8", "--save-plan", str(tmp_path / "saved.yaml")),
                 ("suggest", "-m", m, *job, "--save", str(tmp_path / "best.yaml")),
                 ("suggest", "-m", m, *job, "--export", "megatron", "-o", str(tmp_path / "args.sh")),
                 ("export", "--plan", str(plan), "--format", "megatron", "-o", str(tmp_path / "out.sh")),
                 ("export", "--plan", str(plan), "--format", "maxtext")):
        code, out, err = planner(capsys, monkeypatch, *args)
        line = assert_one_line_error(code, err, "name")
        assert line.isprintable() and out == "", (line, out)
    assert set(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("name", NOT_PRINTABLE)
def test_cli_refuses_a_plan_file_with_an_inline_hostile_model(tmp_path, capsys, monkeypatch, name):
    model = replace(load_model("llama3-8b"), name="inline-model")
    p = save_plan(tmp_path / "p.yaml", model, "h100-sxm", 64, Job(4096, 256, framework="megatron"),
                  Plan(dp=16, tp=4, zero=1))
    data = yaml.safe_load(p.read_text())
    assert isinstance(data["model"], dict)
    data["model"]["name"] = name
    p.write_text(yaml.safe_dump(data))
    for extra in ((), ("-o", str(tmp_path / "args.sh"))):
        code, out, err = planner(capsys, monkeypatch, "export", "--plan", str(p), "--format", "megatron", *extra)
        assert_one_line_error(code, err, "name")
        assert out == ""
    assert sorted(os.listdir(tmp_path)) == ["p.yaml"]


def test_cli_megatron_export_of_a_printable_hostile_name_is_inert(tmp_path, capsys, monkeypatch):
    name = f"q\"'$(touch pwned2)`touch pwned3`; echo {INJECTED} [red]x[/red] #"
    model = replace(load_model("llama3-8b"), name=name)
    p = save_plan(tmp_path / "p.yaml", model, "h100-sxm", 64, Job(4096, 256, framework="megatron"),
                  Plan(dp=16, tp=4, zero=1))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, _, err = planner(capsys, monkeypatch, "export", "--plan", str(p), "--format", "megatron", "-o",
                           str(out_dir / "args.sh"))
    assert code == 0, err
    r = subprocess.run(["bash", "-c", "source ./args.sh"], cwd=out_dir, capture_output=True, text=True, timeout=10)
    assert r.returncode == 0 and r.stdout == r.stderr == ""
    assert sorted(os.listdir(out_dir)) == ["args.sh"]


# ---- the terminal: rich markup in text from files prints as written ------------------------------------------

def test_catalog_show_prints_markup_from_files_literally(tmp_path, capsys, monkeypatch):
    markup = "[red]x[/red] [link=http://e.example]y[/link]"
    m = tmp_path / "m.yaml"
    m.write_text(yaml.safe_dump({**to_dict(replace(load_model("llama3-8b"), name="[bold]m[/bold]")),
                                 "description": markup, "source": markup}))
    code, out, err = planner(capsys, monkeypatch, "models", "show", str(m))
    assert code == 0, err
    assert "[bold]m[/bold]" in out and out.count(markup) == 2 and "\x1b" not in out
    chip = to_dict(replace(load_hardware("h100-sxm"), name="[bold]h[/bold]", description=markup,
                           sources=(markup,)))
    h = tmp_path / "h.yaml"
    h.write_text(yaml.safe_dump(chip))
    code, out, err = planner(capsys, monkeypatch, "hardware", "show", str(h))
    assert code == 0, err
    assert "[bold]h[/bold]" in out and out.count(markup) == 2 and "\x1b" not in out
