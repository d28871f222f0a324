"""Plan file -> Megatron-LM arguments for pretrain_gpt.py, written as a bash file that defines MEGATRON_ARGS.

Flags as in Megatron-LM megatron/training/arguments.py (checked against the 2025-05 tree and the 2026 HEAD, see
/work/shared/reference/hardware_and_configs.md Part 3). Each plan field maps to flags: degrees -> the
--*-model-parallel-size and --context-parallel-size flags (Megatron's data-parallel size, world / (TP * PP * CP),
is our dp * fsdp * ep); vpp and uneven pp -> per-stage layer counts, or Megatron-Core's
--account-for-embedding/loss-in-pipeline-split where the plan sets them; batch -> --micro-batch-size and
--global-batch-size; zero 1 -> --use-distributed-optimizer; the expert all-to-all overlap ->
--overlap-moe-expert-parallel-comm --delay-wgrad-compute; remat, offload, precision and the model -> their flags
(remat full with recompute_num_layers N -> --recompute-method block --recompute-num-layers N, else uniform 1;
cpu_offload_layers N -> --cpu-offloading-num-layers N, the only CLI form: arguments.py sets cpu_offloading from it).
What the arguments cannot express (fsdp or ZeRO-2/3, other remat choices, activation or parameter offload, int8)
is exported as the nearest plan, with a warning and both predicted costs.
Names are data, never code (issue 31): every argument is written through shlex.quote, and every comment line
through hardware.errors.escape (line breaks and control characters as escapes), so no name or path can end its
comment and start a command.
(details: docs/exports.md, 'Megatron-LM')
"""

from __future__ import annotations

import math
import shlex
from dataclasses import replace

from costmodel.job import Job
from costmodel.model import ModelSpec
from costmodel.plan import REMAT_POLICIES, SPLIT_FLAGS, Plan, pipeline_split, split_accounted
from hardware.errors import InputError, escape
from planner.adapt import Adapted, named_policy, nearest_policy
from planner.candidates import Constraints
from planner.planfile import PlanFile, model_ref_for

MEGATRON_POLICIES = ("full", "selective", "none")  # most recompute first (nearest_policy ties go first)


def megatron_constraints(cons: Constraints) -> Constraints:
    """The search space of plans Megatron-LM runs exactly as costed (`suggest` under megatron or nemo): no fsdp axis,
    ZeRO 0 or 1, remat none / selective / full, parameters on the GPU. A pin outside it is an input error."""
    fsdp = cons.fixed.get("fsdp", 1)
    if fsdp != 1:
        raise InputError(f"--fix fsdp={fsdp}: Megatron-LM has no fully-sharded axis; expected fsdp=1 "
                         "under Megatron-LM")
    if cons.fixed.get("zero", 0) > 1:
        raise InputError(f"--fix zero={cons.fixed['zero']}: Megatron's distributed optimizer is ZeRO-1; expected "
                         "zero=0 or 1 under Megatron-LM")
    if cons.remat is not None and named_policy(cons.remat, MEGATRON_POLICIES) is None:
        raise InputError(f"--fix remat={cons.remat.name}: Megatron-LM recomputes none, selective (core attention) "
                         f"or full layers; expected one of {', '.join(MEGATRON_POLICIES)} under Megatron-LM")
    if cons.offload_params:
        raise InputError("--fix offload_params=1: Megatron-LM keeps parameters on the GPU; expected 0 under "
                         "Megatron-LM")
    limits = Constraints(max_tp=cons.max_tp, fixed={"fsdp": 1}, offload_params=False,
                         policies=tuple(REMAT_POLICIES[n] for n in MEGATRON_POLICIES))
    return replace(cons, fixed={**cons.fixed, "fsdp": 1}, offload_params=False, policies=limits.policies,
                   limits=limits)


def megatron_plan(pf: PlanFile) -> Adapted:
    """The nearest plan Megatron-LM can run (and the job under Megatron's state convention)."""
    p, job, notes = pf.plan, pf.job, []
    plan = p
    if p.fsdp > 1:
        plan = plan.with_(dp=p.dp * p.fsdp, fsdp=1, zero=1)
        notes.append(f"fsdp={p.fsdp}: Megatron-LM has no fully-sharded axis; it becomes data parallel "
                     f"(dp {p.dp} -> {plan.dp}) with the distributed optimizer (ZeRO-1, zero -> 1). "
                     "Megatron-FSDP (--use-megatron-fsdp) is not exported")
    elif p.zero >= 2:
        plan = plan.with_(zero=1)
        if p.dp > 1:
            notes.append(f"zero {p.zero}: Megatron's distributed optimizer shards the optimizer state (ZeRO-1); "
                         "zero -> 1")
    named = named_policy(plan.remat, MEGATRON_POLICIES)
    if named is None:
        near = nearest_policy(plan.remat, MEGATRON_POLICIES)
        notes.append(f"remat {plan.remat.summary()}: Megatron-LM recomputes none, selective (core attention) or "
                     f"full layers; remat -> {near.name}")
        named = near
    plan = plan.with_(remat=named)
    plan, why = _ep_overlap(plan)
    notes += [why] if why else []
    if plan.offload_params:
        plan = plan.with_(offload_params=False)
        notes.append("offload_params: Megatron-LM keeps parameters on the GPU; offload_params -> false")
    if plan.offload_optimizer and plan.zero == 0:
        plan = plan.with_(zero=1)
        notes.append("offload_optimizer: Megatron's --optimizer-cpu-offload runs through the distributed "
                     "optimizer (precision-aware); zero 0 -> 1")
    if plan.tp == 1 and plan.sequence_parallel:
        plan = plan.with_(sequence_parallel=False)  # Megatron turns SP off at TP=1 itself: same cost
    if job.precision == "int8":
        job = replace(job, precision="bf16")
        notes.append("precision int8: Megatron-LM trains in bf16, fp16 or fp8; precision -> bf16")
    if job.framework != "megatron":
        notes.append(f"framework {job.framework}: Megatron keeps bf16 weights with fp32 main gradients, master "
                     "weights and moments (the megatron state convention); framework -> megatron")
        job = replace(job, framework="megatron")
    if pf.hardware.vendor != "gpu":
        notes.append(f"hardware: Megatron-LM runs on NVIDIA GPUs; {escape(pf.hardware.name)} is a "
                     f"{escape(pf.hardware.vendor)}")
    return Adapted(plan, job, tuple(notes))


def _ep_overlap(plan: Plan) -> tuple[Plan, str]:
    """Megatron-Core runs --overlap-moe-expert-parallel-comm with pp > 1 only in the interleaved schedule
    (TransformerConfig.__post_init__: virtual_pipeline_model_parallel_size must be set, and arguments.py sets it
    to None at 1 virtual stage) and never with full recompute: the overlap is dropped, with a note, where either
    holds (DeepSeek's DualPipe hides the all-to-all without virtual stages; Megatron-Core has no DualPipe)."""
    if not plan.overlap_moe_expert_parallel_comm:
        return plan, ""
    why = ("Megatron-Core runs it with pp > 1 only in the interleaved schedule (expected vpp > 1, got vpp 1)"
           if plan.pp > 1 and plan.vpp == 1 else
           "Megatron-Core refuses it with full recompute" if plan.remat.name == "full" else "")
    if not why:
        return plan, ""
    return plan.with_(overlap_moe_expert_parallel_comm=False), (
        f"overlap_moe_expert_parallel_comm: {why}; overlap_moe_expert_parallel_comm -> false")


def _moe_layer_freq(m) -> str:
    return f"([0]*{m.n_dense_layers}+[1]*{m.n_layers - m.n_dense_layers})"


def megatron_args(pf: PlanFile) -> tuple[list[str], Adapted]:
    """The argument list (flag, value, flag, ...) for the nearest expressible plan, and that plan."""
    ad = megatron_plan(pf)
    plan, job, m = ad.plan, ad.job, pf.model
    notes = list(ad.notes)
    if plan.cp > 1 and job.seq_len % (2 * plan.cp):
        raise InputError(f"cp: Megatron-LM needs seq_len ({job.seq_len}) divisible by 2 * cp = {2 * plan.cp}")
    a = _model_args(m, notes) + ["--make-vocab-size-divisible-by", str(vocab_divisor(m.vocab_size, plan.tp))]
    if m.vocab_size % plan.tp:
        notes.append(f"model: Megatron-LM pads the vocabulary to a multiple of 128 x TP; {m.vocab_size} is not a "
                     f"multiple of TP {plan.tp}, so it becomes {padded_vocab(m.vocab_size, plan.tp)}")
    a += _parallel_args(m, job, plan) + _training_args(job, plan)
    return a, replace(ad, notes=tuple(notes))


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary Megatron-LM builds with the exported divisor (megatron/training/tokenizer/tokenizer.py
    _vocab_size_with_padding: up to a multiple of divisor x TP)."""
    step = vocab_divisor(vocab_size, tp) * tp
    return -(-vocab_size // step) * step


def _model_args(m: ModelSpec, notes: list[str]) -> list[str]:
    """The model's shape: attention (GQA or MLA), MLP, embeddings, MoE; what Megatron cannot express noted."""
    a: list[str] = ["--num-layers", str(m.n_layers), "--hidden-size", str(m.d_model),
                    "--ffn-hidden-size", str(m.ffn_dim), "--num-attention-heads", str(m.n_heads)]
    if m.is_mla:
        a += ["--multi-latent-attention", "--q-lora-rank", str(m.q_lora_rank), "--kv-lora-rank", str(m.kv_lora_rank),
              "--qk-head-dim", str(m.head_dim - m.qk_rope_head_dim), "--qk-pos-emb-head-dim", str(m.qk_rope_head_dim),
              "--v-head-dim", str(m.v_head_dim)]
    else:
        a += ["--kv-channels", str(m.head_dim)]
        if m.n_kv_heads != m.n_heads:
            a += ["--group-query-attention", "--num-query-groups", str(m.n_kv_heads)]
    if m.qk_norm:
        a += ["--qk-layernorm"]
    a += _mlp_args(m, notes)
    if not m.tied_embeddings:
        a += ["--untie-embeddings-and-output-weights"]
    a += _norm_args(m) + _position_args(m, notes)
    if not m.linear_bias:
        a += ["--disable-bias-linear"]
    a += ["--attention-dropout", repr(float(m.dropout)), "--hidden-dropout", repr(float(m.dropout))]
    a += ["--vocab-size", str(m.vocab_size)]
    if m.is_moe:
        a += _moe_args(m, notes)
    if m.sliding_window:
        notes.append(f"model: sliding-window attention ({m.sliding_window} tokens) is not exported; add "
                     "Megatron's window-attention flags by hand")
    return a


def _mlp_args(m: ModelSpec, notes: list[str]) -> list[str]:
    """--swiglu (gated SiLU), --squared-relu, or Megatron's default GeLU."""
    act = m.activation
    if m.gated_mlp and act == "silu":
        return ["--swiglu"]
    if not m.gated_mlp and act == "relu2":
        return ["--squared-relu"]
    if not m.gated_mlp and act == "gelu":
        return []
    notes.append(f"model: Megatron-LM's arguments build SwiGLU, squared-ReLU or GeLU MLPs; this model's "
                 f"{'gated ' if m.gated_mlp else ''}{act} MLP is not exported (set activation_func in Python)")
    return ["--swiglu"] if m.gated_mlp else []


def _norm_args(m: ModelSpec) -> list[str]:
    """--normalization and --norm-epsilon; layernorm1p is LayerNorm with --apply-layernorm-1p."""
    a = ["--normalization", "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm", "--norm-epsilon", repr(m.norm_eps)]
    return a + (["--apply-layernorm-1p"] if m.norm == "layernorm1p" else [])


def _position_args(m: ModelSpec, notes: list[str]) -> list[str]:
    """Learned positions, or RoPE with its base, rotated fraction and scaling (Llama 3.1's or, for MLA, YaRN)."""
    if m.position_embedding == "learned":
        return ["--position-embedding-type", "learned_absolute"]
    if m.position_embedding == "alibi":
        notes.append("model: Megatron-LM has no ALiBi; exported with learned absolute positions")
        return ["--position-embedding-type", "learned_absolute"]
    if not float(m.rope_theta).is_integer():
        notes.append(f"model: Megatron-LM's --rotary-base is an integer; {m.rope_theta} -> {round(m.rope_theta)}")
    a = ["--position-embedding-type", "rope", "--rotary-base", str(round(m.rope_theta)),
         "--rotary-percent", repr(float(m.rope_fraction))]
    if m.rope_local_theta:
        notes.append(f"model: the sliding-window layers' RoPE base ({m.rope_local_theta:g}) is not exported")
    if m.is_mla:
        return a + _mla_rope_args(m, notes)
    if m.rope_scaling == "llama3":
        a += ["--use-rope-scaling", "--rope-scaling-factor", repr(float(m.rope_scaling_factor))]
        if m.rope_original_context != 8192:
            notes.append(f"model: Megatron-LM's Llama 3.1 RoPE scaling hard-codes 8192 original positions; this "
                         f"model has {m.rope_original_context}")
    elif m.rope_scaling:
        notes.append(f"model: {m.rope_scaling} RoPE scaling (factor {m.rope_scaling_factor:g}) is not exported for "
                     "non-MLA attention")
    return a


# Megatron-Core's MLATransformerConfig YaRN fields that no argument sets: (field, ours, its default).
MLA_YARN_FIXED = (("original_max_position_embeddings", "rope_original_context", 4096),
                  ("beta_fast", "rope_beta_fast", 32.0), ("beta_slow", "rope_beta_slow", 1.0))


def _mla_rope_args(m: ModelSpec, notes: list[str]) -> list[str]:
    """MLA takes YaRN by default (--rope-type): its factor and mscale terms; the rest are MLATransformerConfig's."""
    if m.rope_scaling != "yarn":
        if m.rope_scaling:
            notes.append(f"model: MLA takes rope or yarn; this model's {m.rope_scaling} scaling is not exported")
        return ["--rope-type", "rope"]
    for field, ours, default in MLA_YARN_FIXED:
        if getattr(m, ours) != default:
            notes.append(f"model: Megatron-LM sets no {field} for MLA (MLATransformerConfig keeps {default:g}); "
                         f"this model has {getattr(m, ours):g}")
    return ["--rotary-scaling-factor", repr(float(m.rope_scaling_factor)), "--mscale", repr(float(m.rope_mscale)),
            "--mscale-all-dim", repr(float(m.rope_mscale_all_dim))]


def _moe_args(m: ModelSpec, notes: list[str]) -> list[str]:
    """Experts, shared experts, dense layers, capacity, and the router (scores, top-k normalisation, scaling,
    expert bias, node-limited groups) as megatron/core/transformer/moe/moe_utils.py routes."""
    a = ["--num-experts", str(m.n_experts), "--moe-router-topk", str(m.experts_per_token),
         "--moe-ffn-hidden-size", str(m.moe_ffn_dim)]
    if m.n_shared_experts:
        a += ["--moe-shared-expert-intermediate-size", str(m.n_shared_experts * m.moe_ffn_dim)]
    if m.n_dense_layers:
        a += ["--moe-layer-freq", _moe_layer_freq(m)]
    if m.capacity_factor > 0:
        a += ["--moe-expert-capacity-factor", repr(float(m.capacity_factor)), "--moe-pad-expert-input-to-capacity"]
    a += ["--moe-router-score-function", m.router_score]
    if m.router_score == "softmax" and not m.router_norm_topk:
        a += ["--moe-router-pre-softmax"]  # softmax over all experts, top-k weights not renormalised
    elif m.router_score == "sigmoid" and not m.router_norm_topk:
        notes.append("model: Megatron-LM renormalises sigmoid top-k weights; this model does not")
    if m.router_topk_scale != 1.0:
        a += ["--moe-router-topk-scaling-factor", repr(float(m.router_topk_scale))]
    if m.router_expert_bias:
        a += ["--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", repr(m.router_bias_update_rate)]
    if m.router_groups:
        a += ["--moe-router-num-groups", str(m.router_groups), "--moe-router-group-topk", str(m.router_group_topk)]
    return a + ["--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm"]


def vocab_divisor(vocab_size: int, tp: int) -> int:
    """--make-vocab-size-divisible-by: Megatron pads the vocabulary to a multiple of this times TP
    (_vocab_size_with_padding); the largest power of two up to its default 128 that keeps vocab_size exact, or
    128 when TP does not divide vocab_size (then it pads)."""
    if vocab_size % tp:
        return 128
    return math.gcd(vocab_size // tp, 128)


def _parallel_args(m: ModelSpec, job: Job, plan: Plan) -> list[str]:
    """Batch, sequence and the parallel degrees, with the (uneven) pipeline split and gradient overlap."""
    a = ["--seq-length", str(job.seq_len), "--max-position-embeddings", str(job.seq_len),
         "--micro-batch-size", str(plan.micro_batch), "--global-batch-size", str(job.global_batch),
         "--tensor-model-parallel-size", str(plan.tp), "--pipeline-model-parallel-size", str(plan.pp)]
    accounted = any(plan.split_accounting)
    even = m.n_layers % (plan.pp * plan.vpp) == 0 and not accounted
    if plan.vpp > 1:
        a += (["--num-layers-per-virtual-pipeline-stage", str(m.n_layers // (plan.pp * plan.vpp))] if even
              else ["--num-virtual-stages-per-pipeline-rank", str(plan.vpp)])
    if accounted:  # Megatron-Core splits L + 1 (+ 1) layers; it refuses these with --decoder-first/last-...
        split_accounted(m.n_layers, plan.pp, plan.vpp, *plan.split_accounting)
        a += ["--" + f.replace("_", "-") for f in SPLIT_FLAGS if getattr(plan, f)]
    elif not even:
        split = pipeline_split(m.n_layers, plan.pp, plan.vpp)
        if split is None:
            raise InputError(f"pp*vpp: {m.n_layers} layers cannot be split over pp={plan.pp} stages x "
                             f"vpp={plan.vpp}; use a pp*vpp that divides {m.n_layers}")
        a += ["--decoder-first-pipeline-num-layers", str(split[0]), "--decoder-last-pipeline-num-layers",
              str(split[2])]
    a += ["--context-parallel-size", str(plan.cp)]
    if plan.ep > 1:
        a += ["--expert-model-parallel-size", str(plan.ep)]
    if plan.sequence_parallel:
        a += ["--sequence-parallel"]
    if plan.zero >= 1:
        a += ["--use-distributed-optimizer"]
    if plan.dp * plan.ep > 1:
        a += ["--overlap-grad-reduce"]
        if plan.zero >= 1:
            a += ["--overlap-param-gather"]
    return a


def _training_args(job: Job, plan: Plan) -> list[str]:
    """Recompute, optimizer offload and precision."""
    a: list[str] = []
    if plan.remat.name == "selective":
        a += ["--recompute-granularity", "selective"]
    elif plan.remat.name == "full" and plan.recompute_num_layers:  # only the first N layers of each chunk
        a += ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers",
              str(plan.recompute_num_layers)]
    elif plan.remat.name == "full":
        a += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if plan.cpu_offload_layers:  # activations offloaded (cpu_offloading_activations defaults True), weights not
        a += ["--cpu-offloading-num-layers", str(plan.cpu_offload_layers)]
    if plan.overlap_moe_expert_parallel_comm:  # with the delayed weight gradients Megatron's MoE README pairs it with
        a += ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
    if plan.fp8_param_gather:  # fp8 GEMM weights (TransformerConfig.fp8_param and DDP fp8_param_gather from it)
        a += ["--fp8-param-gather"]
    if plan.grad_reduce_in_bf16:  # bf16 main-gradient buffer: arguments.py clears accumulate_allreduce_grads_in_fp32
        a += ["--grad-reduce-in-bf16"]
    if plan.offload_optimizer:
        a += ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0", "--use-precision-aware-optimizer"]
    if job.precision == "fp16":
        a += ["--fp16"]
    else:
        a += ["--bf16"]
        if job.precision == "fp8":
            a += ["--fp8-format", "hybrid"]
    return a


def _lines(args: list[str]) -> list[str]:
    """One flag (with its value) per line."""
    out: list[str] = []
    for tok in args:
        if tok.startswith("--") or not out:
            out.append(shlex.quote(tok))
        else:
            out[-1] += " " + shlex.quote(tok)
    return out


def planner_hint(pf: PlanFile) -> str:
    """The body of the `# planner: model=... hardware=... chips=...` comment that import_configs reads back by
    splitting on whitespace. A value holding whitespace or a non-printable character would forge or break a key
    there, so it is left out (the import then asks for --model / --hardware). A preset's name is printable, so a
    name that is not is never looked up (load_model would read it as a path)."""
    model = (model_ref_for(pf.model) if pf.model.name.isprintable() else "") or pf.model.name
    pairs = (("model", model), ("hardware", pf.hardware_ref or pf.hardware.name), ("chips", str(pf.chips)))
    return "planner: " + " ".join(f"{k}={v}" for k, v in pairs if v and v.isprintable() and " " not in v)


def comment(text: str) -> str:
    """One `#` comment line of a bash or YAML file: `text` with line breaks and control characters escaped."""
    return "# " + escape(text)


def megatron_text(pf: PlanFile) -> tuple[str, Adapted]:
    """The bash file: comments (escaped, see the module doc), then MEGATRON_ARGS=( shlex-quoted arguments )."""
    args, ad = megatron_args(pf)
    per_node = pf.hardware.chips_per_host if pf.hardware.vendor == "gpu" else 8
    nodes = max(1, pf.chips // per_node) if pf.chips >= per_node else 1
    nproc = per_node if pf.chips >= per_node else pf.chips
    notes = [
        f"Megatron-LM arguments for pretrain_gpt.py, written by planner for {pf.model.name} on "
        f"{pf.chips} x {pf.hardware.name}.",
        "Source this file, then on every node add data, tokenizer and optimizer arguments, e.g.:",
        f"  torchrun --nproc-per-node {nproc} --nnodes {nodes} --node-rank $NODE_RANK --master-addr $MASTER_ADDR \\",
        '      pretrain_gpt.py "${MEGATRON_ARGS[@]}" --tokenizer-type ... --data-path ... --lr ... --train-iters ...',
        "--vocab-size is used by --tokenizer-type NullTokenizer; other tokenizers set the vocabulary themselves",
        "(Megatron pads it to a multiple of --make-vocab-size-divisible-by * TP; the divisor here keeps",
        "--vocab-size exact).",
        planner_hint(pf),
    ]
    lines = ["#!/usr/bin/env bash", *map(comment, notes), "MEGATRON_ARGS=(", *("  " + ln for ln in _lines(args)), ")"]
    return "\n".join(lines) + "\n", ad


assert all(n in REMAT_POLICIES for n in MEGATRON_POLICIES)
