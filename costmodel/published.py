"""Published training runs (the runs_dev.csv schema) as (model, chip, job, plan) cases, and their accuracy.

Row conventions (from RUNS_SCHEMA.md; no per-row numbers are invented here):
  - micro_batch: MaxText rows give per-device batch; Megatron/NeMo/DeepSpeed per model replica; llm-foundry per
    GPU (= per replica under pure FSDP). Our plan's micro_batch is per replica, so it is always recomputed as
    global_batch / (dp*fsdp*ep * grad_accum), with grad_accum = 1 for MaxText rows (no accumulation in
    those runs) and global_batch / (dp*fsdp*ep*micro_batch) otherwise. A missing micro_batch (Megatron 2021
    Table 1) is taken as 1, the value of the paper's weak-scaling runs' smallest memory footprint.
  - framework: maxtext and palm -> 'maxtext'; mosaic (llm-foundry, FSDP amp_bf16) -> 'pytorch-fsdp';
    megatron and nemo -> 'megatron'; deepspeed -> 'deepspeed' (see costmodel.job.Job); torchtitan and nanotron
    as FRAMEWORK_CONVENTION says. Any other value (or none) skips the row, naming the supported ones.
  - sequence parallelism: Megatron-LM 2021 (Narayanan et al.) predates it; every other tp > 1 run uses it.
  - remat 'custom': tensor choices from the notes ('remat custom: a=offload, ...'); PaLM's own scheme (no
    such list) is costed as 'full', the closest policy.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from costmodel.constraints import check_fp8_params, check_grad_bf16, check_split_flags
from costmodel.job import ATTENTION_KERNELS, Job
from costmodel.model import ModelSpec
from costmodel.plan import SPLIT_FLAGS, Plan, parse_remat
from hardware.catalog import load_hardware, preset_names
from hardware.chip import Chip
from hardware.errors import MAX_NAME_CHARS, InputError, check_name, excerpt, shown_path
from hardware.fileio import MAX_TABLE_BYTES, read_text

# Source framework -> our framework convention (costmodel.job.Job.framework).
#   torchtitan -> pytorch-fsdp: FSDP2 (torch.distributed fully_shard) keeps the sharded parameters, gradients and
#     Adam moments in fp32 and computes in bf16 (MixedPrecisionPolicy param_dtype bfloat16, reduce_dtype float32),
#     the layout of llm-foundry's FSDP amp_bf16 runs (pytorch/torchtitan apply_fsdp: fully_shard with
#     MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32); data/runs/SOURCES_gpu.md section 2).
#   nemo -> nemo: Megatron's conventions, with NeMo's distributed optimizer settings (costmodel.framework.NEMO).
#   nanotron -> megatron: bf16 parameters with fp32 gradient accumulation and fp32 master weights and moments
#     (ZeRO-1 shards the optimizer state), Megatron-style tp (tp_mode REDUCE_SCATTER = sequence parallel) and 1F1B
#     pipelining (huggingface/nanotron configs: dtype bfloat16, accumulate_grad_in_fp32; data/runs/SOURCES_gpu.md
#     section 1).
FRAMEWORK_CONVENTION = {"maxtext": "maxtext", "palm": "maxtext", "other": "maxtext", "mosaic": "pytorch-fsdp",
                        "megatron": "megatron", "nemo": "nemo", "deepspeed": "deepspeed",
                        "torchtitan": "pytorch-fsdp", "nanotron": "megatron"}
NAME_COLUMNS = ("id", "model_name", "hardware", "source", "framework", "precision", "remat")  # check_name: printable
MAX_COUNT = 2**40  # any count column (a dimension, degree, length, batch); Job's bound on tokens per step
MAX_TABLE_ROWS = 5_000  # ~5 s of estimates (1 ms a row); runs_dev.csv has 248 rows
# Optional column pipeline_split -> the Megatron-Core flags the run set (RUNS_SCHEMA.md; blank or no column: none).
PIPELINE_SPLIT = {"": (), "embedding": SPLIT_FLAGS[:1], "loss": SPLIT_FLAGS[1:], "embedding+loss": SPLIT_FLAGS}
# Optional column fp8_param_gather: true where the run kept its GEMM weights in fp8 (Megatron-LM --fp8-param-gather,
# NeMo fp8_params; NVIDIA's MLPerf FP8_PARAMS=True) -> Plan.fp8_param_gather (RUNS_SCHEMA.md; blank or no column: off).
BOOL_VALUES = {"": False, "false": False, "true": True}
# Optional column grad_reduce_in_bf16: true where the run kept and reduced its main gradients in bf16 (Megatron-LM
# --grad-reduce-in-bf16, NeMo grad_reduce_in_fp32=False, Apex distributed_fused_adam grad_sync_dtype bf16)
# -> Plan.grad_reduce_in_bf16 (RUNS_SCHEMA.md; blank or no column: off, fp32 gradients). Values: BOOL_VALUES.
GRAD_BF16_COLUMN = "grad_reduce_in_bf16"
REQUIRED = ("id", "measured_step_time_s", "chips", "n_layers", "d_model", "n_heads", "ffn_dim", "vocab_size",
            "seq_len", "hardware", "tp", "pp", "cp", "ep", "dp", "fsdp", "global_batch")


@dataclass(frozen=True)
class Case:
    id: str
    source: str
    model: ModelSpec
    chip: Chip
    job: Job
    plan: Plan
    measured_step_time_s: float
    measured_memory_bytes: float | None = None
    framework: str = ""  # the row's framework column (the software stack: nemo, torchtitan, ...), for holdout splits


def _num(row: dict[str, str], key: str, default: float | None = None) -> float | None:
    """A column's number; default when blank or NaN (how pandas writes a missing value); a row with a
    non-number or an infinite one is skipped."""
    v = (row.get(key) or "").strip()
    try:
        x = float(v) if v else math.nan
    except ValueError:
        raise InputError(f"{key}: expected a number, got {excerpt(v)}") from None
    if math.isnan(x):
        return default
    if math.isinf(x):
        raise InputError(f"{key}: expected a finite number, got {excerpt(v)}")
    return x


def _int(row: dict[str, str], key: str, default: int | None = None) -> int | None:
    """A column's integer (rounded); default when blank or NaN; a value past MAX_COUNT in magnitude is refused."""
    v = _num(row, key, None)
    if v is not None and abs(v) > MAX_COUNT:
        raise InputError(f"{key}: expected at most {MAX_COUNT:,}, got {excerpt(row.get(key))}")
    return default if v is None else int(round(v))


def _count(row: dict[str, str], key: str, default: int | None = None) -> int:
    """A positive integer column (a degree, a length, a batch, a model dimension) of at most MAX_COUNT (_int);
    default when blank or NaN."""
    v = _int(row, key, default)
    if v is None or v < 1:
        raise InputError(f"{key}: expected a positive integer, got {excerpt(row.get(key))}")
    return v


def _bool(row: dict[str, str], key: str) -> bool:
    return (row.get(key) or "").strip().lower() in ("true", "1", "yes")


def _sliding_window(row: dict[str, str]) -> dict[str, int]:
    """'5 local (sliding window 1024) : 1 global' in a row's notes (Gemma 3)."""
    # (?<!\d): a match starts only at the start of a number (without it a long run of digits is quadratic)
    hit = re.search(r"(?<!\d)(\d{1,9}) local \(sliding window (\d{1,9})\) : 1 global", row.get("notes") or "")
    return {"local_per_global": int(hit.group(1)), "sliding_window": int(hit.group(2))} if hit else {}


def _capacity_factor(row: dict[str, str]) -> float:
    """'capacity factor 1.25' in a row's notes (token-dropping MoE); 0 = dropless."""
    hit = re.search(r"capacity[ _]factor\s*([0-9.]{1,24})", row.get("notes") or "")
    return float(hit.group(1)) if hit else 0.0


def _vocab_tiles(row: dict[str, str]) -> int:
    """'num_vocab_tiling 16' in a row's notes (MaxText's chunked logits/loss)."""
    hit = re.search(r"num_vocab_tiling[ =]\s*(\d{1,9})", row.get("notes") or "")
    return int(hit.group(1)) if hit else 1


def _weight_dtype(row: dict[str, str], framework: str) -> str:
    """'weight_dtype=bfloat16' in the notes of a row whose framework has that setting (bf16 weights and moments)."""
    from costmodel.framework import framework as record

    hit = re.search(r"weight_dtype[ =]\s*bfloat16", row.get("notes") or "")
    return "bfloat16" if hit and record(framework).bf16_state is not None else "float32"


def _attention(row: dict[str, str]) -> str:
    """The optional `attention` column (Job.attention): blank or no column is flash."""
    v = (row.get("attention") or "").strip() or "flash"
    if v not in ATTENTION_KERNELS:
        raise InputError(f"attention: expected one of {', '.join(ATTENTION_KERNELS)} or blank, got {excerpt(v)}")
    return v


def _pipeline_split(row: dict[str, str]) -> dict[str, bool]:
    """The Plan flags of the optional `pipeline_split` column: which of Megatron-Core's
    account_for_embedding/loss_in_pipeline_split the run set (NVIDIA's MLPerf ASYM_PP_EMBED / ASYM_PP_LOSS)."""
    v = (row.get("pipeline_split") or "").strip()
    if v not in PIPELINE_SPLIT:
        raise InputError(f"pipeline_split: expected empty, embedding, loss or embedding+loss, got {excerpt(v)}")
    return dict.fromkeys(PIPELINE_SPLIT[v], True)


def _bool_column(row: dict[str, str], name: str) -> bool:
    """An optional true/false column (blank or no column: false)."""
    v = (row.get(name) or "").strip().lower()
    if v not in BOOL_VALUES:
        raise InputError(f"{name}: expected empty, true or false, got {excerpt(v)}")
    return BOOL_VALUES[v]


def _remat(row: dict[str, str]) -> str:
    name = (row.get("remat") or "").strip() or "full"
    if name != "custom":
        return name
    hit = re.search(r"remat custom:\s*([^|]*)", row.get("notes") or "")
    if not hit:
        return "full"
    items = [s.strip() for s in hit.group(1).split("(")[0].split(",") if "=" in s]
    return "custom:" + ",".join(items)


def _check_megatron_columns(row: dict[str, str], model: ModelSpec, job: Job, plan: Plan) -> None:
    """The Megatron-Core columns only where Megatron accepts them; InputError naming the column otherwise."""
    split = f"pipeline_split {excerpt((row.get('pipeline_split') or '').strip())}"
    checks = ((split, check_split_flags, (model, job, plan)),  # framework, pp, Megatron-Core's split checks
              ("fp8_param_gather", check_fp8_params, (job, plan)),  # framework, fp8, distributed optimizer
              (GRAD_BF16_COLUMN, check_grad_bf16, (job, plan)))  # framework, bf16 parameters, no FSDP
    for column, check, args in checks:
        try:
            check(*args)
        except InputError as e:
            raise InputError(f"{column}: {e}") from None


def row_to_case(row: dict[str, str]) -> Case:
    """Build one case or raise InputError with the reason the row cannot be estimated."""
    for key in NAME_COLUMNS:
        if row.get(key):
            check_name(row[key], key)
    for key in REQUIRED:
        if (row.get(key) or "").strip() == "":
            why = re.search(r"UNUSABLE[^|]*", row.get("notes") or "")
            raise InputError(f"missing {key}" + (f" ({why.group(0).strip()[:120]})" if why else ""))
    if row["hardware"] not in preset_names():
        raise InputError(f"no hardware profile {excerpt(row['hardware'])}")
    fw = (row.get("framework") or "").strip()
    if fw not in FRAMEWORK_CONVENTION:  # no silent fallback: the state layout and collectives depend on it
        raise InputError(f"framework: expected one of {', '.join(sorted(FRAMEWORK_CONVENTION))}, got "
                         f"{excerpt(fw) if fw else 'none'}")
    convention = FRAMEWORK_CONVENTION[fw]
    n_exp = _int(row, "n_experts", 0) or 0
    model = ModelSpec(
        name=row.get("model_name") or row["id"], n_layers=_count(row, "n_layers"), d_model=_count(row, "d_model"),
        n_heads=_count(row, "n_heads"), n_kv_heads=_int(row, "n_kv_heads", 0), head_dim=_int(row, "head_dim", 0),
        ffn_dim=_count(row, "ffn_dim"), vocab_size=_count(row, "vocab_size"), gated_mlp=_bool(row, "gated_mlp"),
        tied_embeddings=_bool(row, "tied_embeddings"), n_experts=n_exp,
        experts_per_token=_int(row, "experts_per_token", 0) if n_exp else 0,
        moe_ffn_dim=_int(row, "moe_ffn_dim", 0) if n_exp else 0,
        n_dense_layers=_int(row, "n_dense_layers", 0) if n_exp else 0,
        n_shared_experts=_int(row, "n_shared_experts", 0) if n_exp else 0,
        capacity_factor=_capacity_factor(row) if n_exp else 0.0, **_sliding_window(row))
    precision = {"fp16": "bf16"}.get(row.get("precision") or "bf16", row.get("precision") or "bf16")
    job = Job(seq_len=_count(row, "seq_len"), global_batch=_count(row, "global_batch"), precision=precision,
              framework=convention, weight_dtype=_weight_dtype(row, convention), attention=_attention(row))
    deg = {a: _count(row, a, 1) for a in ("dp", "fsdp", "tp", "cp", "pp", "ep")}
    chips = _count(row, "chips")
    if chips != math.prod(deg.values()):
        raise InputError(f"chips: {chips} is not the product of the degrees dp*fsdp*tp*cp*pp*ep = "
                         f"{'*'.join(str(v) for v in deg.values())} = {math.prod(deg.values())}")
    shards = deg["dp"] * deg["fsdp"] * deg["ep"]
    if fw == "maxtext" or fw == "palm":
        accum = 1
    else:
        mb = _int(row, "micro_batch", 1) or 1
        accum = max(1, job.global_batch // (shards * mb))
    micro = job.global_batch // (shards * accum)
    zero = _int(row, "zero", None)
    if zero is None:
        zero = 3 if deg["fsdp"] > 1 else 0
    sp = deg["tp"] > 1 and not (row.get("source") or "").startswith("narayanan2021")
    plan = Plan(**deg, vpp=_int(row, "vpp", 1) or 1, micro_batch=max(1, micro), zero=zero, sequence_parallel=sp,
                remat=parse_remat(_remat(row)), slices=_int(row, "slices", 1) or 1, vocab_tiles=_vocab_tiles(row),
                fp8_param_gather=_bool_column(row, "fp8_param_gather"),
                grad_reduce_in_bf16=_bool_column(row, GRAD_BF16_COLUMN),
                **_pipeline_split(row))
    _check_megatron_columns(row, model, job, plan)
    measured = _num(row, "measured_step_time_s")
    if measured is None or measured <= 0:
        raise InputError(f"measured_step_time_s: expected a positive number of seconds, got "
                         f"{excerpt(row.get('measured_step_time_s'))}")
    return Case(row["id"], row.get("source") or "", model, load_hardware(row["hardware"]), job, plan, measured,
                framework=fw)


def load_cases(path: str | Path) -> tuple[list[Case], dict[str, str]]:
    """All estimable rows of a runs CSV, plus {row label: reason} for the rows that are skipped (issue 28's rule:
    a row that cannot be used is reported and skipped, nothing else is lost). The file goes through
    hardware.fileio.read_text (MAX_TABLE_BYTES, UTF-8) and at most MAX_TABLE_ROWS rows; a file that is not CSV
    (a field over csv's 128 KB limit, a stray quote) is one InputError naming the line."""
    p = Path(path)
    rows = _read_rows(p)
    cases, skipped = [], {}
    for line, row in rows:
        try:
            cases.append(row_to_case(row))
        except (InputError, ValueError) as e:
            skipped[_row_label(row, line, skipped)] = str(e)
    return cases, skipped


def _read_rows(p: Path) -> list[tuple[int, dict[str, str]]]:
    """(line number, row) for every row of a runs CSV; the header must have the runs schema's key columns."""
    try:
        text = read_text(p, MAX_TABLE_BYTES)
    except InputError as e:
        raise InputError(f"--file {e}") from None
    reader = csv.DictReader(io.StringIO(text, newline=""))
    rows = []
    try:
        header = reader.fieldnames or []
        missing = [c for c in ("id", "measured_step_time_s", "hardware") if c not in header]
        if missing:
            raise InputError(f"--file {shown_path(p)}: lacks the column(s) {', '.join(missing)} of the runs schema")
        twice = sorted(c for c, n in Counter(header).items() if n > 1)
        if twice:  # csv.DictReader would keep the last silently
            raise InputError(f"--file {shown_path(p)}: column(s) {excerpt(', '.join(twice))} given twice in the header")
        for row in reader:
            if len(rows) == MAX_TABLE_ROWS:
                raise InputError(f"--file {shown_path(p)}: more than {MAX_TABLE_ROWS:,} rows; split the file")
            rows.append((reader.line_num, row))
    except csv.Error as e:
        raise InputError(f"--file {shown_path(p)}: line {reader.reader.line_num}: not a valid CSV row ({e})") from None
    return rows


def _row_label(row: dict[str, str], line: int, taken: dict[str, str]) -> str:
    """The row's id when it is a usable, unused name; else its line number, so that no skipped row hides another."""
    rid = row.get("id") or ""
    if rid and rid.isprintable() and len(rid) <= MAX_NAME_CHARS and rid not in taken:
        return rid
    return f"line {line}" + (f" ({excerpt(rid)})" if rid else "")


def family(case: Case) -> str:
    return case.chip.name


def evaluate(cases: list[Case], chips: dict[str, Chip] | None = None) -> list[dict]:
    """Predicted vs measured step time per case. `chips` overrides profiles by name (calibration)."""
    from costmodel.estimate import estimate

    rows = []
    for c in cases:
        chip = (chips or {}).get(c.chip.name, c.chip)
        try:
            cost = estimate(c.model, chip, c.job, c.plan)
        except (InputError, ArithmeticError) as e:  # a row that cannot be estimated is reported, not fatal
            why = str(e) if isinstance(e, InputError) else f"cannot be estimated ({type(e).__name__}: {e})"
            rows.append({"id": c.id, "source": c.source, "hardware": c.chip.name, "skipped": why})
            continue
        err = (cost.step_time_s - c.measured_step_time_s) / c.measured_step_time_s * 100
        rows.append({"id": c.id, "source": c.source, "hardware": c.chip.name,
                     "predicted_step_time_s": cost.step_time_s, "measured_step_time_s": c.measured_step_time_s,
                     "error_pct": err, "predicted_peak_memory_bytes": cost.peak_memory_bytes,
                     "predicted_fit_memory_bytes": cost.fit_memory_bytes, "fits": cost.fits,
                     "mfu": cost.mfu})
    return rows


def mape(rows: list[dict]) -> dict[str, float]:
    """Mean absolute percentage error overall, per source and per hardware."""
    ok = [r for r in rows if "error_pct" in r]
    out: dict[str, float] = {}
    if ok:
        out["overall"] = sum(abs(r["error_pct"]) for r in ok) / len(ok)
    for key in ("source", "hardware"):
        for val in sorted({r[key] for r in ok}):
            sel = [abs(r["error_pct"]) for r in ok if r[key] == val]
            out[f"{key}:{val}"] = sum(sel) / len(sel)
    return out
