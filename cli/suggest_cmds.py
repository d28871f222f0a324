"""`planner suggest`: the fastest plans that fit, from the auto-parallel search (planner.solve)."""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from cli import options as o
from cli.main import app
from cli.render import plan_dict, print_json
from cli.verify_cmds import MAXTEXT_ENV
from hardware.errors import InputError, escape

if TYPE_CHECKING:
    from planner.candidates import Constraints

GIB = 2**30
SHORT = {"layer_input": "in", "qkv_proj": "qkv", "context": "ctx", "out_proj": "out", "mlp_in": "mlp_in",
         "mlp_out": "mlp_out"}
TOKENS_RE = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmg]?)\s*$", re.IGNORECASE)


def parse_tokens(text: str | None) -> int | None:
    """'4M' -> 4 * 2**20 tokens (K/M/G are powers of two, as batch sizes in tokens usually are); '4e6' -> 4,000,000."""
    if text is None:
        return None
    m = TOKENS_RE.match(text)
    if not m:
        raise InputError(f"--tokens-per-batch: expected a positive number of tokens such as 4194304, 4M or 4e6, "
                         f"got {text!r}")
    value = float(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m.group(2).lower()]
    if value < 1:
        raise InputError(f"--tokens-per-batch: expected a positive number of tokens, got {text!r}")
    return int(round(value))


def rerank_by_time_to_train(s, train_tokens: float, price: float | None) -> None:
    """Order the suggestion's plans by expected days to train (costmodel.goodput), keeping each Goodput."""
    from costmodel.goodput import rank_by_time_to_train

    ranked = rank_by_time_to_train(s.plans, s.model, s.chip, s.job, train_tokens, price)
    s.plans = [r for r, _ in ranked]
    s.goodput = {id(r): g for r, g in ranked}


def fates(plan) -> str:
    """Short remat/offload summary: which tensors are kept, recomputed, offloaded; optimizer/params offload."""
    ch = plan.remat.choices()
    parts = []
    for label, choice in (("save", "device"), ("remat", "remat"), ("offload", "offload")):
        names = [SHORT[t] for t, c in ch.items() if c == choice]
        if names:
            parts.append(f"{label} {','.join(names)}" if len(names) < 6 else f"{label} all")
    host = [n for n, on in (("optimizer", plan.offload_optimizer), ("params", plan.offload_params)) if on]
    if host:
        parts.append("host " + ",".join(host))
    if plan.overlap_moe_expert_parallel_comm:  # Megatron-Core's expert all-to-all overlap (docs/ep_overlap.md)
        parts.append("a2a overlap")
    if plan.fp8_param_gather:  # Megatron-Core's --fp8-param-gather (docs/fp8_params.md)
        parts.append("fp8 params")
    name = plan.remat.name if plan.remat.name != "custom" else ""
    if plan.recompute_num_layers:  # Megatron's --recompute-method block: only the first N layers of a chunk
        name = f"{name} first {plan.recompute_num_layers}/chunk"
    return (f"{name}: " if name else "") + "; ".join(parts)  # (not "[name]": rich would take it for markup)


def degrees(plan) -> str:
    d = " ".join(f"{a}={v}" for a, v in plan.degrees().items() if v > 1) or "1 chip"
    extra = [f"vpp={plan.vpp}"] if plan.vpp > 1 else []
    if plan.zero:
        extra.append(f"zero={plan.zero}")
    if plan.slices > 1:
        extra.append(f"slices={plan.slices}")
    counted = [n for n, on in zip(("emb", "loss"), plan.split_accounting, strict=True) if on]
    if counted:  # Megatron-Core's --account-for-embedding/loss-in-pipeline-split (docs/pipeline_split.md)
        extra.append("split=" + "+".join(counted))
    return " ".join([d] + extra)


def result_dict(rank: int, r) -> dict:
    c = r.cost
    return {"rank": rank, "plan": plan_dict(r.plan), "degrees": r.plan.degrees(), "micro_batch": r.plan.micro_batch,
            "grad_accum": c.grad_accum, "remat": r.plan.remat.choices(),
            "offload_optimizer": r.plan.offload_optimizer, "offload_params": r.plan.offload_params,
            "step_time_s": c.step_time_s, "mfu": c.mfu, "tokens_per_s": c.tokens_per_s,
            "peak_memory_bytes": c.peak_memory_bytes, "fit_memory_bytes": c.fit_memory_bytes,
            "hbm_usable_bytes": c.hbm_usable_bytes,
            "host_memory_bytes": c.host_memory_bytes, "fits": c.fits, "dominant": c.dominant,
            "within_headroom": not r.in_margin, "breakdown_time_s": dict(c.time),
            **(r.interval.to_dict() if r.interval else {})}


def goodput_fields(g) -> dict:
    return {"days_to_train": g.days_to_train, "goodput": g.goodput, "cost": g.cost}


def suggestion_dict(s) -> dict:
    out = {"model": s.model.name, "hardware": s.chip.name, "chips": s.chips, "slices": s.slices,
           "job": {"seq_len": s.job.seq_len, "global_batch": s.job.global_batch, "tokens_per_batch": s.job.tokens,
                   "precision": s.job.precision, "framework": s.job.framework},
           "ranked_by": s.ranked_by, "headroom": s.headroom,
           "constraints": s.constraints.describe(), "search": s.stats.to_dict(),
           "plans": [result_dict(i + 1, r) for i, r in enumerate(s.plans)]}
    gp = s.goodput
    if gp:
        out["ranked_by"] = "days_to_train"
        for d, r in zip(out["plans"], s.plans, strict=True):
            d.update(goodput_fields(gp[id(r)]))
    if s.infeasible is not None:
        out["infeasible"] = s.infeasible.to_dict()
    return out


def print_suggestion(s) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from cli.render import print_cost
    from planner.solve import why_better

    console = Console() if sys.stdout.isatty() else Console(width=150)  # pipes and files: no wrapped rows
    job = s.job
    head = (f"{s.model.name} on {s.chips} x {s.chip.name}"
            + (f" ({s.slices} slices)" if s.slices > 1 else "")
            + f": seq {job.seq_len}, global batch {job.global_batch} ({job.tokens / 2**20:.1f}M tokens), "
            f"{job.precision}, {job.framework}")
    if not s.plans:
        console.print(f"[bold]{escape(head)}[/bold]")
        inf = s.infeasible
        console.print(f"[bold red]{escape(inf.reason) if inf else 'no plan fits'}[/bold red]")
        for tip in (inf.suggestions if inf else ()):
            console.print(f"  - {escape(tip)}")
        return
    t = Table(title=escape(f"top {len(s.plans)} plans: {head}"))
    gp = s.goodput
    cols = ["#", "degrees", "mb x accum", "remat / offload", "step s", "80 % range s", "MFU", "tokens/s",
            "GiB need/usable", "dominant"]
    if gp:
        cols += ["days", "goodput"] + (["cost"] if any(g.cost for g in gp.values()) else [])
    for col in cols:
        left = col in ("degrees", "mb x accum", "remat / offload", "dominant")
        t.add_column(col, justify="left" if left else "right")
    for i, r in enumerate(s.plans, 1):
        c = r.cost
        iv = r.interval
        row = [f"{i}{'*' if r.in_margin else ''}", degrees(r.plan), f"{r.plan.micro_batch} x {c.grad_accum}",
               fates(r.plan), f"{c.step_time_s:.3f}", f"{iv.low_s:.2f}-{iv.high_s:.2f}" if iv else "",
               f"{c.mfu * 100:.1f}%{'!' if iv and iv.best_mfu and c.mfu > iv.best_mfu else ''}",
               f"{c.tokens_per_s:,.0f}",
               f"{c.fit_memory_bytes / GIB:.1f}/{c.hbm_usable_bytes / GIB:.1f}", c.dominant]
        if gp:
            g = gp[id(r)]
            row += [f"{g.days_to_train:.1f}", f"{g.goodput * 100:.1f}%"]
            row += [f"{g.cost:,.0f}"] if "cost" in cols else []
        t.add_row(*row)
    console.print(t)
    print_flags(s, console)
    st = s.stats
    console.print(f"searched {st.candidates} mesh candidates{' exhaustively' if st.exhaustive else ''}: "
                  f"{st.infeasible} found not to fit, {st.bounded} costed for a bound, {st.solved} solved"
                  f"{' by brute force' if st.brute_forced == st.solved else ' with CP-SAT'}; "
                  f"{st.estimates} cost-model calls")
    best = s.plans[0]
    console.print(f"[bold]best plan[/bold]: {degrees(best.plan)}, micro-batch {best.plan.micro_batch} "
                  f"x {best.cost.grad_accum} accumulation steps; {fates(best.plan)}")
    print_cost(best.cost, "best plan", console, interval=best.interval)
    if len(s.plans) > 1:
        console.print("why #1: " + why_better(best, s.plans[1]))


def slices_note(chip, chips: int, slices: int) -> str:
    """Why a TPU job spans slices, with the slice shape and the nearest single-slice sizes (hardware.topology)."""
    from hardware.topology import slice_shape, valid_slice_sizes

    per = chips // slices
    shape = "x".join(map(str, slice_shape(chip, per)))
    sizes = [n for n in valid_slice_sizes(chip) if n <= chip.scale_up.domain_chips]
    near = sorted(sorted(sizes, key=lambda n: (abs(n - chips), n))[:2])
    single = f"; nearest single-slice sizes: {', '.join(map(str, near))}" if chips not in sizes else ""
    return f"{chips} chips on {chip.name}: {slices} slices of {per} chips ({shape}) joined over DCN{single}"


def print_flags(s, console) -> None:
    """What the table's marks mean, and each plan's extrapolations (costmodel.interval)."""
    from rich.markup import escape

    head = (f"ranked by {'the slow end of the 80 % range' if s.ranked_by == 'conservative' else s.ranked_by}"
            if not s.goodput else "ranked by days to train")
    marks = [head]
    if any(r.in_margin for r in s.plans):
        marks.append(f"*: fits, but inside the {s.headroom * 100:g} % headroom (listed after the others)")
    if any(r.interval and r.interval.best_mfu and r.cost.mfu > r.interval.best_mfu for r in s.plans):
        marks.append("!: MFU above the best measured on this chip family")
    if any(any(r.plan.split_accounting) for r in s.plans):
        marks.append("split=emb/loss: Megatron-Core's --account-for-embedding/loss-in-pipeline-split")
    if any(r.plan.fp8_param_gather for r in s.plans):
        marks.append("fp8 params: Megatron-Core's --fp8-param-gather")
    console.print("; ".join(marks))
    for i, r in enumerate(s.plans, 1):
        for note in (r.interval.extrapolations if r.interval else ()):
            console.print(f"  #{i} extrapolates: {escape(note)}")


def export_conventions(cons: Constraints, export: str | None, framework: str | None, precision: str,
                       chip) -> tuple[Constraints, str]:
    """(constraints, framework) for the search. The framework is --framework, else the --export format's, else the
    chip's default (planner.solve.default_framework); under Megatron-Core (megatron, nemo) only the plans it runs
    exactly as costed are searched (planner.export_megatron.megatron_constraints), as under maxtext only MaxText's."""
    from planner.solve import default_framework

    if export in ("maxtext", "megatron") and framework not in (None, export):
        raise InputError(f"--framework {framework}: --export {export} searches under {export}'s conventions; "
                         f"drop --framework or give --framework {export}")
    from costmodel.framework import framework as record

    framework = framework or (export if export in ("maxtext", "megatron") else default_framework(chip))
    if record(framework).megatron_core:
        from planner.export_megatron import megatron_constraints

        if precision == "int8":
            raise InputError(f"--precision int8: Megatron-LM trains in bf16, fp16 or fp8; expected bf16 or fp8 "
                             f"under --framework {framework}")
        cons = megatron_constraints(cons)
    return cons, framework


def check_outputs(save: str | None, out: str | None) -> None:
    """--save and --out can be written (hardware.fileio.check_output_path) and are two files: checked before the
    search, so a bad path fails at once rather than after it."""
    from hardware.fileio import check_output_path

    paths = [check_output_path(p, flag).resolve() for p, flag in ((save, "--save"), (out, "--out")) if p]
    if len(paths) == 2 and paths[0] == paths[1]:
        raise InputError("--save and --out: name the same file; give two different paths")


def check_export_args(export: str | None, out: str | None, as_json: bool) -> None:
    """--out only with --export, a known export format, and --out with --json (stdout stays one JSON object)."""
    if export is None:
        if out is not None:
            raise InputError("--out: needs --export maxtext|megatron|json")
        return
    from planner.export import FORMATS

    if export not in FORMATS:
        from hardware.errors import unknown

        raise unknown("export format", export, FORMATS)
    if as_json and out is None:
        raise InputError("--export with --json: give --out FILE so that stdout stays one JSON object")


@dataclass(frozen=True)
class PlanRefs:
    """The model and hardware as the user named them (written into the exported configs' comments)."""

    model: str
    hardware: str


@dataclass
class Checked:
    """--verify's outcome: id(PlanResult) -> planner.verify.Verified for the kept plans; the refused, in order."""

    kept: dict = field(default_factory=dict)
    dropped: list = field(default_factory=list)  # (PlanResult, Verified)


def verify_env(k: int, maxtext_env: str | None, chip, framework: str) -> Path | None:
    """The MaxText Python for --verify K (None without it), checked before the search: TPU plans under maxtext
    only, and an environment that has maxtext (planner.verify.find_env)."""
    if not k:
        if maxtext_env is not None:
            raise InputError("--maxtext-env: needs --verify K")
        return None
    o.positive("--verify", k)
    if chip.vendor != "tpu" or framework != "maxtext":
        raise InputError(f"--verify: verification compiles TPU plans under MaxText (train_compile); this search is "
                         f"on {chip.vendor.upper()}s under {framework} (expected a TPU and --framework maxtext)")
    from planner.verify import find_env

    return find_env(maxtext_env)


def verify_top(s, k: int, python: Path, refs: PlanRefs) -> Checked:
    """Compile the top `k` plans one at a time (progress on stderr); those the compiler refuses leave s.plans."""
    from planner.planfile import PlanFile
    from planner.verify import verify_plan

    checked = Checked()
    top = s.plans[:k]
    for i, r in enumerate(top, 1):
        typer.echo(f"verify {i}/{len(top)}: compiling {degrees(r.plan)} with MaxText's train_compile ...", err=True)
        pf = PlanFile(model=s.model, hardware=s.chip, chips=s.chips, job=s.job, plan=r.plan, model_ref=refs.model,
                      hardware_ref=refs.hardware)
        v = verify_plan(pf, python)
        typer.echo(f"  {escape(v.line())}", err=True)
        if v.refused:
            checked.dropped.append((r, v))
        else:
            checked.kept[id(r)] = v
    s.plans = [r for r in s.plans if all(r is not d for d, _ in checked.dropped)]
    return checked


def print_verified(s, checked: Checked) -> None:
    """The compiler's memory beside the prediction for each verified plan, then the refused ones."""
    for i, r in enumerate(s.plans, 1):
        if id(r) in checked.kept:
            typer.echo(f"verified #{i}: {escape(checked.kept[id(r)].line())}")
    for r, v in checked.dropped:
        typer.echo(f"dropped ({degrees(r.plan)}; micro-batch {r.plan.micro_batch}): {escape(v.line())}")


def add_verified_json(out: dict, s, checked: Checked) -> None:
    """--json: each verified plan's 'verify' object, and the refused plans under 'verify_dropped'."""
    for d, r in zip(out["plans"], s.plans, strict=True):
        if id(r) in checked.kept:
            d["verify"] = checked.kept[id(r)].to_dict()
    out["verify_dropped"] = [{"plan": plan_dict(r.plan), "degrees": r.plan.degrees(), "verify": v.to_dict()}
                             for r, v in checked.dropped]


@app.command(short_help="Search for the fastest plans that fit in memory.")
def suggest(
    model: str = o.MODEL,
    chips: int = typer.Option(..., "--chips", "-n", help="Number of chips for the job."),
    hardware: str = o.HARDWARE,
    seq_len: int = o.SEQ_LEN,
    global_batch: int = o.option("global_batch", help="Sequences per optimizer step.",
                                 show_default="about 4M tokens, rounded to fit the chips"),
    tokens_per_batch: str = typer.Option(None, "--tokens-per-batch", metavar="TOKENS",
                                         help="Tokens per step instead of --global-batch, e.g. 4M (= 4*2^20)."),
    slices: int = o.option("slices", default=None, show_default="the fewest that form --chips"),
    top: int = typer.Option(5, "--top", "-k", help="How many plans to list."),
    max_tp: int = typer.Option(None, "--max-tp", help="Largest tensor-parallel degree to consider."),
    fix: str = typer.Option(None, "--fix", metavar="KEY=VALUE,...",
                            help="Pin choices: comma list of key=value; keys dp, fsdp, tp, cp, pp, ep, vpp, "
                                 "micro_batch (mb), zero, remat (a policy name), offload_optimizer, offload_params."),
    framework: str = o.option("framework", default=None),
    precision: str = o.PRECISION,
    exhaustive: bool = typer.Option(False, "--exhaustive", help="Solve every mesh candidate (no pruning; a check "
                                    "of the default search, seconds to minutes)."),
    as_json: bool = o.JSON,
    save: str = typer.Option(None, "--save", metavar="FILE",
                             help="Write the best plan as a plan file (YAML, or JSON for .json)."),
    export: str = typer.Option(None, "--export", metavar="FORMAT",
                               help="Also export the best plan: maxtext, megatron or json (maxtext/megatron: the "
                                    "search keeps to plans that framework runs exactly as costed)."),
    out: str = typer.Option(None, "--out", "-o", metavar="FILE", help="File for --export.",
                            show_default="standard output, after the tables"),
    train_tokens: str = typer.Option(None, "--train-tokens", metavar="COUNT",
                                     help="Rank the plans by expected days to train this many tokens (e.g. 15T), "
                                          "failures and checkpoints included, instead of by step time."),
    price: float = typer.Option(None, "--price", help="Price per chip-hour, for the cost column of --train-tokens."),
    headroom: float = typer.Option(5.0, "--headroom", help="Percent of the usable HBM a plan must leave free to be "
                                   "listed first; plans that fit only inside it follow, marked *."),
    rank: str = typer.Option("conservative", "--rank", help="conservative: by the slow end of each plan's 80 % "
                             "step-time range; expected: by the predicted step time.", metavar="ORDER"),
    verify: int = typer.Option(0, "--verify", metavar="K", help="Compile the top K plans with MaxText's own "
                               "train_compile (TPU plans under maxtext; minutes each): the compiler's per-chip "
                               "memory beside the prediction; plans it refuses are dropped."),
    maxtext_env: str = MAXTEXT_ENV,
) -> None:
    """Search meshes, micro-batching, remat and offload for the fastest plans that fit in memory."""
    from planner.candidates import default_batch_for, parse_fix
    from planner.solve import suggest as suggest_plans

    m, chip = o.resolve(model, hardware)
    o.positive("--chips", chips)
    o.positive("--seq-len", seq_len)
    check_export_args(export, out, as_json)
    check_outputs(save, out)
    if global_batch is not None and tokens_per_batch is not None:
        raise InputError("--global-batch and --tokens-per-batch: give one of them, not both")
    if not (math.isfinite(headroom) and 0 <= headroom < 100):
        raise InputError(f"--headroom: expected a percent of the usable HBM from 0 to below 100, got {headroom}")
    named = framework
    cons, framework = export_conventions(parse_fix(fix, max_tp, slices), export, framework, precision, chip)
    python = verify_env(verify, maxtext_env, chip, framework)
    note = ""
    if global_batch is None:
        o.make_job(seq_len, 1, precision, framework)  # check the job fields first
        from planner.candidates import check_chips

        check_chips(chip, chips)
        global_batch, note = default_batch_for(m, chip, chips, seq_len, precision, framework, cons,
                                               parse_tokens(tokens_per_batch))
    job = o.make_job(seq_len, global_batch, precision, framework)
    from costmodel.goodput import parse_count

    budget = None if train_tokens is None else parse_count(train_tokens, "--train-tokens")
    if price is not None and (budget is None or not price > 0):
        raise InputError(f"--price: expected a positive price per chip-hour together with --train-tokens, got {price}")
    result = suggest_plans(m, chip, job, chips, cons, top=top, exhaustive=exhaustive, headroom=headroom / 100,
                           rank=rank)
    if slices is None and result.slices > 1:
        note = "; ".join(x for x in (note, slices_note(chip, chips, result.slices)) if x)
    if named is None and export is None:
        note = "; ".join(x for x in (note, f"framework {framework}: the default on {chip.vendor.upper()}s "
                                           "(--framework to change)") if x)
    if budget is not None:
        rerank_by_time_to_train(result, budget, price)
    checked = verify_top(result, verify, python, PlanRefs(model, hardware)) if python else None
    if as_json:
        doc = suggestion_dict(result)
        if checked is not None:
            add_verified_json(doc, result, checked)
        print_json({**doc, "notes": [note] if note else []})
    else:
        if note:
            typer.echo(f"note: {note}")
        if result.plans or checked is None:
            print_suggestion(result)
        if checked is not None:
            print_verified(result, checked)
    if checked is not None and not result.plans:
        raise o.nothing_fits(f"--verify {verify}: MaxText's compiler refused every plan found")
    if not result.plans:  # an answer, not bad input: printed in full, but scripts (--save, --export) must see it
        raise typer.Exit(1)
    best = result.plans[0]
    if save:
        from planner.planfile import save_plan

        save_plan(save, model, hardware, chips, job, best.plan, best.cost,
                  description=f"planner suggest: best of {result.stats.candidates} mesh candidates", flag="--save")
    if export:
        from planner.export import ExportDoesNotFit, write_export
        from planner.planfile import PlanFile

        pf = PlanFile(model=m, hardware=chip, chips=chips, job=job, plan=best.plan, model_ref=model,
                      hardware_ref=hardware)
        try:
            text = write_export(pf, export, out)
        except ExportDoesNotFit as e:
            raise o.nothing_fits(f"--export {export}: {e}") from None
        if out is None and not as_json:
            typer.echo(text)
