"""Scale a model spec down to something a few CPU devices can compile and run in seconds (no jax here).

The scaled model keeps what the plan's shardings depend on: the attention kind (MHA / GQA / MQA-like, with the
KV heads divisible by tp), gated or plain MLP, tied or untied embeddings, MoE with top-k routing (experts
divisible by ep, shared experts, one leading dense layer), multi-head latent attention (latents of d/4 and d/8).
Sliding windows become a quarter of the scaled sequence (local/global patterns keep at least one global layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from costmodel.job import Job
from costmodel.model import ModelSpec
from costmodel.plan import Plan
from hardware.errors import InputError
from planner.validate.axis_rules import embed_axes

FLASH_BLOCK_FRACTION = 4  # CPU: flash block (at most) = the scaled sequence / 4 (planner.validate.compare)


@dataclass(frozen=True)
class Scale:
    """Size of the scaled-down model."""

    d_model: int = 128
    n_layers: int = 2
    seq_len: int = 128
    vocab: int = 512
    ffn_mult: int = 2  # ffn_dim = ffn_mult * d_model (MoE experts: d_model)
    max_experts: int = 8
    micro_steps: int = 0  # micro-batches per step (gradient accumulation) of pp plans; 0: pp of them


def _round_up(x: int, k: int) -> int:
    return -(-x // k) * k


def unsupported(plan: Plan) -> str:
    """Why the validator cannot run `plan` ('' when it can), phrased as what to change."""
    if plan.pp > 1:
        # Inside the pipeline's shard_map (manual over pp, automatic over the rest), XLA's SPMD partitioner aborts
        # (a CHECK failure, not an exception) when weights are split along two dimensions: d_model over
        # fsdp/cp/ZeRO-3 dp, heads and MLP columns over tp, experts over ep. One of them at a time works.
        split = {"tp": plan.tp, "ep": plan.ep,
                 "fsdp/cp" + ("/dp (ZeRO-3)" if plan.zero == 3 else ""):
                     plan.fsdp * plan.cp * (plan.dp if plan.zero == 3 else 1)}
        two = [f"{k}={v}" for k, v in split.items() if v > 1]
        if len(two) > 1:
            return (f"pp={plan.pp} with weights split over {' and '.join(two)}: the validator's pipeline supports "
                    "one weight-splitting axis at a time alongside pp (XLA aborts otherwise); keep only one of "
                    "--tp, --ep, --fsdp/--cp above 1 with --pp, or use --pp 1")
    if plan.offload_optimizer or plan.offload_params or plan.remat.count("offload"):
        return "offload: host offload is not supported by the validator; drop --offload"
    if plan.slices > 1:
        return f"slices={plan.slices}: multi-slice plans are not supported by the validator; use --slices 1"
    return ""


def pipeline_unsupported(plan: Plan, n_layers: int, micro_steps: int) -> str:
    """Why the validator's pipeline (planner.validate.pipeline) cannot run `n_layers` layers and `micro_steps`
    micro-batches of `plan` ('' when it can, or without pp), phrased as what to change."""
    if plan.pp == 1:
        return ""
    chunks = plan.pp * plan.vpp
    if n_layers % chunks:
        what = f"{plan.pp} stages" + (f" x {plan.vpp} repeats" if plan.vpp > 1 else "")
        return (f"pp={plan.pp}: the scaled model's {n_layers} layers do not split evenly over {what}; "
                f"use --layers {-(-n_layers // chunks) * chunks} (a multiple of pp*vpp)")
    if micro_steps % plan.pp:  # the logits' batch is split over the stages, as in MaxText
        return (f"--grad-accum: {micro_steps} micro-batches; pipeline plans need a multiple of pp={plan.pp}; "
                f"use --grad-accum {-(-micro_steps // plan.pp) * plan.pp}")
    if plan.vpp > 1 and micro_steps != plan.pp:  # micro-batches go round the ring: one per stage
        return (f"--grad-accum: {micro_steps} micro-batches; the validator's circular pipeline (vpp={plan.vpp}) "
                f"runs exactly pp={plan.pp} of them; use --grad-accum {plan.pp} (or 0)")
    return ""


def weight_shards(plan: Plan) -> int:
    """How many ways the validator splits a weight's (or its Adam moments') d_model dimension (MaxText's `embed`
    rule, planner.validate.axis_rules)."""
    return math.prod(plan.degrees()[a] for a in embed_axes(plan, moments=True))


def _scaled_heads(m: ModelSpec, tp: int, s: Scale, weight_shards: int) -> tuple[int, int, int]:
    """(query heads, KV heads, d_model): 8 query heads (at least tp), KV heads keeping the model's grouping and
    divisible by tp, 8 dimensions per head at least, d_model a multiple of the heads and of the weight shards
    (the axes that split the weights' d_model dimension)."""
    n_heads = _round_up(8, tp)
    ratio = max(1, m.n_heads // m.n_kv_heads)  # queries per KV head in the full model
    kv = n_heads // min(ratio, n_heads)
    kv = max(kv, tp)
    while n_heads % kv:
        kv += 1
    if kv % tp:
        raise InputError(f"tp={tp}: the scaled model's {kv} KV heads are not divisible by tp; use a tp that "
                         f"divides {n_heads}")
    d_model = _round_up(max(s.d_model, n_heads * 8), math.lcm(n_heads, weight_shards))
    return n_heads, kv, d_model


def _scaled_moe(m: ModelSpec, plan: Plan, s: Scale, d_model: int, notes: list[str]) -> dict:
    """The MoE fields of the scaled model (all 0 for a dense one)."""
    if not m.is_moe:
        if plan.ep > 1:
            raise InputError(f"ep={plan.ep}: expert parallelism needs a MoE model; {m.name} is dense (use --ep 1)")
        return dict(n_experts=0, experts_per_token=0, moe_ffn_dim=0, n_dense_layers=0, n_shared_experts=0,
                    capacity_factor=0.0)
    e = min(m.n_experts, s.max_experts)
    e = _round_up(max(e, plan.ep), plan.ep)
    k = min(m.experts_per_token, 2, e)
    # capacity factor 1: the CPU validator routes with a per-sequence expert capacity (planner.validate.model
    # .capacity), not MaxText's dropless ragged buffers (costmodel.memory.routed_buffer_factor), which the TPU
    # compile runs (planner.validate.model.moe_dropless; XLA:CPU lacks the ragged all-to-all)
    # Shared experts kept (at most 2); one leading dense layer kept when the model has some (the rest of the
    # scaled layers MoE), except under pp, whose stages stack alike layers (planner.validate.pipeline).
    dense = min(m.n_dense_layers, 1, s.n_layers - 1) if plan.pp == 1 else 0
    if m.n_dense_layers and not dense:
        why = "pipeline stages run alike layers" if plan.pp > 1 else "the one scaled layer is a MoE layer"
        notes.append(f"leading dense layers dropped ({why})")
    # node-limited routing (router_groups) is dropped: it changes which experts a token picks, not the step's cost
    return dict(n_experts=e, experts_per_token=k, moe_ffn_dim=_round_up(d_model, plan.tp), n_dense_layers=dense,
                n_shared_experts=min(m.n_shared_experts, 2), capacity_factor=1.0, router_groups=0,
                router_group_topk=0)


def _scaled_mla(m: ModelSpec, head_dim: int, d_model: int) -> tuple[int, dict]:
    """(head_dim, the MLA fields). DeepSeek-V3's proportions: qk heads 2/3 nope + 1/3 rope, values as wide as the
    nope part, latents d/4 (queries, when the model has one) and d/8 (keys/values)."""
    if not m.is_mla:
        return head_dim, dict(q_lora_rank=0, kv_lora_rank=0, qk_rope_head_dim=0, v_head_dim=0)
    rope = max(2, head_dim // 2)
    return head_dim + rope, dict(q_lora_rank=d_model // 4 if m.q_lora_rank else 0, kv_lora_rank=d_model // 8,
                                 qk_rope_head_dim=rope, v_head_dim=head_dim)


def _scaled_window(m: ModelSpec, plan: Plan, s: Scale, seq: int, notes: list[str]) -> dict:
    """Sliding windows: a quarter of the scaled sequence; with a local/global pattern one global layer at least
    (under pp every layer local: stages run alike layers)."""
    if not m.sliding_window:
        return dict(sliding_window=0, local_per_global=0)
    k = 0 if plan.pp > 1 else min(m.local_per_global, s.n_layers - 1)
    if m.local_per_global and not k:
        notes.append("every layer local (pipeline stages run alike layers)")
    return dict(sliding_window=max(1, seq // 4), local_per_global=k)


def _scaled_job(plan: Plan, s: Scale, seq: int) -> Job:
    """One micro-batch per batch shard; a pipeline plan's micro-batches (s.micro_steps, default pp) per step."""
    if s.micro_steps > 1 and plan.pp == 1:
        raise InputError(f"--grad-accum: {s.micro_steps} micro-batches; the validator accumulates gradients over "
                         "micro-batches only in pipeline plans (--pp > 1); use --grad-accum 1 (or 0)")
    accum = (s.micro_steps or plan.pp) if plan.pp > 1 else 1
    why = pipeline_unsupported(plan, s.n_layers, accum)
    if why:
        raise InputError(why)
    return Job(seq_len=seq, global_batch=plan.batch_shards * plan.micro_batch * accum, precision="bf16",
               framework="maxtext", scan_layers=False)  # the validator unrolls its layers


def scale_down(m: ModelSpec, plan: Plan, s: Scale = Scale()) -> tuple[ModelSpec, Job, list[str]]:
    """(scaled model, job with one micro-batch per batch shard, notes). Raises InputError if it cannot divide."""
    why = unsupported(plan)
    if why:
        raise InputError(why)
    notes: list[str] = []
    tp, cp = plan.tp, plan.cp
    n_heads, kv, d_model = _scaled_heads(m, tp, s, weight_shards(plan))
    if d_model != s.d_model:
        notes.append(f"d_model {s.d_model} -> {d_model} (a multiple of the {n_heads} heads and of the weight shards)")
    # a multiple of cp x FLASH_BLOCK_FRACTION, so that every cp shard splits into whole flash blocks (a sequence of
    # 129 over cp 3 left blocks of one token: thousands of unrolled block pairs, a compile that never ends)
    seq = _round_up(s.seq_len, cp * FLASH_BLOCK_FRACTION)
    moe = _scaled_moe(m, plan, s, d_model, notes)
    head_dim, mla = _scaled_mla(m, d_model // n_heads, d_model)
    window = _scaled_window(m, plan, s, seq, notes)
    if plan.cp > 1 and m.is_moe:
        raise InputError("cp with MoE: the validator routes tokens per sequence and needs the sequence unsplit; "
                         "use --cp 1 for MoE models")
    small = replace(
        m, name=f"{m.name}-scaled", n_layers=s.n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=kv,
        head_dim=head_dim, ffn_dim=_round_up(s.ffn_mult * d_model, tp), vocab_size=_round_up(s.vocab, tp), **window,
        **mla, **moe)
    job = _scaled_job(plan, s, seq)
    if math.gcd(seq, cp) != cp:
        raise InputError(f"cp={cp}: does not divide the scaled sequence length {seq}")
    return small, job, notes


# Host-platform (CPU) devices jax is asked for, checked before jax starts: XLA creates each one up front (about
# 0.1 MB and 10 ms apiece measured here: 4,096 took 0.6 GB and 40 s to start; 10^8 ran the machine out of 24 GB).
MAX_DEVICES = 4096


def check_device_count(devices: int) -> int:
    """--devices is 1..MAX_DEVICES (the global count with --num-processes). Returns it."""
    if devices is None or not 1 <= devices <= MAX_DEVICES:
        raise InputError(f"--devices: expected 1..{MAX_DEVICES:,} (each host device is created up front), "
                         f"got {devices}")
    return devices


def check_devices(plan: Plan, devices: int) -> None:
    if plan.chips > devices:
        d = " * ".join(f"{a}={v}" for a, v in plan.degrees().items() if v > 1) or "1"
        raise InputError(f"devices: the plan needs {plan.chips} devices ({d}) but only {devices} exist; "
                         f"lower the degrees or raise --devices")
