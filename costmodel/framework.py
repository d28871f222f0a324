"""Training frameworks as data: one frozen `Framework` record per training stack, resolved once from the Job
(`Job.fw`). The cost model, the memory model, the plan rules and the planner's solver read its fields; nothing
else compares framework names. Adding a framework is one record in REGISTRY plus its tests (tests/test_framework.py).

Each field states its rule and source in a line; the measurements behind the MaxText fields (compiled steps, the
validator's HLO) are in docs/memory.md and docs/costmodel.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from hardware.errors import InputError

SPMD, ONE_F_ONE_B = "spmd", "1f1b"  # pipeline kinds (Framework.pipeline)
# When a distributed optimizer (zero 1-2 over dp) all-gathers the updated parameters (Framework.param_gather):
# WITH_GRADS: costed with the gradients' reduce-scatter as one all-reduce behind the last backward; AFTER_STEP:
# after the optimizer step, blocking; NEXT_FORWARD: behind the next step's forward.
WITH_GRADS, AFTER_STEP, NEXT_FORWARD = "with-grads", "after-step", "next-forward"


class StateBytes(NamedTuple):
    """Model state per parameter: stored weight and gradient bytes, optimizer state bytes, and the HBM bytes the
    Adam update reads and writes."""

    weights: int
    grads: int
    optimizer: int
    adam_update: int


# fp32 weights and moments: the update reads p, g, m, v and writes p, m, v (7 x 4 B).
FP32_STATE = StateBytes(4, 4, 8, 28)
# bf16 weights with fp32 main gradients, master weights and moments (Megatron's layout): the update reads g,
# master, m, v and writes master, m, v (fp32) and the bf16 weight copy (7 x 4 + 2 B).
MIXED_STATE = StateBytes(2, 4, 12, 30)
# MaxText weight_dtype=bfloat16: bf16 weights and mu/nu (optax keeps moments in the param dtype), fp32 gradients
# (grad_dtype default); the update reads p, m, v (2 B) and g (4 B), writes p, m, v: 16 B.
BF16_STATE = StateBytes(2, 4, 4, 16)


@dataclass(frozen=True)
class Framework:
    """What a training stack decides about one step (the module docstring says how it is used)."""

    name: str  # as given to --framework
    display: str  # as named in messages
    # ---- model state
    state: StateBytes  # weight_dtype float32 (the framework's own layout)
    bf16_state: StateBytes | None = None  # weight_dtype bfloat16, where the framework has that setting
    bf16_grad_reduce: bool = False  # gradients reduced in bf16: the step differentiates the bf16 compute copy
    # (MaxText: the TPU compile's reduce-scatters carry 2 B per parameter), else in the stored gradient dtype
    logit_bytes: int = 6  # per logit: bf16 logits + their fp32 upcast reused by the gradient (Megatron's
    # vocab-parallel cross-entropy); 4 where the loss is fused (XLA; flash-attn's xentropy in llm-foundry)
    # ---- how the step is compiled and allocated (XLA: MaxText)
    compiled_step: bool = False  # compiled ahead of time against the HBM: the fit check reads the fit floor
    bf16_weight_copy: bool = False  # fp32 weights cast to bf16 once per step and the copy kept
    accum_carry: bool = False  # gradient accumulation as a scan carrying an fp32 accumulator and a parameter copy
    scanned_layers: bool = False  # Job.scan_layers applies: the layers run under one scan with loop buffers
    # ---- remat semantics
    jax_remat: bool = False  # a JAX remat policy: once anything is recomputed, the norm outputs (and so the
    # sequence-parallel re-gather), MLA's down-projections and the routed tokens are too; an MLP output kept on
    # device is dropped (nothing needs it); else PyTorch checkpointing: what the policy names
    reruns_mlp_out: bool = False  # full recompute reruns the MLP output matmul and its tp all-reduce (Megatron)
    block_recompute: bool = False  # full recompute of only the first N layers per chunk (Megatron-Core's
    # --recompute-method block --recompute-num-layers N: megatron/core/recompute.py checkpointed_forward)
    layer_cpu_offload: bool = False  # the saved activations of N whole layers on host (Megatron-Core's
    # --cpu-offloading-num-layers: TransformerBlock's Transformer Engine cpu offload context)
    # ---- fp8 (Transformer Engine; te_weight_bytes)
    fp8_weight_cache: bool = False  # under fp8 compute each GEMM weight's fp8 copies (rowwise and columnwise) stay
    # cached across micro-batches and steps: Megatron-Core passes TE is_first_microbatch (TELinear.forward), TE
    # keeps the copy in _fp8_workspaces (transformer_engine/pytorch/module/linear.py Linear.forward, base.py
    # quantize_weight)
    fp8_param_gather: bool = False  # GEMM weights can be stored as fp8 (--fp8-param-gather: Plan.fp8_param_gather)
    # ---- gradient dtype
    grad_reduce_in_bf16: bool = False  # the main gradients can be kept and reduced in bf16 (--grad-reduce-in-bf16:
    # Plan.grad_reduce_in_bf16; bf16_grad_layout)
    # ---- mixture of experts
    dropless_worst_case: bool = False  # dropless routing sizes expert buffers for the worst case under ep
    dispatch_sp_shards: bool = True  # the all-to-all sends the sequence-parallel shards (1/tp of the tokens)
    ep_overlap: bool = False  # runs the expert all-to-all of one micro-batch behind another's compute
    # (Megatron-Core's --overlap-moe-expert-parallel-comm: combined_1f1b.py; pp > 1 only with virtual stages)
    # ---- weight sharding
    weight_shard_axes: tuple[str, ...] = ("fsdp",)  # axes that shard the weights like FSDP (dp too under ZeRO-3;
    # ep never shards the experts, which it splits by expert)
    flat_weight_collectives: bool = False  # ZeRO-3 gathers as flat collectives over the data group
    sharded_embedding_lookup: bool = False  # the lookup runs on the d-sharded table: rows all-to-all'd
    # ---- pipeline
    pipeline: str = ONE_F_ONE_B  # SPMD: every stage runs one program of M * vpp + pp - 1 iterations, embedding
    # and logits outside it; 1F1B: each stage its own schedule, the tables on the end stages
    uneven_pp: bool = False  # the layers may split unevenly over the stages (costmodel.plan.pipeline_split)
    interleaved_pp: bool = True  # virtual stages (vpp > 1)
    microbatches_per_stage: bool = False  # the pipeline's micro-batch count must be a multiple of pp
    # ---- plans it can run
    zero_with_fsdp: bool = True  # optimizer state sharded over dp (ZeRO-1/2) together with fsdp > 1
    vocab_tiling: bool = False  # logits and loss in token chunks (vocab_tiles > 1)
    cp_chunks: int = 1  # seq_len must divide into cp_chunks * cp chunks (load-balanced causal cp: 2)
    optimizer_offload_needs_zero: bool = False  # optimizer CPU offload only with the distributed optimizer
    # with optimizer offload the Adam update runs on the host CPU (Megatron-Core's HybridDeviceOptimizer,
    # megatron/core/optimizer/cpu_offloading; DeepSpeed ZeRO-Offload's CPUAdam; FSDP CPUOffload steps CPU params)
    cpu_optimizer_step: bool = False
    megatron_core: bool = False  # runs Megatron-Core: `suggest` searches only its plan space (no fsdp axis, ZeRO 0/1,
    # remat none/selective/full, parameters on the GPU: planner.export_megatron.megatron_constraints)
    # ---- data-parallel synchronisation
    param_gather: str = WITH_GRADS  # the distributed optimizer's parameter all-gather (WITH_GRADS, ...: above)

    def state_bytes(self, weight_dtype: str, bf16_grads: bool = False) -> StateBytes:
        """The state layout for the job's weight_dtype; with bf16_grads (Plan.grad_reduce_in_bf16, checked by
        costmodel.constraints.check_grad_bf16) its main gradients in bf16 (bf16_grad_layout)."""
        if weight_dtype == "bfloat16":
            if self.bf16_state is None:
                raise InputError(f"weight_dtype bfloat16 is a {'/'.join(bf16_names())} setting; framework "
                                 f"{self.name!r} has its own state layout (expected --framework {bf16_names()[0]})")
            return self.bf16_state
        return bf16_grad_layout(self.state) if bf16_grads else self.state

    def spmd_pipeline(self, pp: int) -> bool:
        """A pipeline whose stages all run the same program (SPMD) is in use."""
        return pp > 1 and self.pipeline == SPMD


MAXTEXT = Framework(
    # JAX/XLA (maxtext/layers/pipeline.py, configs/base.yml logical_axis_rules: `embed` lists context and expert)
    "maxtext", "MaxText", FP32_STATE, bf16_state=BF16_STATE, bf16_grad_reduce=True, logit_bytes=4,
    compiled_step=True, bf16_weight_copy=True, accum_carry=True, scanned_layers=True, jax_remat=True,
    dropless_worst_case=True, dispatch_sp_shards=False, weight_shard_axes=("fsdp", "cp", "ep"),
    sharded_embedding_lookup=True, pipeline=SPMD, microbatches_per_stage=True, zero_with_fsdp=False,
    vocab_tiling=True)
MEGATRON = Framework(
    # Megatron-LM: distributed optimizer (ZeRO-1), --decoder-first/last-pipeline-num-layers, load-balanced cp
    "megatron", "Megatron", MIXED_STATE, reruns_mlp_out=True, uneven_pp=True, cp_chunks=2,
    optimizer_offload_needs_zero=True, megatron_core=True, ep_overlap=True, cpu_optimizer_step=True,
    block_recompute=True, layer_cpu_offload=True, fp8_weight_cache=True, fp8_param_gather=True,
    grad_reduce_in_bf16=True)
PYTORCH_FSDP = Framework(
    # llm-foundry: fp32 sharded weights (amp_bf16 compute), fused_crossentropy loss
    "pytorch-fsdp", "PyTorch FSDP", FP32_STATE, logit_bytes=4, cpu_optimizer_step=True)
DEEPSPEED = Framework(
    # Megatron's state layout; ZeRO-3 gathers flat over the data group (one NIC per rank, as DeepSpeed 2021 did);
    # PipelineModule partitions by parameters (uneven), TrainSchedule is plain 1F1B (no interleaving)
    "deepspeed", "DeepSpeed", MIXED_STATE, flat_weight_collectives=True, uneven_pp=True, interleaved_pp=False,
    cpu_optimizer_step=True)

# NeMo's distributed_fused_adam as its configs set it (overlap_grad_sync and overlap_param_sync True: NeMo launcher,
# Nemotron and MLPerf configs, e.g. mlcommons/training_results_v4.0 NVIDIA gpt3 nemo conf/optim/
# distributed_fused_adam.yaml): the bf16 parameters (megatron_base_model.py: param_sync_dtype = the model dtype)
# all-gathered behind the next step's forward. Gradients stay fp32 on the wire (NeMo sets no grad_sync_dtype: the
# optimizer's fp32 dtype); MLPerf's bf16 (grad_sync_dtype bf16, grad_reduce_in_fp32=False) is a per-run setting:
# Plan.grad_reduce_in_bf16, the runs column grad_reduce_in_bf16 (docs/grad_reduce_bf16.md). Else Megatron's.
NEMO = replace(MEGATRON, name="nemo", display="NeMo", param_gather=NEXT_FORWARD)
# AFTER_STEP (nanotron's ZeRO-1, optim/zero.py: a blocking all_gather_coalesced after the step) is costed but no
# record uses it: it did not improve the out-of-source figure (docs/h100_residuals.md, 'Implemented').

# Transformer Engine's fp8 weights (docs/fp8_params.md). A Float8Tensor holds 1 B per element (_data). A GEMM weight
# needs it rowwise for the forward and columnwise for the backward's dgrad: on Hopper (no non-TN fp8 GEMM:
# transformer_engine/pytorch/utils.py is_non_tn_fp8_gemm_supported is False below sm 10.0) the columnwise copy is
# a separate transpose (float8_tensor_storage.py Float8TensorStorage.update_usage -> _create_transpose, kept as
# _transpose); under MXFP8 (Blackwell) separate columnwise data (+1/32 B of scales each, not counted). Per-tensor
# scaling on Blackwell reuses _data (1 copy): not modelled, the profiles carry no GPU generation.
FP8_COPIES = 2  # bytes per GEMM weight element of its fp8 copies (rowwise + columnwise, 1 B each)


def te_weight_bytes(fw: Framework, precision: str, fp8_params: bool, stored: int) -> int:
    """Device bytes per Transformer Engine GEMM weight element (stored: the layout's weight bytes, StateBytes)."""
    if precision != "fp8" or not fw.fp8_weight_cache:
        return stored
    if fp8_params:
        # --fp8-param-gather: the weight is the Float8Tensor (1 B, a uint8 buffer: Megatron-Core param_and_grad_buffer
        # group_params_for_buffers), its transpose kept beside it (fp8_utils.quantize_param_shard:
        # manual_post_all_gather_processing keeps the columnwise data); no bf16 copy
        return FP8_COPIES
    # bf16 weight plus the cached fp8 workspace (linear.py: cache_name 'weight' whenever is_first_microbatch is
    # not None; Megatron-Core sets it unless --disable-parameter-transpose-cache)
    return stored + FP8_COPIES


# bf16 main gradients (Plan.grad_reduce_in_bf16; docs/grad_reduce_bf16.md). Megatron-Core sizes the gradient
# buffer by grad_reduce_in_fp32 (distributed/param_and_grad_buffer.py group_params_for_buffers: grad_dtype =
# torch.float if grad_reduce_in_fp32 else param.dtype, i.e. bf16) and reduces that buffer as it is (2 B per element
# on the wire); Apex's distributed_fused_adam (NeMo 1) allocates its contiguous grad buffer in grad_sync_dtype
# (_init_grad_buffer). The fp32 master weights and moments stay in the optimizer. The distributed optimizer makes
# an fp32 copy of its gradient shard at each step (distrib_optimizer.py _copy_model_grads_to_main_grads:
# shard_main_param.grad = shard_model_grad.float()), freed by zero_grad before the next forward: it adds HBM
# traffic to the update, not to the backward's peak (not counted: the activations are gone by then).
BF16_GRAD = 2  # bytes per bf16 gradient element


def bf16_grad_layout(layout: StateBytes) -> StateBytes:
    """The state layout with bf16 main gradients: 2 B stored per gradient, and the update reads the bf16 shard
    (2 B) and writes its fp32 copy (layout.grads B) before the fused Adam reads that copy as before."""
    return layout._replace(grads=BF16_GRAD, adam_update=layout.adam_update + BF16_GRAD + layout.grads)


REGISTRY: dict[str, Framework] = {f.name: f for f in (MAXTEXT, MEGATRON, PYTORCH_FSDP, DEEPSPEED, NEMO)}


def bf16_names() -> list[str]:
    """The frameworks with a bfloat16 weight_dtype setting."""
    return [f.name for f in REGISTRY.values() if f.bf16_state is not None]


def framework(name: str) -> Framework:
    """The record of a framework by name; InputError naming the known ones otherwise."""
    if name not in REGISTRY:
        raise InputError(f"framework must be one of {', '.join(REGISTRY)}, got {name!r}")
    return REGISTRY[name]
