"""Hostile inputs for the fuzzers (issue 31): each case is one `planner` call in its own process, in a fresh
folder, under a 10 s wall-clock limit, with its peak memory measured (os.wait4's ru_maxrss).

A case fails when the call prints a traceback, exits with a code it should not (2 for bad input, 1 for a valid
job that nothing fits, 130 for an interrupt), prints more than one `error:` line for exit 2, runs past 10 s, uses
more than 2 GB, leaves a file it should not have written (an output despite the error, a `pwned` file), or writes
an export that carries content from a name: a MaxText YAML whose keys differ from the planner's, a Megatron file
that, sourced by bash in a sandbox folder, runs anything or defines other arguments.

Classes: names (line breaks, carriage returns, U+2028, ESC, shell and YAML syntax in model, hardware and plan
names), aliases (YAML alias bombs), encodings (Latin-1, UTF-16, NUL bytes), nesting (5,000 levels), numbers
(5,000 digits, 1e400), tables (a 200 KB CSV field, a CSV over the size cap), paths (outputs to folders, missing
folders, /proc, /sys, /dev/full), counts (chips, devices, spares, sweep points, batch). cli_fuzz.py runs the
paths and counts classes, config_fuzz.py the file classes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PLANNER = [sys.executable, "-c", "from cli.main import main; main()"]
TIME_LIMIT_S = 10.0
MEMORY_LIMIT_MB = 2048

NAMES = ["x\necho INJECTED > pwned.txt\n#", "y\nrun_name: injected\nbase_output_directory: gs://elsewhere",
         "r\recho INJECTED > pwned.txt", "u\u2028run_name: injected", "e\x1b[31mred\x1b[0m", "n\x85next: 1",
         "q'\"; touch pwned.txt; '", "$(touch pwned.txt)", "`touch pwned.txt`", "[red]markup[/red]",
         "n" * 5000]
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))


@dataclass(frozen=True)
class Case:
    klass: str
    what: str
    args: list[str]
    files: dict[str, bytes]  # written into the case's folder first
    expect: tuple[int, ...] = (2,)
    must_not_exist: tuple[str, ...] = ()  # outputs the call must not leave behind
    check: Callable[[Path], str] | None = None  # extra check on the folder after the call ('' = fine)


@dataclass(frozen=True)
class Outcome:
    code: int
    stderr: str
    seconds: float
    peak_mb: float
    timed_out: bool


def run(args: list[str], cwd: Path, timeout: float = TIME_LIMIT_S) -> Outcome:
    """One `planner` call in a new process group; killed (with its children) at the time limit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryFile() as err:
        t = time.perf_counter()
        p = subprocess.Popen([*PLANNER, *args], cwd=cwd, stdout=subprocess.DEVNULL, stderr=err,
                             stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        timed_out = False
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t > timeout:
                timed_out = True
                os.killpg(p.pid, signal.SIGKILL)
                pid, status, ru = os.wait4(p.pid, 0)
                break
            time.sleep(0.01)
        p.returncode = os.waitstatus_to_exitcode(status)
        secs = time.perf_counter() - t
        err.seek(0)
        text = err.read(200_000).decode("utf-8", "replace")
    return Outcome(p.returncode, text, secs, ru.ru_maxrss / 1024, timed_out)


def judge(case: Case, out: Outcome, folder: Path) -> str:
    """'' when the call behaved, else what went wrong."""
    if out.timed_out:
        return f"ran past {TIME_LIMIT_S:.0f} s"
    if out.peak_mb > MEMORY_LIMIT_MB:
        return f"used {out.peak_mb:.0f} MB"
    if "Traceback" in out.stderr:
        return "traceback: " + out.stderr.strip().splitlines()[-1][:200]
    if out.code not in case.expect:
        return f"exit {out.code}, expected {case.expect}: {out.stderr.strip()[:200]!r}"
    lines = out.stderr.strip().splitlines()
    if out.code == 2 and (len(lines) != 1 or not lines[0].startswith("error: ") or len(lines[0]) > 500):
        return f"exit 2 without one short 'error:' line: {out.stderr.strip()[:200]!r}"
    if not out.stderr.isprintable() and any(c == "\x1b" for c in out.stderr):
        return "a terminal escape reached stderr"
    for name in (*case.must_not_exist, "pwned.txt"):
        if (folder / name).exists():
            return f"left {name}"
    return case.check(folder) if case.check else ""


def run_cases(cases: list[Case]) -> tuple[dict[str, dict], list[str]]:
    """Run every case in its own folder: per class {calls, failures, max seconds, max MB}, and the failures."""
    stats: dict[str, dict] = {}
    failures: list[str] = []
    for case in cases:
        folder = Path(tempfile.mkdtemp(prefix="hostile_"))
        try:
            for name, data in case.files.items():
                (folder / name).write_bytes(data)
            out = run(case.args, folder)
            verdict = judge(case, out, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        s = stats.setdefault(case.klass, {"calls": 0, "failures": 0, "max_s": 0.0, "max_mb": 0.0})
        s["calls"] += 1
        s["max_s"] = max(s["max_s"], out.seconds)
        s["max_mb"] = max(s["max_mb"], out.peak_mb)
        if verdict:
            s["failures"] += 1
            failures.append(f"  [{case.klass}] {case.what}: {verdict}\n    planner {' '.join(case.args)[:300]}")
    return stats, failures


def report_lines(stats: dict[str, dict], failures: list[str]) -> list[str]:
    lines = [f"hostile cases (own process each; limits {TIME_LIMIT_S:.0f} s, {MEMORY_LIMIT_MB} MB):",
             "  class      calls  failures  slowest (s)  peak memory (MB)"]
    lines += [f"  {k:9s} {s['calls']:6d} {s['failures']:9d} {s['max_s']:12.2f} {s['max_mb']:17.0f}"
              for k, s in sorted(stats.items())]
    n = sum(s["calls"] for s in stats.values())
    lines.append(f"hostile cases that failed (traceback, hang, memory, wrong exit, injected or leftover content): "
                 f"{len(failures)} of {n}")
    return lines + failures


# ---- files -------------------------------------------------------------------------------------------------------

def _yaml(data: object) -> bytes:
    return yaml.safe_dump(data, allow_unicode=True, sort_keys=False).encode()


def _model(name: str = "m") -> dict:
    return {"name": name, "n_layers": 2, "d_model": 256, "n_heads": 4, "ffn_dim": 1024, "vocab_size": 1000}


def _profile(name: str = "chip") -> dict:
    return {**yaml.safe_load((ROOT / "hardware/profiles/h100-sxm.yaml").read_text()), "name": name}


def _plan_file(model: dict | str = "llama3-8b", hardware: dict | str = "h100-sxm") -> dict:
    return {"version": 1, "model": model, "hardware": hardware, "chips": 8,
            "job": {"seq_len": 1024, "global_batch": 64}, "plan": {"degrees": {"fsdp": 8}}}


EST = ["-n", "8", "--fsdp", "8", "-b", "64", "-s", "1024"]


def export_is_clean(folder: Path) -> str:
    """The exports a call wrote carry nothing but the planner's content: a MaxText YAML parses to the expected
    keys; a Megatron file, sourced by bash in the folder, creates nothing and defines only flags and values."""
    for f in folder.glob("*.maxtext.yml"):
        keys = set(yaml.safe_load(f.read_text()))
        if "run_name" in keys or "base_output_directory" in keys or "next" in keys:
            return f"{f.name}: injected keys"
    for f in folder.glob("*.megatron.sh"):
        before = set(os.listdir(folder))
        r = subprocess.run(["bash", "-c", f'source "./{f.name}"; printf "%s\\n" "${{MEGATRON_ARGS[@]}}"'],
                           cwd=folder, capture_output=True, text=True, timeout=10)
        if set(os.listdir(folder)) != before or "INJECTED" in r.stdout + r.stderr or r.returncode:
            return f"{f.name}: sourcing it ran something (rc {r.returncode}, {r.stderr.strip()[:100]!r})"
    return ""


def _refused(name: str) -> bool:
    """A name the loader must refuse: control characters or line breaks once YAML has read it, or too long."""
    read = yaml.safe_load(_yaml({"name": name}))["name"]
    return not read.isprintable() or len(read) > 128


def name_cases() -> list[Case]:
    """Hostile names in a model YAML, a hardware profile and a plan file's inline model: refused when loaded
    (exit 2, nothing written) when they carry control characters, else costed and exported as plain data."""
    out = []
    for i, name in enumerate(NAMES):
        expect, gone = ((2,), ("p.yml", "out.megatron.sh", "out.maxtext.yml")) if _refused(name) else ((0,), ())
        out.append(Case("names", f"model name {i}", ["estimate", "-m", "m.yaml", "-H", "h100-sxm", *EST,
                                                       "--save-plan", "p.yml"],
                        {"m.yaml": _yaml(_model(name))}, expect, gone[:1]))
        out.append(Case("names", f"hardware name {i}", ["estimate", "-m", "llama3-8b", "-H", "c.yaml", *EST],
                        {"c.yaml": _yaml(_profile(name))}, expect))
        for fmt, suffix in (("megatron", "sh"), ("maxtext", "yml")):
            out.append(Case("names", f"plan file, inline model name {i}, {fmt} export",
                            ["export", "--plan", "p.yml", "--format", fmt, "-o", f"out.{fmt}.{suffix}"],
                            {"p.yml": _yaml(_plan_file(_model(name)))}, expect, gone[1:], check=export_is_clean))
    # a clean export of each format, checked the same way (the check itself must pass on good output)
    for fmt, suffix in (("megatron", "sh"), ("maxtext", "yml")):
        out.append(Case("names", f"clean {fmt} export", ["export", "--plan", "p.yml", "--format", fmt, "-o",
                                                          f"out.{fmt}.{suffix}"],
                        {"p.yml": _yaml(_plan_file(_model("clean-name")))}, expect=(0,), check=export_is_clean))
    return out


def _readers(data: bytes, suffix: str = "yml") -> list[tuple[str, list[str], dict[str, bytes]]]:
    """The same bytes given as each kind of input file."""
    f = f"f.{suffix}"
    return [("model", ["estimate", "-m", f, "-H", "h100-sxm", *EST], {f: data}),
            ("hardware", ["estimate", "-m", "llama3-8b", "-H", f, *EST], {f: data}),
            ("plan", ["export", "--plan", f, "--format", "json"], {f: data}),
            ("maxtext config", ["estimate", "--from-maxtext", f, "-H", "tpu-v5p", "-n", "64"], {f: data}),
            ("megatron args", ["estimate", "--from-megatron", f, "-H", "h100-sxm", "-n", "64"], {f: data}),
            ("runs csv", ["bench", "published", "--file", "f.csv"], {"f.csv": data}),
            ("sweep model", ["sweep", "-m", f, "-H", "h100-sxm", "-n", "8", "--vary", "seq_len=1024:2048:x2"],
             {f: data})]


def file_cases() -> list[Case]:
    """Aliases, encodings, nesting, huge numbers and oversized tables in every kind of input file."""
    deep = ("name: " + "[" * 5000 + "]" * 5000 + "\n").encode()
    deep_json = ('{"version": 1, "model": ' + "[" * 5000 + "]" * 5000 + "}").encode()
    bodies = {
        "aliases": [("alias bomb", BOMB.encode()), ("alias bomb in a name", (BOMB + "name: *i\n").encode())],
        "encodings": [("Latin-1", "name: caf\xe9\n".encode("latin-1")),
                      ("UTF-16", "name: x\n".encode("utf-16")), ("NUL bytes", b"name: x\x00\x00\n")],
        "nesting": [("5,000 nested lists", deep), ("5,000 nested JSON lists", deep_json)],
        "numbers": [("5,000-digit integer", ("n_layers: " + "9" * 5000 + "\n").encode()),
                    ("1e400", b"n_layers: 1e400\nd_model: 1e400\n")],
    }
    out = [Case(klass, f"{what} as {kind}", args, files)
           for klass, items in bodies.items() for what, data in items for kind, args, files in _readers(data)]
    header = (ROOT / "benchmarks" / "runs_v5p_maxtext.csv").read_text().splitlines()
    wide = header[0] + "\n" + header[1].replace(",", "," + "x" * 200_000 + ",", 1) + "\n"
    out.append(Case("tables", "a 200 KB CSV field", ["bench", "published", "--file", "f.csv"],
                    {"f.csv": wide.encode()}, expect=(0, 2)))
    big = (header[0] + "\n" + "\n".join(header[1:] * (25_000_000 // max(1, len("\n".join(header[1:]))) + 1)))
    out.append(Case("tables", "a 25 MB runs CSV", ["bench", "published", "--file", "f.csv"], {"f.csv": big.encode()}))
    out.append(Case("tables", "a folder as the runs file", ["bench", "published", "--file", "."], {}))
    return out


# ---- paths and counts ---------------------------------------------------------------------------------------------

OUTPUTS = [("estimate --save-plan", ["estimate", "-m", "llama3-8b", "-H", "h100-sxm", *EST, "--save-plan"]),
           ("suggest --save", ["suggest", "-m", "deepseek-v3-671b", "-H", "h100-sxm", "-n", "2048", "--exhaustive",
                               "--save"]),
           ("suggest --export -o", ["suggest", "-m", "deepseek-v3-671b", "-H", "h100-sxm", "-n", "2048",
                                    "--exhaustive", "--export", "megatron", "-o"]),
           ("export -o", ["export", "--plan", "p.yml", "--format", "maxtext", "-o"]),
           ("import --out", ["import", "--from-maxtext", "mt.yml", "-H", "tpu-v5p", "-n", "64", "--out"]),
           ("sweep --out", ["sweep", "-m", "llama3-8b", "-H", "h100-sxm", "--vary", "chips=8:4096:x2", "--out"]),
           ("plot --out", ["plot", "-m", "llama3-8b", "-H", "h100-sxm", *EST, "--out"]),
           ("replan --out", ["replan", "--plan", "p.yml", "-n", "16", "--out"])]
BAD_PATHS = ["missing/x.yml", ".", "/proc/x.yml", "/sys/x.yml", "/dev/full", "/dev/null/x.yml"]


def path_cases() -> list[Case]:
    """Every output flag given a folder, a missing folder, /proc, /sys or a device: exit 2 before any work."""
    files = {"p.yml": _yaml(_plan_file()), "mt.yml": b"base_config: base.yml\nmodel_name: llama3-8b\n"}
    return [Case("paths", f"{flag} {path}", [*args, path], files)
            for flag, args in OUTPUTS for path in BAD_PATHS]


COUNTS = [("chips 10^12", ["estimate", "-m", "llama3-8b", "-H", "h100-sxm", "-n", str(10**12), "--fsdp",
                           str(10**12), "-b", str(10**12)]),
          ("suggest chips 10^9", ["suggest", "-m", "llama3-8b", "-H", "tpu-v5p", "-n", str(10**9)]),
          ("batch 10^18", ["estimate", "-m", "llama3-8b", "-H", "h100-sxm", "-n", "8", "--fsdp", "8",
                           "-b", str(10**18)]),
          ("seq 10^12", ["estimate", "-m", "llama3-8b", "-H", "h100-sxm", *EST[:-2], "-s", str(10**12)]),
          ("validate --devices 10^8", ["validate", "-m", "llama3-8b", "--devices", str(10**8)]),
          ("validate --steps -1", ["validate", "-m", "llama3-8b", "--steps", "-1"]),
          ("validate --num-processes 0", ["validate", "-m", "llama3-8b", "--num-processes", "0"]),
          ("goodput --spares 10^12", ["goodput", "-m", "llama3-8b", "-H", "h100-sxm", "-n", "1024",
                                      "--spares", str(10**12)]),
          ("sweep 10^6 points", ["sweep", "-m", "llama3-8b", "-H", "h100-sxm", "--vary", "chips=8:100000000:+8"]),
          ("sweep chips nan", ["sweep", "-m", "llama3-8b", "-H", "h100-sxm", "--vary", "chips=nan:inf:x2"]),
          ("--fix tp twice", ["suggest", "-m", "llama3-8b", "-H", "h100-sxm", "-n", "64", "--fix", "tp=4,tp=8"]),
          ("--vary chips with --chips", ["sweep", "-m", "llama3-8b", "-H", "h100-sxm", "-n", "256", "--vary",
                                         "chips=8:64:x2"])]


def count_cases() -> list[Case]:
    """Counts far past any real job: refused before any work (exit 2) or answered at once."""
    return [Case("counts", what, args, {}, expect=(1, 2)) for what, args in COUNTS]
