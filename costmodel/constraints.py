"""Divisibility and shape rules a plan must satisfy before it can be costed."""

from __future__ import annotations

from costmodel.framework import REGISTRY
from costmodel.job import Job
from costmodel.model import ModelSpec
from costmodel.plan import (
    CPU_OFFLOAD_LAYERS,
    EP_OVERLAP,
    FP8_PARAMS,
    GRAD_BF16,
    RECOMPUTE_LAYERS,
    REMAT_POLICIES,
    SPLIT_FLAGS,
    Plan,
    busiest_stage_layers,
)
from hardware.chip import Chip
from hardware.errors import InputError


def check_plan(m: ModelSpec, chip: Chip, job: Job, plan: Plan, chips: int | None = None) -> None:
    """Raise InputError naming the first violated constraint and its numbers."""
    if chips is not None and plan.chips != chips:
        d = plan.degrees()
        prod = "*".join(f"{a}{v}" for a, v in d.items())
        raise InputError(f"degrees: product {prod} = {plan.chips} must equal chips = {chips}")
    if plan.tp > 1 and m.n_heads % plan.tp:
        raise InputError(f"tp: n_heads {m.n_heads} is not divisible by tp {plan.tp}")
    if plan.tp > 1 and m.n_kv_heads % plan.tp and plan.tp % m.n_kv_heads:
        raise InputError(f"tp: n_kv_heads {m.n_kv_heads} and tp {plan.tp} must divide one another")
    check_split_flags(m, job, plan)
    check_ep_overlap(m, job, plan)
    if m.n_layers % (plan.pp * plan.vpp):
        if not job.fw.uneven_pp:
            raise InputError(f"pp*vpp: n_layers {m.n_layers} is not divisible by pp*vpp = {plan.pp * plan.vpp} "
                             f"({job.framework} splits the layers evenly; Megatron-LM can split them unevenly: "
                             "--framework megatron)")
        busiest_stage_layers(m.n_layers, plan)  # raises when even an uneven split cannot place them
    if plan.vpp > 1 and plan.pp == 1:
        raise InputError(f"vpp: virtual stages ({plan.vpp}) need pp > 1")
    check_recompute_layers(m, job, plan)
    check_cpu_offload_layers(m, job, plan)
    check_fp8_params(job, plan)
    check_grad_bf16(job, plan)
    if job.seq_len % plan.cp:
        raise InputError(f"cp: seq_len {job.seq_len} is not divisible by cp {plan.cp}")
    if plan.ep > 1 and not m.is_moe:
        raise InputError(f"ep: expert parallelism ({plan.ep}) needs a MoE model; {m.name} is dense")
    if m.is_moe and m.n_experts % plan.ep:
        raise InputError(f"ep: n_experts {m.n_experts} is not divisible by ep {plan.ep}")
    shard = plan.batch_shards * plan.micro_batch
    if job.global_batch % shard:
        raise InputError(f"global_batch: {job.global_batch} is not divisible by dp*fsdp*ep*micro_batch = "
                         f"{plan.dp}*{plan.fsdp}*{plan.ep}*{plan.micro_batch} = {shard}")
    check_framework_rules(job, plan)
    if plan.slices > 1:
        if plan.chips % plan.slices:
            raise InputError(f"slices: chips {plan.chips} is not divisible by slices {plan.slices}")
        if chip.scale_up.kind != "torus":
            raise InputError("slices: multi-slice jobs are for TPUs; GPU jobs span nodes automatically")
    max_chips = chip.max_chips
    if plan.chips > max_chips:
        raise InputError(f"chips: {plan.chips} exceeds the {chip.name} profile's maximum of {max_chips}")


def require_framework(job: Job, field: str, what: str) -> None:
    """InputError unless the job's framework record has `field` set (costmodel.framework); the message names the
    frameworks that have it."""
    if not getattr(job.fw, field):
        names = " or ".join(f.name for f in REGISTRY.values() if getattr(f, field))
        raise InputError(f"{what}; expected --framework {names}, got {job.framework}")


def check_split_flags(m: ModelSpec, job: Job, plan: Plan) -> None:
    """Megatron-Core's --account-for-embedding/loss-in-pipeline-split: only under a Megatron-Core framework, only
    with pp > 1, and only where Megatron's own checks accept the split (costmodel.plan.split_accounted)."""
    on = [n for n in SPLIT_FLAGS if getattr(plan, n)]
    if not on:
        return
    flag = "--" + on[0].replace("_", "-")
    require_framework(job, "megatron_core", f"{on[0]} ({flag}): a Megatron-Core option")
    if plan.pp == 1:
        raise InputError(f"{on[0]} ({flag}): counts a layer of the pipeline split; expected pp > 1, got pp 1")
    busiest_stage_layers(m.n_layers, plan)  # Megatron-Core's divisibility checks


def check_recompute_layers(m: ModelSpec, job: Job, plan: Plan) -> None:
    """Megatron-Core's --recompute-num-layers N under --recompute-method block (Plan.recompute_num_layers): only
    under a framework that runs it (Framework.block_recompute), only with remat full (TransformerConfig: full
    granularity needs a method and N; selective refuses N), and N from 1 to the layers of the largest model
    chunk (stage layers / vpp; Megatron's message: between 1 and num_layers_per_pipeline_rank)."""
    n = plan.recompute_num_layers
    if not n:
        return
    flag = f"{RECOMPUTE_LAYERS} (--{RECOMPUTE_LAYERS.replace('_', '-')})"
    require_framework(job, "block_recompute", f"{flag}: Megatron-Core's block recompute")
    if plan.remat.choices() != REMAT_POLICIES["full"].choices():
        raise InputError(f"{flag}: recomputes whole layers (--recompute-granularity full); expected --remat full, "
                         f"got {plan.remat.summary()}")
    chunk = -(-busiest_stage_layers(m.n_layers, plan) // plan.vpp)  # layers of the largest model chunk
    if n > chunk:
        raise InputError(f"{flag}: expected 1 to {chunk} (the layers of a model chunk: stage layers / vpp), got {n}")


def check_cpu_offload_layers(m: ModelSpec, job: Job, plan: Plan) -> None:
    """Megatron-Core's --cpu-offloading-num-layers N (Plan.cpu_offload_layers): only under a framework that runs
    it (Framework.layer_cpu_offload), and TransformerConfig.__post_init__'s checks: N from 1 to num_layers - 1,
    no pipeline parallelism, no activation recomputation (recompute_granularity None: --remat none)."""
    n = plan.cpu_offload_layers
    if not n:
        return
    flag = f"{CPU_OFFLOAD_LAYERS} (--cpu-offloading-num-layers)"
    require_framework(job, "layer_cpu_offload", f"{flag}: Megatron-Core's layer CPU offloading")
    if plan.pp > 1:
        raise InputError(f"{flag}: expected pp 1, got pp {plan.pp} (Megatron-Core: 'Currently there is no support "
                         "for Pipeline parallelism with CPU offloading')")
    if plan.remat.choices() != REMAT_POLICIES["none"].choices():
        raise InputError(f"{flag}: expected --remat none, got {plan.remat.summary()} (Megatron-Core: 'CPU "
                         "offloading does not work when activation recomputation is enabled')")
    if n >= m.n_layers:
        raise InputError(f"{flag}: expected 1 to {m.n_layers - 1} (fewer than the model's {m.n_layers} layers), "
                         f"got {n}")


def check_fp8_params(job: Job, plan: Plan) -> None:
    """Megatron-LM's --fp8-param-gather (Plan.fp8_param_gather): only under a framework that runs it
    (Framework.fp8_param_gather), with fp8 compute (TransformerConfig.__post_init__: 'fp8_param must be used together
    with fp8 mode.'), and with the parameters sharded over the data-parallel ranks, a distributed optimizer
    (zero 1-2) or FSDP (zero 3, fsdp > 1) (arguments.py: '--fp8-param-gather only supported with distributed
    optimizer, torch fsdp2, megatron fsdp, or inference mode')."""
    if not plan.fp8_param_gather:
        return
    flag = f"{FP8_PARAMS} (--fp8-param-gather)"
    require_framework(job, "fp8_param_gather", f"{flag}: Megatron-Core's fp8 parameters")
    if job.precision != "fp8":
        raise InputError(f"{flag}: keeps the weights in fp8 for fp8 matmuls (Megatron-Core: 'fp8_param must be used "
                         f"together with fp8 mode'); expected --precision fp8, got {job.precision}")
    if plan.zero == 0 and plan.fsdp == 1:
        raise InputError(f"{flag}: Megatron-LM runs it only with the distributed optimizer or FSDP; expected zero "
                         f"1, 2 or 3 (or fsdp > 1), got zero 0")
    if plan.offload_params:
        raise InputError(f"{flag}: the fp8 weights live on the GPU; expected no parameter offload "
                         "(--offload without params)")


def check_grad_bf16(job: Job, plan: Plan) -> None:
    """Megatron-LM's --grad-reduce-in-bf16 (Plan.grad_reduce_in_bf16): only under a framework that runs it
    (Framework.grad_reduce_in_bf16); it acts on bf16 parameters (arguments.py validate_args applies it under
    args.bf16, which fp8 runs set too; fp16 gradients are already 2 B); and on the DDP gradient buffer, which
    Megatron-FSDP does not use (it reads --megatron-fsdp-main-grads-dtype instead)."""
    if not plan.grad_reduce_in_bf16:
        return
    flag = f"{GRAD_BF16} (--grad-reduce-in-bf16)"
    require_framework(job, "grad_reduce_in_bf16", f"{flag}: Megatron-Core's bf16 main gradients")
    if job.precision not in ("bf16", "fp8"):
        raise InputError(f"{flag}: Megatron-LM applies it to bf16 parameters (validate_args, under --bf16); "
                         f"expected --precision bf16 or fp8, got {job.precision}")
    if plan.zero == 3 or plan.fsdp > 1:
        raise InputError(f"{flag}: sets the DDP gradient buffer's dtype, which Megatron-FSDP does not use; "
                         f"expected zero 0-2 and fsdp 1, got zero {plan.zero}, fsdp {plan.fsdp}")


def fp8_params_allowed(job: Job, plan: Plan) -> bool:
    """check_fp8_params accepts --fp8-param-gather on this plan. `suggest` turns it on wherever it does: it keeps
    the GEMM weights in 2 B instead of 4 B and gathers them in 1 B, at no cost the model knows (docs/fp8_params.md)."""
    try:
        check_fp8_params(job, plan.with_(fp8_param_gather=True))
    except InputError:
        return False
    return True


def check_ep_overlap(m: ModelSpec, job: Job, plan: Plan) -> None:
    """Megatron-Core's --overlap-moe-expert-parallel-comm (TransformerConfig.__post_init__ asserts ep > 1 and no
    full or MoE recompute): only under a framework that runs it (Framework.ep_overlap), with expert parallelism,
    and with the MoE layer's tensors not recomputed (the hidden all-to-alls are the four of expert_exchange)."""
    if not plan.overlap_moe_expert_parallel_comm:
        return
    flag = f"{EP_OVERLAP} (--{EP_OVERLAP.replace('_', '-')})"
    require_framework(job, "ep_overlap", f"{flag}: the expert all-to-all overlap of Megatron-Core")
    if plan.ep == 1 or not m.n_moe_layers:
        raise InputError(f"{flag}: hides the expert-parallel all-to-all; expected ep > 1 on a MoE model, got ep "
                         f"{plan.ep} on {m.name}")
    recomputed = [t for t in ("mlp_in", "mlp_out") if plan.remat.choices()[t] == "remat"]
    if recomputed:
        raise InputError(f"{flag}: Megatron-Core refuses full recompute and recomputing the MoE layer with it; "
                         f"expected remat none or selective (mlp_in, mlp_out kept), got {plan.remat.summary()}")


def check_framework_rules(job: Job, plan: Plan) -> None:
    """Rules the target framework itself enforces (costmodel.framework), so that every costed plan can be launched
    there."""
    fw = job.fw
    accum = job.global_batch // (plan.batch_shards * plan.micro_batch)
    # MaxText 0.2.5's config loader refuses shard_optimizer_over_data together with fsdp > 1.
    if not fw.zero_with_fsdp and plan.zero in (1, 2) and plan.fsdp > 1:
        raise InputError(f"zero: {fw.display} cannot shard optimizer state over dp (zero={plan.zero}) when fsdp > 1 "
                         f"(fsdp={plan.fsdp}); use zero 0 or 3")
    # MaxText: num_pipeline_microbatches must be a multiple of the number of stages.
    if fw.microbatches_per_stage and plan.pp > 1 and accum % plan.pp:
        raise InputError(f"micro_batch: {fw.display} needs the pipeline micro-batch count ({accum}) to be a "
                         f"multiple of pp ({plan.pp})")
    if plan.vocab_tiles > 1:
        tokens = plan.micro_batch * job.seq_len // plan.cp
        if not fw.vocab_tiling:
            raise InputError(f"vocab_tiles: vocab tiling (num_vocab_tiling) is a maxtext setting; framework "
                             f"{job.framework!r} computes the logits whole (expected vocab_tiles 1)")
        if tokens % plan.vocab_tiles:
            raise InputError(f"vocab_tiles: must divide the tokens per micro-batch on a chip ({tokens}), "
                             f"got {plan.vocab_tiles}")
    # DeepSpeed's PipelineEngine runs one model chunk per stage (its TrainSchedule is plain 1F1B).
    if not fw.interleaved_pp and plan.vpp > 1:
        raise InputError(f"vpp: {fw.display}'s pipeline engine has no interleaved schedule; expected vpp 1 with "
                         f"framework {fw.name}, got {plan.vpp}")
    k = fw.cp_chunks  # Megatron's load-balanced causal cp: 2 * cp chunks of the sequence
    if k > 1 and plan.cp > 1 and job.seq_len % (k * plan.cp):
        raise InputError(f"cp: {fw.display} needs seq_len ({job.seq_len}) divisible by {k}*cp ({k * plan.cp})")
    if fw.optimizer_offload_needs_zero and plan.offload_optimizer and plan.zero < 1:
        raise InputError(f"offload: {fw.display}'s optimizer CPU offload needs the distributed optimizer (zero >= 1)")
