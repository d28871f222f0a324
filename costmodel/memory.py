"""Memory per chip: model state under the plan's sharding, activations under the remat choices, buffers.

Model state follows the job's framework (costmodel.framework: Framework.state, bytes per parameter; Cost.convention
says which layout a number uses). Activations per layer and token are counted per saved tensor (bf16), which for
the 'none' policy and GPT shapes reproduces Korthikanti et al. 2022's 34*s*b*h bytes per layer (without the
5*a*s/h attention term, which flash attention does not store). The compiled steps the XLA (MaxText) terms were
read off, and how close they come: docs/memory.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from costmodel.framework import SPMD, Framework, StateBytes, te_weight_bytes
from costmodel.job import Job
from costmodel.model import ModelSpec
from costmodel.plan import (
    REMAT_POLICIES,
    TENSORS,
    Plan,
    busiest_stage_layers,
    chunk_layer_counts,
    plan_split,
    recomputed_share,
    stage_layer_counts,
)
from hardware.chip import Chip

BF16 = 2


def state_convention(job: Job, plan: Plan | None = None) -> StateBytes:
    """(weight, gradient, optimizer bytes per parameter, Adam update HBM bytes per parameter) for the job: its
    framework's layout for its weight_dtype (costmodel.framework), with bf16 main gradients where the plan sets
    them (Plan.grad_reduce_in_bf16)."""
    return job.fw.state_bytes(job.weight_dtype, plan is not None and plan.grad_reduce_in_bf16)


def routed_buffer_factor(m: ModelSpec, job: Job, plan: Plan) -> float:
    """How many times the balanced routed rows a chip's expert buffers hold. MaxText's dropless MoE under expert
    parallelism (ragged_buffer_factor -1, the default) sizes the ragged all-to-all's receive buffer, and so the
    experts' inputs and outputs, for the worst case: min(ep, experts / top_k) times the balanced rows
    (maxtext/layers/moe.py, get_ragged_buffer_size; seen as bf16[32768, 14336] operands on Mixtral, 4096 tokens
    per chip, top-2, ep 4)."""
    if job.fw.dropless_worst_case and plan.ep > 1 and m.is_moe and m.capacity_factor == 0:
        return min(plan.ep, m.n_experts / m.experts_per_token)
    return 1.0


def mlp_act_elems(m: ModelSpec, plan: Plan, moe: bool, buffer: float = 1.0) -> float:
    """Elements per token on one chip of a layer's MLP activation output: ffn wide, split over tp; in a MoE layer
    one row per routed copy (k, times the routed_buffer_factor) and per shared expert."""
    if not moe:
        return m.ffn_dim / plan.tp
    return m.moe_ffn_dim * (m.experts_per_token * buffer + m.n_shared_experts) / plan.tp


def tensor_elems_per_token(m: ModelSpec, plan: Plan, moe: bool, buffer: float = 1.0) -> dict[str, float]:
    """Elements per token on one chip of each remat tensor of a layer (MoE: tokens routed to k experts; buffer:
    routed_buffer_factor)."""
    sp = plan.tp if plan.sequence_parallel else 1
    return {
        "layer_input": m.d_model / sp,
        # query, key and value heads (MLA: values v_head_dim wide, MaxText's query_proj / key_proj / value_proj)
        "qkv_proj": (m.q_dim + m.kv_dim + m.n_kv_heads * (m.v_head_dim if m.is_mla else m.head_dim)) / plan.tp,
        "context": m.attn_out_dim / plan.tp,
        "out_proj": m.d_model / sp,
        "mlp_in": (2 if m.gated_mlp else 1) * mlp_act_elems(m, plan, moe, buffer),
        "mlp_out": m.d_model / sp,
    }


def extra_saved_elems_per_token(m: ModelSpec, plan: Plan, moe: bool, buffer: float = 1.0) -> float:
    """Tensors kept only when nothing is recomputed: two norm outputs and the MLP activation output; in a MoE
    layer also the dispatched copies of the tokens (the experts' input, for their weight gradients) and the
    experts' outputs before the weighted combine (for the gate gradient): k x capacity rows of d each, not split
    over tp (the routed tokens are replicated over tp); buffer: routed_buffer_factor. Shared experts have neither:
    they read the norm output and their output is added ungated (their MLP intermediates are in mlp_act_elems;
    docs/memory.md, "Shared experts")."""
    sp = plan.tp if plan.sequence_parallel else 1
    routed = 2 * m.experts_per_token * (m.effective_capacity_factor + buffer - 1) * m.d_model if moe else 0.0
    return 2 * m.d_model / sp + mlp_act_elems(m, plan, moe, buffer) + routed + m.mla_latent_elems()


def xla_loop_extra_bytes(stack_bytes: float, layer_grad_bytes: float, only_layer_input: bool, tp: int) -> float:
    """Bytes XLA:TPU keeps beside the scanned layer checkpoints of MaxText's step (stack_bytes: the checkpoints
    of all layers; layer_grad_bytes: the fp32 gradients of all layers' weights on this chip).

    The backward layer loop needs one more buffer beside its inputs and outputs: with only the layer input saved
    (full remat) a second copy of the checkpoint stack; with more tensors saved, the smaller of the checkpoint
    stack and the fp32 weight-gradient stack (XLA copies whichever is cheaper); with tensor parallelism one more
    such buffer, again the smaller of the two (counted always). Read off MaxText's compiled steps by sweeping the
    layer count (docs/memory.md, "The scanned layer loop"). The fit check reads fit_floor_bytes, which keeps only
    the tp buffer (xla_loop_tp_bytes)."""
    extra = stack_bytes if only_layer_input else min(stack_bytes, layer_grad_bytes)
    return extra + xla_loop_tp_bytes(stack_bytes, layer_grad_bytes, tp)


def xla_loop_tp_bytes(stack_bytes: float, layer_grad_bytes: float, tp: int) -> float:
    """The tensor-parallel share of xla_loop_extra_bytes: the one loop buffer that XLA's own peak
    (peak_memory_in_bytes) holds on some tp compiles (tp 4 and tp 2 with 4 sequences per replica), so the fit
    floor keeps it (fit_floor_bytes)."""
    return min(stack_bytes, layer_grad_bytes) if tp > 1 else 0.0


def maxtext_stage_buffers(stage_params: float, stage_grad_elems: float, weight_shards: int, dp_reduced: bool,
                          vpp: int = 1) -> float:
    """Bytes MaxText's pipeline keeps live beside the usual terms (stage_params: the stage's layer weights on this
    chip before weight sharding; stage_grad_elems: their gradient elements this chip stores).

    MaxText runs a stage's layers unscanned in every pipeline iteration and differentiates the iteration loop as
    a whole: the whole stage's bf16 gradients stay live through the loop; under weight sharding the gathered
    bf16 weights of one iteration's chunk (L / (pp * vpp) layers); and when the gradient is reduced over dp, an
    unreduced fp32 accumulator beside the reduced gradient. Read off its compiled step (docs/memory.md,
    "Pipeline parallelism")."""
    out = BF16 * stage_params  # bf16 gradients of the whole stage
    if weight_shards > 1:
        out += BF16 * stage_params / vpp  # gathered bf16 weights of one iteration's chunk of layers
    if dp_reduced:
        out += 4.0 * stage_grad_elems  # fp32 accumulator of the unreduced dp gradient
    return out


@dataclass(frozen=True)
class MemoryTerms:
    convention: str
    param_bytes: int
    grad_reduce_bytes: int  # bytes per gradient element on the wire (reduce-scatter / all-reduce)
    grad_bytes: int  # bytes per stored gradient element
    adam_bytes_per_param: int
    param_elems: float  # parameters stored on this chip (after all weight sharding)
    optimizer_param_elems: float  # parameters whose optimizer state this chip holds and updates
    grad_elems_for_reduce: float  # gradient elements this chip contributes to the dp reduction (before ZeRO-2 split)
    layer_weight_elems: float  # one layer's weights on this chip before fsdp sharding (the gathered size)
    layer_expert_elems: float  # the routed experts' share of layer_weight_elems (sharded over fsdp, not ep)
    loop_grad_bytes: float  # fp32 layer gradients on this chip when MaxText's scanned layer loop applies, else 0
    # (the gradient stack of xla_loop_extra_bytes; the `loop_buffers` breakdown entry is that function's value)
    non_expert_param_elems: float  # parameters on this chip outside the routed experts (replicated over ep
    # unless the framework shards them over it: weight_shard_degrees)
    offload_bytes_per_layer: float  # activations moved to host per layer per micro-step
    peak_bytes: float
    host_bytes: float
    fit_bytes: float  # what the fit check reads: fit_floor_bytes when XLA compiles the step, else peak_bytes
    breakdown: dict[str, float] = field(default_factory=dict)
    cpu_offload_layer_bytes: float = 0.0  # saved activations of one layer Megatron-Core's layer CPU offload moves to
    # host per micro-step (0: off; Plan.cpu_offload_layers)


def head_table_bytes(logit_elems: float, table_elems: float, gathered: bool) -> float:
    """Bytes the loss phase holds beside the bf16 logits and their gradient when the output table is sharded over
    fsdp (gathered: True): the table gathered in bf16, and its unreduced bf16 gradient, where that is larger than
    the logits it outlives (at the softmax XLA holds table + logits + their gradient; in the head's backward
    table + the logits' gradient + the table's gradient). Read off Gemma 3 12B's buffer assignment: two
    bf16[262144, 3840] beside bf16[4096, 262144] logits (benchmarks/validate_tpu.py, "Sliding windows")."""
    if not gathered:
        return 0.0
    return BF16 * table_elems + BF16 * max(0.0, table_elems - logit_elems)


def fit_floor_bytes(breakdown: dict[str, float], loop_tp: float = 0.0, head: float = 0.0) -> float:
    """The HBM a step compiled by XLA needs to fit: model state, the saved checkpoints, the scanned loop's
    tensor-parallel buffer (loop_tp, xla_loop_tp_bytes; counted beside both phases, the safe side), and the
    larger of the loss phase (the logits and their gradient; head: under FSDP the gathered output table and its
    gradient, head_table_bytes) and the layer loops' phase (one layer's working set with its gathered weights and
    unreduced gradients); not the layer loop's copy of the checkpoint stack.

    `peak_bytes` is the total XLA's memory_analysis() reports (argument + output - alias + temp, what MaxText
    prints). XLA's capacity check is on its buffer assignment's peak (peak_memory_in_bytes) instead: the logits
    die before the backward layer loop starts, so the two phases never overlap, and the loop's copy of the
    checkpoint (or gradient) stack is not in the peak. How this floor sorts the compiles XLA accepted from those
    it refused, and the near-limit case behind Cost.near_limit: docs/memory.md, "The fit floor"."""
    b = breakdown
    state = b["weights"] + b["gradients"] + b["optimizer"]
    loop_phase = b["activation_working"] + b["collective_buffers"]
    return state + b["activations"] + loop_tp + max(b["logits"] + head, loop_phase)


def pipeline_inflight(job: Job, plan: Plan, accum: int, n_layers: int = 0) -> float:
    """Micro-batches' worth of checkpoints a pipeline stage keeps per layer of the busiest stage (1 without pp).
    n_layers: the model's, for an uneven split (costmodel.plan.pipeline_split). The expert all-to-all overlap
    (Plan.overlap_moe_expert_parallel_comm) keeps one more forward pass in flight (docs/ep_overlap.md)."""
    # Megatron-Core's combined 1F1B runs one micro-batch's forward beside another's backward: without a pipeline
    # the next forward starts before the last backward (combined_1f1b.py, combined_1f1b_schedule_for_no_pipelining:
    # 2 of M micro-batches at once); interleaved, one more warmup chunk pass (schedules.py get_pp_rank_microbatches:
    # num_warmup_microbatches += 1 under overlap_moe_expert_parallel_comm)
    extra = 1 if plan.overlap_moe_expert_parallel_comm else 0
    if job.fw.spmd_pipeline(plan.pp):
        # one scan over M * vpp + pp - 1 iterations of L / (pp * vpp) layers, differentiated as a whole: every
        # iteration's checkpoints are kept (the bubble's too)
        return accum + (plan.pp - 1) / plan.vpp
    if plan.pp > 1 and plan.vpp == 1 and n_layers % plan.pp:
        # 1F1B over an uneven split: stage s keeps min(M, pp - s) micro-batches of its own layers; the most of them
        # (Llama 3 405B over 16 stages: the second stage's 8 x 15, not 8 x 16), per layer of the busiest stage
        counts = stage_layer_counts(n_layers, plan.pp, 1, *plan.split_accounting)
        return max(n * min(accum, plan.pp - s + extra) for s, n in enumerate(counts)) / max(counts)
    if plan.pp > 1 and plan.vpp > 1 and any(plan.split_accounting):
        return interleaved_inflight_layers(n_layers, plan, accum) / busiest_stage_layers(n_layers, plan)
    if plan.pp > 1 and plan.vpp > 1:
        # interleaved 1F1B: the first rank runs 2 (pp - 1) + (vpp - 1) pp warm-up chunk passes and one more, at
        # most all M * vpp of them (Megatron-LM schedules.py, forward_backward_pipelining_with_interleaving:
        # num_warmup_microbatches capped at total_num_microbatches); a chunk holds 1 / vpp of the stage's layers
        return min(accum * plan.vpp, plan.pp * plan.vpp + plan.pp - 1 + extra) / plan.vpp
    if plan.pp > 1:  # 1F1B: min(M, pp) in flight (with the overlap, one more: export_megatron drops it at vpp 1)
        return min(accum, plan.pp + extra)
    return float(min(accum, 1 + extra))


def interleaved_inflight_layers(n_layers: int, plan: Plan, accum: int) -> int:
    """Layers' worth of checkpoints the most loaded rank keeps under Megatron's interleaved 1F1B when the chunks
    differ (the split flags: the first chunk of rank 0 and the last of the last rank hold one layer fewer): rank r
    runs 2 (pp - 1 - r) + (vpp - 1) pp warm-up chunk passes and one more, at most M * vpp, taken in the order of
    Megatron-LM schedules.py get_schedule_table (groups of pp micro-batches, each through chunks 0..vpp-1)."""
    chunks = chunk_layer_counts(n_layers, plan)
    extra = 1 if plan.overlap_moe_expert_parallel_comm else 0  # one more warmup pass (pipeline_inflight)
    order = []  # chunk of each forward pass, in schedule order
    for start in range(0, accum, plan.pp):
        group = accum - start if start + plan.pp >= accum else plan.pp
        order += [c for c in range(plan.vpp) for _ in range(group)]
    return max(sum(chunks[r][c] for c in order[:2 * (plan.pp - 1 - r) + (plan.vpp - 1) * plan.pp + 1 + extra])
               for r in range(plan.pp))


def weight_shard_degrees(job: Job, plan: Plan, experts: bool = False) -> dict[str, int]:
    """Axes that shard (and so gather) the weights: fsdp always, dp under ZeRO-3, and under MaxText the context
    and expert axes too (its `embed` sharding rule, configs/base.yml logical_axis_rules, lists `context` and
    `expert`: both shard weights like FSDP). experts=True: the routed experts' weights, which MaxText splits
    over the expert axis by expert (`exp`), so that axis does not shard them again (Megatron replicates the
    non-expert weights over ep)."""
    out = {"fsdp": plan.fsdp}
    axes = job.fw.weight_shard_axes
    if "cp" in axes and plan.cp > 1:
        out["cp"] = plan.cp
    if "ep" in axes and plan.ep > 1 and not experts:
        out["ep"] = plan.ep
    if plan.zero == 3:
        out["dp"] = plan.dp
    return out


def layer_stages(m: ModelSpec, plan: Plan) -> float:
    """pp when the layers split evenly over the stages; else n_layers / (the busiest stage's layers)
    (costmodel.plan.pipeline_split, Megatron's uneven split), so that per-stage quantities counted as totals / this
    are the busiest stage's in the model's average mix of layer kinds (busiest_kinds gives the exact mix of a MoE
    model with leading dense layers)."""
    return m.n_layers / busiest_stage_layers(m.n_layers, plan)


def stage_kinds(m: ModelSpec, plan: Plan) -> list[tuple[float, float, bool]]:
    """(dense-MLP layers, MoE layers, holds the logits) of each pipeline stage, first to last (one entry without
    pp). A MoE model's leading dense layers (n_dense_layers) sit on the first stages, as Megatron and MaxText place
    them, so a middle stage of DeepSeek-V3 (3 dense + 58 MoE layers) over 16 stages holds 4 MoE layers, not the
    average 3.8; with virtual stages (chunks dealt round the ring) and for models with one kind of layer every
    stage has the model's average mix."""
    counts = stage_layer_counts(m.n_layers, plan.pp, plan.vpp, *plan.split_accounting)
    mixed = m.n_dense_mlp_layers > 0 and m.n_moe_layers > 0 and plan.vpp == 1
    out, start = [], 0
    for i, n in enumerate(counts):
        if mixed:
            dense = max(0, min(start + n, m.n_dense_mlp_layers) - start)
            out.append((float(dense), float(n - dense), i == len(counts) - 1))
        else:
            stages = m.n_layers / n
            out.append((m.n_dense_mlp_layers / stages, m.n_moe_layers / stages, i == len(counts) - 1))
        start += n
    return out


def busiest_kinds(m: ModelSpec, plan: Plan, stages: list | None = None) -> tuple[float, float] | None:
    """(dense, MoE) layers of the stage whose memory the cost model counts: the most weights on a chip (a MoE
    layer's experts outweigh several dense layers), then the most layers; None when every stage has the average
    mix (then totals / layer_stages give the same counts). stages: stage_kinds when the caller has them."""
    if not (m.n_dense_mlp_layers > 0 and m.n_moe_layers > 0 and plan.vpp == 1 and plan.pp > 1):
        return None
    common = m.attn_params() + m.layer_norm_params()
    dense_w = common + m.dense_mlp_params()
    moe_w = common + m.d_model * m.n_experts + (m.n_experts / plan.ep + m.n_shared_experts) * m.expert_params()
    dense, moe, _ = max(stages or stage_kinds(m, plan), key=lambda k: (k[0] * dense_w + k[1] * moe_w, k[0] + k[1]))
    return dense, moe


def expert_params_per_chip(m: ModelSpec, plan: Plan, s: StepShape | None = None) -> float:
    """Routed-expert weights on this chip before fsdp sharding (sharded over ep, tp and pp); s: the step's shape
    when the caller has it."""
    if not m.is_moe:
        return 0.0
    kinds = busiest_kinds(m, plan) if s is None else s.kinds
    if kinds is not None:
        return kinds[1] * m.n_experts / plan.ep * m.expert_params() / plan.tp
    stages = layer_stages(m, plan) if s is None else s.layer_stages
    return m.n_moe_layers * m.n_experts / plan.ep * m.expert_params() / (stages * plan.tp)


def param_counts_per_chip(m: ModelSpec, plan: Plan, tables_every_stage: bool = False,
                          s: StepShape | None = None) -> tuple[float, float, float]:
    """(stage weights on this chip before fsdp sharding, one average layer of them, embedding share);
    tables_every_stage: an SPMD pipeline (Framework.pipeline) keeps both embedding tables on every stage; s: the
    step's shape when the caller has it."""
    tp, pp, ep = plan.tp, layer_stages(m, plan) if s is None else s.layer_stages, plan.ep
    kinds = busiest_kinds(m, plan) if s is None else s.kinds
    layers, dense, moe = ((m.n_layers, m.n_dense_mlp_layers, m.n_moe_layers) if kinds is None
                          else (kinds[0] + kinds[1], *kinds))  # the whole model, or the busiest stage's layers
    rep = m.attn_tp_replicated_params()  # MLA's down-projections: not split over tp
    non_expert = layers * (m.attn_params() - rep + m.layer_norm_params()) + dense * m.dense_mlp_params()
    expert = 0.0
    if m.is_moe:
        non_expert += moe * m.d_model * m.n_experts  # routers, replicated over ep
        expert = moe * (m.n_experts / ep + m.n_shared_experts) * m.expert_params()
    body = (non_expert + expert + layers * rep * tp) / ((pp if kinds is None else 1) * tp)
    # Embedding (vocab-sharded by tp): both tables on one stage without pipelining; with it, one per end stage
    # (Megatron), or both on every stage (MaxText embeds and computes the logits outside its pipeline module;
    # the tables' `vocab`/`embed` sharding rules do not name the `stage` axis).
    emb = (m.embedding_params() if plan.pp == 1 or tables_every_stage else m.vocab_size * m.d_model) / tp
    layer = body / (m.n_layers / pp if kinds is None else layers)
    if plan.pp > 1 and not tables_every_stage:
        # Megatron: each end stage holds its table beside its own layers, so the stage with the most weights holds
        # max(the busiest stage's layers, an end stage's layers and its table); beyond the busiest stage's layers
        # (body) that is what emb counts. An end stage with fewer layers (Megatron's uneven split 1 / 2 / 1, or
        # the account-for-embedding/loss flags: one layer fewer) makes room for part of its table.
        split = plan_split(m.n_layers, plan)
        emb = max(0.0, max(split[0], split[2]) * layer + emb - max(split) * layer)
    return body, layer, emb


def busiest_stage_activations(job: Job, plan: Plan, act_saved: float, inflight: float, logits: float,
                              accum: int) -> tuple[float, float]:
    """(saved activations, logits) on the busiest pipeline stage: without pp the chip's own; under MaxText's
    pipeline every stage runs the same program, with the logits' batch split over the stages too
    (activation_embed_and_logits_batch: data, stage, fsdp: M / pp micro-batches of logits per chip); under 1F1B
    the first stage (the most micro-batches in flight) or the last (one in flight, and the logits)."""
    if job.fw.spmd_pipeline(plan.pp):
        return act_saved, logits * accum / plan.pp
    if plan.pp == 1:
        return act_saved, logits
    first, last = act_saved, act_saved / inflight + logits  # whichever stage holds more is the peak
    return (act_saved, 0.0) if first >= last else (act_saved / inflight, logits)


def layer_activation_bytes(m: ModelSpec, job: Job, plan: Plan, tokens: float, kinds: tuple[float, float] | None,
                           layers_stage: float) -> tuple[float, float, float]:
    """Per layer of the busiest stage, averaged over its dense and MoE layers: (bytes the remat policy keeps on
    the device, bytes it offloads to the host), and the largest working set of one layer's backward (its
    intermediates, recomputed if needed, while their gradients flow)."""
    choices = plan.remat.choices()
    saved = offl = working = 0.0
    for moe, count in ((False, m.n_dense_mlp_layers), (True, m.n_moe_layers)):
        if count == 0 or (kinds is not None and kinds[moe] == 0):
            continue
        frac = count / m.n_layers if kinds is None else kinds[moe] / layers_stage  # of the stage's layers
        buf = routed_buffer_factor(m, job, plan) if moe else 1.0
        el = tensor_elems_per_token(m, plan, moe, buf)
        extra = extra_saved_elems_per_token(m, plan, moe, buf)
        dev = sum(el[t] for t in TENSORS if choices[t] == "device")
        if job.fw.jax_remat and plan.remat.count("remat") > 0 and choices["mlp_out"] == "device":
            # The MLP output matmul's result is not needed by the backward pass (the residual add's gradient
            # takes no values), so XLA drops the checkpoint (not in the TPU compiler's buffer assignment).
            dev -= el["mlp_out"]
        if plan.remat.count("remat") == 0:
            # Nothing recomputed: the norm outputs and MLP activation are kept too, and the MLP output is the
            # next layer's input (already counted there), as in Korthikanti et al.'s per-layer sum.
            dev += extra - (el["mlp_out"] if choices["mlp_out"] == "device" else 0.0)
        saved += frac * dev * tokens * BF16
        offl += frac * sum(el[t] for t in TENSORS if choices[t] == "offload") * tokens * BF16
        # MaxText's ragged (dropless, ep) experts run as grouped matmuls whose backward holds the gradients of the
        # experts' intermediates (the two input projections and the activation) beside them, at the buffer's
        # worst-case size: five bf16[32768, 14336] operands in the Mixtral ep 4 buffer assignment (docs/memory.md,
        # "Expert parallelism"). Not counted for capacity-based routing (buffer 1).
        grouped = el["mlp_in"] + mlp_act_elems(m, plan, moe, buf) if buf > 1 else 0.0
        scores = score_elems_per_token(m, job, plan)
        if plan.remat.count("remat") == 0:
            saved += frac * scores * tokens * BF16  # the probabilities P, which the backward reads
        # the attention backward holds P, dP and dS at once (FlashAttention's Algorithm 3, step 3)
        working = max(working, (sum(el.values()) + extra + grouped + 3 * scores) * tokens * BF16)
    return saved, offl, working


def score_elems_per_token(m: ModelSpec, job: Job, plan: Plan) -> float:
    """bf16 elements per token on one chip of one s x s score tensor of dot-product attention (Job.attention):
    a row of seq_len keys per head; 0 under flash attention, which keeps its blocks on chip."""
    return 0.0 if job.attention == "flash" else m.n_heads / plan.tp * job.seq_len


@dataclass(frozen=True)
class StepShape:
    """What the terms of one step are counted over, computed once (step_shape): the framework's record, the
    micro-steps, one micro-batch's tokens per chip, the sequence-parallel degree, each pipeline stage's (dense,
    MoE, holds the logits) layers (stage_kinds) and the busiest stage's mix (busiest_kinds; None: every stage has
    the average mix), layer_stages, the busiest stage's layers, the layer passes per stage (layer_passes), the
    stages sharing the logits (head_stages), the weight-sharded axes (weight_shard_degrees) and the micro-batches
    a stage keeps in flight (pipeline_inflight)."""

    fw: Framework
    micro_steps: int
    tokens: float
    sp: int
    stage_kinds: tuple[tuple[float, float, bool], ...]
    kinds: tuple[float, float] | None
    layer_stages: float
    layers: float
    layer_steps: float
    head_stages: int
    wdegrees: dict[str, int]
    inflight: float


def layer_passes(job: Job, plan: Plan, accum: int) -> float:
    """Layer passes per stage in a step, in micro-batches: MaxText's pipeline iterations run every stage through
    the bubble too (M * vpp + pp - 1 iterations of L / (pp * vpp) layers), each with its layers' collectives."""
    return accum + ((plan.pp - 1) / plan.vpp if job.fw.spmd_pipeline(plan.pp) else 0)


def head_stages(job: Job, plan: Plan) -> int:
    """Stages that share the logits (embedding and loss) of each micro-batch: all of them under MaxText's
    pipeline (the batch is split over `stage` outside it), else the last stage alone."""
    return plan.pp if job.fw.spmd_pipeline(plan.pp) else 1


def step_shape(m: ModelSpec, job: Job, plan: Plan, accum: int = 1) -> StepShape:
    """The StepShape of one step of `plan` with `accum` micro-steps (the per-stage fields do not depend on it)."""
    kinds_all = stage_kinds(m, plan)
    kinds = busiest_kinds(m, plan, kinds_all)
    stages = layer_stages(m, plan)
    return StepShape(
        fw=job.fw, micro_steps=accum, tokens=plan.micro_batch * job.seq_len / plan.cp,
        sp=plan.tp if plan.sequence_parallel else 1, stage_kinds=tuple(kinds_all), kinds=kinds, layer_stages=stages,
        layers=m.n_layers / stages if kinds is None else kinds[0] + kinds[1],  # the busiest stage's
        layer_steps=layer_passes(job, plan, accum), head_stages=head_stages(job, plan),
        wdegrees=weight_shard_degrees(job, plan), inflight=pipeline_inflight(job, plan, accum, m.n_layers))


@dataclass(frozen=True)
class StateTerms:
    """Model state on this chip (state_terms): the layout, the sharding, the parameter counts, and the
    weights, gradients and optimizer entries of the breakdown."""

    layout: StateBytes
    reduce_bytes: int  # per gradient element on the wire
    weight_shards: int
    expert_shards: int
    body: float  # stage weights before weight sharding (param_counts_per_chip)
    layer_w: float  # one average layer of them
    emb: float  # embedding share
    experts: float  # routed-expert weights before weight sharding (expert_params_per_chip)
    params: float  # parameters stored here, after all sharding
    opt_params: float  # parameters whose optimizer state is held here
    grad_params: float  # parameters whose gradient is stored here
    weights: float
    grads: float
    optimizer: float


def state_terms(m: ModelSpec, job: Job, plan: Plan, s: StepShape) -> StateTerms:
    """Weights (with the bf16 working copy), gradients (with MaxText's accumulation carry) and optimizer state on
    this chip, under the framework's layout and the plan's sharding. An offloaded optimizer state leaves the device
    only where the CPU updates it (Framework.cpu_optimizer_step); MaxText's optimizer_memory_host_offload brings it
    back for the update on the device, which saves no device memory (docs/memory.md, 'Optimizer host offload')."""
    fw = s.fw
    layout = state_convention(job, plan)
    w_b, g_b, o_b, _ = layout
    # MaxText differentiates the bf16 compute copy of the weights: XLA reduces that bf16 gradient and converts it
    # to fp32 afterwards (the TPU compile's reduce-scatters carry 2 B per parameter; planner validate --target).
    reduce_b = BF16 if fw.bf16_grad_reduce else g_b
    weight_shards = math.prod(s.wdegrees.values())
    expert_shards = math.prod(weight_shard_degrees(job, plan, experts=True).values())
    body, layer_w, emb = param_counts_per_chip(m, plan, fw.pipeline == SPMD, s)
    experts = expert_params_per_chip(m, plan, s)
    params = (body - experts + emb) / weight_shards + experts / expert_shards
    opt_params = params / (plan.dp if 1 <= plan.zero < 3 else 1)
    grad_params = params / (plan.dp if plan.zero == 2 else 1)
    # under fp8 the layer (GEMM) weights, all but the embedding tables, carry Transformer Engine's fp8 copies
    # (te_weight_bytes; the norms and routers among them, which TE keeps in bf16, are < 0.1 % of a layer)
    gemm_b = te_weight_bytes(fw, job.precision, plan.fp8_param_gather, w_b)
    weights = 0.0 if plan.offload_params else params * w_b + (params - emb / weight_shards) * (gemm_b - w_b)
    # bf16 copy of the weights for compute: streamed in when offloaded; under MaxText's fp32 weight_dtype the
    # step casts the whole (sharded) parameter tree to bf16 once and keeps it (seen in XLA's temp allocation).
    weights_working = params * BF16 if (plan.offload_params or (fw.bf16_weight_copy and w_b > BF16)) else 0.0
    accum_buf = 0.0
    if s.micro_steps > 1 and fw.accum_carry and plan.pp == 1:
        # (with pp the accumulation is the pipeline's micro-batches: gradient_accumulation_steps = 1)
        # MaxText's gradient accumulation (utils/gradient_accumulation.py) runs a lax.scan whose carry holds an
        # fp32 gradient accumulator and a copy of the parameters (bf16 when the optimizer is sharded over data,
        # else weight_dtype): the argument buffers stay live for the update, so the loop carry is a second copy.
        accum_buf = grad_params * 4 + params * (BF16 if plan.zero == 1 else w_b)
    return StateTerms(
        layout=layout, reduce_bytes=reduce_b, weight_shards=weight_shards, expert_shards=expert_shards, body=body,
        layer_w=layer_w, emb=emb, experts=experts, params=params, opt_params=opt_params, grad_params=grad_params,
        weights=weights + weights_working, grads=grad_params * g_b + accum_buf,
        optimizer=0.0 if plan.offload_optimizer and fw.cpu_optimizer_step else opt_params * o_b)


@dataclass(frozen=True)
class ActivationTerms:
    """Activations on this chip (activation_terms): the checkpoints the stage keeps, per layer offloaded bytes,
    one layer's backward working set, and MaxText's scanned-loop buffers."""

    saved: float  # checkpoints of the busiest stage's layers over the micro-batches in flight
    offload_per_layer: float  # bytes offloaded per layer per micro-step
    working: float
    loop_buffers: float  # xla_loop_extra_bytes
    loop_tp: float  # xla_loop_tp_bytes
    layer_grads: float  # the fp32 layer-gradient stack those read (0 without the scanned loop)
    layer_host: float = 0.0  # saved activations of the layers Megatron-Core's layer CPU offload keeps on host


def activation_terms(m: ModelSpec, job: Job, plan: Plan, s: StepShape, st: StateTerms) -> ActivationTerms:
    """Saved activations under the remat choices, the backward's working set and the scanned loop's buffers."""
    # Backward of one layer holds its intermediates (recomputed if needed) while their gradients flow.
    saved, offl, working = layer_activation_bytes(m, job, plan, s.tokens, s.kinds, s.layers)
    share = recomputed_share(plan, s.layers)
    if share < 1.0:
        # Megatron-Core block recompute: the recomputed layers keep their input only (the policy's bytes), the
        # others everything, as under remat none (megatron/core/recompute.py checkpointed_forward)
        kept = layer_activation_bytes(m, job, plan.with_(remat=REMAT_POLICIES["none"]), s.tokens, s.kinds,
                                      s.layers)[0]
        saved = share * saved + (1.0 - share) * kept  # per layer, averaged over the stage's layers
    act_saved = saved * s.layers * s.inflight
    layer_host = 0.0
    if plan.cpu_offload_layers:  # check_cpu_offload_layers: pp 1, remat none (one micro-batch in flight)
        act_saved, layer_host = cpu_offloaded_layers(saved, s.layers, plan.cpu_offload_layers, s.inflight)
    loop_buffers, loop_tp, layer_grads = 0.0, 0.0, 0.0
    # (MaxText runs a pipeline stage's layers unscanned by default: scan_layers_per_stage = false)
    if s.fw.scanned_layers and job.scan_layers and plan.pp == 1:
        layer_grads = st.grad_params * 4 * st.body / (st.body + st.emb)
        if plan.remat.count("remat") > 0:
            only_input = plan.remat.count("device") == 1 and plan.remat.choices()["layer_input"] == "device"
            loop_buffers = xla_loop_extra_bytes(act_saved, layer_grads, only_input, plan.tp)
            loop_tp = xla_loop_tp_bytes(act_saved, layer_grads, plan.tp)
    return ActivationTerms(act_saved, offl, working, loop_buffers, loop_tp, layer_grads, layer_host)


def cpu_offloaded_layers(per_layer: float, layers: float, n: int, inflight: float) -> tuple[float, float]:
    """(device, host) bytes of the stage's saved activations when Megatron-Core offloads n of its layers to host
    (--cpu-offloading-num-layers; Transformer Engine's cpu_offload.py AsyncDoubleBufferGroupOffloadHandler): the
    first n layers' saved tensors are copied to host, each freed on device at the end of its copy window
    (cpu_offload_windows); the last one's window ends with the last layer's forward, so at that peak the device
    holds the layers - n kept layers and one offloaded layer not yet freed (the backward's first reload brings
    the same one back: the same count). Host: the n layers."""
    return per_layer * (layers - n + 1) * inflight, per_layer * n * inflight


def logit_terms(m: ModelSpec, plan: Plan, s: StepShape, st: StateTerms) -> tuple[float, float]:
    """(the logits and their gradient of one micro-batch on this chip, head_table_bytes beside them)."""
    # Logits and loss (vocab-sharded by tp, on the last stage). Megatron/DeepSpeed: bf16 logits plus their fp32
    # upcast for the vocab-parallel cross-entropy, the gradient reusing the fp32 buffer (6 B). XLA (MaxText) fuses
    # the fp32 log-softmax into its consumers: bf16 logits and their bf16 gradient (4 B; matches the TPU compile).
    # llm-foundry (pytorch-fsdp) defaults to loss_fn fused_crossentropy, flash-attn's xentropy kernel: it keeps
    # the bf16 logits and an fp32 log-sum-exp per row, and writes a new bf16 gradient (4 B). (Framework.logit_bytes)
    # Vocab tiling (MaxText num_vocab_tiling) computes logits, loss and their gradient one token chunk at a time.
    logits = s.tokens * m.vocab_size / plan.tp * s.fw.logit_bytes / plan.vocab_tiles
    head_extra = head_table_bytes(s.tokens * m.vocab_size / plan.tp / plan.vocab_tiles,
                                  m.vocab_size * m.d_model / plan.tp, st.weight_shards > 1)
    return logits, head_extra


def collective_buffer_bytes(plan: Plan, s: StepShape, st: StateTerms) -> float:
    """Bytes of gathered weights and unreduced gradients the weight-sharding collectives keep live."""
    if s.fw.spmd_pipeline(plan.pp):
        return maxtext_stage_buffers(st.layer_w * s.layers, st.grad_params * st.body / (st.body + st.emb),
                                     st.weight_shards, plan.dp > 1 and plan.zero < 3, plan.vpp)
    # FSDP: one layer of gathered bf16 weights and one layer of unreduced bf16 gradients awaiting reduce-scatter
    # (of the weights that are sharded: under MaxText ep alone shards the non-expert weights, not the experts).
    layer_experts = st.experts / s.layers  # the routed experts' share of layer_w
    gathered = (st.layer_w - layer_experts) * (st.weight_shards > 1) + layer_experts * (st.expert_shards > 1)
    return (BF16 + BF16) * gathered


def host_bytes(plan: Plan, s: StepShape, st: StateTerms, act: ActivationTerms) -> float:
    """Host memory per chip: offloaded activations, and the optimizer state and master weights when offloaded."""
    host = act.offload_per_layer * s.layers * s.inflight + act.layer_host
    if plan.offload_optimizer:
        host += st.opt_params * st.layout.optimizer
    if plan.offload_params:
        host += st.params * st.layout.weights
    return host


def memory_terms(m: ModelSpec, chip: Chip, job: Job, plan: Plan, accum: int, s: StepShape | None = None) -> MemoryTerms:
    """Per-chip memory of one step on the busiest stage, by term (model state, saved activations, the scanned
    loop's buffers, one layer's working set, logits, collective buffers), under the job's framework convention;
    with the fit check's figure (fit_floor_bytes under XLA), host memory and the per-layer quantities the
    collectives and the planner's surrogate read. s: the step's shape when the caller has it (step_shape)."""
    s = s or step_shape(m, job, plan, accum)
    st = state_terms(m, job, plan, s)
    act = activation_terms(m, job, plan, s, st)
    logits, head_extra = logit_terms(m, plan, s, st)
    acts, logits_counted = busiest_stage_activations(job, plan, act.saved, s.inflight, logits, accum)
    breakdown = {
        "weights": st.weights,
        "gradients": st.grads,
        "optimizer": st.optimizer,
        "activations": acts,
        "loop_buffers": act.loop_buffers,
        "activation_working": act.working,
        "logits": logits_counted,
        "collective_buffers": collective_buffer_bytes(plan, s, st),
    }
    total = sum(breakdown.values())
    # XLA's memory_analysis() total (argument + output - alias + temp) holds every buffer its peak holds, so the
    # total is never below the fit floor; the sum of terms can be when the loss phase's gathered output table
    # (head_table_bytes, counted by the floor only) outweighs the layer loop's working set (a huge vocabulary
    # over a tiny width).
    fit = fit_floor_bytes(breakdown, act.loop_tp, head_extra if logits_counted else 0.0) if s.fw.compiled_step \
        else total
    w_b, g_b, _, adam_b = st.layout
    return MemoryTerms(
        convention=job.framework + (" (bf16 weights)" if job.weight_dtype == "bfloat16" else ""),
        param_bytes=w_b, grad_reduce_bytes=st.reduce_bytes, grad_bytes=g_b, adam_bytes_per_param=adam_b,
        param_elems=st.params, optimizer_param_elems=st.opt_params, grad_elems_for_reduce=st.params,
        layer_weight_elems=st.layer_w, layer_expert_elems=st.experts / s.layers, loop_grad_bytes=act.layer_grads,
        non_expert_param_elems=st.params - st.experts / st.expert_shards,
        offload_bytes_per_layer=act.offload_per_layer, peak_bytes=max(total, fit), fit_bytes=fit,
        host_bytes=host_bytes(plan, s, st, act), breakdown=breakdown,
        cpu_offload_layer_bytes=act.layer_host / (plan.cpu_offload_layers * s.inflight) if act.layer_host else 0.0)
