"""`planner export` and `planner import`: plan files to and from MaxText / Megatron-LM configs."""

from __future__ import annotations

import sys

import typer

from cli import options as o
from cli.main import app
from costmodel.estimate import estimate as estimate_cost
from hardware.errors import InputError, escape, unknown
from hardware.fileio import check_output_path, write_text
from planner.export import FORMATS, ExportDoesNotFit, write_export
from planner.import_configs import import_config
from planner.planfile import PlanFile, load_plan, planfile_text

IMPORT_FORMATS = ("maxtext", "megatron")


def warn(line: str) -> None:
    typer.echo(f"warning: {line}", err=True)


def resolve_source(plan: str | None, from_maxtext: str | None, from_megatron: str | None,
                   hardware: str | None = None, chips: int | None = None, model: str | None = None,
                   required: bool = True) -> PlanFile | None:
    """The PlanFile named by --plan / --from-maxtext / --from-megatron (at most one), or None."""
    given = [(k, v) for k, v in (("--plan", plan), ("--from-maxtext", from_maxtext),
                                 ("--from-megatron", from_megatron)) if v]
    if len(given) > 1:
        raise InputError(f"{' and '.join(k for k, _ in given)}: give only one plan source")
    if not given:
        if required:
            raise InputError("give --plan FILE, --from-maxtext FILE or --from-megatron FILE")
        return None
    flag, path = given[0]
    if chips is not None and chips < 1:
        raise InputError(f"--chips: expected a positive integer, got {chips}")
    if flag == "--plan":
        return load_plan(path)
    res = import_config("maxtext" if flag == "--from-maxtext" else "megatron", path, hardware, chips, model)
    for n in res.notes:
        warn(f"import {path}: {n}")
    return res.planfile


@app.command("export")
def export_cmd(
    plan: str = typer.Option(..., "--plan", "-p", help="Plan file (YAML or JSON)."),
    fmt: str = typer.Option(..., "--format", "-f", help="maxtext (YAML for maxtext 0.2.5), megatron (bash "
                                                         "MEGATRON_ARGS for pretrain_gpt.py) or json (the plan file)."),
    out: str = typer.Option(None, "--out", "-o", help="Write here instead of standard output."),
    force: bool = typer.Option(False, "--force", help="Write the config even when the exported plan is predicted "
                                                      "not to fit in memory (otherwise exit 1, nothing written)."),
) -> None:
    """Turn a plan file into a training config. Plans the framework cannot express are exported as the nearest
    plan it can run, with a warning and both predicted costs on stderr. A plan predicted not to fit is refused
    (exit 1) unless --force."""
    if fmt not in FORMATS:
        raise unknown("export format", fmt, FORMATS)
    if out is not None:
        check_output_path(out, "--out")
    pf = load_plan(plan)
    try:
        text = write_export(pf, fmt, out, warn, force=force)
    except ExportDoesNotFit as e:
        raise o.nothing_fits(str(e)) from None
    if out is None:
        sys.stdout.write(text)
    else:
        typer.echo(f"wrote {escape(out)} ({fmt})", err=True)


@app.command("import")
def import_cmd(
    from_maxtext: str = typer.Option(None, "--from-maxtext", help="A MaxText config YAML (maxtext 0.2.5 keys)."),
    from_megatron: str = typer.Option(None, "--from-megatron",
                                      help="Megatron-LM arguments: an args file, bash array or command line."),
    hardware: str = typer.Option(None, "--hardware", "-H", help="Hardware preset or profile path, where the "
                                                                "config does not say."),
    chips: int = typer.Option(None, "--chips", "-n", help="Number of chips, where the config does not say."),
    model: str = typer.Option(None, "--model", "-m", help="Use this model instead of the config's shape keys."),
    out: str = typer.Option(None, "--out", "-o", help="Write the plan file here (.json for JSON) instead of "
                                                      "standard output."),
) -> None:
    """Build a plan file from an existing MaxText config or Megatron-LM command line."""
    if not (from_maxtext or from_megatron):
        raise InputError("give --from-maxtext FILE or --from-megatron FILE")
    if out is not None:
        check_output_path(out, "--out")
    pf = resolve_source(None, from_maxtext, from_megatron, hardware, chips, model)
    cost = estimate_cost(pf.model, pf.hardware, pf.job, pf.plan, pf.chips)
    text = planfile_text(pf, "json" if out and out.lower().endswith(".json") else "yaml", cost)
    if out is None:
        sys.stdout.write(text)
    else:
        write_text(out, text, "--out")
        typer.echo(f"wrote {escape(out)}", err=True)
