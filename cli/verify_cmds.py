"""`planner verify`: compile a TPU plan with MaxText's own train_compile and print XLA's memory beside ours."""

from __future__ import annotations

import typer

from cli import options as o
from cli.main import app
from cli.plan_flags import PlanFlags, print_notes, resolve_plan, with_plan_flags
from cli.render import print_json
from hardware.errors import escape

MAXTEXT_ENV = typer.Option(None, "--maxtext-env", metavar="DIR",
                           help="The MaxText environment (a venv with maxtext and libtpu).",
                           show_default="$MAXTEXT_ENV, else /work/maxtext-env (make maxtext-memory-env builds it)")


def timeout_option(default: float) -> float:
    return typer.Option(default, "--timeout", metavar="S", help="Seconds per compile before it is stopped.")


@app.command("verify", short_help="Compile a TPU plan with MaxText's train_compile: XLA's memory beside ours.")
@with_plan_flags()
def verify_cmd(
    flags: PlanFlags,
    maxtext_env: str = MAXTEXT_ENV,
    timeout: float = timeout_option(1500),
    as_json: bool = o.JSON,
) -> None:
    """Compile the plan's MaxText export ahead of time for its TPU topology (libtpu on this host).

    Prints the compiler's per-chip memory (argument + output - alias + temp) beside the predicted one. Exit 0
    when it compiles, 1 when the compiler refuses it (over HBM or a MaxText error) or the compile times out, 2
    for bad input: a GPU or non-MaxText plan, or no MaxText environment.
    """
    from planner.verify import check_verifiable, find_env, verify_plan

    o.number("--timeout", timeout)
    r = resolve_plan(flags)
    print_notes(r.notes)
    pf = r.planfile()
    check_verifiable(pf)
    python = find_env(maxtext_env)
    typer.echo(f"compiling with {escape(str(python))} -m maxtext.trainers.pre_train.train_compile ...", err=True)
    v = verify_plan(pf, python, timeout)
    for w in v.warnings:
        typer.echo(f"warning: {escape(w)}", err=True)
    if as_json:
        print_json({"model": pf.model.name, "hardware": pf.hardware.name, "chips": pf.chips, **v.to_dict()})
    else:
        typer.echo(f"{pf.model.name} on {pf.chips} x {pf.hardware.name}: {escape(v.line())}")
    if v.compiled.status != "ok":
        raise typer.Exit(1)
