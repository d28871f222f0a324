"""`planner estimate`, `planner bench published` and `planner calibrate`."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from cli import options as o
from cli.main import app
from cli.render import plan_dict, plan_summary, print_cost, print_json
from costmodel.estimate import estimate as estimate_cost

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks of the cost model against measurements.")
app.add_typer(bench_app, name="bench")


@app.command()
def estimate(
    model: str = o.MODEL,
    hardware: str = o.HARDWARE,
    chips: int = typer.Option(..., "--chips", "-n", help="Number of chips; must equal the product of the degrees."),
    seq_len: int = o.SEQ_LEN,
    global_batch: int = typer.Option(..., "--global-batch", "-b", help="Sequences per optimizer step."),
    dp: int = typer.Option(1, "--dp", help="Data-parallel degree (replicated weights)."),
    fsdp: int = typer.Option(1, "--fsdp", help="Fully-sharded data-parallel degree."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel degree."),
    cp: int = typer.Option(1, "--cp", help="Context (sequence) parallel degree."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel degree."),
    ep: int = typer.Option(1, "--ep", help="Expert-parallel degree (MoE only)."),
    vpp: int = typer.Option(1, "--vpp", help="Virtual pipeline stages per pipeline rank."),
    micro_batch: int = typer.Option(1, "--micro-batch", help="Sequences per micro-step per model replica."),
    zero: int = typer.Option(0, "--zero", help="ZeRO stage over the dp axis (0-3)."),
    remat: str = typer.Option("full", "--remat", help="none, selective, full, a MaxText policy, or custom:t=c,..."),
    offload: list[str] = typer.Option(None, "--offload", help="optimizer, params, or remat tensors to offload."),
    slices: int = typer.Option(1, "--slices", help="TPU slices joined over DCN."),
    no_sp: bool = typer.Option(False, "--no-sequence-parallel", help="Disable sequence parallelism on tp."),
    precision: str = o.PRECISION,
    framework: str = o.FRAMEWORK,
    as_json: bool = o.JSON,
) -> None:
    """Cost one explicit plan: step time, MFU, memory per chip and where the time goes."""
    m, chip = o.resolve(model, hardware)
    job = o.make_job(seq_len, global_batch, precision, framework)
    plan = o.make_plan(dp, fsdp, tp, cp, pp, ep, vpp, micro_batch, zero, remat, offload, slices, not no_sp)
    o.positive("--chips", chips)
    cost = estimate_cost(m, chip, job, plan, chips)
    if as_json:
        print_json({"model": m.name, "hardware": chip.name, "chips": chips, "plan": plan_dict(plan), **cost.to_dict()})
        return
    print_cost(cost, f"{m.name} on {chips} x {chip.name}: {plan_summary(plan)}")


@bench_app.command("published")
def bench_published(
    file: str = typer.Option(..., "--file", "-f", help="CSV in the runs_dev.csv schema."),
    as_json: bool = o.JSON,
) -> None:
    """Predicted vs measured step time for every usable row of a published-runs CSV."""
    from costmodel.published import evaluate, load_cases, mape

    cases, skipped = load_cases(file)
    rows = evaluate(cases) + [{"id": k, "skipped": v} for k, v in skipped.items()]
    summary = mape(rows)
    if as_json:
        print_json({"rows": rows, "mape_pct": summary})
        return
    console = Console()
    t = Table(title=f"published runs: {file}")
    for c in ("id", "hardware", "predicted s", "measured s", "error %", "mem GiB", "fits"):
        t.add_column(c, justify="right" if c != "id" else "left")
    for r in rows:
        if "skipped" in r:
            t.add_row(r["id"], "", "", "", "skipped: " + r["skipped"], "", "")
        else:
            t.add_row(r["id"], r["hardware"], f"{r['predicted_step_time_s']:.3f}", f"{r['measured_step_time_s']:.3f}",
                      f"{r['error_pct']:+.1f}", f"{r['predicted_peak_memory_bytes'] / 2**30:.1f}", str(r["fits"]))
    console.print(t)
    s = Table(title="MAPE (%)")
    s.add_column("group")
    s.add_column("MAPE %", justify="right")
    for k, v in summary.items():
        s.add_row(k, f"{v:.1f}")
    console.print(s)


@app.command()
def calibrate(
    file: str = typer.Option(..., "--file", "-f", help="CSV in the runs_dev.csv schema with measured step times."),
    hardware: list[str] = typer.Option(None, "--hardware", "-H", help="Only these presets (default: all in file)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the fit without writing the overlay."),
) -> None:
    """Fit each chip's efficiency parameters to measured runs and write hardware/calibration/NAME.yaml."""
    from costmodel.calibrate import calibrate_all

    for name, eff, stats, path in calibrate_all(file, hardware or None, write=not dry_run):
        vals = ", ".join(f"{k}={v:.3g}" for k, v in eff.__dict__.items())
        where = f" -> {path}" if path else ""
        typer.echo(f"{name}: {stats['rows']} rows, MAPE {stats['mape_pct']:.1f}%, worst {stats['worst_pct']:.1f}%"
                   f"  [{vals}]{where}")
