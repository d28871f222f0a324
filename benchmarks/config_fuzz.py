"""Mutated input files through the `planner` CLI: every bad file must get one `error:` line and exit 2.

Usage: python benchmarks/config_fuzz.py [--seed 1] [--calls 1200] [--write]
Starts from good files (a model YAML, a hardware profile, a plan file, a MaxText config and Megatron-LM arguments
exported by the planner, a runs CSV) and mutates one thing each call: a key or flag dropped, a value replaced by a
wrong type, 0, -1, a huge number or NaN, a flag inserted, CSV cells; or a file that is not YAML at all. Each mutated
file is read by `planner estimate` (--model, --hardware, --plan, --from-maxtext, --from-megatron) or `planner bench
published --file` in-process, as cli_fuzz.py runs its calls. Prints exit codes by file kind and every call that
raised, exited otherwise or broke the one-line error rule. Then the hostile file classes of benchmarks/hostile.py
(names, aliases, encodings, nesting, huge numbers, oversized tables), each call in its own process under a time
and memory limit (--no-hostile skips them). --write saves benchmarks/config_fuzz_report.txt.
"""

from __future__ import annotations

import argparse
import collections
import copy
import csv
import io
import random
import shlex
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import hostile  # noqa: E402
from cli_fuzz import call, emit, exit_code_lines, problem  # noqa: E402

BAD = [None, -1, 0, 0, 1.5, "x", [], {}, True, 10**30, float("nan"), "-1", 3]
NOT_YAML = ["", "- 1\n- 2\n", ": :", "a: [1,\n", "\x00\x01", "name: 3\n", "!!python/object/apply:os.system [ls]"]


def mutate_mapping(rnd: random.Random, data: dict) -> dict:
    """One key (at any depth) dropped, given a bad value, or an unknown key added."""
    data = copy.deepcopy(data)
    paths: list[list] = []

    def walk(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                paths.append([*path, k])
                walk(v, [*path, k])
        elif isinstance(x, list):
            for i, v in enumerate(x):
                paths.append([*path, i])
                walk(v, [*path, i])

    walk(data, [])
    path = rnd.choice(paths)
    parent = data
    for k in path[:-1]:
        parent = parent[k]
    r = rnd.random()
    if r < 0.2 and isinstance(parent, dict):
        del parent[path[-1]]
    elif r < 0.3 and isinstance(parent, dict):
        parent["not_a_key"] = 1
    else:
        parent[path[-1]] = rnd.choice(BAD)
    return data


def mutate_args(rnd: random.Random, text: str) -> str:
    """One token of a Megatron-LM argument list dropped, replaced or preceded by a flag."""
    toks = shlex.split(text, comments=True)
    j = rnd.randrange(len(toks))
    r = rnd.random()
    if r < 0.3:
        del toks[j]
    elif r < 0.7:
        toks[j] = str(rnd.choice(BAD))
    else:
        toks.insert(j, rnd.choice(["--bogus", "--tensor-model-parallel-size", "--fp16", "--num-experts", "8"]))
    return " ".join(shlex.quote(t) for t in toks)


def mutate_csv(rnd: random.Random, text: str) -> str:
    """One to five cells of a runs CSV replaced by a blank, 0, -1, inf, nan, 1e30 or a word."""
    rows = list(csv.reader(io.StringIO(text)))
    for _ in range(rnd.choice([1, 1, 2, 5])):
        row = rnd.choice(rows[1:])
        row[rnd.randrange(len(row))] = rnd.choice(["", "0", "-1", "inf", "nan", "1e30", "x", "true", "3.5"])
    out = io.StringIO()
    csv.writer(out).writerows(rows)
    return out.getvalue()


def good_files(tmp: Path) -> dict[str, object]:
    """The files the mutations start from, written by the planner itself."""
    plan_args = ["-m", "llama3-8b", "-H", "h100-sxm", "-n", "8", "--fsdp", "8", "-b", "64"]
    call(["estimate", *plan_args, "--save-plan", str(tmp / "plan.yml")])
    call(["estimate", "-m", "mixtral-8x7b", "-H", "tpu-v5p", "-n", "64", "--fsdp", "16", "--ep", "4", "-b", "256",
          "--save-plan", str(tmp / "mt_plan.yml")])
    call(["export", "--plan", str(tmp / "mt_plan.yml"), "--format", "maxtext", "-o", str(tmp / "maxtext.yml")])
    call(["estimate", "-m", "llama3-70b", "-H", "h100-sxm", "-n", "64", "--tp", "8", "--pp", "4", "--dp", "2",
          "-b", "256", "--framework", "megatron", "--save-plan", str(tmp / "mg_plan.yml")])
    call(["export", "--plan", str(tmp / "mg_plan.yml"), "--format", "megatron", "-o", str(tmp / "megatron.sh")])
    return {"model": yaml.safe_load((ROOT / "costmodel/models/llama3-8b.yaml").read_text()),
            "hardware": yaml.safe_load((ROOT / "hardware/profiles/h100-sxm.yaml").read_text()),
            "plan": yaml.safe_load((tmp / "plan.yml").read_text()),
            "maxtext": yaml.safe_load((tmp / "maxtext.yml").read_text()),
            "megatron": (tmp / "megatron.sh").read_text(),
            "runs csv": (ROOT / "benchmarks" / "runs_v5p_maxtext.csv").read_text()}


def one_call(rnd: random.Random, good: dict, tmp: Path, i: int) -> tuple[str, list[str]]:
    """(kind, planner arguments) reading one freshly mutated file (a new name each call)."""
    kind = rnd.choice(["model", "hardware", "plan", "maxtext", "megatron", "runs csv", "not yaml"])
    f = tmp / f"f{i}.{ {'megatron': 'sh', 'runs csv': 'csv'}.get(kind, 'yml') }"
    base = ["-n", "8", "--fsdp", "8", "-b", "64"]
    if kind == "megatron":
        f.write_text(mutate_args(rnd, good["megatron"]))
        return kind, ["estimate", "--from-megatron", str(f), "-H", "h100-sxm"] + (["-n", "64"] if rnd.random() < .7
                                                                                  else [])
    if kind == "runs csv":
        f.write_text(mutate_csv(rnd, good["runs csv"]))
        return kind, ["bench", "published", "--file", str(f)]
    if kind == "not yaml":
        f.write_text(rnd.choice(NOT_YAML))
        flag = rnd.choice(["-m", "-H", "--plan", "--from-maxtext"])
        return kind, ["estimate", flag, str(f)] + (base if flag in ("-m", "-H") else [])
    f.write_text(yaml.safe_dump(mutate_mapping(rnd, good[kind])))
    if kind == "model":
        return kind, ["estimate", "-m", str(f), "-H", "h100-sxm", *base]
    if kind == "hardware":
        return kind, ["estimate", "-m", "llama3-8b", "-H", str(f), *base]
    if kind == "plan":
        return kind, [rnd.choice(["estimate", "explain"]), "--plan", str(f)]
    return kind, ["estimate", "--from-maxtext", str(f), "-H", "tpu-v5p"] + (["-n", "64"] if rnd.random() < .5 else [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--calls", type=int, default=1200)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--no-hostile", action="store_true", help="skip the hostile file classes (benchmarks/hostile.py)")
    a = ap.parse_args()
    from cli import main as cli_main

    cli_main._register()
    rnd = random.Random(a.seed)
    tmp = Path(tempfile.mkdtemp(prefix="config_fuzz_"))
    good = good_files(tmp)
    codes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    problems = []
    for i in range(a.calls):
        kind, args = one_call(rnd, good, tmp, i)
        code, err, tb, _ = call(args)
        codes[kind][code] += 1
        if p := problem(code, err, tb):
            problems.append(f"  {p}\n    planner {' '.join(args)}")
    lines = [f"# planner config fuzz: seed {a.seed}, {a.calls} mutated files, in-process",
             "exit codes by file kind (0 read and costed, 1 does not fit, 2 bad input):"]
    lines += exit_code_lines(codes)
    lines.append(f"calls that raised, exited otherwise or broke the one-line error rule: {len(problems)}")
    lines += problems
    if not a.no_hostile:
        lines += hostile.report_lines(*hostile.run_cases(hostile.name_cases() + hostile.file_cases()))
    emit(lines, "config_fuzz_report.txt", a.write)


if __name__ == "__main__":
    main()
