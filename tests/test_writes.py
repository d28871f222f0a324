"""Outputs (issue 31, items 4 and 5): every file is written to a temporary file beside it and renamed, so a failed
write never changes an existing file; every output path is checked before any search; Ctrl-C to a sweep's process
group exits 130 with no traceback, no output file and no process left; calibrate writes the shipped overlays only
when asked, refuses an input with no usable row, and writes the same bytes for the same rows."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from costmodel.job import Job
from costmodel.plan import Plan
from hardware.chip import Efficiency
from hardware.errors import InputError
from tests.test_cli_errors import planner

PLANNER = str(Path(sys.executable).with_name("planner"))
RUNS = Path(__file__).resolve().parents[1] / "benchmarks" / "runs_v5p_maxtext.csv"  # runs schema, tpu-v5p rows
OLD = "old content\n"


def one_error_line(code: int, err: str, *needles: str) -> str:
    assert code == 2, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def disk_full(*_a, **_k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def assert_unchanged(path: Path) -> None:
    """The old file is intact and no temporary file is left beside it."""
    assert path.read_text() == OLD
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


# ---- a failed write leaves the old file -------------------------------------------------------------------

ROWS = [{"model": "llama3-8b", "chips": 8, "feasible": True, "mfu": 0.5}]


@pytest.mark.parametrize("failure", ["rename", "midway"])
def test_sweep_table_failed_write_keeps_the_old_file(tmp_path, monkeypatch, failure):
    pd = pytest.importorskip("pandas")
    from planner.sweep import write_table

    path = tmp_path / "s.csv"
    path.write_text(OLD)
    if failure == "rename":
        monkeypatch.setattr(os, "replace", disk_full)
    else:  # the disk fills after part of the table is written

        def partial(self, target, **_kw):
            Path(target).write_text("model,chi")
            disk_full()

        monkeypatch.setattr(pd.DataFrame, "to_csv", partial)
    with pytest.raises(InputError, match="unchanged"):
        write_table(ROWS, path)
    assert_unchanged(path)


def test_sweep_table_replaces_the_old_file_whole(tmp_path):
    pd = pytest.importorskip("pandas")
    from planner.sweep import write_table

    path = tmp_path / "s.csv"
    path.write_text(OLD)
    write_table(ROWS, path)
    assert list(pd.read_csv(path)["chips"]) == [8]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.csv"]


def _figure():
    from planner.plots import _pyplot

    fig, ax = _pyplot().subplots()
    ax.plot([1, 2], [3, 4])
    return fig


@pytest.mark.parametrize("ext, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_figures_keep_their_format_and_a_failed_save_keeps_the_old_file(tmp_path, monkeypatch, ext, magic):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    from planner import plots

    monkeypatch.setattr(plots, "draw_sweep", lambda *a, **k: _figure())
    path = tmp_path / f"sweep{ext}"
    assert plots.plot_sweep(ROWS, "chips", None, path).read_bytes().startswith(magic)  # the temp name ends in ext
    path.write_text(OLD)

    def partial(self, target, **_kw):
        Path(target).write_bytes(magic)
        disk_full()

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", partial)
    with pytest.raises(InputError, match="unchanged"):
        plots.plot_sweep(ROWS, "chips", None, path)
    assert_unchanged(path)


@pytest.fixture()
def planfile(tmp_path):
    from costmodel.catalog import load_model
    from hardware.catalog import load_hardware
    from planner.planfile import PlanFile, save_plan

    job = Job(seq_len=4096, global_batch=8)
    path = save_plan(tmp_path / "plan.yaml", "llama3-8b", "tpu-v5p", 8, job, Plan(fsdp=8))
    pf = PlanFile(load_model("llama3-8b"), load_hardware("tpu-v5p"), 8, job, Plan(fsdp=8), "llama3-8b", "tpu-v5p")
    return path, pf


def test_export_failed_write_keeps_the_old_file(tmp_path, monkeypatch, planfile):
    from planner.export import write_export

    out = tmp_path / "out" / "args.sh"
    out.parent.mkdir()
    out.write_text(OLD)
    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(InputError, match="unchanged"):
        write_export(planfile[1], "megatron", str(out), warn=None)
    assert_unchanged(out)


def test_overlay_failed_write_keeps_the_old_overlay(tmp_path, monkeypatch):
    from costmodel.calibrate import write_overlay

    path = tmp_path / "tpu-v5p.yaml"
    path.write_text(OLD)
    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(InputError, match="unchanged"):
        write_overlay("tpu-v5p", Efficiency(), {"rows": 1, "mape_pct": 1.0, "worst_pct": 1.0}, "x", tmp_path)
    assert_unchanged(path)


def test_cli_sweep_on_a_full_disk_exits_2_and_keeps_the_old_csv(tmp_path, monkeypatch, capsys):
    pytest.importorskip("pandas")
    import planner.sweep as sw

    path = tmp_path / "s.csv"
    path.write_text(OLD)
    monkeypatch.setattr(sw, "run_points", lambda pts, *a, **k: [{**p, "feasible": False, "reason": "x"}
                                                                  for p in pts])
    monkeypatch.setattr(os, "replace", disk_full)
    code, _, err = planner(capsys, monkeypatch, "sweep", "-m", "llama3-8b", "--vary", "chips=8,16", "--out",
                           str(path))
    one_error_line(code, err, "--out", "unchanged")
    assert_unchanged(path)


def test_cli_import_failed_write_keeps_the_old_file(tmp_path, monkeypatch, capsys, planfile):
    from planner.export import export

    cfg = tmp_path / "run.yml"
    cfg.write_text(export(planfile[1], "maxtext", warn=None))
    out = tmp_path / "out" / "p.yaml"
    out.parent.mkdir()
    out.write_text(OLD)
    monkeypatch.setattr(os, "replace", disk_full)
    code, _, err = planner(capsys, monkeypatch, "import", "--from-maxtext", str(cfg), "-H", "tpu-v5p", "--out",
                           str(out))
    one_error_line(code, err, "--out", "unchanged")
    assert_unchanged(out)


# ---- output paths are checked before any work --------------------------------------------------------------

def _no_work(monkeypatch) -> None:
    """Every search, estimate, plan load or fit fails the test if it is reached."""
    import cli.estimate_cmds
    import costmodel.calibrate
    import planner.explain
    import planner.import_configs
    import planner.planfile
    import planner.solve
    import planner.sweep

    def reached(*_a, **_k):
        raise AssertionError("work started before the output path was checked")

    for mod, name in ((planner.solve, "search"), (planner.sweep, "run_points"), (cli.estimate_cmds, "estimate_cost"),
                      (planner.planfile, "load_plan"),
                      (planner.import_configs, "import_config"), (planner.explain, "explain"),
                      (costmodel.calibrate, "_fit_group")):
        monkeypatch.setattr(mod, name, reached)


def _bad_paths(tmp_path: Path, ext: str) -> dict[str, tuple[str, str]]:
    folder = tmp_path / f"folder{ext}"
    folder.mkdir(exist_ok=True)
    return {"missing folder": (str(tmp_path / "missing" / f"x{ext}"), "does not exist"),
            "a folder": (str(folder), "is a folder"),
            "unwritable": (f"/proc/x{ext}", "not writable")}


DEEPSEEK = ("suggest", "-m", "deepseek-v3-671b", "-H", "tpu-v5p", "-n", "1024", "--exhaustive")
OUTPUTS = {  # (command line before the path, the flag, the extension, command line after it)
    "suggest --save": ((*DEEPSEEK, "--save"), "--save", ".yaml", ()),
    "suggest --export -o": ((*DEEPSEEK, "--export", "maxtext", "-o"), "--out", ".yml", ()),
    "estimate --save-plan": (("estimate", "-m", "llama3-8b", "-n", "8", "--fsdp", "8", "-b", "8", "--save-plan"),
                             "--save-plan", ".yaml", ()),
    "export -o": (("export", "--plan", "PLAN", "-f", "megatron", "-o"), "--out", ".sh", ()),
    "import --out": (("import", "--from-maxtext", "PLAN", "-H", "tpu-v5p", "--out"), "--out", ".yaml", ()),
    "sweep --out": (("sweep", "-m", "llama3-70b", "--vary", "chips=64:1024:x2", "--out"), "--out", ".csv", ()),
    "sweep --plot": (("sweep", "-m", "llama3-70b", "--vary", "chips=64:1024:x2", "--plot"), "--plot", ".png", ()),
    "plot --out": (("plot", "-m", "llama3-8b", "-n", "8", "--fsdp", "8", "-b", "8", "--out"), "--out", ".png", ()),
    "calibrate --out": (("calibrate", "-H", "cpu-host", "--out"), "--out", ".yaml", ()),
}


@pytest.mark.parametrize("kind", ["missing folder", "a folder", "unwritable"])
@pytest.mark.parametrize("case", list(OUTPUTS))
def test_bad_output_path_exits_2_before_any_work(tmp_path, monkeypatch, capsys, planfile, case, kind):
    before, flag, ext, after = OUTPUTS[case]
    path, needle = _bad_paths(tmp_path, ext)[kind]
    args = [str(planfile[0]) if a == "PLAN" else a for a in (*before, path, *after)]
    _no_work(monkeypatch)
    t0 = time.perf_counter()
    code, _, err = planner(capsys, monkeypatch, *args)
    assert time.perf_counter() - t0 < 5, "the path was checked late"
    one_error_line(code, err, flag, needle)


@pytest.mark.parametrize("flag", ["--save", "-o"])
def test_suggest_to_a_device_or_one_file_twice_exits_2(tmp_path, monkeypatch, capsys, flag):
    _no_work(monkeypatch)
    code, _, err = planner(capsys, monkeypatch, *DEEPSEEK, "--export", "json", flag, "/dev/full")
    one_error_line(code, err, "/dev/full", "not a regular file")
    same = str(tmp_path / "p.json")
    code, _, err = planner(capsys, monkeypatch, *DEEPSEEK, "--export", "json", "-o", same, "--save", same)
    one_error_line(code, err, "--save and --out")


def test_overlay_dir_must_exist(tmp_path, monkeypatch, capsys):
    _no_work(monkeypatch)
    code, _, err = planner(capsys, monkeypatch, "calibrate", "-f", str(RUNS), "--overlay-dir", str(tmp_path / "no"))
    one_error_line(code, err, "--overlay-dir", "existing folder")


# ---- sweep: bounded, contradictions named ------------------------------------------------------------------

@pytest.mark.parametrize("args, needles", [
    (("--vary", "chips=nan:inf:x2"), ("--vary chips", "'nan'", "finite positive integer")),
    (("--vary", "chips=8:inf:x2"), ("--vary chips", "finite positive integer")),
    (("--vary", "chips=1e400"), ("--vary chips", "finite positive integer")),
    (("--vary", "chips=8:1e30:x2"), ("--vary chips", "more than 1,048,576")),
    (("--vary", "chips=8:64:xinf"), ("factor", "finite number greater than 1")),
    (("--vary", "chips=8:64:xnan"), ("factor", "finite number greater than 1")),
    (("--vary", "seq_len=1:1000000000:+1", "-n", "8"), ("more than the 2000 points",)),
    (("--vary", "chips=8:64:x2", "--vary", "global_batch=1:1999:+1"), ("--vary", "more than the 2000")),
    (("--vary", "chips=8:64:x2", "--chips", "256"), ("--vary chips and --chips",)),
    (("--vary", "seq_len=1024,2048", "-n", "8", "--seq-len", "4096"), ("--vary seq_len and --seq-len",)),
    (("--vary", "global_batch=8,16", "-n", "8", "-b", "32"), ("--vary global_batch and --global-batch",)),
    (("--vary", "hardware=tpu-v5p,tpu-v4", "-n", "8", "-H", "tpu-v5p"), ("--vary hardware and --hardware",)),
    (("--vary", "chips=8,16", "--workers", "100000"), ("--workers", "at most 256")),
])
def test_sweep_bad_grids_exit_2_before_any_work(monkeypatch, capsys, args, needles):
    _no_work(monkeypatch)
    code, _, err = planner(capsys, monkeypatch, "sweep", "-m", "llama3-8b", *args)
    one_error_line(code, err, *needles)


def test_sweep_varying_model_and_fixing_it_is_a_contradiction(monkeypatch, capsys):
    _no_work(monkeypatch)
    code, _, err = planner(capsys, monkeypatch, "sweep", "--vary", "model=llama3-8b,llama3-70b", "-m", "llama3-8b",
                           "-n", "8")
    one_error_line(code, err, "--vary model and --model")


# ---- Ctrl-C to a sweep --------------------------------------------------------------------------------------

def _group(pgid: int) -> list[int]:
    """The live (not zombie) processes of a process group, from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def _wait_for(check, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
@pytest.mark.parametrize("after", [0.3, 1.5])  # seconds after the workers start: first points, later points
def test_ctrl_c_to_a_sweep_exits_130_with_no_file_and_no_process_left(tmp_path, after):
    out = tmp_path / "s.csv"
    cmd = [PLANNER, "sweep", "-m", "llama3-70b", "--vary", "chips=64:4096:x2", "--vary", "seq_len=2048:16384:x2",
           "--workers", "2", "--out", str(out)]  # 28 points, about 20 s of searching on two cores
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert _wait_for(lambda: len(_group(proc.pid)) >= 3, 60), "the sweep's two workers never started"
        time.sleep(after)  # the workers are searching
        assert proc.poll() is None, "the sweep ended before it could be interrupted"
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        waited = time.monotonic() - t0
        gone = _wait_for(lambda: not _group(proc.pid), 10)
    finally:
        if proc.poll() is None or _group(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert waited < 5, f"the sweep took {waited:.1f} s to stop (it finished the queued points?)"
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 1, err
    assert err.strip() == "error: interrupted", err  # one line, from cli.main
    assert gone, "a worker process outlived the sweep"
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)
    assert list(tmp_path.iterdir()) == [], "a partial or temporary output file was left"


# ---- calibrate ------------------------------------------------------------------------------------------------

def _runs(tmp_path: Path, rows: int, edit: dict | None = None) -> Path:
    """The first `rows` rows of the repository's runs CSV (tpu-v5p), with `edit` applied to each."""
    import csv

    with RUNS.open(newline="") as f:
        reader = csv.DictReader(f)
        fields, data = reader.fieldnames, [next(reader) for _ in range(rows)]
    path = tmp_path / f"runs{rows}.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows({**r, **(edit or {})} for r in data)
    return path


@pytest.mark.parametrize("rows, edit, extra, needles", [
    (0, None, (), ("--file", "no usable row", "runs_dev.csv schema")),
    (2, {"measured_step_time_s": "0"}, (), ("no usable row", "2 skipped", "measured_step_time_s")),
    (2, None, ("-H", "h100-sxm"), ("no usable row for --hardware h100-sxm",)),
])
def test_calibrate_with_no_usable_row_exits_2(tmp_path, monkeypatch, capsys, rows, edit, extra, needles):
    _no_work(monkeypatch)
    code, _, err = planner(capsys, monkeypatch, "calibrate", "-f", str(_runs(tmp_path, rows, edit)), *extra)
    one_error_line(code, err, *needles)


def test_calibrate_contradictory_write_flags_exit_2(tmp_path, monkeypatch, capsys):
    _no_work(monkeypatch)
    for flags, needle in ((("--write-shipped", "--dry-run"), "--write-shipped and --dry-run"),
                          (("--write-shipped", "--overlay-dir", str(tmp_path)), "--write-shipped and --overlay-dir"),
                          (("--out", str(tmp_path / "p.yaml"), "-H", "cpu-host", "--write-shipped"),
                           "--out and --write-shipped")):
        args = flags if "--out" in flags else ("-f", str(RUNS), *flags)
        code, _, err = planner(capsys, monkeypatch, "calibrate", *args)
        one_error_line(code, err, needle)


def test_calibrate_writes_overlays_only_when_asked_and_the_same_bytes_each_time(tmp_path, monkeypatch, capsys):
    import hardware.catalog as catalog

    runs = _runs(tmp_path, 3)
    shipped = catalog.CALIBRATION_DIR / "tpu-v5p.yaml"
    before = shipped.read_bytes()
    code, out, err = planner(capsys, monkeypatch, "calibrate", "-f", str(runs), "--json")
    assert code == 0, err
    assert [r["written"] for r in json.loads(out)] == [None] and shipped.read_bytes() == before
    written = []
    for n in (1, 2):
        folder = tmp_path / f"overlays{n}"
        folder.mkdir()
        code, out, err = planner(capsys, monkeypatch, "calibrate", "-f", str(runs), "--overlay-dir", str(folder))
        assert code == 0 and str(folder / "tpu-v5p.yaml") in out, err
        assert sorted(p.name for p in folder.iterdir()) == ["tpu-v5p.yaml"]
        written.append((folder / "tpu-v5p.yaml").read_bytes())
    assert written[0] == written[1] and shipped.read_bytes() == before  # reproducible byte for byte


def test_calibrate_write_shipped_replaces_the_shipped_overlay(tmp_path, monkeypatch, capsys):
    import hardware.catalog as catalog

    shipped = (catalog.CALIBRATION_DIR / "tpu-v5p.yaml").read_text()
    monkeypatch.setattr(catalog, "CALIBRATION_DIR", tmp_path)  # stands in for hardware/calibration
    (tmp_path / "tpu-v5p.yaml").write_text(shipped)
    try:
        code, _, err = planner(capsys, monkeypatch, "calibrate", "-f", str(_runs(tmp_path, 3)), "--write-shipped")
    finally:
        catalog.with_calibration.cache_clear()  # other tests read the real overlays
    assert code == 0, err
    assert "fitted_on: runs3.csv" in (tmp_path / "tpu-v5p.yaml").read_text()
