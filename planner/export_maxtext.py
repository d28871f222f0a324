"""Plan file -> MaxText 0.2.5 config (a YAML of overrides for MaxText's base.yml).

Key names are those of maxtext==0.2.5 on PyPI (src/maxtext/configs/base.yml; snapshot of the names in
planner/maxtext_0_2_5_keys.txt). Mapping (plan -> MaxText):

  degrees          ici_{data,fsdp,tensor,context,pipeline,expert}_parallelism inside a slice and
                   dcn_*_parallelism across slices (TPU: costmodel.estimate.dcn_split; GPU: a "slice" is one
                   NVLink node, axes filled innermost first: tensor, context, expert, fsdp, pipeline, data);
                   num_slices. The ICI product is the devices per slice, the DCN product the number of slices.
  batch            per_device_batch_size = global_batch / (chips * gradient_accumulation_steps); MaxText's global
                   batch = per_device_batch_size * devices * gradient_accumulation_steps. Without pipelining
                   gradient_accumulation_steps = the plan's accumulation (micro_batch sequences per batch shard per
                   micro-step). With pp > 1 the micro-batches stream through one pipeline flush:
                   gradient_accumulation_steps = 1, num_pipeline_microbatches = the accumulation (MaxText wants a
                   multiple of the stage count), num_layers_per_pipeline_stage = n_layers / (pp * vpp) so that
                   MaxText's circular pipeline runs vpp repeats.
  zero             1 -> shard_optimizer_over_data (ZeRO-1 over `data`); the fsdp axis is MaxText's fsdp (ZeRO-3).
  remat            a named remat_policy when the per-tensor choices equal one of MaxText's (our 'none' is
                   minimal_with_context, 'selective' is minimal), else custom with decoder_layer_input,
                   query/key/value_proj, context, out_proj, mlpwi_0/mlpwi_1 (mlpwi for plain MLPs), mlpwo.
  offload          optimizer_memory_host_offload, parameter_memory_host_offload.
  precision        dtype bfloat16 (float16 for fp16), weight_dtype from the job
                   (float32, MaxText's default, or bfloat16),
                   quantization int8 / fp8.
  scan_layers      from the job (true, MaxText's default: the layers run under one lax.scan).

Not expressible in MaxText (exported as the nearest plan, with a warning): ZeRO-2/3 over the data axis (ZeRO-3
becomes the fsdp axis, ZeRO-2 becomes ZeRO-1), ZeRO-1 together with an fsdp axis (MaxText 0.2.5 refuses
shard_optimizer_over_data with fsdp > 1: zero becomes 0), tensor parallelism without sequence-sharded activations
(MaxText always shards the residual stream over `tensor`), a pipeline whose micro-batch count is not a multiple
of the stage count (the micro-batch size is lowered until it is).

Names are data, never code (issue 31): every value is written by PyYAML's emitter (`_value`), every comment line
through export_megatron.comment (line breaks, including YAML 1.1's U+0085 and U+2028, and control characters
escaped), so whatever a model or hardware name holds, the file parses to exactly the planner's keys.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import yaml

from costmodel.estimate import dcn_split
from costmodel.plan import AXES, AXIS_ORDER_INNER_TO_OUTER, REMAT_POLICIES
from hardware.errors import InputError
from planner.adapt import Adapted, named_policy
from planner.export_megatron import comment, planner_hint
from planner.planfile import PlanFile

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
    plan, why = _even_stages(pf, plan)
    if why:
        notes.append(why)
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


def model_keys(pf: PlanFile) -> tuple[dict[str, Any], list[str]]:
    m = pf.model
    notes: list[str] = []
    k: dict[str, Any] = {"decoder_block": _decoder_block(m), "base_emb_dim": m.d_model,
                         "base_num_query_heads": m.n_heads, "base_num_kv_heads": m.n_kv_heads}
    if not m.is_mla:
        k["head_dim"] = m.head_dim
    k.update(base_mlp_dim=m.ffn_dim, base_num_decoder_layers=m.n_layers, vocab_size=m.vocab_size,
             mlp_activations=["silu", "linear"] if m.gated_mlp else ["gelu"],
             logits_via_embedding=m.tied_embeddings)
    if m.is_moe:
        k.update(num_experts=m.n_experts, num_experts_per_tok=m.experts_per_token, base_moe_mlp_dim=m.moe_ffn_dim,
                 capacity_factor=float(m.capacity_factor) if m.capacity_factor > 0 else -1.0)
        if m.n_dense_layers:
            k["first_num_dense_layers"] = m.n_dense_layers
        if m.n_shared_experts:
            k["shared_experts"] = m.n_shared_experts
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
    return k, notes


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


SECTIONS = (("model", ("decoder_block", "base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "head_dim",
                       "base_mlp_dim", "base_num_decoder_layers", "vocab_size", "mlp_activations",
                       "logits_via_embedding", "num_experts", "num_experts_per_tok", "base_moe_mlp_dim",
                       "capacity_factor", "first_num_dense_layers", "shared_experts", "attention_type",
                       "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                       "sliding_window_size")),
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
        "or pass its keys as key=value overrides after maxtext/configs/base.yml.",
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
