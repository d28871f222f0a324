"""`planner validate`: run a plan as a real sharded JAX step and hold the cost model against XLA.

jax is imported inside the command body only (after XLA_FLAGS asks for the host devices), so that the other
commands start without it.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

import typer

from cli import options as o
from cli.main import app
from cli.plan_flags import DEFAULTS, PlanFlags, resolve_plan, with_plan_flags
from cli.render import print_json
from hardware.errors import InputError

if TYPE_CHECKING:
    from planner.validate.scale import Scale

# Stated bounds, checked before jax starts (--devices: planner.validate.scale.MAX_DEVICES). The scaled model is a
# CPU stand-in (defaults: d_model 128, 2 layers, 128 tokens); --seq-len is the real one under --target.
MAX_STEPS = 1000  # timed steps after the warm-up (timings take the fastest of a few)
MAX_D_MODEL = 4096
MAX_LAYERS = 64
MAX_SEQ_LEN = 131072  # 128 K tokens (the real length under --target; the CPU stand-in defaults to 128)
MAX_GRAD_ACCUM = 1024
SET_GIVES = ("plan_file", "from_maxtext", "from_megatron", "model", "chips", "dp", "fsdp", "tp", "cp", "pp", "ep",
             "vpp", "micro_batch", "zero", "remat", "offload", "slices", "no_sp")  # what a --set names itself
TARGET_IGNORES = ("devices", "steps", "grad_accum", "plan_timeout", "coordinator", "fast_compile", "calibrate_out",
                  "d_model", "layers")


def check_counts(devices: int, steps: int, num_processes: int, process_id: int, coordinator: str) -> None:
    """Every count within its stated bound, before any work: --devices 1..MAX_DEVICES, --steps 0..MAX_STEPS,
    --num-processes 1..MAX_DEVICES (and with --process-id only under --coordinator)."""
    from planner.validate.scale import MAX_DEVICES, check_device_count

    check_device_count(devices)
    if steps is None or not 0 <= steps <= MAX_STEPS:
        raise InputError(f"--steps: expected 0 (compile only)..{MAX_STEPS:,}, got {steps}")
    o.positive("--num-processes", num_processes, MAX_DEVICES)
    if not coordinator and (num_processes != 1 or process_id != 0):
        raise InputError(f"--num-processes {num_processes} and --process-id {process_id}: a multi-process run "
                         "needs --coordinator HOST:PORT")


def check_scale(scale: Scale) -> Scale:
    """The scaled model's sizes within their stated bounds (MAX_D_MODEL, MAX_LAYERS, MAX_SEQ_LEN, MAX_GRAD_ACCUM).
    Returns `scale`."""
    o.positive("--d-model", scale.d_model, MAX_D_MODEL)
    o.positive("--layers", scale.n_layers, MAX_LAYERS)
    o.positive("--seq-len", scale.seq_len, MAX_SEQ_LEN)
    if not 0 <= scale.micro_steps <= MAX_GRAD_ACCUM:
        raise InputError(f"--grad-accum: expected 0 (auto) or a positive integer up to {MAX_GRAD_ACCUM:,}, "
                         f"got {scale.micro_steps}")
    return scale


def check_exclusive(ctx: typer.Context, plan_set: str, target: str) -> None:
    """Flags that another one would silently override are errors naming both: --set names its models and plans,
    and --target compiles at full width without running anything."""
    if plan_set:
        o.exclusive(ctx, "--set", ("target", *SET_GIVES), "a plan set names its models and plans")
    if target:
        o.exclusive(ctx, "--target", TARGET_IGNORES, "a TPU target compiles the full-width step and runs nothing")


def _fmt(v: float | None, quantity: str) -> str:
    if v is None:
        return "-"
    if quantity.startswith(("memory", "state", "temp", "collective")):
        return f"{v / 2**20:.3f} MiB"
    if quantity == "step_time_s":
        return f"{v * 1e3:.1f} ms"
    return f"{v:.4g}"


VALIDATE_OMIT = ("seq_len", "global_batch", "precision", "framework", "weight_dtype", "vocab_tiles")  # its own job
VALIDATE_DEFAULTS = {**DEFAULTS, "model": "llama3-8b", "hardware": "cpu-host"}


@app.command(short_help="Run a plan as a JAX step; compare with the cost model.")
@with_plan_flags(omit=VALIDATE_OMIT, defaults=VALIDATE_DEFAULTS,
                 model={"help": "Preset name, a model YAML path or a size (run scaled down)."},
                 hardware={"help": "The profile the predictions use (also over a plan source's)."},
                 chips={"help": "Number of devices the plan runs on, the product of the degrees."},
                 pp={"help": "Pipeline-parallel degree (GPipe stages; layers must divide by it)."},
                 vpp={"help": "Pipeline repeats per stage (MaxText's circular pipeline; with pp)."})
def validate(
    ctx: typer.Context,
    flags: PlanFlags,
    plan_set: str = typer.Option("", "--set", metavar="NAME", help="Validate a named plan set instead (quick, cpu8)."),
    devices: int = typer.Option(8, "--devices", help="Host-platform devices to create (CPU) / to use; with "
                                "--num-processes, the global count."),
    grad_accum: int = typer.Option(0, "--grad-accum", help="Micro-batches per step of a pipeline plan (0: pp)."),
    plan_timeout: float = typer.Option(0.0, "--plan-timeout",
                                       help="Seconds a plan's compile may take before it is reported as timed out "
                                            "(0: no limit); the other plans still run."),
    coordinator: str = typer.Option("", "--coordinator", envvar="PLANNER_COORDINATOR", metavar="HOST:PORT",
                                    help="Process 0's address: run as one JAX program over several processes "
                                         "(jax.distributed.initialize; gloo collectives on CPU)."),
    num_processes: int = typer.Option(1, "--num-processes", envvar="PLANNER_NUM_PROCESSES",
                                      help="Processes of a multi-process run (with --coordinator)."),
    process_id: int = typer.Option(0, "--process-id", envvar="PLANNER_PROCESS_ID",
                                   help="This process's index, 0..N-1 (with --coordinator)."),
    steps: int = typer.Option(3, "--steps", help="Timed steps after one warm-up step (0: compile only)."),
    d_model: int = typer.Option(128, "--d-model", help="Width of the scaled-down model."),
    layers: int = typer.Option(2, "--layers", help="Layers of the scaled-down model."),
    seq_len: int = typer.Option(128, "--seq-len", "-s", help="Sequence length of the scaled-down job; under "
                                "--target the real one (then the plan source's, else 4096)."),
    fast_compile: bool = typer.Option(False, "--fast-compile/--full-opt",
                                      help="XLA backend optimisation level 0: halves CPU compile time, but steps "
                                           "run slower than the calibrated profile expects."),
    calibrate_out: str = typer.Option("", "--calibrate-out", metavar="FILE",
                                      help="Time the plans in interleaved rounds, fit the profile's efficiencies "
                                           "to them and write the calibrated profile here (a --hardware file)."),
    target: str = typer.Option("", "--target", metavar="TOPOLOGY",
                               help="Compile for a TPU topology instead (tpu-v5p:2x2x2, tpu-v6e:2x4, tpu-v5e:2x2; "
                                    "needs libtpu, no TPU): full width and the real sequence length."),
    as_json: bool = o.JSON,
) -> None:
    """Compile and run a plan on JAX devices; compare FLOPs, memory and collectives with the cost model.

    The plan comes from the plan flags of `planner estimate` (a plan source and the degrees given over it); the
    validator builds its own scaled-down job from the plan (one micro-batch per batch shard, bf16, MaxText
    conventions), so it takes no job flags.
    """
    from costmodel.constraints import check_plan
    from hardware.catalog import load_hardware
    from planner.validate.scale import Scale, check_devices, scale_down

    check_counts(devices, steps, num_processes, process_id, coordinator)
    check_exclusive(ctx, plan_set, target)
    if calibrate_out:
        from hardware.fileio import check_output_path

        check_output_path(calibrate_out, "--calibrate-out")
    if not (plan_timeout >= 0 and math.isfinite(plan_timeout)):
        raise InputError(f"--plan-timeout: expected 0 (no limit) or a positive number of seconds, got {plan_timeout}")
    scale = check_scale(Scale(d_model=d_model, n_layers=layers, seq_len=seq_len, micro_steps=grad_accum))
    hardware = flags.hardware or VALIDATE_DEFAULTS["hardware"]
    chip = load_hardware(hardware)
    local_devices = devices
    if coordinator:
        from planner.validate.distributed import check_args

        local_devices = check_args(coordinator, num_processes, process_id, devices)
    if plan_set:
        runs = plan_set_runs(plan_set)
    else:
        r = resolve_validated(flags, hardware)
        label = flags.source[1] if flags.source else "plan"
        runs = [(label, r.model, r.plan)]
        if target:  # XLA:TPU ahead-of-time compile at full width (cli.validate_tpu_cmd)
            from cli.validate_tpu_cmd import run_target

            seq = seq_len if o.given(ctx, "seq_len") else r.job.seq_len
            return run_target(target, r.plan, r.model, label, seq, as_json)
        # Bad input is checked before jax starts: one line saying what to change, exit 2 (the scaled job must also
        # pass the cost model's plan rules, which the comparison costs it by).
        check_devices(r.plan, devices)
        small, job, _ = scale_down(r.model, r.plan, scale)
        check_plan(small, chip, job, r.plan)
    run_validation(runs, chip, hardware, scale, devices, local_devices=local_devices, steps=steps,
                   plan_timeout=plan_timeout, calibrate_out=calibrate_out, fast_compile=fast_compile,
                   coordinator=coordinator, num_processes=num_processes, process_id=process_id, as_json=as_json)


def resolve_validated(flags: PlanFlags, hardware: str):
    """The model and plan to validate (cli.plan_flags.resolve_plan, the file unchecked against its own hardware:
    the plan runs scaled down here); --chips, when given, must equal the degrees' product."""
    r = resolve_plan(replace(flags, hardware=hardware), required=(), defaults=VALIDATE_DEFAULTS, check=False)
    if flags.chips is not None and flags.chips != r.plan.chips:
        raise InputError(f"--chips {flags.chips}: the plan's degrees multiply to {r.plan.chips} devices; give "
                         f"--chips {r.plan.chips} or change the degrees")
    return r


def run_validation(runs: list, chip, hardware: str, scale, devices: int, *, local_devices: int | None = None,
                   steps: int = 3, plan_timeout: float = 0.0, calibrate_out: str = "", fast_compile: bool = False,
                   coordinator: str = "", num_processes: int = 1, process_id: int = 0, as_json: bool = False) -> None:
    """Compile and run `runs` ((name, full model, plan) each) on the JAX devices, print the checks, and with
    calibrate_out time them in rounds and write the fitted profile there. Exits 1 when a check is outside
    tolerance (shared by `planner validate` and `planner calibrate --out`)."""
    from planner.validate import jax_loaded, set_host_devices

    if not jax_loaded():
        set_host_devices(local_devices or devices)
        if fast_compile:
            import os

            os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
    import jax

    from cli.progress import progress
    from planner.validate.compare import ABANDONED_COMPILES, run_plan

    restore_stdout = None
    if coordinator:
        from planner.validate.distributed import initialize, stdout_to_stderr

        restore_stdout = stdout_to_stderr() if as_json else None  # gloo's messages would corrupt the JSON
        initialize(coordinator, num_processes, process_id)
    have = len(jax.devices())
    results = []
    with progress(as_json) as bar:
        bar.stage("validate", len(runs))
        for name, m, plan in runs:
            if plan.chips > have:
                raise InputError(f"devices: plan {name} needs {plan.chips} devices but jax sees {have}; "
                                 f"lower the degrees or raise --devices")
            bar.start(f"{name}: compiling and running")
            r = run_plan(name, m, plan, chip, devices=have, steps=steps, scale=scale,
                         time_steps=not calibrate_out, keep_runner=bool(calibrate_out), timeout_s=plan_timeout)
            bar.done(f"{name}: " + (f"FAILED {r.error}" if r.error else f"compiled in {r.compile_s:.1f} s"))
            results.append(r)
        calibration = _calibrate(results, chip, hardware, calibrate_out, steps, bar) if calibrate_out else None
    checks = [c.to_dict() for r in results for c in r.checks]
    checks += [{"plan": r.name, "quantity": "compile", "predicted": None, "xla": None, "error_pct": None,
                "ok": False, "note": r.error} for r in results if r.error]
    bad = any(not c["ok"] for c in checks)
    if restore_stdout:
        restore_stdout()
    if as_json:
        print_json({"checks": checks, "plans": [_plan_info(r) for r in results],
                    **({"calibration": calibration} if calibration else {})})
    else:
        _print_table(results)
    if ABANDONED_COMPILES:  # a timed-out compile may still be running in XLA: leave without waiting for it
        import os

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if bad else 0)
    if bad:
        # typer.Exit would be swallowed by click's standalone_mode=False (cli.main ignores the return code)
        sys.stdout.flush()
        sys.exit(1)


def plan_set_runs(plan_set: str) -> list:
    """(name, full model, plan) of each plan in a named set (planner.validate.plans.PLAN_SETS)."""
    from costmodel.catalog import load_model
    from planner.validate.plans import PLAN_SETS

    if plan_set not in PLAN_SETS:
        raise InputError(f"--set: unknown plan set {plan_set!r}; expected one of {', '.join(PLAN_SETS)}")
    return [(name, load_model(mname), plan) for name, mname, plan in PLAN_SETS[plan_set]]


def calibrate_on_devices(hardware: str, out: str, plan_set: str, devices: int, steps: int, scale,
                         fast_compile: bool, as_json: bool) -> None:
    """`planner calibrate --hardware H --out FILE`: run a named plan set on the JAX devices, fit the profile's
    efficiencies to the measured step times and write the calibrated profile to FILE."""
    from hardware.catalog import load_hardware
    from hardware.fileio import check_output_path
    from planner.validate.scale import check_devices

    check_counts(devices, steps, 1, 0, "")
    check_scale(scale)
    check_output_path(out, "--out")
    chip = load_hardware(hardware)
    runs = plan_set_runs(plan_set)
    for _, _, plan in runs:  # before jax starts: one line saying what to change
        check_devices(plan, devices)
    run_validation(runs, chip, hardware, scale, devices, steps=steps, calibrate_out=out, fast_compile=fast_compile,
                   as_json=as_json)


def _calibrate(results, chip, hardware: str, out: str, steps: int, bar) -> dict:
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

    rounds = 5
    bar.stage("calibrate", rounds)

    def log(msg: str) -> None:  # one call per finished timing round
        bar.start(msg)
        bar.done(f"calibrate: {msg}")

    time_in_rounds(results, chip, rounds=rounds, steps=max(1, min(steps, 3)), log=log)
    cases = cases_from(results, chip)
    if len(cases) < 3:
        raise InputError(f"--calibrate-out: needs at least 3 plans that ran (got {len(cases)}); use --set cpu8")
    meas = [c.measured_step_time_s for c in cases]
    before = summary(predicted_times(cases, chip), meas)
    cal, stats = fit_efficiency(cases, chip)
    after = summary(predicted_times(cases, cal), meas)
    base = Path(hardware) if hardware.endswith((".yaml", ".yml")) else PROFILE_DIR / f"{hardware}.yaml"
    import jax

    path = Path(out)
    if jax.process_index() == 0:  # one writer in a multi-process run
        path = write_profile(cal, base, path, f"[FIT] efficiencies fitted by planner validate on {len(cases)} plans")
    bar.log(f"calibrate: Spearman {before['spearman']:.3f} -> {after['spearman']:.3f}, median |error| "
            f"{before['median_error_pct']:.1f}% -> {after['median_error_pct']:.1f}%; wrote {path}")
    return {"before": before, "after": after, "rows": stats["rows"], "profile": str(path),
            "eff": dict(cal.eff.__dict__)}


def _plan_info(r) -> dict:
    from cli.render import plan_dict

    d = {"plan": r.name, "config": plan_dict(r.plan), "error": r.error, "notes": r.notes,
         "compile_s": r.compile_s, "step_times_s": r.step_times_s, "loss": r.loss}
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
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    for r in results:
        if r.error:
            console.print(f"[red]{escape(r.name)}: {escape(r.error)}[/red]")
            continue
        t = Table(title=escape(f"{r.name} ({r.model.name}, seq {r.job.seq_len}, batch {r.job.global_batch})"))
        for c in ("quantity", "predicted", "XLA / measured", "error %", "ok"):
            t.add_column(c, justify="left" if c == "quantity" else "right")
        for c in r.checks:
            err = "-" if c.error_pct is None else f"{c.error_pct:+.1f}"
            t.add_row(c.quantity, _fmt(c.predicted, c.quantity), _fmt(c.xla, c.quantity), err,
                      "yes" if c.ok else "[red]no[/red]")
        console.print(t)
    sys.stdout.flush()
