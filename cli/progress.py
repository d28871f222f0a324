"""A progress bar for long validator runs (compiling and running plans, calibration rounds): rich.progress on
stderr, shown only when stderr is a terminal and the output is not --json; otherwise plain one-line messages on
stderr (or nothing, with quiet)."""

from __future__ import annotations

import sys
from contextlib import contextmanager

import typer


class _Plain:
    """Same interface as _Bar, printing one line per event."""

    def __init__(self, quiet: bool):
        self.quiet = quiet

    def stage(self, label: str, total: int) -> None:
        self.label, self.total, self.i = label, total, 0

    def start(self, what: str) -> None:
        self.i += 1
        if not self.quiet:
            typer.echo(f"[{self.i}/{self.total}] {what} ...", err=True)

    def done(self, what: str) -> None:
        if not self.quiet:
            typer.echo(f"[{self.i}/{self.total}] {what}", err=True)

    def log(self, msg: str) -> None:
        if not self.quiet:
            typer.echo(msg, err=True)


class _Bar:
    def __init__(self, progress):
        self.p, self.task = progress, None

    def stage(self, label: str, total: int) -> None:
        if self.task is not None:
            self.p.update(self.task, visible=False)
        self.label = label
        self.task = self.p.add_task(label, total=total)

    def start(self, what: str) -> None:
        self.p.update(self.task, description=f"{self.label}: {what}")

    def done(self, what: str) -> None:
        self.p.console.print(what)
        self.p.advance(self.task)

    def log(self, msg: str) -> None:
        self.p.console.print(msg)


def enabled(as_json: bool, stream=None) -> bool:
    stream = stream if stream is not None else sys.stderr
    return not as_json and hasattr(stream, "isatty") and stream.isatty()


@contextmanager
def progress(as_json: bool, quiet: bool = False):
    """Yields an object with stage(label, total), start(what), done(what), log(msg)."""
    if not enabled(as_json):
        yield _Plain(quiet)
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    cols = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=Console(stderr=True), transient=True) as p:
        yield _Bar(p)
