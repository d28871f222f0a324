"""`planner ARGS` run in this process (no subprocess start-up), for the tests of one option each."""

from __future__ import annotations

import sys

from cli.main import main


def planner_in_process(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `planner ARGS` in process."""
    monkeypatch.setattr(sys, "argv", ["planner", *args])
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    out = capsys.readouterr()
    return code, out.out, out.err
