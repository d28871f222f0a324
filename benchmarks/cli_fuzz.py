"""Random `planner suggest`, `estimate`, `explain` and `export` calls: exit codes, tracebacks, suggest's latency.

Usage: python benchmarks/cli_fuzz.py [--seed 1] [--suggest 150] [--plans 300] [--write]
Draws models (presets and sizes), hardware, chip counts, sequence lengths, batches, frameworks and precisions at
random, and for estimate/explain random degree factorizations of the chip count, remat policies and offloads
(some invalid on purpose); a share of the estimates saves its plan file, which `export` then turns into a MaxText,
Megatron-LM or JSON config (the nearest plan that framework runs). Each call runs in-process through the CLI's own
entry point (cli.main.main), so a traceback is an exception that escaped it. Prints exit codes by command, every
call that raised or exited with a code other than 0 (a plan), 1 (nothing fits) or 2 (bad input, one `error:` line
on stderr), suggest's wall time percentiles (start-up excluded) and its slowest calls. Then the hostile path and
count classes of benchmarks/hostile.py (outputs to folders, missing folders, /proc, /sys, devices; counts far past
any job), each call in its own process under a time and memory limit (--no-hostile skips them). --write saves
benchmarks/cli_fuzz_report.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cli import main as cli_main  # noqa: E402

MODELS = ["deepseek-v2-236b", "deepseek-v2-lite-16b", "deepseek-v3-671b", "gemma3-12b", "gpt3-175b", "llama2-13b",
          "llama2-70b", "llama2-7b", "llama3-405b", "llama3-70b", "llama3-8b", "megatron-gpt-1.7b",
          "megatron-gpt-1008.0b", "mistral-7b", "mixtral-8x22b", "mixtral-8x7b", "mpt-30b", "nemotron4-340b",
          "palm-540b", "1T", "3B", "175B", "20B"]
HARDWARE = ["tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu-v7", "a100-40gb", "a100-80gb", "h100-sxm", "h800", "h200",
            "b200", "gb200"]
CHIPS = [1, 2, 4, 8, 16, 24, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096, 6144, 8192]
SEQS = [512, 2048, 4096, 8192, 32768, 131072]
FRAMEWORKS = ["maxtext", "megatron", "pytorch-fsdp", "deepspeed"]


def call(args: list[str]) -> tuple[int, str, str | None, float]:
    """(exit code, stderr, traceback or None, seconds) of one `planner` call."""
    sys.argv = ["planner", *args]
    out, err = io.StringIO(), io.StringIO()
    code, tb = 0, None
    t = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli_main.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception:  # noqa: BLE001  (what the fuzz looks for)
        code, tb = -1, traceback.format_exc(limit=4)
    return code, err.getvalue(), tb, time.perf_counter() - t


def suggest_args(rnd: random.Random) -> list[str]:
    args = ["suggest", "-m", rnd.choice(MODELS), "-n", str(rnd.choice(CHIPS)), "-H", rnd.choice(HARDWARE),
            "-s", str(rnd.choice(SEQS)), "--json"]
    if rnd.random() < 0.4:
        args += ["-b", str(rnd.choice([1, 7, 16, 64, 256, 1024, 4096]))]
    if rnd.random() < 0.8:
        args += ["--framework", rnd.choice(FRAMEWORKS)]
    if rnd.random() < 0.2:
        args += ["--precision", rnd.choice(["fp8", "int8"])]
    if rnd.random() < 0.2:
        args += ["--export", rnd.choice(["maxtext", "megatron"])]
    return args


def plan_args(rnd: random.Random) -> list[str]:
    cmd = rnd.choice(["estimate", "estimate", "explain"])
    n = rnd.choice([8, 16, 64, 256, 1024])
    args = [cmd, "-m", rnd.choice(MODELS), "-n", str(n), "-H", rnd.choice(HARDWARE), "-s", str(rnd.choice(SEQS)),
            "-b", str(rnd.choice([64, 512, 1024, 4096]))]
    rest = n
    for axis in rnd.sample(["--tp", "--pp", "--cp", "--ep", "--dp"], 5):
        if rnd.random() < 0.5:
            d = rnd.choice([x for x in (1, 2, 4, 8, 16) if rest % x == 0])
            args, rest = args + [axis, str(d)], rest // d
    args += ["--fsdp", str(rest)]
    if rnd.random() < 0.2:
        args += ["--vpp", str(rnd.choice([2, 4]))]
    if rnd.random() < 0.3:
        args += ["--micro-batch", str(rnd.choice([1, 2, 4]))]
    if rnd.random() < 0.2:
        args += ["--zero", str(rnd.choice([0, 1, 2, 3]))]
    if rnd.random() < 0.5:
        args += ["--remat", rnd.choice(["none", "selective", "full", "minimal", "save_qkv_proj", "bogus"])]
    if rnd.random() < 0.2:
        args += ["--offload", rnd.choice(["optimizer", "params", "qkv_proj", "x"])]
    if rnd.random() < 0.3:
        args += ["--framework", rnd.choice(FRAMEWORKS)]
    if rnd.random() < 0.1:
        args += ["--vocab-tiles", str(rnd.choice([1, 2, 3, 4]))]
    if rnd.random() < 0.1:
        args += ["--slices", str(rnd.choice([1, 2, 4]))]
    if cmd == "explain":
        args += ["--no-what-ifs"] if rnd.random() < 0.5 else []
    return args + ["--json"] if cmd == "estimate" and rnd.random() < 0.5 else args


def problem(code: int, err: str, tb: str | None) -> str:
    if tb is not None:
        return "traceback: " + tb.strip().splitlines()[-1]
    if code not in (0, 1, 2):
        return f"exit code {code}"
    lines = err.strip().splitlines()
    if code == 2 and (len(lines) != 1 or not lines[0].startswith("error: ")):
        return "exit 2 without a one-line 'error:' message: " + err.strip()[:200]
    return ""


def exit_code_lines(codes: dict[str, dict[int, int]]) -> list[str]:
    """One line per command (or file kind): its exit codes and how often each came."""
    return [f"  {k:9s} " + ", ".join(f"{c}: {n}" for c, n in sorted(v.items())) for k, v in sorted(codes.items())]


def emit(lines: list[str], report: str, write: bool) -> None:
    """Print the report; with write, save it as benchmarks/<report>."""
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if write:
        (ROOT / "benchmarks" / report).write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--suggest", type=int, default=150)
    ap.add_argument("--plans", type=int, default=300)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--no-hostile", action="store_true", help="skip the hostile path and count classes")
    a = ap.parse_args()
    cli_main._register()
    rnd = random.Random(a.seed)
    runs = [suggest_args(rnd) for _ in range(a.suggest)] + [plan_args(rnd) for _ in range(a.plans)]
    codes: dict[str, dict[int, int]] = {}
    problems, times = [], []
    tmp = Path(tempfile.mkdtemp(prefix="cli_fuzz_"))
    queue = list(runs)
    while queue:
        args = queue.pop(0)
        if args[0] == "estimate" and rnd.random() < 0.4:  # then export the saved plan
            args = [*args, "--save-plan", str(tmp / "plan.yml")]
        code, err, tb, secs = call(args)
        cmd = args[0]
        codes.setdefault(cmd, {}).setdefault(code, 0)
        codes[cmd][code] += 1
        if p := problem(code, err, tb):
            problems.append(f"  {p}\n    planner {' '.join(args)}")
        if cmd == "suggest" and code in (0, 1):
            times.append((secs, " ".join(x for x in args[1:] if x != "--json")))
        if cmd == "estimate" and code == 0 and "--save-plan" in args:
            fmt = rnd.choice(["maxtext", "megatron", "json"])
            queue.insert(0, ["export", "--plan", str(tmp / "plan.yml"), "--format", fmt,
                             "-o", str(tmp / f"out.{fmt}")])
    times.sort()
    lines = [f"# planner CLI fuzz: seed {a.seed}, {a.suggest} suggest and {a.plans} estimate/explain calls (and an "
             "export of a share of the estimates' plans), in-process",
             "exit codes by command (0 plan, 1 nothing fits, 2 bad input):"]
    lines += exit_code_lines(codes)
    lines.append(f"calls that raised, exited otherwise or broke the one-line error rule: {len(problems)}")
    lines += problems
    if times:
        pct = [times[min(len(times) - 1, int(q * len(times)))][0] for q in (0.5, 0.9, 0.99)]
        lines.append(f"suggest wall time (s, {len(times)} answered, start-up excluded): median {pct[0]:.2f}, "
                     f"p90 {pct[1]:.2f}, p99 {pct[2]:.2f}, max {times[-1][0]:.2f}")
        lines.append("slowest:")
        lines += [f"  {t:6.2f} s  {args}" for t, args in times[-5:][::-1]]
    if not a.no_hostile:
        import hostile

        lines += hostile.report_lines(*hostile.run_cases(hostile.path_cases() + hostile.count_cases()))
    emit(lines, "cli_fuzz_report.txt", a.write)


if __name__ == "__main__":
    main()
