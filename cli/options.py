"""Shared command-line options: model, hardware, job and plan flags, turned into typed objects."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import typer

from costmodel.catalog import load_model
from costmodel.job import Job
from costmodel.model import ModelSpec
from costmodel.plan import parse_remat
from hardware.catalog import load_hardware
from hardware.chip import Chip
from hardware.errors import InputError

FRAMEWORK_DEFAULT = "maxtext on TPUs, megatron on GPUs"  # planner.solve.default_framework

# Defaults where no flag and no plan source gives a value (shown in --help as typer's "[default: x]").
DEFAULTS: dict[str, Any] = {"hardware": "tpu-v5p", "seq_len": 4096, "dp": 1, "fsdp": 1, "tp": 1, "cp": 1, "pp": 1,
                            "ep": 1, "vpp": 1, "micro_batch": 1, "zero": 0, "remat": "full", "slices": 1,
                            "vocab_tiles": 1, "precision": "bf16", "weight_dtype": "float32"}

# The plan flags (cli.plan_flags, also suggest's and goodput's): name -> (option names, type, metavar, help).
OPTIONS: dict[str, tuple[tuple[str, ...], type, str, str]] = {
    "plan_file": (("--plan", "-p"), str, "FILE", "A plan file (suggest --save, estimate --save-plan) to start from; "
                  "flags given here override its values."),
    "from_maxtext": (("--from-maxtext",), str, "FILE", "A MaxText config (maxtext 0.2.5 keys) to start from; flags "
                     "given here override it."),
    "from_megatron": (("--from-megatron",), str, "FILE", "Megatron-LM pretrain_gpt.py arguments (an args file, bash "
                      "array or command line) to start from; flags given here override them."),
    "model": (("--model", "-m"), str, "NAME", "Preset name, a model YAML path, or a size such as 70B or 1T; required "
              "without a plan source."),
    "hardware": (("--hardware", "-H"), str, "NAME", "Hardware preset name or a profile YAML path."),
    "chips": (("--chips", "-n"), int, "N", "Number of chips, the product of the degrees; required without a plan "
              "source."),
    "seq_len": (("--seq-len", "-s"), int, "N", "Sequence length in tokens."),
    "global_batch": (("--global-batch", "-b"), int, "N", "Sequences per optimizer step; required without a plan "
                     "source."),
    "dp": (("--dp",), int, "N", "Data-parallel degree (replicated weights)."),
    "fsdp": (("--fsdp",), int, "N", "Fully-sharded data-parallel degree."),
    "tp": (("--tp",), int, "N", "Tensor-parallel degree."),
    "cp": (("--cp",), int, "N", "Context (sequence) parallel degree."),
    "pp": (("--pp",), int, "N", "Pipeline-parallel degree."),
    "ep": (("--ep",), int, "N", "Expert-parallel degree (MoE only)."),
    "vpp": (("--vpp",), int, "N", "Virtual pipeline stages per pipeline rank."),
    "micro_batch": (("--micro-batch",), int, "N", "Sequences per micro-step per model replica."),
    "zero": (("--zero",), int, "N", "ZeRO stage over the dp axis (0-3)."),
    "remat": (("--remat",), str, "POLICY", "none, selective, full, a MaxText policy, or custom:tensor=choice,..."),
    "offload": (("--offload",), list[str], "ITEMS", "optimizer, params, or remat tensors to offload to host memory "
                "(comma list, repeatable)."),
    "slices": (("--slices",), int, "N", "TPU slices joined over DCN."),
    "vocab_tiles": (("--vocab-tiles",), int, "N", "Compute logits and loss in this many token chunks (MaxText "
                    "num_vocab_tiling)."),
    "no_sp": (("--no-sequence-parallel",), bool, "", "Disable sequence parallelism on tp."),
    "account_for_embedding_in_pipeline_split": (
        ("--account-for-embedding-in-pipeline-split",), bool, "", "Megatron-Core: count the embedding as one "
        "layer of the pipeline split (the first stage builds one layer fewer; with pp)."),
    "account_for_loss_in_pipeline_split": (
        ("--account-for-loss-in-pipeline-split",), bool, "", "Megatron-Core: count the loss as one layer of the "
        "pipeline split (the last stage builds one layer fewer; with pp)."),
    "overlap_moe_expert_parallel_comm": (
        ("--overlap-moe-expert-parallel-comm",), bool, "", "Megatron-Core: hide the expert all-to-all of one "
        "micro-batch behind another's compute (combined 1F1B, as DeepSeek's DualPipe; with ep > 1)."),
    "recompute_num_layers": (
        ("--recompute-num-layers",), int, "N", "Megatron-Core: under --remat full recompute only the first N "
        "layers of each pipeline stage (each model chunk with --vpp); the rest keep all their activations "
        "(--recompute-method block)."),
    "cpu_offload_layers": (
        ("--cpu-offloading-num-layers",), int, "N", "Megatron-Core: keep the saved activations of the first N "
        "layers in host memory between their forward and backward (with --remat none and --pp 1)."),
    "fp8_param_gather": (
        ("--fp8-param-gather",), bool, "", "Megatron-Core: keep the GEMM weights in fp8 (Transformer Engine "
        "Float8Tensors, fp32 main weights in the distributed optimizer) and all-gather them in fp8 (with --precision "
        "fp8 and --zero 1-3)."),
    "grad_reduce_in_bf16": (
        ("--grad-reduce-in-bf16",), bool, "", "Megatron-Core: keep the main gradients in bf16 and reduce them in "
        "bf16 (2 B per parameter stored and sent instead of fp32's 4; less precise sums; with --precision bf16 "
        "or fp8, no fsdp). Never chosen by suggest."),
    "precision": (("--precision",), str, "NAME", "Matmul precision: bf16, fp8 or int8."),
    "framework": (("--framework",), str, "NAME", "State and collective conventions: maxtext, megatron, pytorch-fsdp "
                  "or deepspeed."),
    "weight_dtype": (("--weight-dtype",), str, "NAME", "MaxText weight_dtype: float32 or bfloat16 (bf16 weights and "
                     "Adam moments)."),
}


def option(name: str, defaults: Mapping[str, Any] = DEFAULTS, **over: Any) -> Any:
    """The typer.Option of plan flag `name`: its default from `defaults` shown in --help, `over` replacing any of
    the Option's arguments (help, show_default, ...)."""
    names, _, metavar, help_text = OPTIONS[name]
    kw: dict[str, Any] = {"help": help_text, "metavar": metavar or None}
    if name == "framework":
        kw["show_default"] = FRAMEWORK_DEFAULT
    kw.update(over)
    default = kw.pop("default", False if OPTIONS[name][1] is bool else defaults.get(name))
    return typer.Option(default, *names, **kw)


MODEL = option("model", default=..., help="Preset name, a model YAML path, or a size such as 70B or 1T.")
HARDWARE = option("hardware")
SEQ_LEN = option("seq_len")
PRECISION = option("precision")
FRAMEWORK = option("framework", default="maxtext", show_default=True)
JSON = typer.Option(False, "--json", help="Print one JSON object instead of tables.")


MIN_NUMBER, MAX_NUMBER = 1e-6, 1e9  # float flags, in the flag's own unit (hours, minutes, GB/s, price)


def positive(name: str, value: int, most: int | None = None) -> int:
    """`value` is an integer of at least 1 and, when `most` is given, at most `most`."""
    if value is None or value < 1:
        raise InputError(f"{name}: expected a positive integer, got {value}")
    return at_most(name, value, most)


def at_most(name: str, value: int, most: int | None) -> int:
    """The stated upper bound of a count, checked before any work: past it, one line naming the flag."""
    if most is not None and value > most:
        raise InputError(f"{name}: expected at most {most:,}, got {value:,}")
    return value


def chips_count(value: int, name: str = "--chips") -> int:
    """A chip count: 1..planner.candidates.MAX_CHIPS, before the profile's own max_chips is known."""
    from planner.candidates import MAX_CHIPS

    return positive(name, value, MAX_CHIPS)


def number(name: str, value: float | None, zero_ok: bool = False) -> float | None:
    """A float flag (None passes): finite and within MIN_NUMBER..MAX_NUMBER of its unit, or 0 when `zero_ok`.
    nan and inf are refused, and so are values so large or small that the formulas over- or underflow (a 1e308-hour
    MTBF made the checkpoint interval infinite)."""
    if value is None or (zero_ok and value == 0):
        return value
    if not (math.isfinite(value) and MIN_NUMBER <= value <= MAX_NUMBER):
        kind = "0 or a number" if zero_ok else "a number"
        raise InputError(f"{name}: expected {kind} from {MIN_NUMBER:g} to {MAX_NUMBER:g}, got {value}")
    return value


def nothing_fits(message: str) -> typer.Exit:
    """A valid job that no plan fits: one 'error:' line and exit 1 (bad input exits 2), as `suggest` does."""
    from cli.main import one_line

    typer.echo(f"error: {one_line(message)}", err=True)
    return typer.Exit(1)


def given(ctx: typer.Context, *params: str) -> list[str]:
    """The flags (their first spelling) among the Python parameter names `params` that the user gave on the
    command line or in the environment, in the order asked."""
    from typer._click.core import ParameterSource

    opts = {p.name: p.opts[0] for p in ctx.command.params}
    return [opts[n] for n in params
            if ctx.get_parameter_source(n) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)]


def exclusive(ctx: typer.Context, flag: str, given_with: Sequence[str], why: str) -> None:
    """InputError naming `flag` and the `given_with` parameters the user also gave, which `flag` overrides."""
    clash = given(ctx, *given_with)
    if clash:
        raise InputError(f"{flag} and {', '.join(clash)}: {why}; give one or the other")


def repeated_option(command: object, args: Sequence[str]) -> str | None:
    """'--chips 8 --chips 16' (click keeps the last silently) or '--fast-compile --full-opt': an error message
    naming both, for the first single-valued option of the subcommand args[0] given twice; else None.
    `command` is the app's click group (typer.main.get_command(app)), `args` sys.argv[1:]."""
    sub = getattr(command, "commands", {}).get(args[0]) if args else None
    params = {o: p for p in (sub.params if sub else ()) for o in (*p.opts, *getattr(p, "secondary_opts", ()))}
    seen: dict[str, str] = {}
    rest = iter(args[1:])
    for token in rest:
        if token == "--":
            break
        opt = token.partition("=")[0] if token.startswith("--") else token[:2]
        p = params.get(opt)
        if p is None:
            continue
        shown = token if opt != token or getattr(p, "is_flag", False) else f"{token} {next(rest, '')}"
        if getattr(p, "multiple", False) or getattr(p, "count", False):
            continue
        if p.name in seen:
            return f"{seen[p.name]} and {shown}: the same option given twice; give it once"
        seen[p.name] = shown
    return None


def resolve(model: str, hardware: str) -> tuple[ModelSpec, Chip]:
    return load_model(model), load_hardware(hardware)


def make_job(seq_len: int, global_batch: int, precision: str, framework: str, weight_dtype: str = "float32") -> Job:
    positive("--seq-len", seq_len)
    positive("--global-batch", global_batch)
    return Job(seq_len=seq_len, global_batch=global_batch, precision=precision, framework=framework,
               weight_dtype=weight_dtype)


def weight_dtype_over(weight_dtype: str | None, framework: str, base: Job) -> str:
    """--weight-dtype over a plan file's job: given, else the file's where the framework has weight_dtype as a
    setting (costmodel.framework: bf16_state; MaxText), else float32."""
    from costmodel.framework import framework as framework_record

    return weight_dtype or (base.weight_dtype if framework_record(framework).bf16_state is not None else "float32")


def offload_items(offload: list[str] | None, remat: str = "full") -> dict[str, str]:
    """{'optimizer' | 'params' | tensor: the item as given} from --offload (comma lists, repeatable). An item
    given twice (optimizer and opt, qkv_proj and query_proj) or a tensor that a custom --remat gives another
    choice is an error naming both."""
    seen: dict[str, str] = {}
    for item in [s.strip() for o in (offload or []) for s in o.split(",") if s.strip()]:
        key = {"opt": "optimizer", "optimizer": "optimizer", "params": "params", "parameters": "params"}.get(item)
        key = key or _tensor(item, "--offload: expected 'optimizer', 'params' or remat tensor names; ")
        if key in seen:
            raise InputError(f"--offload {seen[key]} and --offload {item}: {key} given twice; give it once")
        seen[key] = item
    for t, choice in custom_choices(remat).items():
        if t in seen and choice[1] != "offload":
            raise InputError(f"--remat {choice[0]} and --offload {seen[t]}: contradictory choices for {t}; give one")
    return seen


def custom_choices(remat: str) -> dict[str, tuple[str, str]]:
    """{tensor: (item, choice)} for each tensor a 'custom:t=c,...' --remat names (ours or MaxText's names);
    a tensor named twice (qkv_proj=device,query_proj=remat) is an error naming both items."""
    if not remat.startswith("custom"):
        return {}
    out: dict[str, tuple[str, str]] = {}
    for item in filter(None, (s.strip() for s in remat.partition(":")[2].split(","))):
        t = _tensor(item.partition("=")[0].strip(), "--remat: ")
        if t in out:
            raise InputError(f"--remat: {out[t][0]} and {item}: {t} given twice; give it once")
        out[t] = (item, parse_remat("custom:" + item).choices()[t])
    return out


def _tensor(name: str, where: str) -> str:
    """Our name of the remat tensor `name` (ours or MaxText's: query_proj -> qkv_proj)."""
    try:
        choices = parse_remat(f"custom:{name}=offload").choices()
    except InputError as e:
        raise InputError(f"{where}{e}") from None
    return next(t for t, c in choices.items() if c == "offload")
