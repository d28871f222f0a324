"""Shared command-line options: model, hardware, job and plan flags, turned into typed objects."""

from __future__ import annotations

import typer

from costmodel.catalog import load_model
from costmodel.job import Job
from costmodel.model import ModelSpec
from costmodel.plan import Plan, parse_remat
from hardware.catalog import load_hardware
from hardware.chip import Chip
from hardware.errors import InputError

MODEL = typer.Option(..., "--model", "-m", help="Preset name, a model YAML path, or a size such as 70B or 1T.")
HARDWARE = typer.Option("tpu-v5p", "--hardware", "-H", help="Hardware preset name or a profile YAML path.")
SEQ_LEN = typer.Option(4096, "--seq-len", "-s", help="Sequence length in tokens.")
PRECISION = typer.Option("bf16", "--precision", help="Matmul precision: bf16, fp8 or int8.")
FRAMEWORK = typer.Option("maxtext", "--framework",
                         help="State/collective conventions: maxtext, megatron, pytorch-fsdp or deepspeed.")
JSON = typer.Option(False, "--json", help="Print one JSON object instead of tables.")


def positive(name: str, value: int) -> int:
    if value is None or value < 1:
        raise InputError(f"{name}: expected a positive integer, got {value}")
    return value


def resolve(model: str, hardware: str) -> tuple[ModelSpec, Chip]:
    return load_model(model), load_hardware(hardware)


def make_job(seq_len: int, global_batch: int, precision: str, framework: str, weight_dtype: str = "float32") -> Job:
    positive("--seq-len", seq_len)
    positive("--global-batch", global_batch)
    return Job(seq_len=seq_len, global_batch=global_batch, precision=precision, framework=framework,
               weight_dtype=weight_dtype)


def weight_dtype_over(weight_dtype: str | None, framework: str, base: Job) -> str:
    """--weight-dtype over a plan file's job: given, else the file's under MaxText (the only framework with fp32
    weights as a setting), else float32."""
    return weight_dtype or (base.weight_dtype if framework == "maxtext" else "float32")


def make_plan(dp: int, fsdp: int, tp: int, cp: int, pp: int, ep: int, vpp: int, micro_batch: int, zero: int,
              remat: str, offload: list[str] | None, slices: int, sequence_parallel: bool = True,
              vocab_tiles: int = 1) -> Plan:
    """Plan from flags. --offload takes 'optimizer', 'params' and/or tensor names (e.g. qkv_proj)."""
    for name, v in (("--dp", dp), ("--fsdp", fsdp), ("--tp", tp), ("--cp", cp), ("--pp", pp), ("--ep", ep),
                    ("--vpp", vpp), ("--micro-batch", micro_batch), ("--slices", slices),
                    ("--vocab-tiles", vocab_tiles)):
        positive(name, v)
    policy = parse_remat(remat)
    opt = par = False
    tensors = []
    for item in [s.strip() for o in (offload or []) for s in o.split(",") if s.strip()]:
        if item in ("optimizer", "opt"):
            opt = True
        elif item in ("params", "parameters"):
            par = True
        else:
            tensors.append(item)
    if tensors:
        base = {t: c for t, c in policy.choices().items()}
        spec = ",".join([f"{t}={c}" for t, c in base.items() if t not in tensors] + [f"{t}=offload" for t in tensors])
        try:
            policy = parse_remat("custom:" + spec)
        except InputError as e:
            raise InputError(f"--offload: expected 'optimizer', 'params' or remat tensor names; {e}") from None
    return Plan(dp=dp, fsdp=fsdp, tp=tp, cp=cp, pp=pp, ep=ep, vpp=vpp, micro_batch=micro_batch, zero=zero,
                sequence_parallel=sequence_parallel, remat=policy, offload_optimizer=opt, offload_params=par,
                slices=slices, vocab_tiles=vocab_tiles)
