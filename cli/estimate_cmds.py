"""`planner estimate`, `planner bench published` and `planner calibrate`."""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cli import options as o
from cli.main import app
from cli.plan_flags import PlanFlags, print_notes, resolve_plan, with_plan_flags
from cli.render import plan_dict, plan_summary, print_cost, print_json, shown
from costmodel.estimate import estimate as estimate_cost
from hardware.errors import InputError, shown_path

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks of the cost model against measurements.")
app.add_typer(bench_app, name="bench")


@app.command(short_help="Cost one plan: step time, MFU, memory, where the time goes.")
@with_plan_flags()
def estimate(
    flags: PlanFlags,
    save_plan_to: str = typer.Option(None, "--save-plan", metavar="FILE",
                                     help="Also write the costed plan as a plan file."),
    as_json: bool = o.JSON,
) -> None:
    """Cost one explicit plan: step time, MFU, memory per chip and where the time goes. The plan comes from the
    flags, or from --plan / --from-maxtext / --from-megatron with the flags given over it."""
    from costmodel.interval import step_time_interval
    from planner.planfile import save_plan

    if save_plan_to:  # before any work: a bad path fails at once
        from hardware.fileio import check_output_path

        check_output_path(save_plan_to, "--save-plan")
    r = resolve_plan(flags)
    cost = estimate_cost(r.model, r.chip, r.job, r.plan, r.chips)
    if save_plan_to:
        save_plan(save_plan_to, r.model if r.source else r.model_ref, r.hardware_ref, r.chips, r.job, r.plan, cost,
                  flag="--save-plan")
    iv = step_time_interval(cost, r.chip, r.job, r.plan)
    if as_json:
        print_json({"model": r.model.name, "hardware": r.chip.name, "chips": r.chips, "plan": plan_dict(r.plan),
                    **cost.to_dict(), **iv.to_dict(), "notes": list(r.notes)})
        return
    print_notes(r.notes)
    print_cost(cost, f"{r.model.name} on {r.chips} x {r.chip.name}: {plan_summary(r.plan)}", interval=iv)


@bench_app.command("published", short_help="Predicted against measured step times of a runs CSV.")
def bench_published(
    file: str = typer.Option(..., "--file", "-f", metavar="FILE", help="CSV in the runs_dev.csv schema."),
    as_json: bool = o.JSON,
) -> None:
    """Predicted vs measured step time for every usable row of a published-runs CSV, with the shipped calibration
    (nothing is fitted on the file). Leads with the calibration's out-of-source accuracy (leave-source-out, computed
    when the overlays were written: hardware/calibration/accuracy.yaml); rows of a source the calibration was
    fitted on are in-sample, the others out of sample."""
    from costmodel.published import evaluate, load_cases, mape

    cases, skipped = load_cases(file)
    if not cases:
        first = next(iter(skipped.items()), None)
        raise InputError(f"--file {shown_path(file)}: no usable row ({len(skipped)} skipped"
                         + (f"; {first[0]}: {first[1]}" if first else "") + ")")
    stored = _stored_accuracy()
    rows = evaluate(cases)
    for r in rows:
        r["in_calibration"] = _in_calibration(stored, r)
    rows += [{"id": k, "skipped": v} for k, v in skipped.items()]
    summary = mape(rows)
    inside = mape([r for r in rows if r.get("in_calibration") is True])
    other = mape([r for r in rows if r.get("in_calibration") is False])
    out_of_source = {"computed_by": "leave-source-out at calibration time (planner calibrate --write-shipped); "
                                    "each chip family's rows predicted by a fit without their source",
                     **stored}
    if as_json:
        print_json({"out_of_source": out_of_source, "rows": rows, "mape_pct": summary,
                    "mape_pct_calibration_sources": inside, "mape_pct_other_sources": other})
        return
    console = Console()
    console.print(_out_of_source_table(stored))
    t = Table(title=escape(f"published runs: {file}"))
    for c in ("id", "hardware", "in cal.", "predicted s", "measured s", "error %", "mem GiB", "need GiB", "fits"):
        t.add_column(c, justify="right" if c != "id" else "left")
    for r in rows:
        if "skipped" in r:
            t.add_row(shown(r["id"]), "", "", "", "", "skipped: " + shown(r["skipped"]), "", "", "")
        else:
            t.add_row(shown(r["id"]), shown(r["hardware"]), "yes" if r["in_calibration"] else "no",
                      f"{r['predicted_step_time_s']:.3f}", f"{r['measured_step_time_s']:.3f}",
                      f"{r['error_pct']:+.1f}", f"{r['predicted_peak_memory_bytes'] / 2**30:.1f}",
                      f"{r['predicted_fit_memory_bytes'] / 2**30:.1f}", str(r["fits"]))
    console.print(t)
    s = Table(title="MAPE (%): rows of other sources (out of sample) first")
    s.add_column("group")
    s.add_column("MAPE %", justify="right")
    for label, part in (("other sources", other), ("calibration sources", inside), ("all", summary)):
        for k, v in part.items():
            if k == "overall" or label == "all":
                s.add_row(shown(f"{label}: {k}"), f"{v:.1f}")
    console.print(s)


def _stored_accuracy() -> dict:
    """hardware/calibration/accuracy.yaml (method, weighting, families); {'families': {}} when there is none."""
    import hardware.catalog as catalog
    from costmodel.calibrate import ACCURACY_FILE
    from hardware.yamlio import read_yaml

    path = catalog.CALIBRATION_DIR / ACCURACY_FILE
    if not path.is_file():
        return {"families": {}, "note": f"no {ACCURACY_FILE}: run planner calibrate --write-shipped"}
    data = read_yaml(path)
    fams = data.get("families")
    if not isinstance(fams, dict) or not all(isinstance(f, dict) for f in fams.values()):
        raise InputError(f"{shown_path(path)}: expected 'families' to map each chip family to its figures")
    return data


def _in_calibration(stored: dict, row: dict) -> bool:
    """Whether rows of this row's source on its chip family entered the shipped calibration's fit."""
    from costmodel.calibrate import family

    fam = stored["families"].get(family(row.get("hardware", "")), {})
    return row.get("source") in (fam.get("calibration_sources") or ())


def _out_of_source_table(stored: dict) -> Table:
    t = Table(title="out-of-source accuracy of the shipped calibration (leave-source-out at calibration time, "
                    "hardware/calibration/accuracy.yaml)")
    for c in ("chip family", "rows", "sources", "MAPE %", "sources equal %", "pred/meas p10..p90", "predicted by"):
        t.add_column(c, justify="left" if c in ("chip family", "predicted by") else "right")
    for name, f in stored["families"].items():
        lo, hi = (f.get("log_residual_p10"), f.get("log_residual_p90"))
        span = f"x{math.exp(lo):.2f} .. x{math.exp(hi):.2f}" if isinstance(lo, float) and isinstance(hi, float) else ""
        t.add_row(shown(str(name)), str(f.get("rows", "")), str(len(f.get("sources") or ())),
                  _pct(f.get("out_of_source_mape_pct")), _pct(f.get("out_of_source_source_mape_pct")), span,
                  shown(str(f.get("predicted_by", ""))))
    if not stored["families"]:
        t.add_row(shown(stored.get("note", "")), "", "", "", "", "", "")
    return t


def _pct(v) -> str:
    return f"{v:.1f}" if isinstance(v, (int, float)) else ""


@app.command(short_help="Fit the chips' efficiencies to measured step times.")
def calibrate(
    file: list[str] = typer.Option(None, "--file", "-f", help="CSV(s) in the runs_dev.csv schema with measured step "
                                   "times; repeat to combine files. Prints the fit; writes nothing unless "
                                   "--write-shipped or --overlay-dir is given.", metavar="FILE"),
    hardware: list[str] = typer.Option(None, "--hardware", "-H", metavar="NAME", show_default="all in the files",
                                       help="Only these presets; with --out, the one profile to calibrate."),
    write_shipped: bool = typer.Option(False, "--write-shipped", help="With --file: replace the shipped overlays "
                                       "hardware/calibration/NAME.yaml with the fit (atomically)."),
    overlay_dir: str = typer.Option(None, "--overlay-dir", help="With --file: write the overlays NAME.yaml into "
                                    "this existing folder instead of the shipped one.", metavar="DIR"),
    evaluate: list[str] = typer.Option(None, "--evaluate", help="With --write-shipped: runs CSV(s) whose rows are "
                                       "never fitted, only predicted out of source in accuracy.yaml (their sources "
                                       "must not be in --file).", metavar="FILE"),
    weighting: str = typer.Option("sources", "--weighting", metavar="WEIGHTING",
                                  help="With --file: 'sources' (each source the same total weight, at most 40 rows "
                                       "of a source per chip) or 'rows' (every row weight 1, the procedure of the "
                                       "shipped overlays)."),
    priors: bool = typer.Option(False, "--priors/--no-priors",
                                help="With --file: pull each fit towards the microbenchmark priors "
                                     "(hardware/priors.yaml; the shipped overlays: --weighting rows --priors)."),
    out: str = typer.Option("", "--out", help="Instead of published runs: run a validator plan set on the JAX "
                            "devices here, fit the profile to their step times and write it to this file.",
                            metavar="FILE"),
    plan_set: str = typer.Option("cpu8", "--set", metavar="NAME",
                                 help="With --out: the plan set (quick, cpu8, single)."),
    devices: int = typer.Option(8, "--devices", help="With --out: host-platform devices to create (CPU) / to use."),
    steps: int = typer.Option(2, "--steps", help="With --out: steps per timing round (the fastest counts)."),
    d_model: int = typer.Option(128, "--d-model", help="With --out: width of the scaled-down models."),
    layers: int = typer.Option(2, "--layers", help="With --out: layers of the scaled-down models."),
    seq_len: int = typer.Option(128, "--seq-len", help="With --out: sequence length of the scaled-down jobs."),
    fast_compile: bool = typer.Option(False, "--fast-compile/--full-opt",
                                      help="With --out: XLA backend optimisation level 0 (CPU)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the fit without writing an overlay (what --file "
                                 "does without --write-shipped or --overlay-dir; kept for scripts)."),
    as_json: bool = o.JSON,
) -> None:
    """Fit each chip's efficiency parameters to measured runs and print them (--write-shipped replaces
    hardware/calibration/NAME.yaml); or, with --out, fit to step times measured here by running a validator plan set
    (planner validate) and write that profile."""
    if out and evaluate:
        raise InputError("--out and --evaluate: --out fits step times measured here; --evaluate goes with --file")
    if out:
        return _calibrate_here(out, file, hardware, write_shipped, overlay_dir, plan_set, devices, steps, d_model,
                               layers, seq_len, fast_compile, as_json)
    if not file:
        raise InputError("--file: expected a CSV of measured runs (runs_dev.csv schema), or --out FILE to calibrate "
                         "on this machine's devices")
    from costmodel.calibrate import calibrate_all

    directory, flag = _overlay_target(write_shipped, overlay_dir, dry_run)
    if evaluate and not write_shipped:
        raise InputError("--evaluate: only with --write-shipped (its rows feed hardware/calibration/accuracy.yaml; "
                         "benchmarks/holdout.py prints out-of-source figures without writing)")
    fits = list(calibrate_all(file, hardware or None, directory, flag, weighting, evaluate, priors))
    if as_json:
        return print_json([{"hardware": name, "rows": stats["rows"], "fit_rows": stats["fit_rows"],
                            "sources": stats["sources"], "weighting": weighting, "priors": priors,
                            "mape_pct": stats["mape_pct"],
                            "source_mape_pct": stats["source_mape_pct"], "worst_pct": stats["worst_pct"],
                            "eff": dict(eff.__dict__), "written": str(path) if path else None}
                           for name, eff, stats, path in fits])
    for name, eff, stats, path in fits:
        vals = ", ".join(f"{k}={v:.3g}" for k, v in eff.__dict__.items())
        where = f" -> {shown_path(path, 1000)}" if path else ""
        typer.echo(f"{name}: {stats['rows']} rows ({stats['fit_rows']} fitted, {len(stats['sources'])} sources), "
                   f"in-sample MAPE {stats['mape_pct']:.1f}%, worst {stats['worst_pct']:.1f}%  [{vals}]{where}")
    if write_shipped:
        from costmodel import evidence
        from costmodel.calibrate import Procedure
        from hardware.errors import escape as plain

        doc = evidence.build(list(file), list(evaluate or ()), Procedure(weighting, priors))
        where = evidence.write(doc, directory, "+".join(Path(f).name for f in file))
        typer.echo(f"evidence for the step-time intervals -> {shown_path(where, 1000)}")

        for name, f in _stored_accuracy()["families"].items():
            typer.echo(f"out of source (leave-source-out) {plain(str(name))}: MAPE "
                       f"{_pct(f.get('out_of_source_mape_pct'))}% over {f.get('rows')} rows of "
                       f"{len(f.get('sources') or ())} source(s), predicted by {plain(str(f.get('predicted_by')))}")


def _overlay_target(write_shipped: bool, overlay_dir: str | None, dry_run: bool):
    """(folder the overlays go to or None, its flag): the shipped overlays only when --write-shipped asks."""
    from pathlib import Path

    from hardware.catalog import CALIBRATION_DIR

    given = [f for f, v in (("--write-shipped", write_shipped), ("--overlay-dir", overlay_dir),
                            ("--dry-run", dry_run)) if v]
    if len(given) > 1:
        raise InputError(f"{' and '.join(given)}: give only one of them")
    if overlay_dir is not None and not Path(overlay_dir).is_dir():
        raise InputError(f"--overlay-dir {shown_path(overlay_dir)}: expected an existing folder")
    if write_shipped:
        return CALIBRATION_DIR, "--write-shipped"
    return (Path(overlay_dir), "--overlay-dir") if overlay_dir is not None else (None, "")


def _calibrate_here(out: str, file: list[str] | None, hardware: list[str] | None, write_shipped: bool,
                    overlay_dir: str | None, plan_set: str, devices: int, steps: int, d_model: int, layers: int,
                    seq_len: int, fast_compile: bool, as_json: bool) -> None:
    """calibrate --out: the validator's plan set run here (cli.validate_cmds); --out is checked before the run."""
    if file:
        raise InputError("--out: runs the validator's plan set on this machine; leave out --file (published "
                         "runs are fitted without --out)")
    if write_shipped or overlay_dir is not None:
        raise InputError(f"--out and {'--write-shipped' if write_shipped else '--overlay-dir'}: --out writes one "
                         "profile measured here; the overlays come from --file")
    if not hardware or len(hardware) != 1:
        raise InputError("--hardware: expected exactly one profile to calibrate with --out, e.g. -H cpu-host")
    from cli.validate_cmds import calibrate_on_devices
    from hardware.fileio import check_output_path
    from planner.validate.scale import Scale

    check_output_path(out, "--out")
    scale = Scale(d_model=o.positive("--d-model", d_model), n_layers=o.positive("--layers", layers),
                  seq_len=o.positive("--seq-len", seq_len))
    return calibrate_on_devices(hardware[0], out, plan_set, o.positive("--devices", devices),
                                o.positive("--steps", steps), scale, fast_compile, as_json)
