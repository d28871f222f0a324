"""The fuzzers' hostile classes (benchmarks/hostile.py, issue 31), a few cases of each, every one in its own
process: no traceback, hang, memory blow-up, wrong exit code, leftover output or injected content."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import hostile  # noqa: E402


def _sample(cases: list[hostile.Case], per_class: int) -> list[hostile.Case]:
    """The first `per_class` cases of each class, spread over the list (every kind of reader and flag shows up
    across the classes)."""
    by: dict[str, list[hostile.Case]] = {}
    for c in cases:
        by.setdefault(c.klass, []).append(c)
    out = []
    for group in by.values():
        step = max(1, len(group) // per_class)
        out += group[::step][:per_class]
    return out


CASES = _sample(hostile.name_cases(), 6) + _sample(hostile.file_cases(), 5) + _sample(hostile.path_cases(), 10) \
    + hostile.count_cases()


@pytest.mark.parametrize("case", CASES, ids=[f"{c.klass}: {c.what}" for c in CASES])
def test_hostile_case(case: hostile.Case, tmp_path: Path) -> None:
    for name, data in case.files.items():
        (tmp_path / name).write_bytes(data)
    out = hostile.run(case.args, tmp_path)
    assert hostile.judge(case, out, tmp_path) == ""


def test_judge_catches_injection(tmp_path: Path) -> None:
    """The fuzzers' own check fails on what it looks for: a sourced export that runs a command, an exit 0 where
    2 was expected, a leftover output."""
    (tmp_path / "bad.megatron.sh").write_text("MEGATRON_ARGS=(\n--x\n)\necho INJECTED > pwned2.txt\n")
    assert "ran something" in hostile.export_is_clean(tmp_path)
    ok = hostile.Outcome(0, "", 0.1, 50.0, False)
    assert "expected" in hostile.judge(hostile.Case("t", "t", [], {}, expect=(2,)), ok, tmp_path)
    (tmp_path / "out.yml").write_text("x")
    assert "left out.yml" in hostile.judge(hostile.Case("t", "t", [], {}, expect=(0,), must_not_exist=("out.yml",)),
                                           ok, tmp_path)
    assert "ran past" in hostile.judge(hostile.Case("t", "t", [], {}), hostile.Outcome(-9, "", 11, 50, True), tmp_path)
