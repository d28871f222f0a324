"""A user's MaxText config or Megatron-LM arguments -> PlanFile (the inverse of export_maxtext / export_megatron).

The chip, the chip count and the model name come from, in order: the caller (`--hardware`, `--chips`,
`--model`), what the config itself says (MaxText: compile_topology, the ICI/DCN degrees; Megatron: torchrun's
--nproc-per-node x --nnodes), and the `# planner: model=... hardware=... chips=...` line the exporters write.
Keys the planner does not model are ignored; keys whose value it cannot represent give a one-line InputError
naming the file and the key, or a note when the nearest plan is a fair stand-in.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from costmodel.catalog import load_model
from costmodel.constraints import check_plan
from costmodel.job import Job
from costmodel.model import ModelSpec
from costmodel.plan import REMAT_POLICIES, SPLIT_FLAGS, Plan, Remat, busiest_stage_layers, pipeline_split
from hardware.catalog import load_hardware
from hardware.chip import Chip
from hardware.errors import MAX_NAME_CHARS, InputError, check_name, did_you_mean, escape, excerpt, shown_path
from hardware.fileio import read_text
from hardware.yamlio import parse_yaml
from planner.export_maxtext import AXIS_KEYS, MAXTEXT_POLICIES, TOPOLOGY
from planner.planfile import PlanFile, same_shape

HINT_RE = re.compile(r"^[ \t]*#[ \t]*planner:[ \t]*(.*)$", re.MULTILINE)  # [ \t], not \s: linear on blank lines


@dataclass(frozen=True)
class Imported:
    planfile: PlanFile
    notes: tuple[str, ...] = ()


def _hints(text: str, where: str) -> dict[str, str]:
    """The `# planner: model=... hardware=... chips=...` line the exporters write. Its values are data: names
    (printable, at most MAX_NAME_CHARS) and a chip count of at most 9 digits."""
    m = HINT_RE.search(text)
    if not m:
        return {}
    hints = dict(kv.split("=", 1) for kv in m.group(1).split() if "=" in kv)
    for key, value in hints.items():
        check_name(value, f"{where}: the '# planner:' line's {excerpt(key)}")
    if "chips" in hints and not re.fullmatch(r"[1-9][0-9]{0,8}", hints["chips"]):
        raise InputError(f"{where}: the '# planner:' line's chips: expected a positive integer, got "
                         f"{excerpt(hints['chips'])}")
    return hints


def _model_name(path: Path) -> str:
    """The imported model's name: the file's stem, escaped and cut to MAX_NAME_CHARS (a name is data)."""
    return escape(path.stem)[:MAX_NAME_CHARS] or "imported"


def _chip(hardware: str | None, hints: dict[str, str], guess: str | None, where: str, example: str) -> tuple[Chip, str]:
    name = hardware or hints.get("hardware") or guess
    if not name:
        raise InputError(f"{where}: the config does not say which chip it runs on; pass --hardware (e.g. {example})")
    return load_hardware(name), name


def _named_model(spec: ModelSpec, model: str | None, hints: dict[str, str]) -> tuple[ModelSpec, str]:
    """Use the caller's model, or the hinted preset when it has exactly the config's shape."""
    if model:
        return load_model(model), model
    hint = hints.get("model")
    if hint:
        try:
            preset = load_model(hint)
        except InputError:
            preset = None
        if preset is not None and same_shape(replace(preset, maxtext_name=""), replace(spec, maxtext_name="")):
            return preset, hint  # (a Megatron-LM config cannot name MaxText's model file)
    return spec, ""


def _finish(where: str, model: ModelSpec, model_ref: str, chip: Chip, hw_ref: str, chips: int, job: Job,
            plan: Plan, notes: list[str]) -> Imported:
    try:
        check_plan(model, chip, job, plan, chips)
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    return Imported(PlanFile(model, chip, chips, job, plan, model_ref, hw_ref, path=where), tuple(notes))


# ---- MaxText ------------------------------------------------------------------------------------------------

# maxtext==0.2.5 base.yml defaults of the keys read here.
MT_DEFAULTS: dict[str, Any] = {
    "model_name": "default", "base_emb_dim": 2048, "base_num_query_heads": 16, "base_num_kv_heads": 16,
    "head_dim": 128, "base_mlp_dim": 7168, "base_num_decoder_layers": 16, "vocab_size": 32000,
    "mlp_activations": ["silu", "linear"], "logits_via_embedding": False, "num_experts": 1,
    "num_experts_per_tok": 1, "base_moe_mlp_dim": -1, "first_num_dense_layers": 0, "shared_experts": 0,
    "capacity_factor": -1.0, "attention_type": "global", "q_lora_rank": 0, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "sliding_window_size": 0,
    "decoder_block": "llama2", "global_parameter_scale": 1,
    "max_target_length": 2048, "per_device_batch_size": 12.0, "gradient_accumulation_steps": 1,
    "num_pipeline_microbatches": -1, "num_layers_per_pipeline_stage": 1, "num_pipeline_repeats": -1,
    "pipeline_parallel_layers": -1, "num_slices": -1, "dtype": "bfloat16", "quantization": "",
    "remat_policy": "full", "scan_layers": True, "shard_optimizer_over_data": False,
    "optimizer_memory_host_offload": False, "parameter_memory_host_offload": False, "hardware": "tpu",
    "compile_topology": "", "compile_topology_num_slices": -1,
    "decoder_layer_input": "device", "query_proj": "remat", "key_proj": "remat", "value_proj": "remat",
    "context": "remat", "out_proj": "remat", "mlpwi": "remat", "mlpwi_0": "remat", "mlpwi_1": "remat",
    "mlpwo": "remat",
    "ici_fsdp_parallelism": -1, "dcn_data_parallelism": -1,  # the auto axes; every other mesh degree defaults to 1
    "weight_dtype": "float32", "num_vocab_tiling": 1,
    # what builds the model (costmodel.model's build fields)
    "normalization_layer_epsilon": 1e-5, "enable_dropout": True, "dropout_rate": 0.0, "use_qk_norm": False,
    "rope_type": "default", "rope_max_timescale": 10000, "local_rope_max_timescale": -1,
    "rope_linear_scaling_factor": 1.0, "original_max_position_embeddings": 4096, "rope_factor": 40,
    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "rope_attention_scaling": False,
    "routed_score_func": "", "routed_scaling_factor": 1.0, "routed_bias": False, "routed_bias_update_rate": 0.0,
    "n_routing_groups": -1, "topk_routing_group": -1,
}
# MaxText mesh stems folded into our axes; others must be 1.
MT_AXES = {"data": "dp", "fsdp": "fsdp", "fsdp_transpose": "fsdp", "tensor": "tp", "tensor_sequence": "tp",
           "tensor_transpose": "tp", "context": "cp", "context_usp_ulysses": "cp", "sequence": "cp",
           "pipeline": "pp", "expert": "ep"}
MT_UNSUPPORTED_AXES = ("diloco", "autoregressive", "context_autoregressive")
# MaxText model_name -> our preset (same shapes).
MT_MODEL_NAMES = {"llama3.1-8b": "llama3-8b", "llama3.1-70b": "llama3-70b", "llama3.3-70b": "llama3-70b",
                  "llama3.1-405b": "llama3-405b", "deepseek3-671b": "deepseek-v3-671b",
                  "deepseek2-236b": "deepseek-v2-236b"}
MODEL_SHAPE_KEYS = ("base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_mlp_dim",
                    "base_num_decoder_layers")


MAX_INT_CHARS = 24  # a number written as a string ('10_000'): as long as hardware.yamlio's integer literals
KIND_OF_DEFAULT = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list"}

KEYS_FILE = Path(__file__).with_name("maxtext_0_2_5_keys.txt")


def maxtext_key_names() -> frozenset[str]:
    """Top-level key names of maxtext 0.2.5 base.yml (MaxText refuses any other key)."""
    lines = KEYS_FILE.read_text().splitlines()
    return frozenset(ln.strip() for ln in lines if ln.strip() and not ln.startswith("#"))


class _Keys:
    """Typed access to a MaxText config with base.yml defaults; errors name the file and the key."""

    def __init__(self, data: dict, where: str, name: str = "imported"):
        self.data, self.where, self.name = data, where, name

    def raw(self, key: str) -> Any:
        return self.data.get(key, MT_DEFAULTS.get(key))

    def int(self, key: str, default: int | None = None) -> int:
        v = self.data.get(key, MT_DEFAULTS.get(key, default))
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, str) and len(v) <= MAX_INT_CHARS:
            try:
                v = int(v.replace("_", ""))
            except ValueError:
                pass
        if isinstance(v, bool) or not isinstance(v, int):
            raise InputError(f"{self.where}: key {key!r}: expected an integer, got {excerpt(v)}")
        return v

    def count(self, key: str, default: int | None = None, auto: bool = False) -> int:
        """A positive integer (or -1, MaxText's 'auto', where `auto`)."""
        v = self.int(key, default)
        if v < 1 and not (auto and v == -1):
            raise InputError(f"{self.where}: key {key!r}: expected a positive integer{' or -1 (auto)' if auto else ''}"
                             f", got {v}")
        return v

    def float(self, key: str) -> float:
        v = self.raw(key)
        if isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                pass
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise InputError(f"{self.where}: key {key!r}: expected a finite number, got {excerpt(v)}")
        return float(v)

    def bool(self, key: str) -> bool:
        v = self.raw(key)
        if isinstance(v, str) and v.lower() in ("true", "false"):
            v = v.lower() == "true"
        if not isinstance(v, bool):
            raise InputError(f"{self.where}: key {key!r}: expected true or false, got {excerpt(v)}")
        return v

    def str(self, key: str) -> str:
        v = self.raw(key)
        if v is None:
            return ""
        if not isinstance(v, str):
            raise InputError(f"{self.where}: key {key!r}: expected a string, got {excerpt(v)}")
        return v


def _maxtext_model(k: _Keys, notes: list[str]) -> ModelSpec:
    name = k.str("model_name")
    if k.int("global_parameter_scale") != 1:
        raise InputError(f"{k.where}: key 'global_parameter_scale': only 1 is supported; give the base_* keys")
    if name != "default" and not any(key in k.data for key in MODEL_SHAPE_KEYS):
        preset = MT_MODEL_NAMES.get(name, name)
        try:
            if "/" in preset or preset.lower().endswith((".yaml", ".yml")):  # a name in a config, never a file
                raise InputError(preset)
            return load_model(preset)
        except InputError:
            raise InputError(f"{k.where}: key 'model_name': MaxText model {excerpt(name)} is not a planner preset; "
                             "pass --model (a preset, model YAML or size) or the base_* shape keys") from None
    if name == "default" and not any(key in k.data for key in MODEL_SHAPE_KEYS):
        notes.append("model: no model_name or base_* keys; MaxText's base.yml default model (16 x 2048) is used")
    acts = k.raw("mlp_activations")
    if not isinstance(acts, list) or not acts or not all(isinstance(a, str) for a in acts):
        raise InputError(f"{k.where}: key 'mlp_activations': expected a list such as [\"silu\", \"linear\"], got "
                         f"{excerpt(acts)}")
    mla = k.str("attention_type") == "mla"
    experts = k.int("num_experts")
    spec: dict[str, Any] = dict(
        name=k.name, n_layers=k.int("base_num_decoder_layers"), d_model=k.int("base_emb_dim"),
        n_heads=k.int("base_num_query_heads"), n_kv_heads=k.int("base_num_kv_heads"),
        ffn_dim=k.int("base_mlp_dim"), vocab_size=k.int("vocab_size"), gated_mlp=len(acts) > 1,
        tied_embeddings=k.bool("logits_via_embedding"), source=f"imported from MaxText config {k.where}")
    if mla:
        rope = k.int("qk_rope_head_dim")
        spec.update(head_dim=k.int("qk_nope_head_dim") + rope, q_lora_rank=k.int("q_lora_rank"),
                    kv_lora_rank=k.int("kv_lora_rank"), qk_rope_head_dim=rope, v_head_dim=k.int("v_head_dim"))
    else:
        spec["head_dim"] = k.int("head_dim")
    spec.update(_maxtext_build(k, acts[0], mla, notes))
    if experts > 1:
        moe_dim = k.int("base_moe_mlp_dim")
        cf = k.float("capacity_factor")
        spec.update(n_experts=experts, experts_per_token=k.int("num_experts_per_tok"),
                    moe_ffn_dim=moe_dim if moe_dim > 0 else spec["ffn_dim"],
                    n_dense_layers=k.int("first_num_dense_layers"), n_shared_experts=k.int("shared_experts"),
                    capacity_factor=cf if cf > 0 else 0.0, **_maxtext_router(k, notes))
    window = k.int("sliding_window_size")
    if window > 0:
        if k.str("decoder_block") == "gemma3":
            spec.update(sliding_window=window, local_per_global=5)
        elif k.str("attention_type") == "local_sliding":
            spec.update(sliding_window=window)
    try:
        return ModelSpec(**spec)
    except InputError as e:
        raise InputError(f"{k.where}: {e}") from None


def _maxtext_build(k: _Keys, act: str, mla: bool, notes: list[str]) -> dict[str, Any]:
    """Norm epsilon, dropout, activation, query/key norms, model_name and RoPE (the inverse of
    export_maxtext.model_keys; MaxText's llama2-style blocks build RMSNorm, full RoPE and no biases)."""
    if act not in ("silu", "gelu"):
        notes.append(f"model: mlp_activations {excerpt(act)} is modelled as the default activation")
    name = k.str("model_name")
    out: dict[str, Any] = dict(
        norm_eps=k.float("normalization_layer_epsilon"),
        dropout=k.float("dropout_rate") if k.bool("enable_dropout") else 0.0,
        activation=act if act in ("silu", "gelu") else "",
        qk_norm=mla or k.str("decoder_block") == "gemma3" or k.bool("use_qk_norm"),
        maxtext_name="" if name == "default" else name, rope_theta=float(k.int("rope_max_timescale")))
    if k.int("local_rope_max_timescale") > 0:
        out["rope_local_theta"] = float(k.int("local_rope_max_timescale"))
    rope_type = k.str("rope_type")
    if rope_type == "llama3.1" or name.startswith("llama3.1"):
        out.update(rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_context=8192)
    elif rope_type == "yarn":
        mscale = k.float("mscale")  # the softmax term: config.json's mscale_all_dim
        out.update(rope_scaling="yarn", rope_scaling_factor=float(k.int("rope_factor")),
                   rope_original_context=k.int("original_max_position_embeddings"),
                   rope_beta_fast=float(k.int("beta_fast")), rope_beta_slow=float(k.int("beta_slow")),
                   rope_mscale=1.0 if k.bool("rope_attention_scaling") else mscale, rope_mscale_all_dim=mscale)
    elif k.float("rope_linear_scaling_factor") != 1.0:
        out.update(rope_scaling="linear", rope_scaling_factor=k.float("rope_linear_scaling_factor"))
    return out


def _maxtext_router(k: _Keys, notes: list[str]) -> dict[str, Any]:
    """The router as the decoder block builds it (layers/moe.py get_topk): the deepseek block applies
    routed_score_func to every expert, renormalises the top-k for sigmoid scores and scales them; other blocks
    take a softmax over the top-k logits."""
    if k.str("decoder_block") != "deepseek":
        return {}
    score = k.str("routed_score_func") or "softmax"
    if score not in ("softmax", "sigmoid"):
        notes.append(f"model: routed_score_func {excerpt(score)} is modelled as softmax")
        score = "softmax"
    out: dict[str, Any] = dict(router_score=score, router_norm_topk=score == "sigmoid",
                               router_topk_scale=k.float("routed_scaling_factor"),
                               router_expert_bias=k.bool("routed_bias"))
    if out["router_expert_bias"]:
        out["router_bias_update_rate"] = k.float("routed_bias_update_rate")
    if k.int("n_routing_groups") > 0:
        out.update(router_groups=k.int("n_routing_groups"), router_group_topk=k.int("topk_routing_group"))
    return out


def _fill(vals: dict[str, int], total: int | None, where: str, level: str) -> dict[str, int]:
    """MaxText's fill_unspecified_mesh_axes: at most one -1, which takes total / product(others)."""
    unset = [a for a, v in vals.items() if v == -1]
    if len(unset) > 1:
        raise InputError(f"{where}: at most one {level} axis may be -1 (auto), got {', '.join(unset)}")
    if unset:
        if total is None:
            raise InputError(f"{where}: {level.lower()}_{unset[0]}_parallelism is -1 (auto); pass --chips so the "
                             "planner can fill it in")
        rest = math.prod(v for v in vals.values() if v != -1)
        if total % rest:
            raise InputError(f"{where}: {level} degrees {rest} do not divide {total}")
        vals = {**vals, unset[0]: total // rest}
    for a, v in vals.items():
        if v < 1:
            raise InputError(f"{where}: key {level.lower()}_{a}_parallelism: expected a positive integer or -1, "
                             f"got {v}")
    if total is not None and math.prod(vals.values()) != total:
        raise InputError(f"{where}: the product of the {level} degrees is {math.prod(vals.values())}, expected "
                         f"{total} ({'devices per slice' if level == 'ICI' else 'slices'})")
    return vals


def _topology(k: _Keys) -> tuple[str | None, int | None, int | None]:
    """(hardware preset, chips per slice, slices) from compile_topology, when it names a known TPU."""
    topo = k.str("compile_topology")
    m = re.fullmatch(r"(v4|v5p|v5e|v6e)-(\d+)", topo)
    if not m:
        return None, None, None
    preset = next(p for p, (prefix, _) in TOPOLOGY.items() if prefix == m.group(1))
    cores = TOPOLOGY[preset][1]
    slices = k.int("compile_topology_num_slices")
    return preset, int(m.group(2)) // cores, slices if slices > 0 else 1


def _maxtext_remat(k: _Keys, gated: bool, notes: list[str]) -> Remat:
    name = k.str("remat_policy") or "full"
    if name in ("none", "minimal_flash"):
        name = {"none": "full", "minimal_flash": "minimal_with_context"}[name]  # MaxText's aliases
    if name in MAXTEXT_POLICIES:
        return REMAT_POLICIES[name]
    if name != "custom":
        raise InputError(f"{k.where}: key 'remat_policy': {excerpt(name)} is not a MaxText 0.2.5 policy the planner "
                         f"models; expected one of: {', '.join((*MAXTEXT_POLICIES, 'custom'))}")
    choices = ("remat", "device", "offload")

    def get(key: str) -> str:
        v = k.str(key)
        if v not in choices:
            raise InputError(f"{k.where}: key {key!r}: expected one of remat, device, offload, got {excerpt(v)}")
        return v

    qkv = [get(t) for t in ("query_proj", "key_proj", "value_proj")]
    mlp = [get(t) for t in (("mlpwi_0", "mlpwi_1") if gated else ("mlpwi",))]
    for group, vals in (("query/key/value_proj", qkv), ("mlpwi_0/mlpwi_1", mlp)):
        if len(set(vals)) > 1:
            notes.append(f"remat: {group} differ ({', '.join(vals)}); the planner decides them together and uses "
                         f"{vals[0]!r}")
    return Remat(layer_input=get("decoder_layer_input"), qkv_proj=qkv[0], context=get("context"),
                 out_proj=get("out_proj"), mlp_in=mlp[0], mlp_out=get("mlpwo"), name="custom")


def _check_kinds(data: dict[str, object], where: str) -> None:
    """A key the planner reads holds the kind of value base.yml gives it, whichever branch reads it: a list where
    base.yml has a list (mlp_activations), a single value elsewhere (a list or mapping for a scalar key is
    refused, naming the key and the type). The exact type is checked where the key is read; keys the planner
    ignores are left to MaxText's own typed config (maxtext.configs.types.MaxTextConfig)."""
    for key, default in MT_DEFAULTS.items():
        if key not in data:
            continue
        v, want_list = data[key], isinstance(default, list)
        if (want_list and not isinstance(v, list)) or (not want_list and isinstance(v, list | dict)):
            got = "a list" if isinstance(v, list) else "a mapping" if isinstance(v, dict) else "a single value"
            raise InputError(f"{where}: key {key!r}: expected {KIND_OF_DEFAULT[type(default)]}, got {got} "
                             f"{excerpt(v)}")


def _check_maxtext_keys(data: dict[str, object], k: _Keys, where: str) -> None:
    """Every key a MaxText 0.2.5 key, and no parallelism over an axis the planner does not model."""
    known = maxtext_key_names()
    for key in data:
        if key not in known:
            raise InputError(f"{where}: key {excerpt(key)} is not a MaxText 0.2.5 config key"
                             f"{did_you_mean(str(key)[:MAX_NAME_CHARS], known)}")
    _check_kinds(data, where)
    for stem in MT_UNSUPPORTED_AXES:
        for level in ("ici", "dcn"):
            key = f"{level}_{stem}_parallelism"
            if k.int(key, 1) != 1:
                raise InputError(f"{where}: key {key!r}: the {stem} axis is not modelled by the planner; expected 1")
    for stem in MT_AXES:  # the modelled axes: a degree, or -1 (auto: fills the rest of the chips)
        for level in ("ici", "dcn"):
            k.count(f"{level}_{stem}_parallelism", 1, auto=True)


def _maxtext_mesh(k: _Keys, chips: int | None, topo_per_slice: int | None, topo_slices: int | None,
                  hints: dict[str, str], where: str) -> tuple[int, int, dict[str, int], dict[str, int]]:
    """(chips, slices, ICI and DCN degrees per MaxText axis, each -1 filled in) from the ici_/dcn_ keys,
    num_slices and the chip count (given, from compile_topology, or from a comment hint)."""
    ici_raw = {stem: k.int(f"ici_{stem}_parallelism", 1) for stem in MT_AXES}
    dcn_raw = {stem: k.int(f"dcn_{stem}_parallelism", 1) for stem in MT_AXES}
    slices = k.count("num_slices", auto=True)
    if slices == -1:
        slices = topo_slices or 1
        if slices == 1 and any(v not in (1, -1) for v in dcn_raw.values()):
            slices = math.prod(v for v in dcn_raw.values() if v != -1)
    total = chips or (topo_per_slice * slices if topo_per_slice else None)
    if total is None and -1 not in ici_raw.values():
        total = math.prod(ici_raw.values()) * slices
    if total is None and "chips" in hints:
        total = int(hints["chips"])  # at most 9 digits (_hints)
    if total is not None and total % slices:
        raise InputError(f"{where}: {total} chips do not split into num_slices={slices}")
    ici = _fill(ici_raw, total // slices if total else None, where, "ICI")
    dcn = _fill(dcn_raw, slices, where, "DCN") if slices > 1 else {s: 1 if v == -1 else v for s, v in dcn_raw.items()}
    if slices == 1 and any(v != 1 for v in dcn.values()):
        raise InputError(f"{where}: DCN degrees > 1 need num_slices > 1")
    return math.prod(ici.values()) * slices, slices, ici, dcn


def _maxtext_degrees(ici: dict[str, int], dcn: dict[str, int], notes: list[str]) -> dict[str, int]:
    """The planner's dp/fsdp/tp/cp/pp/ep degrees from MaxText's ICI x DCN axes (the variants noted)."""
    deg = dict.fromkeys(("dp", "fsdp", "tp", "cp", "pp", "ep"), 1)
    for stem, ax in MT_AXES.items():
        deg[ax] *= ici[stem] * dcn[stem]
    for stem, ax in (("fsdp_transpose", "fsdp"), ("tensor_sequence", "tp"), ("tensor_transpose", "tp"),
                     ("context_usp_ulysses", "cp"), ("sequence", "cp")):
        if ici[stem] * dcn[stem] > 1:
            notes.append(f"mesh: {stem} ({ici[stem] * dcn[stem]}) is modelled as {ax}")
    return deg


def _maxtext_batching(k: _Keys, m: ModelSpec, deg: dict[str, int], total: int, where: str,
                      notes: list[str]) -> tuple[int, int, int]:
    """(global batch, micro-batch, vpp) from per_device_batch_size, gradient_accumulation_steps and the pipeline
    keys (num_pipeline_microbatches, num_pipeline_repeats / num_layers_per_pipeline_stage)."""
    gpb = k.float("per_device_batch_size")
    ga = k.count("gradient_accumulation_steps")
    per_step = int(total * gpb)
    if per_step < 1:
        raise InputError(f"{where}: key 'per_device_batch_size': {gpb} x {total} devices is less than one sequence")
    global_batch = per_step * ga
    shards = deg["dp"] * deg["fsdp"] * deg["ep"]
    pp = deg["pp"]
    vpp = 1
    if pp > 1:
        nmb = k.count("num_pipeline_microbatches", auto=True)
        nmb = pp if nmb == -1 else nmb
        if ga > 1:
            notes.append(f"pipeline: MaxText drains the pipeline on each of the {ga} accumulation steps; the "
                         f"planner models one flush of {ga * nmb} micro-batches")
        accum = ga * nmb
        ppl = k.int("pipeline_parallel_layers")
        if ppl not in (-1, m.n_layers):
            notes.append(f"pipeline: pipeline_parallel_layers={ppl} pipelines only part of the model; the planner "
                         f"pipelines all {m.n_layers} layers")
        repeats = k.count("num_pipeline_repeats", auto=True)
        lps = k.count("num_layers_per_pipeline_stage")
        if repeats == -1:
            if m.n_layers % (pp * lps):
                raise InputError(f"{where}: key 'num_layers_per_pipeline_stage': {lps} x {pp} stages does not "
                                 f"divide {m.n_layers} layers")
            repeats = m.n_layers // (pp * lps)
        vpp = repeats
    else:
        accum = ga
    per_micro = shards * (accum // ga)  # one accumulation step splits over the batch shards (x pipeline micro-batches)
    if per_step % per_micro:
        raise InputError(f"{where}: the batch per step ({per_step} = per_device_batch_size x {total} devices) is "
                         f"not divisible by the batch shards dp*fsdp*ep = {shards}"
                         + (f" x {accum // ga} pipeline micro-batches" if pp > 1 else ""))
    micro_batch = global_batch // (shards * accum)
    if micro_batch < 1:
        raise InputError(f"{where}: fewer sequences per step ({global_batch}) than batch shards x micro-batches "
                         f"({shards} x {accum})")
    return global_batch, micro_batch, vpp


def _maxtext_precision(k: _Keys, where: str, notes: list[str]) -> tuple[str, str]:
    """(precision, weight_dtype) from dtype, quantization and weight_dtype."""
    precision = "bf16"
    quant = k.str("quantization")
    if k.str("dtype") == "float16":
        precision = "fp16"
    if quant == "int8":
        precision = "int8"
    elif quant.startswith("fp8") or quant in ("nanoo_fp8", "te_fp8_delayedscaling", "te_fp8_currentscaling"):
        precision = "fp8"
    elif quant:
        notes.append(f"precision: quantization {excerpt(quant)} is modelled as bf16")
    weight_dtype = k.str("weight_dtype") or "float32"
    if weight_dtype not in ("float32", "bfloat16"):
        raise InputError(f"{where}: weight_dtype: expected float32 or bfloat16, got {excerpt(weight_dtype)}")
    return precision, weight_dtype


def import_maxtext(path: str | Path, hardware: str | None = None, chips: int | None = None,
                   model: str | None = None) -> Imported:
    """A MaxText config YAML (keys of maxtext 0.2.5 base.yml; unlisted keys take base.yml's defaults)."""
    p = Path(path)
    where = shown_path(p)
    text = read_text(p)  # size cap, UTF-8, then the strict YAML loader (no aliases or duplicate keys)
    data = parse_yaml(text, where)
    if not isinstance(data, dict):
        raise InputError(f"{where}: expected a mapping of MaxText config keys at the top level")
    hints = _hints(text, where)
    k = _Keys(data, where, _model_name(p))
    notes: list[str] = []
    _check_maxtext_keys(data, k, where)
    topo_hw, topo_per_slice, topo_slices = _topology(k)
    chip, hw_ref = _chip(hardware, hints, topo_hw, where, "tpu-v5p or h100-sxm")
    spec = _maxtext_model(k, notes)
    m, model_ref = _named_model(spec, model, hints)
    total, slices, ici, dcn = _maxtext_mesh(k, chips, topo_per_slice, topo_slices, hints, where)
    deg = _maxtext_degrees(ici, dcn, notes)
    global_batch, micro_batch, vpp = _maxtext_batching(k, m, deg, total, where, notes)
    precision, weight_dtype = _maxtext_precision(k, where, notes)
    job = Job(seq_len=k.int("max_target_length"), global_batch=global_batch, precision=precision,
              framework="maxtext", weight_dtype=weight_dtype, scan_layers=k.bool("scan_layers"))
    plan = Plan(**deg, vpp=vpp, micro_batch=micro_batch, zero=1 if k.bool("shard_optimizer_over_data") else 0,
                sequence_parallel=True, remat=_maxtext_remat(k, m.gated_mlp, notes),
                offload_optimizer=k.bool("optimizer_memory_host_offload"),
                offload_params=k.bool("parameter_memory_host_offload"),
                slices=slices if chip.scale_up.kind == "torus" else 1,
                vocab_tiles=k.int("num_vocab_tiling", 1))
    if chip.scale_up.kind == "torus":
        _check_dcn_matches(plan, dcn, where, notes)
    return _finish(where, m, model_ref, chip, hw_ref, total, job, plan, notes)


def _check_dcn_matches(plan: Plan, dcn: dict[str, int], where: str, notes: list[str]) -> None:
    from costmodel.estimate import dcn_split

    try:
        model = dcn_split(plan)
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    got = {ax: 1 for ax in ("dp", "pp", "fsdp", "tp", "cp", "ep")}
    for stem, ax in MT_AXES.items():
        got[ax] *= dcn[stem]
    want = {ax: model.get(ax, 1) for ax in got}
    if got != want:
        show = ", ".join(f"{AXIS_KEYS[a]} {v}" for a, v in got.items() if v > 1)
        notes.append(f"mesh: the config spans slices with {show}; the planner lays DCN out as data, then pipeline, "
                     "then fsdp")


# ---- Megatron-LM -------------------------------------------------------------------------------------------

MEG_VALUE_FLAGS = {
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--kv-channels",
    "--num-query-groups", "--seq-length", "--max-position-embeddings", "--micro-batch-size", "--global-batch-size",
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--expert-model-parallel-size", "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank", "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
    "--moe-shared-expert-intermediate-size", "--moe-layer-freq", "--moe-expert-capacity-factor",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--fp8-format", "--vocab-size",
    "--optimizer-offload-fraction", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
    "--v-head-dim", "--data-parallel-sharding-strategy", "--expert-tensor-parallel-size", "--nproc-per-node",
    "--nproc_per_node", "--nnodes", "--window-size", "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers", "--normalization", "--norm-epsilon", "--position-embedding-type",
    "--rotary-base", "--rotary-percent", "--rope-scaling-factor", "--rope-type", "--rotary-scaling-factor",
    "--mscale", "--mscale-all-dim", "--attention-dropout", "--hidden-dropout", "--make-vocab-size-divisible-by",
    "--moe-router-score-function", "--moe-router-topk-scaling-factor", "--moe-router-bias-update-rate",
    "--moe-router-num-groups", "--moe-router-group-topk", "--main-grads-dtype",
}
MEG_BOOL_FLAGS = {
    "--group-query-attention", "--swiglu", "--untie-embeddings-and-output-weights", "--sequence-parallel",
    "--use-distributed-optimizer", "--bf16", "--fp16", "--optimizer-cpu-offload", "--recompute-activations",
    "--multi-latent-attention", "--use-megatron-fsdp", "--use-torch-fsdp2", "--qk-layernorm", "--squared-relu",
    "--apply-layernorm-1p", "--disable-bias-linear", "--use-rope-scaling", "--use-rotary-position-embeddings",
    "--moe-router-pre-softmax", "--moe-router-enable-expert-bias", "--account-for-embedding-in-pipeline-split",
    "--account-for-loss-in-pipeline-split", "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute",
    "--fp8-param-gather", "--grad-reduce-in-bf16",
}


def _check_uneven_split(a: _Args, n_layers: int, pp: int, vpp: int, where: str, notes: list[str]) -> None:
    """The stages' layer counts as Megatron-LM lays them out: pp * vpp must divide --num-layers unless
    --decoder-first/last-pipeline-num-layers are given; then the other stages share the rest equally (an end stage
    without its flag counts as one of them). The cost model splits as costmodel.plan.pipeline_split does; a
    different split given here is noted, not modelled."""
    flags = ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers")
    given = [a.int(f) if a.has(f) else None for f in flags]
    accounted = [f for f in ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")
                 if a.has(f)]
    if accounted:  # Megatron-Core splits them (costmodel.plan.split_accounted; checked with the plan)
        if given != [None, None]:  # TransformerConfig.__post_init__ refuses the two together
            raise InputError(f"{where}: {' and '.join(f for f, g in zip(flags, given, strict=True) if g is not None)}"
                             f" cannot be set together with {' and '.join(accounted)} (Megatron-Core refuses it); "
                             "expected one of the two ways to split")
        return
    if given == [None, None]:
        if n_layers % (pp * vpp):
            raise InputError(f"{where}: --num-layers {n_layers} is not divisible by --pipeline-model-parallel-size "
                             f"{pp}" + (f" x {vpp} virtual stages" if vpp > 1 else "") + "; Megatron-LM splits "
                             "unevenly only with --decoder-first-pipeline-num-layers / "
                             "--decoder-last-pipeline-num-layers")
        return
    for f, g in zip(flags, given, strict=True):
        if g is not None and (g < vpp or g % vpp):
            raise InputError(f"{where}: argument {f}: expected a positive multiple of the {vpp} virtual stages, "
                             f"got {g}" + (" (Megatron-Core refuses it too; an end stage one layer short with "
                                           "virtual stages: --account-for-embedding-in-pipeline-split / "
                                           "--account-for-loss-in-pipeline-split)" if vpp > 1 and g > 0 else ""))
    others = pp - sum(g is not None for g in given)
    rest = n_layers - sum(g or 0 for g in given)
    if others < 1 or rest < others or rest % others:
        raise InputError(f"{where}: {' and '.join(f for f, g in zip(flags, given, strict=True) if g is not None)} "
                         f"leave {rest} of {n_layers} layers for {others} stages; expected a positive multiple of "
                         f"{others}")
    mid = rest // others
    first, last = (mid if g is None else g for g in given)
    split = pipeline_split(n_layers, pp, vpp)
    if split is None:
        raise InputError(f"{where}: --pipeline-model-parallel-size {pp} x {vpp} virtual stages cannot hold "
                         f"{n_layers} layers (every stage needs a positive multiple of {vpp})")
    if (first, mid, last) != split:
        notes.append(f"mesh: stages of {first} / {mid} / {last} layers (first / middle / last) are modelled as "
                     f"{split[0]} / {split[1]} / {split[2]} (the planner's uneven split; busiest {max(split)}, "
                     f"given {max(first, mid, last)})")


_SHELL_PART = re.compile(r"""
    (?P<space>[ \t\r\n\f\v]+)
  | (?P<cont>\\\r?\n)
  | '(?P<single>[^']*)'
  | "(?P<double>[^"\\]*(?:\\.[^"\\]*)*)"
  | \\(?P<escape>.)
  | (?P<plain>[^ \t\r\n\f\v'"\\]+)
""", re.VERBOSE | re.DOTALL)
_DOUBLE_ESCAPE = re.compile(r'\\([$`"\\\n])')


def shell_words(text: str, where: str) -> list[str]:
    """Split a command line or bash array into words as bash does, without expanding anything: quotes,
    backslash escapes, line continuations, and comments from a '#' at the start of a word. Linear in the text
    (shlex.split is quadratic in a long quoted word: 47 s for 1 MB)."""
    words: list[str] = []
    word: list[str] | None = None
    i = 0
    while i < len(text):
        if word is None and text[i] == "#":
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
            continue
        m = _SHELL_PART.match(text, i)
        if m is None:
            line = text.count("\n", 0, i) + 1
            raise InputError(f"{where}: cannot split into arguments (a quote that is not closed, or a "
                             f"backslash at the end, at line {line})")
        i = m.end()
        kind = m.lastgroup
        if kind == "space":
            if word is not None:
                words.append("".join(word))
            word = None
        elif kind != "cont":
            part = m.group(kind)
            word = [] if word is None else word
            word.append(_DOUBLE_ESCAPE.sub(_unescape, part) if kind == "double" else part)
    if word is not None:
        words.append("".join(word))
    return words


def _unescape(m: re.Match) -> str:
    """Inside double quotes a backslash escapes only $ ` " \\ and a line break (which it removes)."""
    return "" if m.group(1) == "\n" else m.group(1)


def _meg_tokens(text: str, where: str) -> dict[str, str | bool]:
    """Flag -> value (True for a bare flag). A flag the planner reads given twice with different values is
    refused: Megatron-LM's argparse keeps the last one silently, which is seldom what a script meant."""
    tokens = shell_words(text, where)
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.startswith("--"):
            flag, eq, val = tok.partition("=")
            value: str | bool = True
            if flag in MEG_BOOL_FLAGS:
                value = True
            elif eq:
                value = val
            elif flag in MEG_VALUE_FLAGS or (i + 1 < len(tokens) and not tokens[i + 1].startswith("-")):
                if i + 1 >= len(tokens):
                    raise InputError(f"{where}: argument {flag} needs a value")
                value = tokens[i + 1]
                i += 1
            _check_repeat(out, flag, value, where)
            out[flag] = value
        i += 1
    return out


def _check_repeat(out: dict[str, str | bool], flag: str, value: str | bool, where: str) -> None:
    """Refuse a flag the planner reads given again with another value (the same value twice is harmless)."""
    if flag in out and out[flag] != value and (flag in MEG_VALUE_FLAGS or flag in MEG_BOOL_FLAGS):
        raise InputError(f"{where}: argument {flag} is given twice, {excerpt(out[flag])} and {excerpt(value)} "
                         "(Megatron-LM would use the last); keep one")


class _Args:
    def __init__(self, flags: dict[str, str | bool], where: str, name: str = "imported"):
        self.flags, self.where, self.name = flags, where, name

    def has(self, flag: str) -> bool:
        return flag in self.flags

    def int(self, flag: str, default: int | None = None) -> int:
        v = self.flags.get(flag)
        if v is None:
            if default is None:
                raise InputError(f"{self.where}: missing argument {flag} (an integer)")
            return default
        try:
            if len(str(v)) > MAX_INT_CHARS:
                raise ValueError
            return int(str(v))
        except ValueError:
            hint = " (shell variables are not expanded)" if "$" in str(v) else ""
            raise InputError(f"{self.where}: argument {flag}: expected an integer, got {excerpt(v)}{hint}") from None

    def count(self, flag: str, default: int | None = None) -> int:
        """A positive integer."""
        v = self.int(flag, default)
        if v < 1:
            raise InputError(f"{self.where}: argument {flag}: expected a positive integer, got {v}")
        return v

    def float(self, flag: str, default: float) -> float:
        v = self.flags.get(flag)
        if v is None:
            return default
        try:
            x = float(str(v))
        except ValueError:
            x = math.nan
        if not math.isfinite(x):
            raise InputError(f"{self.where}: argument {flag}: expected a finite number, got {excerpt(v)}")
        return x

    def str(self, flag: str, default: str = "") -> str:
        v = self.flags.get(flag, default)
        return v if isinstance(v, str) else default


MAX_PATTERN_LAYERS = 100_000  # --moe-layer-freq is expanded per layer; published MoE models have at most ~100


def _layer_pattern(text: str, n_layers: int, where: str) -> list[int]:
    """--moe-layer-freq: an integer N (one MoE layer every N, Megatron's `i % N == 0`) or a list expression such
    as ([0]*3+[1]*58), evaluated with no value or list larger than the layer count."""
    bad = InputError(f"{where}: argument --moe-layer-freq: expected a positive integer or a list expression of "
                     f"{n_layers} zeros and ones such as ([0]*3+[1]*{n_layers - 3}), got {excerpt(text)}")
    if n_layers > MAX_PATTERN_LAYERS:
        raise InputError(f"{where}: argument --num-layers: expected at most {MAX_PATTERN_LAYERS:,} layers for an "
                         f"MoE model, got {n_layers:,}")
    if re.fullmatch(r"\s*[0-9]{1,9}\s*", text):
        n = int(text)
        if n < 1:
            raise bad
        return [1 if i % n == 0 else 0 for i in range(n_layers)]
    try:
        out = _pattern_value(ast.parse(text.strip(), mode="eval").body, max(n_layers, 1))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise bad from None
    if not isinstance(out, list) or len(out) != n_layers or any(v not in (0, 1) for v in out):
        raise bad
    return out


def _pattern_value(node: ast.AST, bound: int) -> Any:
    """An integer, a list, or a sum or product of them, refused (ValueError) before any integer or list would
    exceed `bound`: '[0]*10**12' costs nothing."""
    if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) <= bound:
        return node.value
    if isinstance(node, ast.List) and len(node.elts) <= bound:
        return [_pattern_value(e, bound) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult):
        a, b = _pattern_value(node.left, bound), _pattern_value(node.right, bound)
        sa, sb = (len(x) if isinstance(x, list) else abs(x) for x in (a, b))
        if (sa * sb if isinstance(node.op, ast.Mult) else sa + sb) > bound:
            raise ValueError
        return a * b if isinstance(node.op, ast.Mult) else a + b
    raise ValueError


def _megatron_model(a: _Args, notes: list[str]) -> ModelSpec:
    h = a.count("--hidden-size")
    heads = a.count("--num-attention-heads")
    layers = a.count("--num-layers")
    swiglu = a.has("--swiglu")
    ffn_default = int((4 * h * 2 / 3) / 64) * 64 if swiglu else 4 * h  # Megatron's defaults
    if not a.has("--vocab-size"):
        raise InputError(f"{a.where}: missing argument --vocab-size (Megatron takes it from the tokenizer; add "
                         "--vocab-size N or pass --model)")
    spec: dict[str, Any] = dict(
        name=a.name, n_layers=layers, d_model=h, n_heads=heads, ffn_dim=a.int("--ffn-hidden-size",
                                                                                          ffn_default),
        vocab_size=_megatron_vocab(a, notes), gated_mlp=swiglu,
        tied_embeddings=not a.has("--untie-embeddings-and-output-weights"),
        source=f"imported from Megatron-LM arguments {a.where}", **_megatron_build(a, notes))
    if a.has("--multi-latent-attention"):
        rope = a.int("--qk-pos-emb-head-dim", 64)
        spec.update(head_dim=a.int("--qk-head-dim", 128) + rope, q_lora_rank=a.int("--q-lora-rank", 0),
                    kv_lora_rank=a.int("--kv-lora-rank", 32), qk_rope_head_dim=rope, v_head_dim=a.int("--v-head-dim",
                                                                                                        128))
    else:
        spec["head_dim"] = a.int("--kv-channels", h // heads if h % heads == 0 else 0)
        spec["n_kv_heads"] = a.int("--num-query-groups", 1) if a.has("--group-query-attention") else heads
    experts = a.int("--num-experts", 0)
    if experts:
        pattern = _layer_pattern(a.str("--moe-layer-freq", "1"), layers, a.where)
        dense = next((i for i, v in enumerate(pattern) if v), layers)
        if any(v == 0 for v in pattern[dense:]):
            notes.append(f"model: --moe-layer-freq interleaves dense and MoE layers; the planner models its "
                         f"{pattern.count(0)} dense layers as leading ones")
            dense = pattern.count(0)
        moe_dim = a.count("--moe-ffn-hidden-size", spec["ffn_dim"])
        shared = a.int("--moe-shared-expert-intermediate-size", 0)
        if shared % moe_dim:
            notes.append(f"model: shared-expert size {shared} is not a multiple of the expert size {moe_dim}; "
                         f"rounded to {round(shared / moe_dim)} shared experts")
        spec.update(n_experts=experts, experts_per_token=a.int("--moe-router-topk", 2), moe_ffn_dim=moe_dim,
                    n_dense_layers=dense, n_shared_experts=round(shared / moe_dim),
                    capacity_factor=max(0.0, a.float("--moe-expert-capacity-factor", 0.0)), **_megatron_router(a))
    try:
        return ModelSpec(**spec)
    except InputError as e:
        raise InputError(f"{a.where}: {e}") from None


def _megatron_vocab(a: _Args, notes: list[str]) -> int:
    """--vocab-size padded as Megatron-LM pads it: up to a multiple of --make-vocab-size-divisible-by (128) x TP
    (megatron/core/tokenizers/utils/build_tokenizer.py vocab_size_with_padding)."""
    vocab = a.count("--vocab-size")
    step = a.count("--make-vocab-size-divisible-by", 128) * a.count("--tensor-model-parallel-size", 1)
    padded = -(-vocab // step) * step
    if padded != vocab:
        notes.append(f"model: Megatron-LM pads --vocab-size {vocab} to a multiple of {step} "
                     f"(--make-vocab-size-divisible-by x TP): {padded}")
    return padded


def _megatron_build(a: _Args, notes: list[str]) -> dict[str, Any]:
    """Norm, activation, biases, dropout, query/key norms and positions, with Megatron-LM's defaults for what is
    not given (LayerNorm, GeLU, biases, dropout 0.1, learned absolute positions; arguments.py)."""
    norm = {"RMSNorm": "rmsnorm", "LayerNorm": "layernorm"}.get(a.str("--normalization", "LayerNorm"))
    if norm is None:
        raise InputError(f"{a.where}: argument --normalization: expected LayerNorm or RMSNorm, got "
                         f"{excerpt(a.str('--normalization'))}")
    attn_drop, hidden_drop = a.float("--attention-dropout", 0.1), a.float("--hidden-dropout", 0.1)
    if attn_drop != hidden_drop:
        notes.append(f"model: --attention-dropout {attn_drop:g} and --hidden-dropout {hidden_drop:g} differ; the "
                     f"planner keeps one dropout, {hidden_drop:g}")
    out: dict[str, Any] = dict(
        norm="layernorm1p" if norm == "layernorm" and a.has("--apply-layernorm-1p") else norm,
        norm_eps=a.float("--norm-epsilon", 1e-5), linear_bias=not a.has("--disable-bias-linear"),
        dropout=hidden_drop, qk_norm=a.has("--qk-layernorm"),
        activation="relu2" if a.has("--squared-relu") else "silu" if a.has("--swiglu") else "gelu")
    out.update(_megatron_rope(a, notes))
    return out


def _megatron_rope(a: _Args, notes: list[str]) -> dict[str, Any]:
    """Learned positions, or RoPE: base, rotated fraction, Llama 3.1 scaling, and MLA's YaRN (its default
    --rope-type; original context and betas fixed by MLATransformerConfig at 4096, 32 and 1)."""
    kind = a.str("--position-embedding-type", "learned_absolute")
    if a.has("--use-rotary-position-embeddings"):
        kind = "rope"
    if kind not in ("rope", "yarn"):
        if kind != "learned_absolute":
            notes.append(f"model: --position-embedding-type {excerpt(kind)} is modelled as learned absolute")
        return {"position_embedding": "learned"}
    out: dict[str, Any] = dict(position_embedding="rope", rope_theta=a.float("--rotary-base", 10000.0),
                               rope_fraction=a.float("--rotary-percent", 1.0))
    if a.has("--multi-latent-attention") and a.str("--rope-type", "yarn") == "yarn":
        out.update(rope_scaling="yarn", rope_scaling_factor=a.float("--rotary-scaling-factor", 1.0),
                   rope_original_context=4096, rope_mscale=a.float("--mscale", 1.0),
                   rope_mscale_all_dim=a.float("--mscale-all-dim", 0.0))
    elif a.has("--use-rope-scaling"):
        out.update(rope_scaling="llama3", rope_scaling_factor=a.float("--rope-scaling-factor", 8.0),
                   rope_original_context=8192)
    return out


def _megatron_router(a: _Args) -> dict[str, Any]:
    """The router as megatron/core/transformer/moe/moe_utils.py routes: softmax over the top-k logits (or over all
    experts with --moe-router-pre-softmax, not renormalised), or sigmoid scores renormalised over the top-k."""
    score = a.str("--moe-router-score-function", "softmax")
    if score not in ("softmax", "sigmoid"):
        raise InputError(f"{a.where}: argument --moe-router-score-function: expected softmax or sigmoid, got "
                         f"{excerpt(score)}")
    bias = a.has("--moe-router-enable-expert-bias")
    return dict(router_score=score, router_norm_topk=score == "sigmoid" or not a.has("--moe-router-pre-softmax"),
                router_topk_scale=a.float("--moe-router-topk-scaling-factor", 1.0), router_expert_bias=bias,
                router_bias_update_rate=a.float("--moe-router-bias-update-rate", 1e-3) if bias else 0.0,
                router_groups=a.int("--moe-router-num-groups", 0),
                router_group_topk=a.int("--moe-router-group-topk", 0))


def _megatron_world(a: _Args, chips: int | None, hints: dict[str, str], where: str) -> int:
    """The world size: given, from --nnodes x --nproc-per-node (a torchrun line), or from a comment hint."""
    world = chips
    if world is None and a.has("--nnodes") and (a.has("--nproc-per-node") or a.has("--nproc_per_node")):
        per = a.count("--nproc-per-node") if a.has("--nproc-per-node") else a.count("--nproc_per_node")
        world = per * a.count("--nnodes")
    if world is None and "chips" in hints:
        world = int(hints["chips"])  # at most 9 digits (_hints)
    if world is None:
        raise InputError(f"{where}: Megatron-LM arguments do not give the world size; pass --chips")
    return world


def _megatron_degrees(a: _Args, world: int, where: str, notes: list[str]) -> tuple[int, int, int, int, int]:
    """(Megatron's data-parallel size, tp, pp, cp, ep); the experts are carved out of the data-parallel ranks."""
    tp = a.int("--tensor-model-parallel-size", 1)
    pp = a.int("--pipeline-model-parallel-size", 1)
    cp = a.int("--context-parallel-size", 1)
    ep = a.int("--expert-model-parallel-size", 1)
    for flag, v in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                    ("--context-parallel-size", cp), ("--expert-model-parallel-size", ep)):
        if v < 1:
            raise InputError(f"{where}: argument {flag}: expected a positive integer, got {v}")
    if world % (tp * pp * cp):
        raise InputError(f"{where}: world size {world} is not divisible by TP*PP*CP = {tp}*{pp}*{cp}")
    dp_meg = world // (tp * pp * cp)
    if dp_meg % ep:
        raise InputError(f"{where}: --expert-model-parallel-size {ep} must divide the data-parallel size "
                         f"{dp_meg} (the planner carves experts out of the data-parallel ranks only)")
    if a.has("--expert-tensor-parallel-size") and a.int("--expert-tensor-parallel-size") != tp:
        notes.append("mesh: --expert-tensor-parallel-size differs from TP; the planner shards experts over TP")
    return dp_meg, tp, pp, cp, ep


def _megatron_vpp(a: _Args, n_layers: int, pp: int, where: str) -> int:
    """Model chunks per pipeline rank: --num-layers-per-virtual-pipeline-stage or
    --num-virtual-stages-per-pipeline-rank (1 without either). n_layers: with the embedding and the loss where
    the --account-for-...-in-pipeline-split flags count them (megatron/training/arguments.py does the same)."""
    if a.has("--num-layers-per-virtual-pipeline-stage"):
        per_chunk = a.int("--num-layers-per-virtual-pipeline-stage")
        if per_chunk < 1:
            raise InputError(f"{where}: argument --num-layers-per-virtual-pipeline-stage: expected a positive "
                             f"integer, got {per_chunk}")
        if n_layers % (pp * per_chunk):
            raise InputError(f"{where}: --num-layers-per-virtual-pipeline-stage {per_chunk} x PP {pp} does not "
                             f"divide {n_layers} layers")
        return n_layers // (pp * per_chunk)
    if a.has("--num-virtual-stages-per-pipeline-rank"):
        vpp = a.int("--num-virtual-stages-per-pipeline-rank")
        if vpp < 1:
            raise InputError(f"{where}: argument --num-virtual-stages-per-pipeline-rank: expected a positive "
                             f"integer, got {vpp}")
        return vpp
    return 1


def _megatron_zero(a: _Args) -> int:
    """ZeRO stage: 1 with the distributed optimizer; Megatron-FSDP's sharding strategy; 3 under torch FSDP2."""
    zero = 1 if a.has("--use-distributed-optimizer") else 0
    if a.has("--use-megatron-fsdp"):
        zero = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}.get(
            a.str("--data-parallel-sharding-strategy", "optim_grads_params"), 3)
    if a.has("--use-torch-fsdp2"):
        zero = 3
    return zero


def _megatron_remat(a: _Args, where: str, notes: list[str]) -> tuple[Remat, int]:
    """--recompute-granularity (or --recompute-activations) as a policy, and --recompute-num-layers N under
    --recompute-method block (Plan.recompute_num_layers; 0 elsewhere). Uniform groups of N > 1 layers are
    modelled as uniform 1 (every layer recomputed, each keeping its input), with a note."""
    gran = a.str("--recompute-granularity") or ("selective" if a.has("--recompute-activations") else "")
    if gran == "selective":
        return REMAT_POLICIES["selective"], 0
    if gran == "full":
        method, n = a.str("--recompute-method", "uniform"), a.int("--recompute-num-layers", 1)
        if method == "block":  # the first n layers of each chunk recomputed (megatron/core/recompute.py)
            if n < 1:
                notes.append(f"remat: --recompute-method block --recompute-num-layers {n} recomputes no layer; "
                             "remat none")
                return REMAT_POLICIES["none"], 0
            return REMAT_POLICIES["full"], n
        if n != 1:
            notes.append(f"remat: --recompute-method {method} --recompute-num-layers {n} is modelled as full "
                         "recompute of every layer, each keeping its input (uniform 1: one input per layer, not "
                         f"per group of {n}, and one layer's activations in the backward, not {n})")
        return REMAT_POLICIES["full"], 0
    if gran in ("", "none"):
        return REMAT_POLICIES["none"], 0
    raise InputError(f"{where}: argument --recompute-granularity: expected full or selective, got {excerpt(gran)}")


def _megatron_precision(a: _Args, notes: list[str]) -> str:
    """--bf16 / --fp16 / --fp8-format as the job's precision (fp32 training noted and modelled as bf16)."""
    precision = "fp16" if a.has("--fp16") else "bf16"
    if a.has("--fp8-format"):
        precision = "fp8"
    if not (a.has("--bf16") or a.has("--fp16")):
        notes.append("precision: neither --bf16 nor --fp16 (Megatron would train in fp32); modelled as bf16")
    return precision


def _megatron_ep_overlap(a: _Args, pp: int, vpp: int, where: str) -> bool:
    """--overlap-moe-expert-parallel-comm (the rest of its checks with the plan: constraints.check_ep_overlap);
    refused where Megatron-Core refuses it: pp > 1 without virtual stages (TransformerConfig.__post_init__), or
    --delay-wgrad-compute without it."""
    on = a.has("--overlap-moe-expert-parallel-comm")
    if a.has("--delay-wgrad-compute") and not on:
        raise InputError(f"{where}: --delay-wgrad-compute needs --overlap-moe-expert-parallel-comm (Megatron-Core "
                         "refuses it alone); expected both or neither")
    if on and pp > 1 and vpp == 1:
        raise InputError(f"{where}: --overlap-moe-expert-parallel-comm with --pipeline-model-parallel-size {pp} "
                         "needs virtual stages (Megatron-Core refuses it otherwise); expected "
                         "--num-virtual-stages-per-pipeline-rank > 1")
    return on


def import_megatron(path: str | Path, hardware: str | None = None, chips: int | None = None,
                    model: str | None = None) -> Imported:
    """Megatron-LM pretrain_gpt.py arguments: an args file, a bash array or a copied command line."""
    p = Path(path)
    where = shown_path(p)
    text = read_text(p)  # size cap and UTF-8, one-line errors
    hints = _hints(text, where)
    a = _Args(_meg_tokens(text, where), where, _model_name(p))
    notes: list[str] = []
    chip, hw_ref = _chip(hardware, hints, None, where, "h100-sxm")
    if model:
        m, model_ref = load_model(model), model
    else:
        m, model_ref = _named_model(_megatron_model(a, notes), None, hints)
    world = _megatron_world(a, chips, hints, where)
    dp_meg, tp, pp, cp, ep = _megatron_degrees(a, world, where, notes)
    split_flags = {f: a.has("--" + f.replace("_", "-")) for f in SPLIT_FLAGS}
    split_layers = m.n_layers + sum(split_flags.values())  # the layers Megatron-Core's split divides
    vpp = _megatron_vpp(a, split_layers, pp, where)
    _check_uneven_split(a, m.n_layers, pp, vpp, where, notes)
    mbs = a.count("--micro-batch-size")
    gbs = a.count("--global-batch-size", mbs * dp_meg)
    if gbs % (mbs * dp_meg):
        raise InputError(f"{where}: --global-batch-size {gbs} is not divisible by --micro-batch-size x data-parallel "
                         f"size = {mbs} x {dp_meg}")
    zero = _megatron_zero(a)
    remat, block_layers = _megatron_remat(a, where, notes)
    overlap = _megatron_ep_overlap(a, pp, vpp, where)
    offload = a.has("--optimizer-cpu-offload")
    if offload and a.float("--optimizer-offload-fraction", 1.0) < 1.0:
        notes.append("offload: --optimizer-offload-fraction < 1 is modelled as offloading all optimizer state")
    precision = _megatron_precision(a, notes)
    if a.has("--window-size"):
        notes.append("model: --window-size (sliding-window attention) is not read; the model attends globally")
    job = Job(seq_len=a.int("--seq-length"), global_batch=gbs, precision=precision, framework="megatron")
    plan = Plan(dp=dp_meg // ep, tp=tp, cp=cp, pp=pp, ep=ep, vpp=vpp, micro_batch=mbs, zero=zero,
                sequence_parallel=a.has("--sequence-parallel"), remat=remat, offload_optimizer=offload, **split_flags,
                overlap_moe_expert_parallel_comm=overlap)
    plan = plan.with_(recompute_num_layers=_block_layers(m, plan, block_layers))
    # --cpu-offloading-num-layers N: on only when N > 0 (arguments.py sets cpu_offloading from it); check_plan
    # then applies TransformerConfig's checks (pp 1, no recompute, N < num_layers)
    plan = plan.with_(cpu_offload_layers=max(0, a.int("--cpu-offloading-num-layers", 0)))
    # --fp8-param-gather: check_plan applies Megatron's checks (--fp8-format, the distributed optimizer)
    plan = plan.with_(fp8_param_gather=a.has("--fp8-param-gather"))
    # --grad-reduce-in-bf16, or --main-grads-dtype bf16 (precision-aware optimizer): arguments.py validate_args then
    # leaves accumulate_allreduce_grads_in_fp32 False, so DistributedDataParallelConfig.grad_reduce_in_fp32 False
    # (training.py get_megatron_ddp_config); check_plan applies check_grad_bf16
    bf16_grads = a.has("--grad-reduce-in-bf16") or a.str("--main-grads-dtype") == "bf16"
    plan = plan.with_(grad_reduce_in_bf16=bf16_grads)
    return _finish(where, m, model_ref, chip, hw_ref, world, job, plan, notes)


def _block_layers(m: ModelSpec, plan: Plan, n: int) -> int:
    """Plan.recompute_num_layers for --recompute-method block --recompute-num-layers n: 0 (every layer, as remat
    full) when n covers the largest model chunk (stage layers / vpp), else n. A split Megatron refuses is left to
    check_plan's message."""
    if not n:
        return 0
    try:
        chunk = -(-busiest_stage_layers(m.n_layers, plan) // plan.vpp)  # layers of the largest model chunk
    except InputError:
        return n
    return 0 if n >= chunk else n


def import_config(kind: str, path: str, hardware: str | None = None, chips: int | None = None,
                  model: str | None = None) -> Imported:
    fn = {"maxtext": import_maxtext, "megatron": import_megatron}[kind]
    return fn(path, hardware=hardware, chips=chips, model=model)


def with_model_name(pf: PlanFile, name: str) -> PlanFile:
    return replace(pf, model=replace(pf.model, name=name))
