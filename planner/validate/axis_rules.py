"""The validator's weight shardings from MaxText's own rules, not from the cost model it checks (no jax here).

Each weight carries the logical axis names MaxText 0.2.5 gives its kernel (KERNEL_AXES); MaxText's
`logical_axis_rules` (LOGICAL_AXIS_RULES, configs/base.yml) turn them into mesh axes by flax's priority rule
(flax.linen.spmd._logical_to_mesh_axes: the first rule for a name whose mesh axes the array does not use yet);
MaxText's mesh axes are then renamed to the validator's (MESH_RENAME), the ones the validator lacks (always of size
1 there) dropped. ZeRO-1 adds `data` to the optimizer moments as MaxText's add_data_to_sharding does
(utils/sharding.py). ZeRO-3 over dp has no MaxText axis: its export folds dp into fsdp (planner.export_maxtext), so
MaxText's `fsdp` spans the validator's fsdp and dp then.
"""

from __future__ import annotations

import math

from costmodel.plan import Plan

Entry = str | tuple[str, ...] | None  # one dimension of a PartitionSpec: unsplit, one axis, or several

# MaxText 0.2.5 configs/base.yml `logical_axis_rules`: the entries for weights and the activation batch, in order
# (order is priority: `mlp` comes before `embed`, so a dense kernel's `embed` falls through to the second rule).
LOGICAL_AXIS_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("vocab", ("tensor", "tensor_sequence", "autoregressive")),
    ("embed_vocab", ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "expert")),
    ("heads", ("tensor", "tensor_sequence", "autoregressive")),
    ("q_heads", ("tensor", "tensor_sequence", "autoregressive")),
    ("kv_heads", ("tensor", "tensor_sequence", "autoregressive")),
    ("qkv", ()),
    ("kv", ()),
    ("kv_head_dim", ()),
    ("q_lora", ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "expert")),
    ("q_lora", ("fsdp", "context", "context_usp_ulysses", "expert")),
    ("q_lora_up_proj", ()),
    ("kv_lora", ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "expert")),
    ("kv_lora", ("fsdp", "context", "context_usp_ulysses", "expert")),
    ("kv_lora_up_proj", ()),
    ("embed_attn", ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "expert")),
    ("exp", ("expert",)),
    ("mlp_moe", ("fsdp_transpose", "tensor", "tensor_sequence", "autoregressive")),
    ("embed_moe", ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses")),
    ("embed_moe", ("fsdp", "context", "context_usp_ulysses")),
    ("embed_router", ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses")),
    ("embed_router", ("fsdp", "context", "context_usp_ulysses")),
    ("activation_batch", ("data", "fsdp", "fsdp_transpose", "expert")),
    ("mlp", ("fsdp_transpose", "tensor", "tensor_sequence", "autoregressive")),
    ("embed", ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "expert")),
    ("embed", ("fsdp", "context", "context_usp_ulysses", "expert")),
    ("layers", ("stage",)),
)

# MaxText's mesh axes (configs/base.yml mesh_axes) -> the validator's; the others are absent (size 1)
MESH_RENAME = {"data": "dp", "stage": "pp", "fsdp": "fsdp", "context": "cp", "tensor": "tp", "expert": "ep"}

_ATTN = {"wqkv": ("embed_attn", "kv_heads", "qkv", "kv_head_dim"),  # fused: per KV head, its queries, key, value
         "wq": ("embed_attn", "q_heads", "kv"), "wo": ("heads", "kv", "embed_attn"),  # layers/attentions.py
         "wq_a": ("embed_attn", "q_lora_up_proj"), "wq_b": ("q_lora", "q_heads", "kv"),  # layers/attention_mla.py
         "wkv_a": ("embed_attn", "kv_lora_up_proj"), "wkv_b": ("kv_lora", "kv_heads", "kv_head_dim"),
         # norm scales: laid out as the activations they scale. MaxText splits both over tensor (`norm`,
         # `activation_embed`); the validator's residual stream keeps d whole (Megatron's layout, its sequence
         # parallelism), so its norm scales do too (split alone, XLA split the norm outputs and re-gathered them)
         "q_norm": (None,), "kv_norm": (None,), "norm1": (None,), "norm2": (None,)}
_MLP = {"wi": ("embed", "num_activations", "mlp"), "wo_mlp": ("mlp", "embed"),  # layers/linears.py MlpBlock
        "shared_wi": ("embed", "num_activations", "mlp"), "shared_wo": ("mlp", "embed")}
_MOE = {"router": ("embed_router", None), "wi_0": ("exp", "embed_moe", "mlp_moe"),  # layers/moe.py
        "wi_1": ("exp", "embed_moe", "mlp_moe"), "wo_mlp": ("exp", "mlp_moe", "embed_moe")}
# embeddings.py Embed (`vocab`, `embed_vocab`); nnx_decoders.py logits kernel; the final norm
_TOP = {"embed": ("vocab", "embed_vocab"), "unembed": ("embed_vocab", "vocab"), "final_norm": (None,)}


def kernel_axes(name: str, moe_layer: bool = False) -> tuple[str | None, ...]:
    """MaxText's logical axes of the validator's weight `name` (a layer's weights of a MoE layer: moe_layer)."""
    if name in _TOP:
        return _TOP[name]
    if moe_layer and name in _MOE:
        return _MOE[name]
    return {**_ATTN, **_MLP}[name]


def logical_to_mesh(names: tuple[str | None, ...]) -> list[tuple[str, ...]]:
    """flax.linen.spmd._logical_to_mesh_axes over LOGICAL_AXIS_RULES: per dimension, MaxText's mesh axes."""
    out: list[tuple[str, ...] | None] = [None] * len(names)
    for rule, mesh in LOGICAL_AXIS_RULES:
        if rule in names:
            pos = names.index(rule)
            used = {a for axes in out if axes for a in axes}
            if out[pos] is None and not used & set(mesh):
                out[pos] = mesh
    return [axes or () for axes in out]


def _rename(axes: tuple[str, ...], plan: Plan) -> Entry:
    """MaxText's mesh axes -> the validator's of degree > 1 (dp joins fsdp under ZeRO-3), None when unsplit."""
    out: list[str] = []
    for a in axes:
        if a == "fsdp" and plan.zero == 3:
            out += ["fsdp", "dp"]
        elif a in MESH_RENAME:
            out.append(MESH_RENAME[a])
    out = [a for a in out if plan.degrees()[a] > 1]
    return out[0] if len(out) == 1 else (tuple(out) or None)


def spec(names: tuple[str | None, ...], plan: Plan) -> tuple[Entry, ...]:
    """The validator's PartitionSpec entries of an array whose dimensions MaxText names `names`."""
    return tuple(_rename(axes, plan) for axes in logical_to_mesh(names))


def axes_of(entry: Entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else entry


def with_data(entries: tuple[Entry, ...], shape: tuple[int, ...], plan: Plan) -> tuple[Entry, ...]:
    """ZeRO-1's moment sharding, MaxText's add_data_to_sharding: `dp` prepended on the first dimension whose shard
    divides by dp and that tensor parallelism does not split (unchanged when dp already splits one)."""
    degrees = plan.degrees()
    if plan.dp == 1 or any("dp" in axes_of(e) for e in entries):
        return entries
    for i, (size, e) in enumerate(zip(shape, entries, strict=True)):
        shard = size // math.prod(degrees[a] for a in axes_of(e))
        if shard % plan.dp == 0 and "tp" not in axes_of(e):
            joined = ("dp", *axes_of(e))
            return (*entries[:i], joined[0] if len(joined) == 1 else joined, *entries[i + 1:])
    return entries


def batch_axes() -> tuple[str, ...]:
    """The validator's mesh axes of the activations' batch (MaxText's `activation_batch`), whatever their degree."""
    return tuple(MESH_RENAME[a] for a in logical_to_mesh(("activation_batch",))[0] if a in MESH_RENAME)


def dim_axes(name: str, dim: int, plan: Plan, moe_layer: bool = False) -> tuple[str, ...]:
    """The validator's axes that split dimension `dim` of weight `name`."""
    return axes_of(spec(kernel_axes(name, moe_layer), plan)[dim])


def embed_axes(plan: Plan, moments: bool = False) -> tuple[str, ...]:
    """The validator's axes that split a dense kernel's d_model (`embed`) dimension; moments: with dp under ZeRO-1
    or 2 too (the scaled d_model is a multiple of all their degrees, planner.validate.scale)."""
    axes = axes_of(spec(("embed", "mlp"), plan)[0])
    return axes + ("dp",) if moments and plan.zero in (1, 2) and plan.dp > 1 else axes
