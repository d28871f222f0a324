"""`planner validate`: run a plan as a real sharded JAX step and hold the cost model against XLA.

jax is imported inside the command body only (after XLA_FLAGS asks for the host devices), so that the other
commands start without it.
"""

from __future__ import annotations

import sys

import typer

from cli import options as o
from cli.main import app
from cli.render import print_json
from hardware.errors import InputError


def _fmt(v: float | None, quantity: str) -> str:
    if v is None:
        return "-"
    if quantity.startswith(("memory", "state", "temp", "collective")):
        return f"{v / 2**20:.3f} MiB"
    if quantity == "step_time_s":
        return f"{v * 1e3:.1f} ms"
    return f"{v:.4g}"


@app.command()
def validate(
    model: str = typer.Option("llama3-8b", "--model", "-m", help="Preset name or model YAML (scaled down)."),
    hardware: str = typer.Option("cpu-host", "--hardware", "-H", help="Profile the predictions use."),
    dp: int = typer.Option(1, "--dp", help="Data-parallel degree."),
    fsdp: int = typer.Option(1, "--fsdp", help="Fully-sharded data-parallel degree."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel degree."),
    cp: int = typer.Option(1, "--cp", help="Context (sequence) parallel degree."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel degree (not supported by the validator yet)."),
    ep: int = typer.Option(1, "--ep", help="Expert-parallel degree (MoE only)."),
    micro_batch: int = typer.Option(1, "--micro-batch", help="Sequences per micro-step per model replica."),
    zero: int = typer.Option(0, "--zero", help="ZeRO stage over the dp axis (0-3)."),
    remat: str = typer.Option("full", "--remat", help="none, selective, full, a MaxText policy, or custom:t=c,..."),
    no_sp: bool = typer.Option(False, "--no-sequence-parallel", help="Disable sequence parallelism on tp."),
    plan_file: str = typer.Option("", "--plan", help="A plan file (planner plan files); its model and degrees."),
    plan_set: str = typer.Option("", "--set", help="Validate a named plan set instead (quick, cpu8)."),
    devices: int = typer.Option(8, "--devices", help="Host-platform devices to create (CPU) / to use."),
    steps: int = typer.Option(3, "--steps", help="Timed steps after one warm-up step (0: compile only)."),
    d_model: int = typer.Option(128, "--d-model", help="Width of the scaled-down model."),
    layers: int = typer.Option(2, "--layers", help="Layers of the scaled-down model."),
    seq_len: int = typer.Option(128, "--seq-len", help="Sequence length of the scaled-down job."),
    fast_compile: bool = typer.Option(False, "--fast-compile/--full-opt",
                                      help="XLA backend optimisation level 0: halves CPU compile time, but steps "
                                           "run slower than the calibrated profile expects."),
    calibrate_out: str = typer.Option("", "--calibrate-out",
                                      help="Time the plans in interleaved rounds, fit the profile's efficiencies "
                                           "to them and write the calibrated profile here (a --hardware file)."),
    as_json: bool = o.JSON,
) -> None:
    """Compile and run a plan on JAX devices; compare FLOPs, memory and collectives with the cost model."""
    from costmodel.catalog import load_model
    from hardware.catalog import load_hardware
    from planner.validate import jax_loaded, set_host_devices
    from planner.validate.plans import PLAN_SETS
    from planner.validate.scale import Scale, check_devices, scale_down

    o.positive("--devices", devices)
    chip = load_hardware(hardware)
    scale = Scale(d_model=o.positive("--d-model", d_model), n_layers=o.positive("--layers", layers),
                  seq_len=o.positive("--seq-len", seq_len))
    if plan_set:
        if plan_set not in PLAN_SETS:
            raise InputError(f"--set: unknown plan set {plan_set!r}; expected one of {', '.join(PLAN_SETS)}")
        runs = [(name, load_model(mname), plan) for name, mname, plan in PLAN_SETS[plan_set]]
    else:
        if plan_file:
            from planner.planfile import load_plan

            pf = load_plan(plan_file, check=False)
            plan, m_full, label = pf.plan, pf.model, plan_file
        else:
            plan = o.make_plan(dp, fsdp, tp, cp, pp, ep, 1, micro_batch, zero, remat, None, 1, not no_sp)
            m_full, label = load_model(model), "plan"
        runs = [(label, m_full, plan)]
        # Bad input is checked before jax starts: one line saying what to change, exit 2.
        check_devices(plan, devices)
        scale_down(runs[0][1], plan, scale)
    if not jax_loaded():
        set_host_devices(devices)
        if fast_compile:
            import os

            os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
    import jax

    from planner.validate.compare import run_plan

    have = len(jax.devices())
    results = []
    for i, (name, m, plan) in enumerate(runs, 1):
        if plan.chips > have:
            raise InputError(f"devices: plan {name} needs {plan.chips} devices but jax sees {have}; "
                             f"lower the degrees or raise --devices")
        typer.echo(f"[{i}/{len(runs)}] {name}: compiling and running ...", err=True)
        r = run_plan(name, m, plan, chip, devices=have, steps=steps, scale=scale,
                     time_steps=not calibrate_out, keep_runner=bool(calibrate_out))
        typer.echo(f"[{i}/{len(runs)}] {name}: " + (f"FAILED {r.error}" if r.error else
                   f"compiled in {r.compile_s:.1f} s"), err=True)
        results.append(r)
    calibration = _calibrate(results, chip, hardware, calibrate_out, steps) if calibrate_out else None
    checks = [c.to_dict() for r in results for c in r.checks]
    checks += [{"plan": r.name, "quantity": "compile", "predicted": None, "xla": None, "error_pct": None,
                "ok": False, "note": r.error} for r in results if r.error]
    bad = any(not c["ok"] for c in checks)
    if as_json:
        print_json({"checks": checks, "plans": [_plan_info(r) for r in results],
                    **({"calibration": calibration} if calibration else {})})
    else:
        _print_table(results)
    if bad:
        # typer.Exit would be swallowed by click's standalone_mode=False (cli.main ignores the return code)
        sys.stdout.flush()
        sys.exit(1)


def _calibrate(results, chip, hardware: str, out: str, steps: int) -> dict:
    from pathlib import Path

    from hardware.catalog import PROFILE_DIR
    from planner.validate.calibrate_cpu import (
        cases_from,
        fit_efficiency,
        predicted_times,
        summary,
        time_in_rounds,
        write_profile,
    )

    time_in_rounds(results, chip, rounds=5, steps=max(1, min(steps, 3)),
                   log=lambda msg: typer.echo(f"calibrate: {msg}", err=True))
    cases = cases_from(results, chip)
    if len(cases) < 3:
        raise InputError(f"--calibrate-out: needs at least 3 plans that ran (got {len(cases)}); use --set cpu8")
    meas = [c.measured_step_time_s for c in cases]
    before = summary(predicted_times(cases, chip), meas)
    cal, stats = fit_efficiency(cases, chip)
    after = summary(predicted_times(cases, cal), meas)
    base = Path(hardware) if hardware.endswith((".yaml", ".yml")) else PROFILE_DIR / f"{hardware}.yaml"
    path = write_profile(cal, base, Path(out), f"[FIT] efficiencies fitted by planner validate on {len(cases)} plans")
    typer.echo(f"calibrate: Spearman {before['spearman']:.3f} -> {after['spearman']:.3f}, median |error| "
               f"{before['median_error_pct']:.1f}% -> {after['median_error_pct']:.1f}%; wrote {path}", err=True)
    return {"before": before, "after": after, "rows": stats["rows"], "profile": str(path),
            "eff": dict(cal.eff.__dict__)}


def _plan_info(r) -> dict:
    from cli.render import plan_dict

    d = {"plan": r.name, "config": plan_dict(r.plan), "error": r.error, "notes": r.notes,
         "compile_s": r.compile_s, "step_times_s": r.step_times_s}
    if r.model is not None:
        m = r.model
        d["scaled_model"] = {"n_layers": m.n_layers, "d_model": m.d_model, "n_heads": m.n_heads,
                             "n_kv_heads": m.n_kv_heads, "ffn_dim": m.ffn_dim, "vocab_size": m.vocab_size,
                             "n_experts": m.n_experts, "experts_per_token": m.experts_per_token,
                             "seq_len": r.job.seq_len, "global_batch": r.job.global_batch}
        d["xla_collectives_by_axis"] = r.xla.get("collectives_by_axis", {})
        d["xla_memory"] = r.xla.get("memory", {})
    return d


def _print_table(results) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for r in results:
        if r.error:
            console.print(f"[red]{r.name}: {r.error}[/red]")
            continue
        t = Table(title=f"{r.name} ({r.model.name}, seq {r.job.seq_len}, batch {r.job.global_batch})")
        for c in ("quantity", "predicted", "XLA / measured", "error %", "ok"):
            t.add_column(c, justify="left" if c == "quantity" else "right")
        for c in r.checks:
            err = "-" if c.error_pct is None else f"{c.error_pct:+.1f}"
            t.add_row(c.quantity, _fmt(c.predicted, c.quantity), _fmt(c.xla, c.quantity), err,
                      "yes" if c.ok else "[red]no[/red]")
        console.print(t)
    sys.stdout.flush()
