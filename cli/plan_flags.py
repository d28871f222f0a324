"""The plan flags, resolved once: one flag group (model, hardware, chips, job, degrees, remat, offload and the plan
sources --plan / --from-maxtext / --from-megatron) shared by estimate, explain, plot, sweep, validate and export,
and `resolve_plan`, which turns it into the model, chip, job and plan to cost.

Rules: at most one plan source; flags given on the command line override the source's values; without a source
--model, --chips and --global-batch are required and the other flags take the defaults their help shows; the
framework defaults by vendor (planner.solve.default_framework), and the result says so in a note.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import typer

from cli import options as o
from cli.options import DEFAULTS, OPTIONS, option
from costmodel.plan import (
    AXES,
    CPU_OFFLOAD_LAYERS,
    EP_OVERLAP,
    FP8_PARAMS,
    GRAD_BF16,
    MEGATRON_SWITCHES,
    RECOMPUTE_LAYERS,
    SPLIT_FLAGS,
    Plan,
    parse_remat,
)
from hardware.errors import InputError

if TYPE_CHECKING:
    from costmodel.job import Job
    from costmodel.model import ModelSpec
    from hardware.chip import Chip
    from planner.planfile import PlanFile

SOURCES = (("plan_file", "--plan"), ("from_maxtext", "--from-maxtext"), ("from_megatron", "--from-megatron"))
SOURCE_HINT = "give --plan FILE, --from-maxtext FILE or --from-megatron FILE"
PLAN_DEGREES = (*AXES, "vpp", "micro_batch", "slices", "vocab_tiles")


@dataclass(frozen=True)
class PlanFlags:
    """The plan flags as given on the command line; None (False for the switches) where a flag was not given."""

    plan_file: str | None = None
    from_maxtext: str | None = None
    from_megatron: str | None = None
    model: str | None = None
    hardware: str | None = None
    chips: int | None = None
    seq_len: int | None = None
    global_batch: int | None = None
    dp: int | None = None
    fsdp: int | None = None
    tp: int | None = None
    cp: int | None = None
    pp: int | None = None
    ep: int | None = None
    vpp: int | None = None
    micro_batch: int | None = None
    zero: int | None = None
    remat: str | None = None
    offload: tuple[str, ...] | None = None
    slices: int | None = None
    vocab_tiles: int | None = None
    no_sp: bool = False
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    overlap_moe_expert_parallel_comm: bool = False
    recompute_num_layers: int | None = None
    cpu_offload_layers: int | None = None
    fp8_param_gather: bool = False
    grad_reduce_in_bf16: bool = False
    precision: str | None = None
    framework: str | None = None
    weight_dtype: str | None = None

    @property
    def source(self) -> tuple[str, str] | None:
        """(flag, path) of the plan source given, or None; two or more are an error naming them."""
        given = [(flag, getattr(self, name)) for name, flag in SOURCES if getattr(self, name)]
        if len(given) > 1:
            raise InputError(f"{' and '.join(f for f, _ in given)}: give only one plan source")
        return given[0] if given else None


def with_plan_flags(omit: tuple[str, ...] = (), defaults: Mapping[str, Any] = DEFAULTS,
                    **over: dict[str, Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a command taking `flags: PlanFlags`: the plan flags (less `omit`) become its options, before
    its own, and reach it as one PlanFlags holding what the user gave (None elsewhere). `over[name]` replaces
    arguments of that flag's typer.Option. The pipeline-split switches (Megatron-Core's) go with --pp and
    --framework: a command that omits either (it searches the pipeline, or fixes its own framework) has none; the
    expert all-to-all overlap goes with --ep and --framework the same way, --recompute-num-layers with --remat and
    --framework, as is --cpu-offloading-num-layers; --fp8-param-gather with --precision,
    --framework and --zero, as is --grad-reduce-in-bf16."""
    split_off = "pp" in omit or "framework" in omit
    overlap_off = "ep" in omit or "framework" in omit
    recompute_off = "remat" in omit or "framework" in omit
    fp8_off = "precision" in omit or "framework" in omit or "zero" in omit  # --grad-reduce-in-bf16 too
    names = [n for n in OPTIONS if n not in omit and not (split_off and n in SPLIT_FLAGS)
             and not (overlap_off and n == EP_OVERLAP)
             and not (recompute_off and n in (RECOMPUTE_LAYERS, CPU_OFFLOAD_LAYERS))
             and not (fp8_off and n in (FP8_PARAMS, GRAD_BF16))]

    def wrap(command: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(command, eval_str=True)
        own = [p for p in sig.parameters.values() if p.name not in ("flags", "ctx")]
        added = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY,
                                   annotation=bool if OPTIONS[n][1] is bool else OPTIONS[n][1] | None,
                                   default=option(n, defaults, **over.get(n, {}))) for n in names]
        ctx_param = inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
        wants_ctx = "ctx" in sig.parameters

        @functools.wraps(command)
        def run(*args: Any, ctx: typer.Context, **kwargs: Any) -> Any:
            values = {n: kwargs.pop(n) for n in names}
            flags = PlanFlags(**{n: (tuple(v) if n == "offload" else v) for n, v in values.items()
                                 if _given(ctx, n)})
            return command(*args, flags=flags, **({"ctx": ctx} if wants_ctx else {}), **kwargs)

        params = [ctx_param, *added, *(replace_kind(p) for p in own)]
        run.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return wrap


def replace_kind(p: inspect.Parameter) -> inspect.Parameter:
    return p.replace(kind=inspect.Parameter.KEYWORD_ONLY)


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the user gave parameter `name` (on the command line or in the environment), not its default."""
    from typer._click.core import ParameterSource

    return ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


# ---- resolving ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Resolved:
    """What the plan flags name: model, chip, chip count, job and plan, with the names or paths the user gave
    ('' = from a source's own or inline) and notes for the user (a defaulted framework)."""

    model: ModelSpec
    chip: Chip
    chips: int
    job: Job
    plan: Plan
    model_ref: str = ""
    hardware_ref: str = ""
    source: str = ""  # the plan source's flag, '' without one
    notes: tuple[str, ...] = ()

    def planfile(self) -> PlanFile:
        from planner.planfile import PlanFile

        return PlanFile(model=self.model, hardware=self.chip, chips=self.chips, job=self.job, plan=self.plan,
                        model_ref=self.model_ref, hardware_ref=self.hardware_ref)


def resolve_plan(flags: PlanFlags, required: tuple[str, ...] = ("model", "chips", "global_batch"),
                 defaults: Mapping[str, Any] = DEFAULTS, check: bool = True) -> Resolved:
    """The model, chip, job and plan the flags name: the plan source's with the given flags over it, or the flags
    alone with `defaults` (then `required` must be given; a chip count not given follows the degrees). `check`:
    a plan file is checked against its hardware as it loads (planner.planfile.load_plan)."""
    pf = plan_source(flags, check)
    if pf is None:
        return _from_flags(flags, required, defaults)
    if flags.source[0] == "--plan":
        pf = _over_file(pf, flags)
    fw = flags.framework or pf.job.framework
    job = job_over(flags, pf.job, fw, o.weight_dtype_over(flags.weight_dtype, fw, pf.job))
    plan = override_plan(pf.plan, flags)
    chips = o.chips_count(flags.chips if flags.chips is not None else pf.chips)
    return Resolved(pf.model, pf.hardware, chips, job, plan, flags.model or pf.model_ref,
                    flags.hardware or pf.hardware_ref or pf.hardware.name, flags.source[0])


def plan_source(flags: PlanFlags, check: bool = True) -> PlanFile | None:
    """The PlanFile that --plan / --from-maxtext / --from-megatron names (at most one), or None. An import takes
    --hardware, --chips and --model where the config does not say, or over what it says."""
    given = flags.source
    if given is None:
        return None
    flag, path = given
    if flags.chips is not None:
        o.chips_count(flags.chips)
    if flag == "--plan":
        from planner.planfile import load_plan

        return load_plan(path, check=check)
    from planner.import_configs import import_config

    res = import_config("maxtext" if flag == "--from-maxtext" else "megatron", path, flags.hardware, flags.chips,
                        flags.model)
    for n in res.notes:
        typer.echo(f"warning: import {path}: {n}", err=True)
    return res.planfile


def _over_file(pf: PlanFile, flags: PlanFlags) -> PlanFile:
    """--model / --hardware given together with --plan replace the file's."""
    from costmodel.catalog import load_model
    from hardware.catalog import load_hardware

    if flags.model:
        pf = replace(pf, model=load_model(flags.model), model_ref=flags.model)
    if flags.hardware:
        pf = replace(pf, hardware=load_hardware(flags.hardware), hardware_ref=flags.hardware)
    return pf


def _from_flags(flags: PlanFlags, required: tuple[str, ...], defaults: Mapping[str, Any]) -> Resolved:
    """Model, chip, job and plan from the flags alone; an unknown model or hardware is said before a missing flag."""
    model = flags.model or defaults.get("model")
    hardware = flags.hardware or defaults["hardware"]
    loaded = o.resolve(model, hardware) if model is not None else None
    missing = [OPTIONS[n][0][0] for n in required if getattr(flags, n) is None and defaults.get(n) is None]
    if missing:
        raise InputError(f"{', '.join(missing)}: required (or {SOURCE_HINT})")
    m, chip = loaded or o.resolve(model, hardware)
    notes: tuple[str, ...] = ()
    framework = flags.framework
    if framework is None:
        from planner.solve import default_framework

        framework = default_framework(chip)
        notes = (f"framework {framework}: the default on {chip.vendor.upper()}s (--framework to change)",)
    plan = override_plan(Plan(), flags, defaults)
    chips = o.chips_count(flags.chips if flags.chips is not None else plan.chips)
    job = job_over(flags, _default_job(defaults), framework, flags.weight_dtype or defaults["weight_dtype"])
    if flags.global_batch is None:  # not required here: one micro-batch per batch shard
        job = replace(job, global_batch=plan.batch_shards * plan.micro_batch)
    return Resolved(m, chip, chips, job, plan, model, hardware, "", notes)


def _default_job(defaults: Mapping[str, Any]) -> Job:
    """The defaults' job, with a placeholder batch of one sequence (the flags replace what they give)."""
    from costmodel.job import Job

    return Job(seq_len=defaults["seq_len"], global_batch=1, precision=defaults["precision"])


def print_notes(notes: tuple[str, ...] | list[str]) -> None:
    """Notes for the user on stderr, one 'note:' line each (stdout stays the command's output)."""
    for n in notes:
        typer.echo(f"note: {n}", err=True)


def job_over(flags: PlanFlags, base: Job, framework: str, weight_dtype: str) -> Job:
    """`base` with the job flags given over it (its other fields, such as scan_layers, kept)."""
    seq = base.seq_len if flags.seq_len is None else o.positive("--seq-len", flags.seq_len)
    batch = base.global_batch if flags.global_batch is None else o.positive("--global-batch", flags.global_batch)
    return replace(base, seq_len=seq, global_batch=batch, precision=flags.precision or base.precision,
                   framework=framework, weight_dtype=weight_dtype)


def override_plan(plan: Plan, flags: PlanFlags, defaults: Mapping[str, Any] | None = None) -> Plan:
    """`plan` with the plan flags given over it; with `defaults`, the flags not given take those values instead
    (a plan from flags alone). Degrees and slices are at most planner.candidates.MAX_CHIPS."""
    from planner.candidates import MAX_CHIPS

    def value(name: str) -> Any:
        v = getattr(flags, name)
        return v if v is not None or defaults is None else defaults[name]

    kw = {n: value(n) for n in PLAN_DEGREES if value(n) is not None}
    for n, v in kw.items():
        o.positive(OPTIONS[n][0][0], v, None if n in ("micro_batch", "vocab_tiles") else MAX_CHIPS)
    plan = plan.with_(**kw)
    if plan.chips > MAX_CHIPS:
        raise InputError(f"{' '.join(f'--{a} {getattr(plan, a)}' for a in AXES)}: the degrees multiply to "
                         f"{plan.chips:,} chips; expected at most {MAX_CHIPS:,}")
    if value("zero") is not None:
        plan = plan.with_(zero=value("zero"))
    if flags.no_sp:
        plan = plan.with_(sequence_parallel=False)
    plan = plan.with_(**{n: True for n in MEGATRON_SWITCHES if getattr(flags, n)})
    remat = value("remat")
    if remat is not None:
        plan = plan.with_(remat=parse_remat(remat))
    if flags.recompute_num_layers is not None:  # checked against the plan by costmodel.constraints
        plan = plan.with_(recompute_num_layers=o.positive("--recompute-num-layers", flags.recompute_num_layers))
    if flags.cpu_offload_layers is not None:  # checked against the model and plan by costmodel.constraints
        plan = plan.with_(cpu_offload_layers=o.positive("--cpu-offloading-num-layers", flags.cpu_offload_layers))
    return with_offload(plan, list(flags.offload or ()), remat)


def with_offload(plan: Plan, offload: list[str], remat: str | None) -> Plan:
    """--offload over `plan`: optimizer and params switch on, remat tensors move to host memory (the items parsed
    once, by cli.options.offload_items; one that contradicts a custom --remat is an error naming both)."""
    items = o.offload_items(offload, remat or "full")
    tensors = [t for t in items if t not in ("optimizer", "params")]
    if tensors:
        spec = ",".join(f"{t}={'offload' if t in tensors else c}" for t, c in plan.remat.choices().items())
        plan = plan.with_(remat=parse_remat("custom:" + spec))
    return plan.with_(offload_optimizer=plan.offload_optimizer or "optimizer" in items,
                      offload_params=plan.offload_params or "params" in items)


def plan_from(**given: Any) -> Plan:
    """The plan of the plan flags `given` (PlanFlags fields) over DEFAULTS, as a command without a plan source
    builds it."""
    return override_plan(Plan(), PlanFlags(**given), DEFAULTS)
