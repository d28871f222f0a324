"""`planner explain`, `planner sweep` and `planner plot`: exploring trade-offs around a plan or across a grid.

explain and plot take the same plan flags as `planner estimate`, or `--plan FILE` (a plan file from
`planner suggest --save`), in which case any plan flag given explicitly overrides the file's value.
"""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cli import options as o
from cli.main import app
from cli.render import plan_summary, print_json
from costmodel.job import Job
from costmodel.model import ModelSpec
from costmodel.plan import AXES, Plan
from hardware.chip import Chip
from hardware.errors import InputError, shown_path

GIB = 2**30
BAR = 30  # characters of the text waterfall and memory bars

# ---- the plan flags (as `planner estimate`; None = not given, so a --plan file's value stays) ---------------

PLAN_FILE = typer.Option(None, "--plan", "-p", help="A plan file (planner suggest --save); flags override it.")
MODEL = typer.Option(None, "--model", "-m", help="Preset name, a model YAML path, or a size such as 70B or 1T.")
HARDWARE = typer.Option(None, "--hardware", "-H", help="Hardware preset name or profile YAML path [tpu-v5p].")
CHIPS = typer.Option(None, "--chips", "-n", help="Number of chips; must equal the product of the degrees.")
SEQ_LEN = typer.Option(None, "--seq-len", "-s", help="Sequence length in tokens [4096].")
GLOBAL_BATCH = typer.Option(None, "--global-batch", "-b", help="Sequences per optimizer step.")
DP = typer.Option(None, "--dp", help="Data-parallel degree (replicated weights) [1].")
FSDP = typer.Option(None, "--fsdp", help="Fully-sharded data-parallel degree [1].")
TP = typer.Option(None, "--tp", help="Tensor-parallel degree [1].")
CP = typer.Option(None, "--cp", help="Context (sequence) parallel degree [1].")
PP = typer.Option(None, "--pp", help="Pipeline-parallel degree [1].")
EP = typer.Option(None, "--ep", help="Expert-parallel degree (MoE only) [1].")
VPP = typer.Option(None, "--vpp", help="Virtual pipeline stages per pipeline rank [1].")
MICRO_BATCH = typer.Option(None, "--micro-batch", help="Sequences per micro-step per model replica [1].")
ZERO = typer.Option(None, "--zero", help="ZeRO stage over the dp axis (0-3) [0].")
REMAT = typer.Option(None, "--remat", help="none, selective, full, a MaxText policy, or custom:t=c,... [full].")
OFFLOAD = typer.Option(None, "--offload", help="optimizer, params, or remat tensors to offload.")
SLICES = typer.Option(None, "--slices", help="TPU slices joined over DCN [1].")
NO_SP = typer.Option(False, "--no-sequence-parallel", help="Disable sequence parallelism on tp.")
PRECISION = typer.Option(None, "--precision", help="Matmul precision: bf16, fp8 or int8 [bf16].")
FRAMEWORK = typer.Option(None, "--framework",
                         help="State/collective conventions: maxtext, megatron, pytorch-fsdp or deepspeed [maxtext].")
VOCAB_TILES = typer.Option(None, "--vocab-tiles",
                           help="Compute logits/loss in this many token chunks (MaxText num_vocab_tiling) [1].")
WEIGHT_DTYPE = typer.Option(None, "--weight-dtype",
                            help="MaxText weight_dtype: float32 or bfloat16 (bf16 weights and Adam moments) [float32].")


def _from_plan_file(path: str) -> dict:
    """The model/hardware/chips/job/plan a plan file holds, as the keys resolve_inputs fills."""
    try:
        from planner.planfile import load_plan
    except ImportError:
        raise InputError("--plan: plan files are not available in this build (planner/planfile.py)") from None
    pf = load_plan(path)
    job: Job | None = getattr(pf, "job", None)
    out = {"model": getattr(pf, "model", None), "hardware": getattr(pf, "hardware", None),
           "chips": getattr(pf, "chips", None), "plan": getattr(pf, "plan", None), "job": job}
    return out


def _with_offload(plan: Plan, offload: list[str]) -> Plan:
    """--offload on top of a plan file's plan: optimizer/params switch on, tensor names move to host."""
    from costmodel.plan import Remat

    items = [s.strip() for x in offload for s in x.split(",") if s.strip()]
    kw: dict = {}
    tensors = {}
    for item in items:
        if item in ("optimizer", "opt"):
            kw["offload_optimizer"] = True
        elif item in ("params", "parameters"):
            kw["offload_params"] = True
        else:
            tensors[item] = "offload"
    if tensors:
        from costmodel.plan import parse_remat

        named = parse_remat("custom:" + ",".join(f"{t}=offload" for t in tensors))  # validates the names
        choices = {**plan.remat.choices(), **{t: c for t, c in named.choices().items() if c == "offload"}}
        kw["remat"] = Remat(name="custom", **choices)
    return plan.with_(**kw)


def resolve_inputs(plan_file, model, hardware, chips, seq_len, global_batch, dp, fsdp, tp, cp, pp, ep, vpp,
                   micro_batch, zero, remat, offload, slices, no_sp, precision, framework, vocab_tiles=None,
                   weight_dtype=None) -> tuple[ModelSpec, Chip, Job, Plan, int]:
    """(model, chip, job, plan, chips) from the flags, on top of a plan file when --plan is given."""
    from costmodel.catalog import load_model
    from hardware.catalog import load_hardware

    flags = {"dp": dp, "fsdp": fsdp, "tp": tp, "cp": cp, "pp": pp, "ep": ep, "vpp": vpp, "micro_batch": micro_batch,
             "slices": slices, "vocab_tiles": vocab_tiles}
    if plan_file:
        f = _from_plan_file(plan_file)
        fm, fh, fjob, fplan = f["model"], f["hardware"], f["job"], f["plan"]
        m = load_model(model) if model else (fm if isinstance(fm, ModelSpec) else load_model(str(fm)))
        chip = load_hardware(hardware) if hardware else (fh if isinstance(fh, Chip) else load_hardware(str(fh)))
        fw = framework or fjob.framework
        job = o.make_job(seq_len or fjob.seq_len, global_batch or fjob.global_batch, precision or fjob.precision, fw,
                         o.weight_dtype_over(weight_dtype, fw, fjob))
        base: Plan = fplan
        kw = {k: o.positive(f"--{k.replace('_', '-')}", v) for k, v in flags.items() if v is not None}
        if zero is not None:
            kw["zero"] = zero
        if no_sp:
            kw["sequence_parallel"] = False
        if remat is not None:
            from costmodel.plan import parse_remat

            kw["remat"] = parse_remat(remat)
        plan = base.with_(**kw)
        if offload:
            plan = _with_offload(plan, offload)
        # Changed degrees without --chips: the chips follow the degrees.
        n = chips or (plan.chips if any(flags[a] is not None for a in AXES) else f["chips"])
        return m, chip, job, plan, o.positive("--chips", n)
    missing = [flag for flag, v in (("--model", model), ("--chips", chips), ("--global-batch", global_batch))
               if v is None]
    if missing:
        raise InputError(f"{missing[0]}: required (or give --plan FILE)")
    m, chip = o.resolve(model, hardware or "tpu-v5p")
    job = o.make_job(seq_len or 4096, global_batch, precision or "bf16", framework or "maxtext",
                     weight_dtype or "float32")
    d = {k: (1 if v is None else v) for k, v in flags.items()}
    plan = o.make_plan(d["dp"], d["fsdp"], d["tp"], d["cp"], d["pp"], d["ep"], d["vpp"], d["micro_batch"],
                       zero or 0, "full" if remat is None else remat, offload, d["slices"], not no_sp,
                       d["vocab_tiles"])
    return m, chip, job, plan, o.positive("--chips", chips)


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


@app.command()
def explain(
    plan_file: str = PLAN_FILE, model: str = MODEL, hardware: str = HARDWARE, chips: int = CHIPS,
    seq_len: int = SEQ_LEN, global_batch: int = GLOBAL_BATCH, dp: int = DP, fsdp: int = FSDP, tp: int = TP,
    cp: int = CP, pp: int = PP, ep: int = EP, vpp: int = VPP, micro_batch: int = MICRO_BATCH, zero: int = ZERO,
    remat: str = REMAT, offload: list[str] = OFFLOAD, slices: int = SLICES, no_sp: bool = NO_SP,
    precision: str = PRECISION, framework: str = FRAMEWORK, vocab_tiles: int = VOCAB_TILES,
    weight_dtype: str = WEIGHT_DTYPE,
    no_what_ifs: bool = typer.Option(False, "--no-what-ifs", help="Skip costing the neighbouring plans."),
    as_json: bool = o.JSON,
) -> None:
    """Why a plan takes what it takes: step waterfall, memory against capacity, the bottleneck, and what-ifs."""
    from planner.explain import explain as explain_plan

    m, chip, job, plan, n = resolve_inputs(plan_file, model, hardware, chips, seq_len, global_batch, dp, fsdp, tp,
                                           cp, pp, ep, vpp, micro_batch, zero, remat, offload, slices, no_sp,
                                           precision, framework, vocab_tiles, weight_dtype)
    ex = explain_plan(m, chip, job, plan, n, with_what_ifs=not no_what_ifs)
    if as_json:
        print_json({**ex.to_dict(), "job": dict(job.__dict__)})
        return
    print_explanation(ex)


# ---- plot -------------------------------------------------------------------------------------------------

@app.command()
def plot(
    out: str = typer.Option(..., "--out", "-o", help="Figure path; .png, .svg or .pdf (format from the extension)."),
    plan_file: str = PLAN_FILE, model: str = MODEL, hardware: str = HARDWARE, chips: int = CHIPS,
    seq_len: int = SEQ_LEN, global_batch: int = GLOBAL_BATCH, dp: int = DP, fsdp: int = FSDP, tp: int = TP,
    cp: int = CP, pp: int = PP, ep: int = EP, vpp: int = VPP, micro_batch: int = MICRO_BATCH, zero: int = ZERO,
    remat: str = REMAT, offload: list[str] = OFFLOAD, slices: int = SLICES, no_sp: bool = NO_SP,
    precision: str = PRECISION, framework: str = FRAMEWORK, vocab_tiles: int = VOCAB_TILES,
    weight_dtype: str = WEIGHT_DTYPE,
) -> None:
    """Draw one plan's step waterfall and memory bars to a PNG, SVG or PDF file."""
    from planner.explain import explain as explain_plan
    from planner.plots import check_figure_path, plot_explanation

    check_figure_path(out, "--out")
    m, chip, job, plan, n = resolve_inputs(plan_file, model, hardware, chips, seq_len, global_batch, dp, fsdp, tp,
                                           cp, pp, ep, vpp, micro_batch, zero, remat, offload, slices, no_sp,
                                           precision, framework, vocab_tiles, weight_dtype)
    ex = explain_plan(m, chip, job, plan, n, with_what_ifs=False)
    path = plot_explanation(ex, out)
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


@app.command()
def sweep(
    vary: list[str] = typer.Option(..., "--vary", "-v",
                                   help="VARIABLE=VALUES, once or twice. Variables: chips, global_batch, seq_len, "
                                        "model, hardware. Values: a list (256,512) or a range start:stop:xF "
                                        "(geometric) or start:stop:+S. At most 2000 points in all."),
    model: str = typer.Option(None, "--model", "-m", help="Model (unless varied): preset, YAML path or size."),
    hardware: str = typer.Option(None, "--hardware", "-H",
                                 help="Hardware preset or profile (unless varied) [tpu-v5p]."),
    chips: int = typer.Option(None, "--chips", "-n", help="Number of chips (unless varied)."),
    global_batch: int = typer.Option(None, "--global-batch", "-b",
                                     help="Sequences per step (unless varied); default about 4M tokens per point."),
    seq_len: int = typer.Option(None, "--seq-len", "-s", help="Sequence length in tokens (unless varied) [4096]."),
    precision: str = o.PRECISION,
    framework: str = o.FRAMEWORK,
    out: str = typer.Option(None, "--out", "-o", help="Write the rows to a .csv (or .parquet, with pyarrow) file."),
    plot_path: str = typer.Option(None, "--plot", help="Also draw MFU, step time, degrees and headroom (.png/.svg/"
                                                       ".pdf)."),
    workers: int = typer.Option(None, "--workers", help="Processes, at most 256 (default: all cores above 8 "
                                                        "points)."),
    as_json: bool = o.JSON,
) -> None:
    """The planner's best plan at each point of a grid over one or two variables, as a table, file and plot."""
    from planner.sweep import MAX_WORKERS, SweepBase, parse_vary, points

    _check_sweep_outputs(out, plot_path)
    axes = [parse_vary(v) for v in vary]
    for name, v in (("--chips", chips), ("--global-batch", global_batch), ("--seq-len", seq_len),
                    ("--workers", workers)):
        if v is not None:
            o.positive(name, v)
    if workers is not None and workers > MAX_WORKERS:
        raise InputError(f"--workers: expected at most {MAX_WORKERS}, got {workers:,}")
    given = {"model": model, "hardware": hardware, "chips": chips, "global_batch": global_batch, "seq_len": seq_len}
    hardware, seq_len = hardware or "tpu-v5p", seq_len or 4096
    Job(seq_len=seq_len, global_batch=global_batch or 1, precision=precision, framework=framework)  # validate
    base = SweepBase(model=model or "", hardware=hardware, chips=chips, global_batch=global_batch, seq_len=seq_len,
                     precision=precision, framework=framework)
    if model:
        from costmodel.catalog import load_model

        load_model(model)
    pts = points(base, axes, given)
    rows = _run_with_progress(pts, workers)
    varied = [a.name for a in axes]
    _write_sweep(rows, varied, out, plot_path, f"{model or 'models'} on {hardware}: best plan per point")
    if as_json:
        print_json({"varied": varied, "rows": rows, "out": out, "plot": plot_path})
        return
    console = Console()
    console.print(_sweep_table(rows, varied))
    for p, what in ((out, "rows"), (plot_path, "figure")):
        if p:
            console.print(f"wrote {what} to {escape(str(p))}")


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
