"""Plan file -> MaxText 0.2.5 config (a YAML of overrides for MaxText's base.yml).

Key names are those of maxtext==0.2.5 on PyPI (src/maxtext/configs/base.yml; snapshot of the names in
planner/maxtext_0_2_5_keys.txt). Each plan field maps to MaxText keys: degrees -> ici_*/dcn_*_parallelism and
num_slices; batch -> per_device_batch_size and gradient_accumulation_steps (num_pipeline_microbatches with
pp > 1); zero 1 -> shard_optimizer_over_data; remat -> remat_policy; offload, precision, scan_layers and the
model's shape and build keys. What MaxText cannot express (ZeRO-2/3 over data, ZeRO-1 with fsdp, tensor
parallelism without sequence-sharded activations, a micro-batch count not a multiple of the stage count,
Megatron-Core's embedding/loss pipeline-split flags and its expert all-to-all overlap) is exported as the nearest
plan, with a warning.
Names are data, never code (issue 31): every value is written by PyYAML's emitter (`_value`), every comment line
through export_megatron.comment, so whatever a model or hardware name holds, the file parses to exactly the
planner's keys.
(details: docs/exports.md, 'MaxText')
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any

import yaml

from costmodel.estimate import dcn_split
from costmodel.model import ROUTER_DEFAULTS
from costmodel.plan import AXES, AXIS_ORDER_INNER_TO_OUTER, REMAT_POLICIES, SPLIT_FLAGS
from hardware.errors import InputError
from hardware.topology import slice_shape
from planner.adapt import Adapted, named_policy
from planner.export_megatron import comment, planner_hint
from planner.planfile import PlanFile, model_ref_for

MAXTEXT_VERSION = "0.2.5"
# Our axis -> MaxText mesh-axis key stem (ici_<stem>_parallelism / dcn_<stem>_parallelism).
AXIS_KEYS = {"dp": "data", "fsdp": "fsdp", "tp": "tensor", "cp": "context", "pp": "pipeline", "ep": "expert"}
# MaxText 0.2.5 remat_policy names (layers/nnx_decoders.py get_remat_policy), most recompute first.
MAXTEXT_POLICIES = ("full", "save_out_proj", "save_qkv_proj", "qkv_proj_offloaded", "save_dot_except_mlp",
                    "save_dot_except_mlpwi", "save_dot_with_context_except_mlp", "minimal", "minimal_offloaded",
                    "minimal_with_context")
# Known TPU presets -> MaxText compile_topology prefix and devices (TensorCores) per chip in its names.
TOPOLOGY = {"tpu-v4": ("v4", 2), "tpu-v5p": ("v5p", 2), "tpu-v5e": ("v5e", 1), "tpu-v6e": ("v6e", 1),
            "tpu-v7": ("tpu7x", 2)}  # MaxText names TPU7x slices tpu7x-N, N TensorCores (two per chip)


def _split_flags(plan) -> tuple[Any, str]:
    """Megatron-Core's account_for_embedding/loss_in_pipeline_split count the embedding and the loss as a layer of
    the first / last stage; MaxText has no such split: it embeds and computes the logits and loss outside its
    pipeline module, on every stage, and gives each of the pp * vpp chunks n_layers / (pp * vpp) layers."""
    on = [f for f in SPLIT_FLAGS if getattr(plan, f)]
    if not on:
        return plan, ""
    return plan.with_(**dict.fromkeys(on, False)), (
        f"{' and '.join(on)}: MaxText has no such split (it runs the embedding and the loss outside its pipeline, "
        f"on every stage, and splits only the decoder layers over pp x vpp); "
        f"{'both' if len(on) > 1 else 'it'} -> false")


# Megatron-Core options MaxText has no form of (each dropped with a note): plan field -> (off value, the note's
# text after "field [value]: "). Block recompute: MaxText applies one remat_policy to every layer of the scan;
# layer CPU offload: MaxText offloads named tensors of every layer through its remat policy; the all-to-all
# overlap: MaxText's MoE all-to-alls sit in the layer's own shard_map, in order.
_MEGATRON_ONLY = {
    "overlap_moe_expert_parallel_comm": (False, "MaxText has no expert all-to-all overlap across micro-batches "
                                                "(Megatron-Core's combined 1F1B); it -> false"),
    "recompute_num_layers": (0, "MaxText applies one remat_policy to every layer (Megatron-Core's --recompute-method "
                                "block has no MaxText form); every layer recomputed, it -> 0"),
    "cpu_offload_layers": (0, "MaxText offloads named tensors of every layer (remat_policy custom), not whole layers "
                              "(Megatron-Core's --cpu-offloading-num-layers); it -> 0"),
    "fp8_param_gather": (False, "MaxText stores its weights in weight_dtype and quantizes only inside the matmuls "
                                "(Megatron-Core's --fp8-param-gather has no MaxText form); it -> false"),
    "grad_reduce_in_bf16": (False, "MaxText reduces the bf16 gradients of its compute copy and keeps grad_dtype "
                                   "(Megatron-Core's --grad-reduce-in-bf16 has no MaxText setting); it -> false"),
}


def _megatron_only(plan) -> tuple[Any, list[str]]:
    """The plan without the Megatron-Core options MaxText cannot run (_MEGATRON_ONLY), and a note for each."""
    notes = []
    for field, (off, why) in _MEGATRON_ONLY.items():
        value = getattr(plan, field)
        if value != off:
            plan = plan.with_(**{field: off})
            notes.append(f"{field}{'' if isinstance(value, bool) else f' {value}'}: {why}")
    return plan, notes


def _even_stages(pf: PlanFile, plan) -> tuple[Any, str]:
    """MaxText splits the layers evenly over pp * vpp chunks: an uneven (Megatron) split becomes the largest pp
    dividing both the plan's pp and the layer count, the rest of the stage axis going to fsdp (which shards the
    weights the stages no longer split; vpp kept if it still divides, else 1)."""
    n = pf.model.n_layers
    if n % (plan.pp * plan.vpp) == 0:
        return plan, ""
    pp = math.gcd(plan.pp, n)
    vpp = plan.vpp if pp > 1 and n % (pp * plan.vpp) == 0 else 1
    new = plan.with_(pp=pp, vpp=vpp, fsdp=plan.fsdp * plan.pp // pp)
    return new, (f"pipeline: MaxText splits the {n} layers evenly over pp x vpp; pp {plan.pp} -> {pp}"
                 + (f", vpp {plan.vpp} -> {vpp}" if vpp != plan.vpp else "") + f", fsdp {plan.fsdp} -> {new.fsdp}")


def _pipeline_fit(pf: PlanFile, plan) -> tuple[Any, str]:
    """With pp > 1, MaxText needs num_pipeline_microbatches (= our accumulation) to be a multiple of pp."""
    if plan.pp == 1:
        return plan, ""
    shards = plan.batch_shards
    per_shard = pf.job.global_batch // shards
    accum = per_shard // plan.micro_batch
    if accum % plan.pp == 0:
        return plan, ""
    for mb in range(plan.micro_batch - 1, 0, -1):
        if per_shard % mb == 0 and (per_shard // mb) % plan.pp == 0:
            return plan.with_(micro_batch=mb), (
                f"pipeline: MaxText needs num_pipeline_microbatches ({accum}) to be a multiple of the {plan.pp} "
                f"stages; micro_batch {plan.micro_batch} -> {mb} ({per_shard // mb} micro-batches)")
    raise InputError(f"pp: MaxText needs the pipeline micro-batch count to be a multiple of pp={plan.pp}, but "
                     f"global_batch / (dp*fsdp*ep) = {per_shard} sequences per batch shard is not")


def _batch_fit(pf: PlanFile, plan) -> tuple[Any, str]:
    """The global batch must split over the batch shards (dp * fsdp * ep) in whole micro-batches; moving pipeline
    stages or ZeRO-3's dp into fsdp (above) multiplies the shards, so the micro-batch may have to shrink."""
    shards, gb = plan.batch_shards, pf.job.global_batch
    if gb % (shards * plan.micro_batch) == 0:
        return plan, ""
    if gb % shards:
        raise InputError(f"global_batch: MaxText runs this plan as dp={plan.dp} fsdp={plan.fsdp} ep={plan.ep}, "
                         f"{shards} batch shards, which {gb} sequences do not divide; expected a multiple of {shards}")
    mb = max(b for b in range(1, plan.micro_batch) if (gb // shards) % b == 0)
    return plan.with_(micro_batch=mb), (f"batch: {gb} sequences over {shards} batch shards; micro_batch "
                                        f"{plan.micro_batch} -> {mb}")


def maxtext_plan(pf: PlanFile) -> Adapted:
    """The nearest plan MaxText 0.2.5 can run (and the job under MaxText's state convention)."""
    plan, job, notes = pf.plan, pf.job, []
    plan, why = _split_flags(plan)
    plan, dropped = _megatron_only(plan)
    plan, why_even = _even_stages(pf, plan)
    notes += [n for n in (why, *dropped, why_even) if n]
    if plan.zero == 3 and plan.dp > 1:
        plan = plan.with_(dp=1, fsdp=plan.fsdp * plan.dp, zero=0)
        notes.append(f"zero 3 over dp={pf.plan.dp}: MaxText shards weights over its fsdp axis; "
                     f"dp {pf.plan.dp} -> 1, fsdp {pf.plan.fsdp} -> {plan.fsdp}")
    elif plan.zero >= 2:
        plan = plan.with_(zero=1)
        if pf.plan.dp > 1:
            notes.append(f"zero {pf.plan.zero}: MaxText shards only the optimizer state over `data` "
                         "(shard_optimizer_over_data, ZeRO-1); zero -> 1")
    if plan.zero >= 1 and plan.fsdp > 1:
        if plan.dp > 1:
            notes.append(f"zero {plan.zero} with fsdp={plan.fsdp}: MaxText 0.2.5 refuses shard_optimizer_over_data "
                         "together with an fsdp axis; zero -> 0 (optimizer state sharded over fsdp only)")
        plan = plan.with_(zero=0)
    if not plan.sequence_parallel:
        plan = plan.with_(sequence_parallel=True)
        if plan.tp > 1:
            notes.append("sequence_parallel false: MaxText always shards the activations between layers over "
                         "`tensor`; sequence_parallel -> true")
    for fit in (_batch_fit, _pipeline_fit):
        plan, why = fit(pf, plan)
        if why:
            notes.append(why)
    named = named_policy(plan.remat, MAXTEXT_POLICIES)
    plan = plan.with_(remat=named or replace(plan.remat, name="custom"))
    if job.framework != "maxtext":
        notes.append(f"framework {job.framework}: MaxText keeps fp32 weights and Adam moments (the maxtext "
                     "state convention); framework -> maxtext")
        job = replace(job, framework="maxtext")
    return Adapted(plan, job, tuple(notes))


def mesh_split(pf: PlanFile, plan) -> tuple[dict[str, int], dict[str, int], int, str]:
    """(ici, dcn, num_slices, note): per-axis degrees inside a slice and across slices."""
    deg = plan.degrees()
    chip = pf.hardware
    if chip.scale_up.kind == "torus":
        dcn = {a: dcn_split(plan).get(a, 1) for a in AXES}
        return {a: deg[a] // dcn[a] for a in AXES}, dcn, plan.slices, ""
    node = chip.scale_up.domain_chips or plan.chips
    if plan.chips <= node:
        return dict(deg), dict.fromkeys(AXES, 1), 1, ""
    left, ici = node, {}
    for a in AXIS_ORDER_INNER_TO_OUTER:
        g = math.gcd(deg[a], left)
        ici[a], left = g, left // g
    if left != 1:
        return dict(deg), dict.fromkeys(AXES, 1), 1, (
            f"mesh: the degrees do not fill {node}-GPU nodes evenly; every axis is put on ICI in one slice")
    return ici, {a: deg[a] // ici[a] for a in AXES}, plan.chips // node, ""


def whole_physical_axes(ici: dict[str, int], physical: tuple[int, ...]) -> bool:
    """Whether every ICI axis above 1 is a product of whole torus dimensions: MaxText's create_device_mesh
    (jax mesh_utils) refuses a logical axis that splits a physical one unless allow_split_physical_axes is set
    (a 1024-way fsdp on an 8x8x16 slice: 512 is no product of 8, 8 and 16)."""
    sizes = [v for v in ici.values() if v > 1]
    dims = [d for d in physical if d > 1]
    for owner in itertools.product(range(len(sizes)), repeat=len(dims)):
        prods = [math.prod(d for d, o in zip(dims, owner, strict=True) if o == i) for i in range(len(sizes))]
        if prods == sizes:
            return True
    return not sizes


def _splits_physical_axes(ici: dict[str, int], chip, slice_chips: int) -> bool:
    """The mesh needs allow_split_physical_axes on an orderable slice (no shape known: left to MaxText)."""
    try:
        return not whole_physical_axes(ici, slice_shape(chip, slice_chips))
    except InputError:
        return False


def _per_device_batch(global_batch: int, chips: int, accum: int) -> float:
    """global_batch / (chips * accum) as a float that MaxText turns back into the exact batch via int(chips * x)."""
    want = global_batch // accum
    x = want / chips
    while int(chips * x) < want:  # guard against a float just below the exact quotient
        x = math.nextafter(x, math.inf)
    return x


def _remat_keys(pf: PlanFile, remat) -> dict[str, str]:
    m = pf.model
    c = remat.choices()
    out = {"decoder_layer_input": c["layer_input"], "query_proj": c["qkv_proj"], "key_proj": c["qkv_proj"],
           "value_proj": c["qkv_proj"], "context": c["context"], "out_proj": c["out_proj"]}
    if m.gated_mlp:
        out.update(mlpwi_0=c["mlp_in"], mlpwi_1=c["mlp_in"])
    else:
        out["mlpwi"] = c["mlp_in"]
    out["mlpwo"] = c["mlp_out"]
    if m.is_moe:  # MaxText 0.2.5 names the expert matmul outputs both mlpwi_0 and moe_mlpwi_0 etc.
        out.update(moe_mlpwi_0=c["mlp_in"], moe_mlpwi_1=c["mlp_in"], moe_mlpwo=c["mlp_out"])
    return out


def _decoder_block(m) -> str:
    if m.sliding_window and m.local_per_global == 5:
        return "gemma3"
    if m.is_moe:
        return "deepseek" if (m.n_dense_layers or m.n_shared_experts or m.is_mla) else "mixtral"
    return "llama2"


# MaxText 0.2.5 model_name prefixes under which layers/moe.py routes as DeepSeek-V3 does (the expert bias chooses
# experts but stays out of their weights; n_routing_groups / topk_routing_group apply).
DEEPSEEK_ROUTING_NAMES = ("deepseek3", "deepseek4", "kimi-k2")
MAXTEXT_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "relu2": "relu"}  # our name -> jax.nn function


def model_name(pf: PlanFile) -> str:
    """MaxText's model_name for the preset whose configs/models file is this model, else ''. MaxText merges that
    file over the exported keys (equal values, tests/test_export.py), so a changed copy of a preset gets none."""
    m = pf.model
    return m.maxtext_name if m.maxtext_name and model_ref_for(m) else ""


def model_keys(pf: PlanFile) -> tuple[dict[str, Any], list[str]]:
    m = pf.model
    notes: list[str] = []
    k: dict[str, Any] = {}
    name = model_name(pf)
    if name:
        k["model_name"] = name
    k.update(decoder_block=_decoder_block(m), base_emb_dim=m.d_model, base_num_query_heads=m.n_heads,
             base_num_kv_heads=m.n_kv_heads)
    if not m.is_mla:
        k["head_dim"] = m.head_dim
    act = MAXTEXT_ACTIVATIONS[m.activation]
    k.update(base_mlp_dim=m.ffn_dim, base_num_decoder_layers=m.n_layers, vocab_size=m.vocab_size,
             mlp_activations=[act, "linear"] if m.gated_mlp else [act], logits_via_embedding=m.tied_embeddings,
             normalization_layer_epsilon=m.norm_eps, enable_dropout=m.dropout > 0)
    if m.dropout > 0:
        k["dropout_rate"] = m.dropout
    if m.is_moe:
        k.update(num_experts=m.n_experts, num_experts_per_tok=m.experts_per_token, base_moe_mlp_dim=m.moe_ffn_dim,
                 capacity_factor=float(m.capacity_factor) if m.capacity_factor > 0 else -1.0)
        if m.n_dense_layers:
            k["first_num_dense_layers"] = m.n_dense_layers
        if m.n_shared_experts:
            k["shared_experts"] = m.n_shared_experts
        k.update(_router_keys(m, k["decoder_block"], name, notes))
    if m.is_mla:
        k.update(attention_type="mla", q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                 qk_nope_head_dim=m.head_dim - m.qk_rope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                 v_head_dim=m.v_head_dim)
    if m.sliding_window:
        k["sliding_window_size"] = m.sliding_window
        if m.local_per_global == 0:
            k["attention_type"] = "local_sliding"
        elif m.local_per_global != 5:
            notes.append(f"model: MaxText 0.2.5 has no key for {m.local_per_global} local layers per global "
                         "layer (decoder_block gemma3 hard-codes 5); set decoder_block to a block that interleaves")
    k.update(_rope_keys(m, name, notes))
    notes += _block_notes(m, k["decoder_block"])
    return k, notes


def _int_key(key: str, value: float, notes: list[str]) -> int:
    """A MaxText integer key (rope_max_timescale, rope_factor, beta_fast ...): a non-integral value is rounded,
    noted."""
    if not float(value).is_integer():
        notes.append(f"model: MaxText 0.2.5's {key} is an integer; {value} -> {round(value)}")
    return round(value)


def _rope_keys(m, name: str, notes: list[str]) -> dict[str, Any]:
    """RoPE base, local base and scaling (rope_type llama3.1 | yarn, rope_linear_scaling_factor)."""
    k: dict[str, Any] = {"rope_max_timescale": _int_key("rope_max_timescale", m.rope_theta, notes)}
    if m.rope_local_theta:
        k["local_rope_max_timescale"] = _int_key("local_rope_max_timescale", m.rope_local_theta, notes)
    if m.rope_scaling == "llama3":
        k["rope_type"] = "llama3.1"
        if (m.rope_scaling_factor, m.rope_original_context) != (8.0, 8192):
            notes.append(f"model: MaxText 0.2.5's llama3.1 RoPE scaling hard-codes factor 8 over 8192 positions; "
                         f"this model has {m.rope_scaling_factor:g} over {m.rope_original_context}")
    elif m.rope_scaling == "yarn":
        k.update(_yarn_keys(m, notes))
    elif m.rope_scaling == "linear":
        k["rope_linear_scaling_factor"] = m.rope_scaling_factor
        if m.rope_local_theta and not name.startswith("gemma3"):
            notes.append("model: MaxText 0.2.5 leaves the sliding-window layers' RoPE unscaled only under "
                         "model_name gemma3-*; here rope_linear_scaling_factor scales every layer")
    return k


def _yarn_keys(m, notes: list[str]) -> dict[str, Any]:
    """DeepSeek's YaRN: MaxText's `mscale` is the softmax temperature term (config.json's mscale_all_dim);
    rope_attention_scaling scales cos/sin by 0.1 ln(factor) + 1, the ratio of the two terms when mscale is 1 and
    mscale_all_dim 0; equal terms cancel (no scaling)."""
    factor = _int_key("rope_factor", m.rope_scaling_factor, notes)
    scaled = m.rope_mscale != m.rope_mscale_all_dim
    if scaled and (m.rope_mscale, m.rope_mscale_all_dim) != (1.0, 0.0):
        notes.append(f"model: MaxText 0.2.5's YaRN expresses equal mscale and mscale_all_dim, or 1 and 0; this "
                     f"model has {m.rope_mscale:g} and {m.rope_mscale_all_dim:g}")
    return {"rope_type": "yarn", "max_position_embeddings": factor * m.rope_original_context,
            "original_max_position_embeddings": m.rope_original_context, "rope_factor": factor,
            "beta_fast": _int_key("beta_fast", m.rope_beta_fast, notes),
            "beta_slow": _int_key("beta_slow", m.rope_beta_slow, notes), "mscale": m.rope_mscale_all_dim,
            "rope_interleave": True, "rope_truncate": True, "rope_attention_scaling": scaled}


def _router_keys(m, block: str, name: str, notes: list[str]) -> dict[str, Any]:
    """The router as MaxText 0.2.5 builds it per decoder block (layers/moe.py get_topk): the mixtral block takes a
    softmax over the top-k logits; the deepseek block applies routed_score_func to all experts, renormalises the
    top-k only for sigmoid scores, then scales by routed_scaling_factor."""
    if block != "deepseek":
        plain = all(getattr(m, f) == v for f, v in ROUTER_DEFAULTS.items())
        if not plain:
            notes.append(f"model: MaxText 0.2.5's {block} block routes by a softmax over the top-k logits; this "
                         f"model's {m.router_score} router (scale {m.router_topk_scale:g}, bias "
                         f"{m.router_expert_bias}, {m.router_groups} groups) is not exported")
        return {}
    k: dict[str, Any] = {"routed_score_func": m.router_score, "routed_scaling_factor": m.router_topk_scale,
                         "routed_bias": m.router_expert_bias}
    if m.router_bias_update_rate:
        k["routed_bias_update_rate"] = m.router_bias_update_rate
    if m.router_groups:
        k.update(n_routing_groups=m.router_groups, topk_routing_group=m.router_group_topk)
    if m.router_norm_topk != (m.router_score == "sigmoid"):
        notes.append(f"model: MaxText 0.2.5's deepseek block renormalises the top-k weights only for sigmoid "
                     f"scores; this model's {m.router_score} router "
                     f"{'does' if m.router_norm_topk else 'does not'}")
    if (m.router_expert_bias or m.router_groups) and not name.startswith(DEEPSEEK_ROUTING_NAMES):
        notes.append("model: MaxText 0.2.5 keeps the expert bias out of the routing weights and limits routing to "
                     "topk_routing_group groups only under model_name deepseek3-* (layers/moe.py); this export "
                     "names no such model, so the weights include the bias and the groups are not applied")
    return k


def _block_notes(m, block: str) -> list[str]:
    """What the decoder block builds its own way: RMSNorm, RoPE on every dimension, no biases, its own norms."""
    notes = []
    if m.norm != "rmsnorm":
        notes.append(f"model: MaxText 0.2.5's {block} block uses RMSNorm; this model's {m.norm} is not exported")
    if m.position_embedding != "rope":
        notes.append(f"model: MaxText 0.2.5's {block} block applies RoPE; this model's {m.position_embedding} "
                     "position embedding is not exported")
    if m.rope_fraction != 1.0:
        notes.append(f"model: MaxText 0.2.5's {block} block rotates every head dimension; this model rotates "
                     f"{m.rope_fraction:g}")
    if m.linear_bias:
        notes.append(f"model: MaxText 0.2.5's {block} block has no projection biases; this model's are not exported")
    if m.activation == "relu2":
        notes.append("model: MaxText 0.2.5 has no squared ReLU (mlp_activations are jax.nn functions); exported as "
                     "relu")
    if m.qk_norm and not m.is_mla and block in ("llama2", "mixtral"):
        notes.append(f"model: MaxText 0.2.5's {block} block has no query/key norms; this model's are not exported")
    return notes


def maxtext_config(pf: PlanFile) -> tuple[dict[str, Any], Adapted]:
    """The MaxText keys for the nearest expressible plan, in the order they are written, and that plan."""
    ad = maxtext_plan(pf)
    plan, job, chip = ad.plan, ad.job, pf.hardware
    keys, model_notes = model_keys(pf)
    accum = job.global_batch // (plan.batch_shards * plan.micro_batch)
    ga = 1 if plan.pp > 1 else accum
    keys["max_target_length"] = job.seq_len
    keys["per_device_batch_size"] = _per_device_batch(job.global_batch, pf.chips, ga)
    keys["gradient_accumulation_steps"] = ga
    keys["dtype"] = "float16" if job.precision == "fp16" else "bfloat16"
    keys["weight_dtype"] = job.weight_dtype
    keys["scan_layers"] = job.scan_layers
    if job.precision in ("int8", "fp8"):
        keys["quantization"] = job.precision
    if chip.vendor in ("tpu", "gpu", "cpu"):
        keys["hardware"] = chip.vendor
    ici, dcn, slices, mesh_note = mesh_split(pf, plan)
    keys["num_slices"] = slices
    for a in AXES:
        keys[f"ici_{AXIS_KEYS[a]}_parallelism"] = ici[a]
    for a in AXES:
        keys[f"dcn_{AXIS_KEYS[a]}_parallelism"] = dcn[a]
    if chip.scale_up.kind == "torus" and _splits_physical_axes(ici, chip, pf.chips // slices):
        keys["allow_split_physical_axes"] = True
    if plan.pp > 1:
        keys["num_pipeline_microbatches"] = accum
        keys["num_layers_per_pipeline_stage"] = pf.model.n_layers // (plan.pp * plan.vpp)
        keys["pipeline_parallel_layers"] = pf.model.n_layers
    keys["remat_policy"] = plan.remat.name
    if plan.remat.name == "custom":
        keys.update(_remat_keys(pf, plan.remat))
    keys["shard_optimizer_over_data"] = plan.zero >= 1
    keys["optimizer_memory_host_offload"] = plan.offload_optimizer
    keys["parameter_memory_host_offload"] = plan.offload_params
    keys["num_vocab_tiling"] = plan.vocab_tiles
    extra = tuple(model_notes) + ((mesh_note,) if mesh_note else ())
    return keys, replace(ad, notes=ad.notes + extra)


def _value(v: Any) -> str:
    """One value as YAML flow text written by PyYAML's emitter, never by hand: strings double-quoted with quotes,
    backslashes, line breaks and control characters escaped by it; numbers and booleans as YAML 1.1 reads them
    back (1e-05 is written 1.0e-05, which PyYAML reads as a float where the bare repr reads as a string)."""
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    text = yaml.safe_dump(v, default_style='"' if isinstance(v, str) else None, width=math.inf)
    text = text.removesuffix("\n...\n").removesuffix("\n")
    assert "\n" not in text, text
    return text


MODEL_SECTION = ("model_name", "decoder_block", "base_emb_dim", "base_num_query_heads", "base_num_kv_heads",
                 "head_dim", "base_mlp_dim", "base_num_decoder_layers", "vocab_size", "mlp_activations",
                 "logits_via_embedding", "normalization_layer_epsilon", "enable_dropout", "dropout_rate",
                 "num_experts", "num_experts_per_tok", "base_moe_mlp_dim", "capacity_factor", "first_num_dense_layers",
                 "shared_experts", "routed_score_func", "routed_scaling_factor", "routed_bias",
                 "routed_bias_update_rate", "n_routing_groups", "topk_routing_group", "attention_type",
                 "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 "sliding_window_size", "rope_max_timescale", "local_rope_max_timescale", "rope_type",
                 "rope_linear_scaling_factor", "max_position_embeddings", "original_max_position_embeddings",
                 "rope_factor", "beta_fast", "beta_slow", "mscale", "rope_interleave", "rope_truncate",
                 "rope_attention_scaling")
SECTIONS = (("model", MODEL_SECTION),
            ("sequence, batch and precision", ("max_target_length", "per_device_batch_size",
                                               "gradient_accumulation_steps", "dtype", "weight_dtype",
                                               "scan_layers", "quantization")),
            ("mesh: ICI degrees multiply to the devices per slice, DCN degrees to num_slices", None),
            ("pipeline", ("num_pipeline_microbatches", "num_layers_per_pipeline_stage", "pipeline_parallel_layers")),
            ("rematerialisation and offload", None))


def compile_topology(pf: PlanFile, slices: int) -> str:
    key = pf.hardware_ref if pf.hardware_ref in TOPOLOGY else pf.hardware.name  # the reference may be an alias
    if key not in TOPOLOGY:  # (ironwood) or a path; then the profile's name
        return ""
    prefix, cores = TOPOLOGY[key]
    return f"compile_topology={prefix}-{cores * pf.chips // slices} compile_topology_num_slices={slices}"


def maxtext_text(pf: PlanFile) -> tuple[str, Adapted]:
    """The YAML file: escaped comments, base_config, then the keys by section, each value through `_value`."""
    keys, ad = maxtext_config(pf)
    aot = compile_topology(pf, keys["num_slices"])
    notes = [
        f"MaxText config written by planner for {pf.model.name} on {pf.chips} x {pf.hardware.name}.",
        f"Keys valid for maxtext=={MAXTEXT_VERSION} on PyPI (src/maxtext/configs/base.yml); base_config makes",
        "MaxText read its packaged base.yml first, so this file can be given as the config:",
        "  python -m maxtext.trainers.pre_train.train THIS_FILE run_name=... base_output_directory=... \\",
        "      dataset_type=synthetic (or your dataset and tokenizer keys)",
        "or pass its keys as key=value overrides after maxtext/configs/base.yml"
        + (" with override_model_config=true (model_name's file would otherwise refuse them)." if "model_name" in keys
           else "."),
        *([f"Compile ahead of time: python -m maxtext.trainers.pre_train.train_compile THIS_FILE {aot}"]
          if aot else []),
        planner_hint(pf),
    ]
    lines = [*map(comment, notes), f"base_config: {_value('base.yml')}"]
    written: set[str] = set()
    for title, names in SECTIONS:
        if names is None:
            if title.startswith("mesh"):
                names = ("hardware", "num_slices") + tuple(k for k in keys if k.startswith(("ici_", "dcn_")))
            else:
                names = tuple(k for k in keys if k not in written and not k.startswith(("ici_", "dcn_")))
        present = [n for n in names if n in keys and n not in written]
        if not present:
            continue
        lines.append(comment(title))
        for n in present:
            lines.append(f"{n}: {_value(keys[n])}")
            written.add(n)
    assert written == set(keys), set(keys) - written
    return "\n".join(lines) + "\n", ad


assert all(n in REMAT_POLICIES for n in MAXTEXT_POLICIES)
