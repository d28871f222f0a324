"""`planner validate --target tpu-v5p:2x2x2`: compile the plan's step for a real TPU topology (no TPU needed).

Called by cli.validate_cmds.validate when --target is given; prints the same checks as the CPU path
(`{"checks": [...]}` with --json) and exits 1 when a check is outside tolerance, 2 on bad input (including a
missing libtpu).
"""

from __future__ import annotations

import sys

import typer

from cli.render import print_json


def run_target(target: str, plan, m_full, label: str, seq_len: int, as_json: bool) -> None:
    from planner.validate.tpu import check_tpu_plan, parse_target, require_libtpu, result_dict, validate_tpu

    t = parse_target(target)
    check_tpu_plan(m_full, plan, seq_len, t)
    require_libtpu()
    typer.echo(f"{label}: compiling {m_full.name} for {t.name} at full width and depth ...", err=True)
    r = validate_tpu(label, m_full, plan, seq_len, t)
    typer.echo(f"{label}: " + (f"FAILED {r.error}" if r.error else f"compiled in {r.compile_s:.0f} s"), err=True)
    checks = [c.to_dict() for c in r.checks]
    if r.error:
        checks.append({"plan": label, "quantity": "compile", "predicted": None, "xla": None, "error_pct": None,
                       "ok": False, "note": r.error})
    if as_json:
        print_json({"checks": checks, "plans": [result_dict(r)]})
    else:
        _print(r)
    if any(not c["ok"] for c in checks):
        sys.stdout.flush()
        sys.exit(1)


def _print(r) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    if r.error:
        console.print(f"[red]{escape(r.name)}: {escape(r.error)}[/red]")
        return
    t = Table(title=escape(f"{r.name}: {r.model.name} on {r.target.name}, seq {r.job.seq_len}, "
                           f"batch {r.job.global_batch} (XLA:TPU compile, {r.compile_s:.0f} s)"))
    for c in ("quantity", "predicted", "XLA:TPU", "error %", "ok"):
        t.add_column(c, justify="left" if c == "quantity" else "right")
    for c in r.checks:
        scale, unit = (1e12, "TFLOP") if c.quantity == "flops" else (1e9, "GB")
        err = "-" if c.error_pct is None else f"{c.error_pct:+.1f}"
        t.add_row(c.quantity, f"{c.predicted / scale:.3f} {unit}",
                  "-" if c.xla is None else f"{c.xla / scale:.3f} {unit}", err, "yes" if c.ok else "[red]no[/red]")
    console.print(t)
    sys.stdout.flush()
