"""`planner goodput` (failures, checkpoints, time/cost/energy to train) and `planner replan` (elastic re-planning)."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cli import options as o
from cli.main import app
from cli.plan_flags import plan_from
from cli.render import plan_dict, plan_summary, print_json
from costmodel.estimate import estimate as estimate_cost
from costmodel.goodput import (
    DEFAULT_CKPT_AGGREGATE_BPS,
    DEFAULT_CKPT_PER_CHIP_BPS,
    DEFAULT_REPAIR_H,
    DEFAULT_REPLACE_S,
    DEFAULT_RESTART_S,
    Goodput,
    Reliability,
    check_spares,
    goodput,
    parse_count,
)
from hardware.errors import InputError

GIB = 2**30

MTBF = typer.Option(None, "--mtbf-hours", help="Chip MTBF in hours (job-interrupting failures per chip).",
                    show_default="50,677 h from Llama 3: 419 interruptions in 54 days on 16,384 H100s")
SPARES = typer.Option(0, "--spares", help="Hot-spare chips (used in whole hosts) that replace failed ones at once.")
RESTART = typer.Option(DEFAULT_RESTART_S / 60, "--restart-min",
                       help="Minutes from a failure to resuming, before the checkpoint read (an assumed value, "
                            "not a measured one).")
REPLACE = typer.Option(DEFAULT_REPLACE_S / 60, "--replace-min",
                       help="Extra minutes waiting for a replacement host when no hot spare is free (an assumed "
                            "value, not a measured one).")
REPAIR = typer.Option(DEFAULT_REPAIR_H, "--repair-hours", help="Hours a failed host is out before it is a spare again.")
CK_WRITE = typer.Option(DEFAULT_CKPT_PER_CHIP_BPS / 1e9, "--ckpt-write-gbps",
                        help="Checkpoint write bandwidth per chip, GB/s.")
CK_READ = typer.Option(DEFAULT_CKPT_PER_CHIP_BPS / 1e9, "--ckpt-read-gbps",
                       help="Checkpoint read (restore) bandwidth per chip, GB/s.")
CK_AGG = typer.Option(DEFAULT_CKPT_AGGREGATE_BPS / 1e9, "--ckpt-storage-gbps",
                      help="Storage cap on checkpoint bandwidth for the whole job, GB/s (Llama 3: 2,000 sustained).")
INTERVAL = typer.Option(None, "--checkpoint-min", help="Checkpoint interval in minutes.",
                        show_default="Young's optimum")


def make_reliability(mtbf_hours: float | None, spares: int, restart_min: float, replace_min: float,
                     repair_hours: float, ckpt_write_gbps: float, ckpt_read_gbps: float, ckpt_storage_gbps: float,
                     checkpoint_min: float | None) -> Reliability:
    """Reliability from the flags, each checked before any work: floats finite and within cli.options.number's
    bounds (restart and replacement minutes may be 0), spares 0..planner.candidates.MAX_CHIPS."""
    from planner.candidates import MAX_CHIPS

    for flag, v in (("--mtbf-hours", mtbf_hours), ("--repair-hours", repair_hours),
                    ("--ckpt-write-gbps", ckpt_write_gbps), ("--ckpt-read-gbps", ckpt_read_gbps),
                    ("--ckpt-storage-gbps", ckpt_storage_gbps), ("--checkpoint-min", checkpoint_min)):
        o.number(flag, v)
    o.number("--restart-min", restart_min, zero_ok=True)
    o.number("--replace-min", replace_min, zero_ok=True)
    if spares is None or spares < 0:
        raise InputError(f"--spares: expected a non-negative integer, got {spares}")
    o.at_most("--spares", spares, MAX_CHIPS)
    return Reliability(mtbf_h=mtbf_hours, restart_s=restart_min * 60, replace_s=replace_min * 60,
                       repair_h=repair_hours, ckpt_write_Bps=ckpt_write_gbps * 1e9, ckpt_read_Bps=ckpt_read_gbps * 1e9,
                       ckpt_aggregate_Bps=ckpt_storage_gbps * 1e9, spares=spares,
                       interval_s=checkpoint_min * 60 if checkpoint_min is not None else None)


def _dur(s: float) -> str:
    if s != s or s == float("inf"):
        return "never"
    if s < 120:
        return f"{s:.1f} s"
    if s < 2 * 3600:
        return f"{s / 60:.1f} min"
    if s < 2 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:,.1f} days"


def goodput_rows(g: Goodput) -> list[tuple[str, str]]:
    rows = [
        ("chip MTBF", f"{g.chip_mtbf_h:,.0f} h  ({g.mtbf_source})"),
        ("job MTBF", f"{_dur(g.job_mtbf_h * 3600)}  ({g.failures_per_day:.2f} failures/day)"),
        ("checkpoint size", f"{g.checkpoint_bytes / 1e12:.2f} TB"),
        ("checkpoint write / restore", f"{_dur(g.checkpoint_write_s)} / {_dur(g.checkpoint_restore_s)}"),
        ("checkpoint interval", f"{_dur(g.interval_s)}  (Young {_dur(g.young_interval_s)}, Daly "
                                f"{_dur(g.daly_interval_s)}; {g.interval_s / g.step_time_s:.1f} steps)"),
        ("restart per failure", f"{_dur(g.restart_s)} + lost work {_dur(g.lost_work_s)}"),
    ]
    if g.spares:
        rows.append(("hot spares", f"{g.spares} chips = {g.spare_hosts} hosts; a spare is free for "
                                   f"{g.spare_coverage * 100:.1f}% of failures"))
    rows += [
        ("overhead", f"checkpoints {g.checkpoint_overhead * 100:.2f}%, failures {g.failure_overhead * 100:.2f}%"),
        ("goodput", f"{g.goodput * 100:.2f}%"),
        ("tokens/s (step time)", f"{g.tokens_per_s:,.0f}"),
        ("effective tokens/day", f"{g.effective_tokens_per_day:,.4g}"),
    ]
    if g.train_tokens is not None:
        rows += [("time to train", f"{g.days_to_train:,.1f} days (no failures: {g.ideal_days:,.1f})"),
                 ("chip-hours billed", f"{g.chip_hours:,.4g}" + (" (incl. spares)" if g.spares else ""))]
        if g.cost is not None:
            rows.append(("cost", f"${g.cost:,.0f} at ${g.price_per_chip_hour:g}/chip-hour"))
        rows.append(("energy (chips only)", f"{g.energy_kwh / 1e3:,.4g} MWh" if g.energy_kwh is not None
                     else "unknown (profile has no power_w)"))
    return rows


def print_goodput(g: Goodput, title: str, console: Console | None = None) -> None:
    t = Table(title=escape(title), show_header=False)
    t.add_column("metric", style="bold")
    t.add_column("value")
    for k, v in goodput_rows(g):
        t.add_row(k, v)
    (console or Console()).print(t)


PLAN_FILE_GIVES = ("model", "hardware", "chips", "seq_len", "global_batch", "dp", "fsdp", "tp", "cp", "pp", "ep",
                   "vpp", "micro_batch", "zero", "remat", "offload", "slices", "no_sp", "precision", "framework")


@app.command("goodput", short_help="Goodput, days and cost to train under chip failures.")
def goodput_cmd(
    ctx: typer.Context,
    model: str = o.option("model", help="Preset name, model YAML path, or a size such as 1T."),
    hardware: str = o.HARDWARE,
    chips: int = o.option("chips", help="Number of chips."),
    plan_file: str = o.option("plan_file", help="A plan file instead of the model and plan flags."),
    seq_len: int = o.SEQ_LEN,
    global_batch: int = o.option("global_batch", help="Sequences per step.", show_default="about 4M tokens"),
    dp: int = o.option("dp"), fsdp: int = o.option("fsdp"), tp: int = o.option("tp"), cp: int = o.option("cp"),
    pp: int = o.option("pp"), ep: int = o.option("ep"), vpp: int = o.option("vpp"),
    micro_batch: int = o.option("micro_batch"), zero: int = o.option("zero"), remat: str = o.option("remat"),
    offload: list[str] = o.option("offload"), slices: int = o.option("slices"), no_sp: bool = o.option("no_sp"),
    precision: str = o.PRECISION,
    framework: str = o.FRAMEWORK,
    train_tokens: str = typer.Option(None, "--train-tokens", metavar="COUNT",
                                     help="Tokens to train, e.g. 15T, 300B, 2.5e12."),
    price: float = typer.Option(None, "--price-per-chip-hour", help="Price of one chip-hour (any currency)."),
    mtbf_hours: float = MTBF, spares: int = SPARES, restart_min: float = RESTART, replace_min: float = REPLACE,
    repair_hours: float = REPAIR, ckpt_write_gbps: float = CK_WRITE, ckpt_read_gbps: float = CK_READ,
    ckpt_storage_gbps: float = CK_AGG, checkpoint_min: float = INTERVAL,
    as_json: bool = o.JSON,
) -> None:
    """Goodput of one plan under chip failures: optimal checkpoint interval, lost work, effective tokens per day,
    and with --train-tokens the days, cost and energy to finish. Without degree flags the planner's best plan."""
    rel = make_reliability(mtbf_hours, spares, restart_min, replace_min, repair_hours, ckpt_write_gbps,
                           ckpt_read_gbps, ckpt_storage_gbps, checkpoint_min)
    tokens = parse_count(train_tokens) if train_tokens is not None else None
    o.number("--price-per-chip-hour", price)
    if plan_file:
        from planner.planfile import load_plan

        o.exclusive(ctx, "--plan", PLAN_FILE_GIVES, "the plan file gives the model, hardware, chips, job and plan")
        pf = load_plan(plan_file)
        m, chip, job, plan, n, source = pf.model, pf.hardware, pf.job, pf.plan, pf.chips, plan_file
        check_spares(spares, n)
    else:
        plan = plan_from(dp=dp, fsdp=fsdp, tp=tp, cp=cp, pp=pp, ep=ep, vpp=vpp, micro_batch=micro_batch, zero=zero,
                         remat=remat, offload=tuple(offload or ()), slices=slices, no_sp=no_sp)
        m, chip, job, plan, n, source = _flags_plan(model, hardware, chips, seq_len, global_batch, spares, precision,
                                                    framework, plan)
    cost = estimate_cost(m, chip, job, plan, n)
    if not cost.fits:
        typer.echo(f"warning: the plan does not fit in memory (over by {cost.overflow_bytes / GIB:.1f} GiB per chip)",
                   err=True)
    g = goodput(m, chip, job, plan, cost, rel, tokens, price)
    if as_json:
        print_json({"model": m.name, "hardware": chip.name, "chips": n, "plan": plan_dict(plan), "plan_source": source,
                    "global_batch": job.global_batch, "seq_len": job.seq_len, "goodput": g.to_dict(),
                    "step_time_s": cost.step_time_s, "mfu": cost.mfu, "fits": cost.fits})
        return
    print_goodput(g, f"{m.name} on {n} x {chip.name}: {plan_summary(plan)}  [{source}]  step {cost.step_time_s:.2f} s, "
                     f"MFU {cost.mfu * 100:.1f}%, batch {job.global_batch} x {job.seq_len}")


def _flags_plan(model: str | None, hardware: str, chips: int | None, seq_len: int, global_batch: int | None,
               spares: int, precision: str, framework: str, plan):
    """(model, chip, job, plan, chips, source) from the flags; with no degree flags (a one-chip plan on more chips)
    the planner's fastest plan, and a valid job that no plan fits exits 1 (cli.options.nothing_fits)."""
    if model is None:
        raise InputError("give --model (with --chips) or --plan FILE")
    if chips is None:
        raise InputError("--chips: required with --model")
    o.chips_count(chips)
    check_spares(spares, chips)
    m, chip = o.resolve(model, hardware)
    if global_batch is None:
        from planner.candidates import Constraints, check_chips, default_batch_for, default_global_batch

        o.make_job(seq_len, 1, precision, framework)  # check the job fields first
        if plan.chips == 1 and chips > 1:  # the planner's plan: the default batch suggest would use
            check_chips(chip, chips)
            global_batch, _ = default_batch_for(m, chip, chips, seq_len, precision, framework or "maxtext",
                                                Constraints())
        else:
            global_batch = default_global_batch(chips, seq_len)
    job = o.make_job(seq_len, global_batch, precision, framework)
    if plan.chips > 1 or chips == 1:
        return m, chip, job, plan, chips, "plan flags"
    from planner.solve import search

    s = search(m, chip, job, chips, top=1)
    if not s.plans:
        reason = s.infeasible.reason if s.infeasible else "no plan fits"
        raise o.nothing_fits(f"{m.name} on {chips} x {chip.name}: {reason}")
    return m, chip, job, s.plans[0].plan, chips, "planner search (fastest step)"


@app.command("replan", short_help="The best plan at a new chip count, and the cost of moving.")
def replan_cmd(
    plan_file: str = typer.Option(..., "--plan", "-p", metavar="FILE", help="The running job's plan file."),
    chips: int = typer.Option(..., "--chips", "-n", help="The new chip count (after losing or adding chips)."),
    out: str = typer.Option(None, "--out", "-o", metavar="FILE", help="Write the new plan file here (.json for JSON)."),
    mtbf_hours: float = MTBF, restart_min: float = RESTART, ckpt_read_gbps: float = CK_READ,
    ckpt_storage_gbps: float = CK_AGG,
    as_json: bool = o.JSON,
) -> None:
    """The best plan at a new chip count, keeping the global batch if possible, and the cost of moving the
    parameters and optimizer state to it (resharding in memory vs restarting from a checkpoint)."""
    from hardware.fileio import check_output_path
    from planner.planfile import load_plan
    from planner.replan import NoPlanFits, replan

    o.chips_count(chips)
    rel = make_reliability(mtbf_hours, 0, restart_min, DEFAULT_REPLACE_S / 60, DEFAULT_REPAIR_H,
                           DEFAULT_CKPT_PER_CHIP_BPS / 1e9, ckpt_read_gbps, ckpt_storage_gbps, None)
    if out is not None:
        check_output_path(out, "--out")
    pf = load_plan(plan_file)
    try:
        r = replan(pf.model, pf.hardware, pf.job, pf.plan, chips, rel)
    except NoPlanFits as e:  # a valid job that nothing fits: exit 1, as suggest
        raise o.nothing_fits(str(e)) from None
    rs = r.reshard
    if out is not None:
        from planner.planfile import save_plan

        save_plan(out, pf.model_ref or pf.model, pf.hardware_ref or pf.hardware, chips, r.new_job, r.new_plan,
                  r.new_cost, description=f"replanned from {plan_file} ({pf.chips} -> {chips} chips)")
    if as_json:
        print_json({"model": pf.model.name, "hardware": pf.hardware.name, "old_chips": r.old_chips,
                    "new_chips": r.new_chips, "old_plan": plan_dict(r.old_plan), "new_plan": plan_dict(r.new_plan),
                    "old_global_batch": r.old_job.global_batch, "new_global_batch": r.new_job.global_batch,
                    "batch_kept": r.batch_kept, "batch_note": r.batch_note, "searched": r.searched,
                    "old_step_time_s": r.old_cost.step_time_s if r.old_cost else None,
                    "new_step_time_s": r.new_cost.step_time_s, "new_fits": r.new_cost.fits,
                    "old_tokens_per_s": r.old_cost.tokens_per_s if r.old_cost else None,
                    "new_tokens_per_s": r.new_cost.tokens_per_s, "reshard": rs.__dict__,
                    "out": out})
        return
    t = Table(title=escape(f"replan {pf.model.name} on {chip_name(pf)}: {r.old_chips} -> {r.new_chips} chips"),
              show_header=False)
    t.add_column("item", style="bold")
    t.add_column("value")
    old_t = f"{r.old_cost.step_time_s:.2f} s, {r.old_cost.tokens_per_s:,.0f} tok/s" if r.old_cost else "n/a"
    t.add_row("old plan", f"{plan_summary(r.old_plan)}  ({old_t})")
    t.add_row("new plan", f"{plan_summary(r.new_plan)}  ({r.new_cost.step_time_s:.2f} s, "
                          f"{r.new_cost.tokens_per_s:,.0f} tok/s, {r.new_cost.peak_memory_bytes / GIB:.1f} GiB/chip)")
    t.add_row("global batch", r.batch_note)
    t.add_row("state per chip", f"{rs.old_state_bytes_per_chip / GIB:.2f} GiB -> "
                                f"{rs.new_state_bytes_per_chip / GIB:.2f} GiB (weights + optimizer)")
    t.add_row("reshard in memory", f"{rs.moved_bytes_per_chip / GIB:.2f} GiB into the busiest chip over {rs.level} at "
                                   f"{rs.link_Bps / 1e9:.0f} GB/s: {_dur(rs.transfer_s)} + restart = "
                                   f"{_dur(rs.reshard_s)}")
    t.add_row("via checkpoint", f"{rs.checkpoint_bytes / 1e12:.2f} TB: write {_dur(rs.checkpoint_write_s)} + restart "
                                f"+ read {_dur(rs.checkpoint_read_s)} = {_dur(rs.checkpoint_restart_s)} (after a "
                                "failure: no write, but the work since the last checkpoint is lost)")
    t.add_row("recommended", rs.recommended + ("" if rs.replicas_survive_loss else
                                               " (planned resize only: after an unplanned loss the lost shards have no"
                                               " replica, so restore from the checkpoint)"))
    if out:
        t.add_row("written", out)
    Console().print(t)


def chip_name(pf) -> str:
    return pf.hardware.name
