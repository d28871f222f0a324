"""`planner explain`, `planner sweep` and `planner plot`: exploring trade-offs around a plan or across a grid.

explain and plot take the plan flags of `planner estimate` (cli.plan_flags), plan sources included; sweep takes
its job flags and plan sources for the fixed part of its grid.
"""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cli import options as o
from cli.main import app
from cli.plan_flags import DEFAULTS, PlanFlags, print_notes, resolve_plan, with_plan_flags
from cli.render import plan_summary, print_json
from costmodel.job import Job
from hardware.errors import InputError, shown_path

GIB = 2**30
BAR = 30  # characters of the text waterfall and memory bars

# ---- explain ----------------------------------------------------------------------------------------------

def _bar(start: float, width: float, total: float, style: str) -> str:
    if total <= 0:
        return ""
    a = int(round(start / total * BAR))
    b = max(1, int(round((start + width) / total * BAR)) - a)
    return " " * a + f"[{style}]" + "█" * b + f"[/{style}]"


def _term_style(key: str) -> str:
    if key == "compute":
        return "blue"
    if key.startswith("comm_"):
        return "dark_orange"
    return {"recompute": "magenta", "memory_bound": "cyan", "bubble": "red", "offload": "purple"}.get(key, "grey50")


def print_explanation(ex, console: Console | None = None) -> None:
    console = console or Console()
    c = ex.cost
    fit = "fits" if c.fits else f"does NOT fit (over by {c.overflow_bytes / GIB:.1f} GiB)"
    console.print(f"[bold]{escape(ex.model)} on {ex.chips} x {escape(ex.hardware)}[/bold]: {plan_summary(ex.plan)}")
    console.print(f"step {c.step_time_s:.3f} s   MFU {c.mfu * 100:.1f} %   {c.tokens_per_s:,.0f} tokens/s   "
                  f"memory {c.peak_memory_bytes / GIB:.2f} / {c.hbm_usable_bytes / GIB:.1f} GiB per chip"
                  + (f", needs {c.fit_memory_bytes / GIB:.2f}" if c.fit_below_total else "")
                  + f" ({fit})   "
                  f"grad accumulation {c.grad_accum}")
    if ex.interval is not None:
        from cli.render import interval_text, print_interval_notes

        console.print(f"step time range {interval_text(ex.interval)}")
        print_interval_notes(ex.interval, console)
    t = Table(title="where the step goes", title_justify="left")
    t.add_column("part")
    t.add_column("seconds", justify="right")
    t.add_column("share", justify="right")
    t.add_column("waterfall", no_wrap=True)
    for term in ex.waterfall:
        t.add_row(term.label, f"{term.seconds:.3f}", f"{term.share * 100:.1f} %",
                  _bar(term.start_s, term.seconds, c.step_time_s, _term_style(term.key)))
    t.add_row("[bold]step[/bold]", f"[bold]{c.step_time_s:.3f}[/bold]", "100.0 %", _bar(0, c.step_time_s,
                                                                                        c.step_time_s, "white"))
    console.print(t)
    mt = Table(title=f"memory per chip against {c.hbm_usable_bytes / GIB:.1f} GiB usable", title_justify="left")
    mt.add_column("category")
    mt.add_column("GiB", justify="right")
    mt.add_column("of usable", justify="right")
    mt.add_column("", no_wrap=True)
    scale = max(c.hbm_usable_bytes, c.peak_memory_bytes)
    start = 0.0
    for k, v in ex.memory.items():
        if v > 0:
            mt.add_row(k, f"{v / GIB:.2f}", f"{v / c.hbm_usable_bytes * 100:.1f} %", _bar(start, v, scale, "green"))
            start += v
    head = ex.headroom_bytes
    room = f"headroom {head / GIB:.1f} GiB" if head >= 0 else f"[red]over by {-head / GIB:.1f} GiB[/red]"
    mt.add_row("[bold]total[/bold]", f"[bold]{c.peak_memory_bytes / GIB:.2f}[/bold]",
               f"{c.peak_memory_bytes / c.hbm_usable_bytes * 100:.1f} %", "" if c.fit_below_total else room)
    if c.fit_below_total:  # the headroom is the fit check's (costmodel.memory.fit_floor_bytes)
        mt.add_row("least XLA needs", f"{c.fit_memory_bytes / GIB:.2f}",
                   f"{c.fit_memory_bytes / c.hbm_usable_bytes * 100:.1f} %", room)
    if c.host_memory_bytes:
        mt.add_row("host memory", f"{c.host_memory_bytes / GIB:.2f}", "", "fits" if c.host_fits else "[red]over[/red]")
    console.print(mt)
    console.print(f"[bold]Bottleneck:[/bold] {escape(ex.bottleneck.sentence)}.")
    if ex.what_ifs:
        w = Table(title="what if (nearest changes)", title_justify="left")
        for col in ("change", "step s", "delta", "MFU", "GiB/chip", "needs", "fits"):
            w.add_column(col, justify="left" if col == "change" else "right")
        for wi in ex.costed_what_ifs:
            wc = wi.cost
            style = "green" if wi.delta_pct < 0 and wc.fits else ("red" if not wc.fits else "")
            delta = f"[{style}]{wi.delta_pct:+.1f} %[/{style}]" if style else f"{wi.delta_pct:+.1f} %"
            w.add_row(escape(wi.label), f"{wc.step_time_s:.3f}", delta, f"{wc.mfu * 100:.1f} %",
                      f"{wc.peak_memory_bytes / GIB:.1f}", f"{wc.fit_memory_bytes / GIB:.1f}",
                      "yes" if wc.fits else f"[red]no (+{wc.overflow_bytes / GIB:.1f})[/red]")
        console.print(w)
        for wi in ex.what_ifs:
            if wi.detail:
                console.print(f"[dim]{escape(wi.label)}: {escape(wi.detail)}[/dim]")
        for wi in ex.what_ifs:
            if wi.cost is None:
                console.print(f"[dim]skipped {escape(wi.label)}: {escape(str(wi.error))}[/dim]")
        best = ex.best_what_if
        if best is not None:
            console.print(f"[bold]Fastest nearby change on the same chips:[/bold] {escape(best.label)}: "
                          f"{best.cost.step_time_s:.3f} s ({best.delta_pct:+.1f} %).")


@app.command(short_help="Why a plan takes what it takes, and nearby what-ifs.")
@with_plan_flags()
def explain(
    flags: PlanFlags,
    no_what_ifs: bool = typer.Option(False, "--no-what-ifs", help="Skip costing the neighbouring plans."),
    as_json: bool = o.JSON,
) -> None:
    """Why a plan takes what it takes: step waterfall, memory against capacity, the bottleneck, and what-ifs."""
    from planner.explain import explain as explain_plan

    r = resolve_plan(flags)
    ex = explain_plan(r.model, r.chip, r.job, r.plan, r.chips, with_what_ifs=not no_what_ifs)
    if as_json:
        print_json({**ex.to_dict(), "job": dict(r.job.__dict__), "notes": list(r.notes)})
        return
    print_notes(r.notes)
    print_explanation(ex)


# ---- plot -------------------------------------------------------------------------------------------------

@app.command(short_help="Draw a plan's step waterfall and memory bars to a file.")
@with_plan_flags()
def plot(
    flags: PlanFlags,
    out: str = typer.Option(..., "--out", "-o", metavar="FILE",
                            help="Figure path; .png, .svg or .pdf (format from the extension)."),
) -> None:
    """Draw one plan's step waterfall and memory bars to a PNG, SVG or PDF file."""
    from planner.explain import explain as explain_plan
    from planner.plots import check_figure_path, plot_explanation

    check_figure_path(out, "--out")
    r = resolve_plan(flags)
    ex = explain_plan(r.model, r.chip, r.job, r.plan, r.chips, with_what_ifs=False)
    path = plot_explanation(ex, out)
    print_notes(r.notes)
    typer.echo(f"wrote {shown_path(path, 1000)}")


# ---- sweep ------------------------------------------------------------------------------------------------

def _sweep_table(rows: list[dict], varied: list[str]) -> Table:
    t = Table(title="best plan per point")
    notes = any(r.get("reason") for r in rows)
    cols = (*varied, "step s", "MFU", "degrees", "mb", "remat", "GiB (free)") + (("note",) if notes else ())
    for col in cols:
        t.add_column(col, justify="right" if col in ("step s", "MFU", "mb", "GiB (free)") else "left",
                     overflow="fold" if col in ("remat", "note") else "ellipsis")
    for r in rows:
        keys = [str(r[v]) for v in varied]
        if "step_time_s" not in r:
            t.add_row(*keys, "", "", "", "", "", "", f"[red]infeasible: {r['reason']}[/red]")
            continue
        deg = " ".join(f"{a}={r[a]}" for a in ("dp", "fsdp", "tp", "cp", "pp", "ep") if r.get(a, 1) > 1)
        if r.get("vpp", 1) > 1:
            deg += f" vpp={r['vpp']}"
        if r.get("slices", 1) > 1:
            deg += f" ({r['slices']} slices)"
        remat = r["remat"] + (" +opt offload" if r.get("offload_optimizer") else "") + \
            (" +param offload" if r.get("offload_params") else "")
        cells = [*keys, f"{r['step_time_s']:.3f}", f"{r['mfu'] * 100:.1f} %", deg or "single chip",
                 str(r["micro_batch"]), remat, f"{r['peak_memory_gib']:.1f} ({r['headroom_gib']:.1f})"]
        if notes:
            cells.append("" if r["feasible"] else f"[red]{r['reason']}[/red]")
        t.add_row(*cells)
    return t


SWEEP_OMIT = ("dp", "fsdp", "tp", "cp", "pp", "ep", "vpp", "micro_batch", "zero", "remat", "offload", "slices",
              "vocab_tiles", "no_sp", "weight_dtype")  # the sweep searches the plan at each point
SWEEP_HELP = {"model": {"help": "Model, unless varied: preset name, model YAML path or size."},
              "chips": {"help": "Number of chips, unless varied."},
              "global_batch": {"help": "Sequences per step, unless varied.",
                               "show_default": "about 4M tokens per point"}}


@app.command(short_help="The best plan at each point of a grid of one or two variables.")
@with_plan_flags(omit=SWEEP_OMIT, **SWEEP_HELP)
def sweep(
    flags: PlanFlags,
    vary: list[str] = typer.Option(..., "--vary", "-v", metavar="VARIABLE=VALUES",
                                   help="Once or twice. Variables: chips, global_batch, seq_len, model, hardware. "
                                        "Values: a list (256,512) or a range start:stop:xF (geometric) or "
                                        "start:stop:+S. At most 2000 points in all."),
    out: str = typer.Option(None, "--out", "-o", metavar="FILE",
                            help="Write the rows to a .csv (or .parquet, with pyarrow) file."),
    plot_path: str = typer.Option(None, "--plot", metavar="FILE",
                                  help="Also draw MFU, step time, degrees and headroom (.png, .svg or .pdf)."),
    workers: int = typer.Option(None, "--workers", help="Processes, at most 256.",
                                show_default="all cores above 8 points"),
    as_json: bool = o.JSON,
) -> None:
    """The planner's best plan at each point of a grid over one or two variables, as a table, file and plot.

    The fixed part of the grid comes from the flags, or from --plan / --from-maxtext / --from-megatron (its model,
    hardware, chips, batch, sequence length, precision and framework; the flags and the swept variables over it).
    """
    from planner.sweep import MAX_WORKERS, parse_vary, points

    _check_sweep_outputs(out, plot_path)
    axes = [parse_vary(v) for v in vary]
    for name, v in (("--chips", flags.chips), ("--global-batch", flags.global_batch), ("--seq-len", flags.seq_len),
                    ("--workers", workers)):
        if v is not None:
            o.positive(name, v)
    if workers is not None and workers > MAX_WORKERS:
        raise InputError(f"--workers: expected at most {MAX_WORKERS}, got {workers:,}")
    base = _sweep_base(flags)
    given = {"model": flags.model, "hardware": flags.hardware, "chips": flags.chips,
             "global_batch": flags.global_batch, "seq_len": flags.seq_len}
    pts = points(base, axes, given)
    notes = _default_frameworks(pts) if flags.framework is None and flags.source is None else []
    rows = _run_with_progress(pts, workers)
    varied = [a.name for a in axes]
    _write_sweep(rows, varied, out, plot_path, f"{base.model or 'models'} on {base.hardware}: best plan per point")
    if as_json:
        print_json({"varied": varied, "rows": rows, "out": out, "plot": plot_path, "notes": notes})
        return
    print_notes(notes)
    console = Console()
    console.print(_sweep_table(rows, varied))
    for p, what in ((out, "rows"), (plot_path, "figure")):
        if p:
            console.print(f"wrote {what} to {escape(str(p))}")


def _sweep_base(flags: PlanFlags):
    """The fixed part of the grid (planner.sweep.SweepBase): the plan source's job with the flags over it, or the
    flags with the defaults of cli.plan_flags (framework: filled in per point when not given)."""
    from planner.sweep import SweepBase

    if flags.source is None:
        hardware, seq_len = flags.hardware or DEFAULTS["hardware"], flags.seq_len or DEFAULTS["seq_len"]
        precision, framework = flags.precision or DEFAULTS["precision"], flags.framework or "maxtext"
        Job(seq_len=seq_len, global_batch=flags.global_batch or 1, precision=precision, framework=framework)
        if flags.model:
            from costmodel.catalog import load_model

            load_model(flags.model)
        return SweepBase(model=flags.model or "", hardware=hardware, chips=flags.chips,
                         global_batch=flags.global_batch, seq_len=seq_len, precision=precision, framework=framework)
    from planner.planfile import hardware_ref_for, model_ref_for

    r = resolve_plan(flags)
    model = flags.model or model_ref_for(r.model)
    hardware = flags.hardware or hardware_ref_for(r.chip)
    for flag, ref in (("--model", model), ("--hardware", hardware)):
        if not ref:
            raise InputError(f"{flag}: required: the {flags.source[0]} source's {flag[2:]} is no preset, and the "
                             "sweep's points name theirs")
    return SweepBase(model=model, hardware=hardware, chips=r.chips, global_batch=r.job.global_batch,
                     seq_len=r.job.seq_len, precision=r.job.precision, framework=r.job.framework)


def _default_frameworks(pts: list[dict]) -> list[str]:
    """Each point's framework by its hardware's vendor (planner.solve.default_framework), set in place; the notes
    that say so. A hardware name that does not load keeps maxtext (its row says what is wrong)."""
    from hardware.catalog import load_hardware
    from planner.solve import default_framework

    by_name: dict[str, tuple[str, str]] = {}
    for p in pts:
        if p["hardware"] not in by_name:
            try:
                chip = load_hardware(p["hardware"])
                by_name[p["hardware"]] = (default_framework(chip), chip.vendor.upper())
            except InputError:
                by_name[p["hardware"]] = ("maxtext", "")
        p["framework"] = by_name[p["hardware"]][0]
    used = sorted({v for v in by_name.values() if v[1]})
    return [f"framework {fw}: the default on {vendor}s (--framework to change)" for fw, vendor in used]


def _check_sweep_outputs(out: str | None, plot_path: str | None) -> None:
    """--out and --plot can be written (extension, folder, not a folder or device): checked before any work."""
    from planner.plots import check_figure_path
    from planner.sweep import check_table_path

    if out:
        check_table_path(out, "--out")
    if plot_path:
        check_figure_path(plot_path, "--plot")


def _write_sweep(rows: list[dict], varied: list[str], out: str | None, plot_path: str | None, title: str) -> None:
    """The rows to --out and the figure to --plot, each written atomically."""
    from planner.plots import plot_sweep
    from planner.sweep import write_table

    if out:
        write_table(rows, out, "--out")
    if plot_path:
        plot_sweep(rows, varied[0], varied[1] if len(varied) > 1 else None, plot_path, title=title)


def _run_with_progress(pts: list[dict], workers: int | None) -> list[dict]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from planner.sweep import default_search, run_points

    err = Console(stderr=True)
    with Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err,
                  transient=True, disable=len(pts) < 2 or not err.is_terminal) as progress:
        task = progress.add_task("sweep", total=len(pts))
        return run_points(pts, default_search, workers, lambda done, total: progress.update(task, completed=done))
