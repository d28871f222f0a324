"""`planner export` and `planner import`: plan files to and from MaxText / Megatron-LM configs."""

from __future__ import annotations

import sys

import typer

from cli import options as o
from cli.main import app
from cli.plan_flags import PlanFlags, plan_source, print_notes, resolve_plan, with_plan_flags
from hardware.errors import InputError, escape, unknown
from hardware.fileio import check_output_path, write_text


def warn(line: str) -> None:
    typer.echo(f"warning: {line}", err=True)


@app.command("export")
@with_plan_flags()
def export_cmd(
    flags: PlanFlags,
    fmt: str = typer.Option(..., "--format", "-f", metavar="FORMAT",
                            help="maxtext (YAML for maxtext 0.2.5), megatron (bash MEGATRON_ARGS for pretrain_gpt.py) "
                                 "or json (the plan file)."),
    out: str = typer.Option(None, "--out", "-o", metavar="FILE", help="Write here instead of standard output."),
    force: bool = typer.Option(False, "--force", help="Write the config even when the exported plan is predicted "
                                                      "not to fit in memory (otherwise exit 1, nothing written)."),
) -> None:
    """Turn a plan into a training config.

    The plan comes from --plan, --from-maxtext or --from-megatron (flags given over it), or from the flags alone as
    in `planner estimate`. Plans the framework cannot express are exported as the nearest plan it can run, with a
    warning and both predicted costs on stderr. A plan predicted not to fit is refused (exit 1) unless --force.
    """
    from planner.export import FORMATS, ExportDoesNotFit, write_export

    if fmt not in FORMATS:
        raise unknown("export format", fmt, FORMATS)
    if out is not None:
        check_output_path(out, "--out")
    r = resolve_plan(flags)
    print_notes(r.notes)
    try:
        text = write_export(r.planfile(), fmt, out, warn, force=force)
    except ExportDoesNotFit as e:
        raise o.nothing_fits(str(e)) from None
    if out is None:
        sys.stdout.write(text)
    else:
        typer.echo(f"wrote {escape(out)} ({fmt})", err=True)


@app.command("import", short_help="A plan file from a MaxText config or Megatron-LM arguments.")
def import_cmd(
    from_maxtext: str = typer.Option(None, "--from-maxtext", metavar="FILE",
                                     help="A MaxText config YAML (maxtext 0.2.5 keys)."),
    from_megatron: str = typer.Option(None, "--from-megatron", metavar="FILE",
                                      help="Megatron-LM arguments: an args file, bash array or command line."),
    hardware: str = typer.Option(None, "--hardware", "-H", metavar="NAME",
                                 help="Hardware preset or profile path, over what the config says."),
    chips: int = typer.Option(None, "--chips", "-n", help="Number of chips, over what the config says."),
    model: str = typer.Option(None, "--model", "-m", metavar="NAME",
                              help="Use this model instead of the config's shape keys."),
    out: str = typer.Option(None, "--out", "-o", metavar="FILE",
                            help="Write the plan file here (.json for JSON) instead of standard output."),
) -> None:
    """Build a plan file from an existing MaxText config or Megatron-LM command line."""
    if not (from_maxtext or from_megatron):
        raise InputError("give --from-maxtext FILE or --from-megatron FILE")
    if out is not None:
        check_output_path(out, "--out")
    from costmodel.estimate import estimate as estimate_cost
    from planner.planfile import planfile_text

    pf = plan_source(PlanFlags(from_maxtext=from_maxtext, from_megatron=from_megatron, hardware=hardware,
                               chips=chips, model=model))
    cost = estimate_cost(pf.model, pf.hardware, pf.job, pf.plan, pf.chips)
    text = planfile_text(pf, "json" if out and out.lower().endswith(".json") else "yaml", cost)
    if out is None:
        sys.stdout.write(text)
    else:
        write_text(out, text, "--out")
        typer.echo(f"wrote {escape(out)}", err=True)
