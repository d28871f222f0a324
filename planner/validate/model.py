"""A decoder-only transformer in plain JAX that follows a Plan's shardings and remat choices.

RMSNorm, causal GQA or multi-head latent attention (planner.validate.flash: no s x s scores kept), gated or plain
MLP, optional MoE (top-k routing, by per-sequence capacity on CPU or dropless as MaxText runs it on TPU,
Setup.dropless; shared experts, leading dense layers), tied or untied embeddings, cross-entropy and Adam written
by hand. Parameters and Adam moments are fp32, cast to the compute dtype once per step (MaxText's
weight_dtype=float32 / dtype=bfloat16). Layers are unrolled so that XLA's cost analysis counts each; every layer
runs under jax.checkpoint, with remat 'none' too, so weights are re-gathered in the backward as FSDP does.

Mesh axes (outer to inner): dp, fsdp, ep, cp, tp. Batch over (dp, fsdp, ep); sequence over cp (and tp under
sequence parallelism); the weights as MaxText's logical axis rules shard them (planner.validate.axis_rules). One
training step (jit_step) for the unrolled, pipelined and scanned (TPU compile) losses. (details: docs/validator.md)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from costmodel.model import ModelSpec
from costmodel.plan import TENSOR_MAXTEXT_NAMES, TENSORS, Plan
from planner.validate import axis_rules
from planner.validate.flash import causal_attention

MESH_AXES = ("dp", "fsdp", "ep", "cp", "tp")
BATCH = axis_rules.batch_axes()  # ("dp", "fsdp", "ep"): MaxText's activation_batch
ADAM = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8)


@dataclass(frozen=True)
class Setup:
    """Everything needed to build and shard one training step."""

    model: ModelSpec
    plan: Plan
    seq_len: int
    global_batch: int
    compute_dtype: str = "bfloat16"
    flash_block: int = 512  # query / key block of the flash-style attention (planner.validate.flash)
    grad_clip: float = 0.0  # > 0: clip by global norm (MaxText's gradient_clipping_threshold, default 1.0)
    scan_pipeline: bool = False  # pp plans: the ticks as one lax.scan (planner.validate.pipeline.scanned_ticks)
    gather_stage: bool = False  # GPipe plans (vpp 1): a stage's bf16 weights gathered for the whole loop (MaxText)
    dropless: bool = False  # dropless MoE (capacity_factor 0) as MaxText runs it (moe_dropless); else capacity 1

    @property
    def cdt(self):
        return jnp.dtype(self.compute_dtype)


def mesh_axes(plan: Plan) -> tuple[str, ...]:
    return MESH_AXES if plan.pp == 1 else ("dp", "pp", "fsdp", "ep", "cp", "tp")  # pp plans: see pipeline.py


def make_mesh(plan: Plan, devices=None) -> Mesh:
    axes = mesh_axes(plan)
    sizes = [getattr(plan, a) for a in axes]
    devs = list(devices if devices is not None else jax.devices())[: math.prod(sizes)]
    return Mesh(np.array(devs).reshape(sizes), axes)


def layer_is_moe(m: ModelSpec, i: int) -> bool:
    """Layer i of `m` routes to experts (a MoE model's first n_dense_layers are dense)."""
    return m.is_moe and i >= m.n_dense_layers


def expert_in(m: ModelSpec) -> tuple[str, ...]:
    """The routed experts' input projections: MaxText's wi_0 (and wi_1 for a gated MLP), [experts, d, ffn] each."""
    return ("wi_0", "wi_1") if m.gated_mlp else ("wi_0",)


LayerKind = tuple[bool, int]  # (routed to experts, sliding window: 0 for global attention)


def layer_kind(m: ModelSpec, i: int) -> LayerKind:
    return layer_is_moe(m, i), layer_window(m, i)


def layer_groups(m: ModelSpec) -> list[tuple[tuple[LayerKind, ...], int, int]]:
    """Runs of alike blocks of layers, in order: (the block's layer kinds, first layer, blocks). A block is one
    layer, or one period of a local/global attention pattern (Gemma 3: five local layers, then a global one,
    which MaxText scans as one block); DeepSeek's layout is a run of dense layers, then a run of MoE layers
    (MaxText's dense_layers / moe_layers). A depth that is no multiple of the period ends in a shorter block."""
    period = m.local_per_global + 1 if m.sliding_window else 1
    out: list[tuple[tuple[LayerKind, ...], int, int]] = []
    for first in range(0, m.n_layers, period):
        kinds = tuple(layer_kind(m, i) for i in range(first, min(first + period, m.n_layers)))
        if out and out[-1][0] == kinds:
            out[-1] = (kinds, out[-1][1], out[-1][2] + 1)
        else:
            out.append((kinds, first, 1))
    return out


def layer_stacks(m: ModelSpec) -> list[list[int]]:
    """The layers of each stacked parameter array of the scanned step, in order: for every run of layer_groups,
    one stack per position in its block (Gemma 3: six stacks of n / 6 layers each)."""
    return [[first + b * len(kinds) + j for b in range(count)]
            for kinds, first, count in layer_groups(m) for j in range(len(kinds))]


def single_device_plan(plan: Plan) -> Plan:
    return plan.with_(dp=1, fsdp=1, tp=1, cp=1, pp=1, ep=1, vpp=1, zero=0)


# ---- shardings -------------------------------------------------------------------------------------------

def param_specs(cfg: Setup, moments: bool = False, stacks: list[list[int]] | None = None) -> dict:
    """PartitionSpecs of the parameters (moments: of the Adam moments), each weight named as MaxText names its
    kernel and sharded by MaxText's logical axis rules (planner.validate.axis_rules), not by the cost model's rule.
    stacks: the layer weights as stacked arrays, one per list of layers (an unsplit leading dimension; the
    moments' ZeRO-1 `data` placed as on one layer's weight)."""
    m, plan = cfg.model, cfg.plan
    shapes = init_params(cfg, shapes_only=True)

    def one(name: str, shape: tuple[int, ...], moe: bool = False) -> tuple:
        entries = axis_rules.spec(axis_rules.kernel_axes(name, moe), plan)
        return axis_rules.with_data(entries, shape, plan) if moments and plan.zero >= 1 else entries

    specs: dict = {k: P(*one(k, v.shape)) for k, v in shapes.items() if k != "layers"}
    layers = [{k: one(k, v.shape, layer_is_moe(m, i)) for k, v in lay.items()}
              for i, lay in enumerate(shapes["layers"])]
    specs["layers"] = ([{k: P(*e) for k, e in lay.items()} for lay in layers] if stacks is None else
                       [{k: P(None, *e) for k, e in layers[idx[0]].items()} for idx in stacks])
    return specs


def init_params(cfg: Setup, seed: int = 0, shapes_only: bool = False) -> dict:
    """fp32 parameters as numpy arrays, deterministic in `seed` (jax.random would cost seconds of compile);
    with shapes_only, jax.ShapeDtypeStructs (for ahead-of-time lowering)."""
    m = cfg.model
    d, h, kv, hd = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
    rng = np.random.default_rng(seed)

    def w(shape, fan_in):
        if shapes_only:
            return jax.ShapeDtypeStruct(shape, jnp.float32)
        return rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(fan_in))

    def ones(n):
        return jax.ShapeDtypeStruct((n,), jnp.float32) if shapes_only else np.ones((n,), np.float32)

    layers = []
    for _ in range(m.n_layers):
        # Fused projections, as Megatron and MaxText's fused_qkv / fused_mlp lay them out: per KV head its g query
        # heads, its key and its value ([d, kv, g + 2, hd], split over tp by KV head); the gated MLP's two inputs
        # side by side ([d, 2, f]). One matmul each, so the backward pass sums their input gradients before
        # the tp all-reduce (XLA:CPU reduces separate q/k/v or wi_0/wi_1 partial sums one by one).
        n_in = 2 if m.gated_mlp else 1
        lay = {"norm1": ones(d), "norm2": ones(d)}
        if m.is_mla:  # DeepSeek's multi-head latent attention (MaxText's wq_a/wq_b, wkv_a/wkv_b, out)
            rq, rkv, vd = m.q_lora_rank, m.kv_lora_rank, m.v_head_dim
            lay.update(wkv_a=w((d, rkv + m.qk_rope_head_dim), d), kv_norm=ones(rkv),
                       wkv_b=w((rkv, h, hd - m.qk_rope_head_dim + vd), rkv), wo=w((h, vd, d), h * vd))
            lay.update(dict(wq_a=w((d, rq), d), q_norm=ones(rq), wq_b=w((rq, h, hd), rq)) if rq
                       else dict(wq=w((d, h, hd), d)))
        else:
            lay.update(wqkv=w((d, kv, h // kv + 2, hd), d), wo=w((h, hd, d), h * hd))
        if layer_is_moe(m, len(layers)):
            e, f = m.n_experts, m.moe_ffn_dim
            # the experts' gate and up projections as two arrays, MaxText's wi_0 / wi_1 kernels (fused into one
            # [e, d, 2, f] array, XLA:TPU reported 1.4 GB more temp per chip on DeepSeek-V2-Lite at fsdp 8;
            # Mixtral's figures did not move)
            lay.update(router=w((d, e), d), wo_mlp=w((e, f, d), f), **{n: w((e, d, f), d) for n in expert_in(m)})
            if m.n_shared_experts:  # the shared experts as one dense MLP n_shared times as wide
                fs = m.n_shared_experts * f
                lay.update(shared_wi=w((d, n_in, fs), d), shared_wo=w((fs, d), fs))
        else:
            f = m.ffn_dim
            lay.update(wi=w((d, n_in, f), d), wo_mlp=w((f, d), f))
        layers.append(lay)
    params = {"embed": w((m.vocab_size, d), 1.0), "final_norm": ones(d), "layers": layers}
    if not m.tied_embeddings:
        params["unembed"] = w((d, m.vocab_size), d)
    return params


# ---- the model -------------------------------------------------------------------------------------------

class Sharder:
    """with_sharding_constraint on the plan's mesh (a no-op structure on a one-device mesh)."""

    def __init__(self, mesh: Mesh, plan: Plan):
        self.mesh, self.plan = mesh, plan
        self.seq = ("cp", "tp") if (plan.sequence_parallel and plan.tp > 1) else ("cp",)

    def __call__(self, x, *spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(*spec)))

    def resid(self, x):
        return self(x, BATCH, self.seq, None)

    def unsplit(self, x):
        """The input of a tp-column-split matmul: the whole (cp-local) sequence on every tp rank. Under sequence
        parallelism this is Megatron's all-gather of the norm output; left to itself, GSPMD may gather the
        weight over tp instead and swap the sequence and head splits with all-to-alls."""
        return self(x, BATCH, "cp", None)


def rmsnorm(x, g):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
    return (y * g.astype(jnp.float32)).astype(x.dtype)


def attention(cfg: Setup, sh: Sharder, p: dict, x, window: int = 0):
    m = cfg.model
    g = m.n_heads // m.n_kv_heads
    qkv = jnp.einsum("bsd,dkjh->bskjh", x, p["wqkv"])  # [b, s, kv, g + 2, hd]
    # split (its transpose is a concatenate), not slicing (whose transposes are full-size pads, one per part)
    qg, k, v = jnp.split(qkv, [g, g + 1], axis=3)
    qg = sh(checkpoint_name(qg, "query_proj"), BATCH, "cp", "tp", None, None)
    k = sh(checkpoint_name(k[:, :, :, 0], "key_proj"), BATCH, "cp", "tp", None)
    v = sh(checkpoint_name(v[:, :, :, 0], "value_proj"), BATCH, "cp", "tp", None)
    # Context parallelism: every query shard needs all keys and values (all-gather over cp).
    k, v = sh(k, BATCH, None, "tp", None), sh(v, BATCH, None, "tp", None)
    b, s, hd, h = qg.shape[0], qg.shape[1], qg.shape[-1], m.n_heads
    r = cfg.plan.cp  # query rows: dimension 1 sharded over cp
    ctx = causal_attention(qg.reshape(b, r, s // r, *qg.shape[2:]), k, v, cfg.flash_block, window)
    ctx = ctx.reshape(b, s, h, hd)
    ctx = checkpoint_name(sh(ctx, BATCH, "cp", "tp", None), "context")
    return sh.resid(checkpoint_name(jnp.einsum("bshk,hkd->bsd", ctx, p["wo"]), "out_proj"))


def mla_attention(cfg: Setup, sh: Sharder, p: dict, x, window: int = 0):
    """Multi-head latent attention as MaxText's MLA layer runs it (no RoPE, as everywhere here): the query and the
    keys/values come from low-rank latents (normalised), the rope part of the key is one head shared by all; the
    down-projections run on every tp rank, the up-projections are split over tp by head."""
    m = cfg.model
    nope, vd = m.head_dim - m.qk_rope_head_dim, m.v_head_dim
    if m.q_lora_rank:
        q = jnp.einsum("bsr,rhk->bshk", rmsnorm(jnp.einsum("bsd,dr->bsr", x, p["wq_a"]), p["q_norm"]), p["wq_b"])
    else:
        q = jnp.einsum("bsd,dhk->bshk", x, p["wq"])
    latent, k_pe = jnp.split(jnp.einsum("bsd,dr->bsr", x, p["wkv_a"]), [m.kv_lora_rank], axis=-1)
    k_nope, v = jnp.split(jnp.einsum("bsr,rhk->bshk", rmsnorm(latent, p["kv_norm"]), p["wkv_b"]), [nope], axis=-1)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, :, None, :], (*k_nope.shape[:3], k_pe.shape[-1]))], -1)
    q = sh(checkpoint_name(q, "query_proj"), BATCH, "cp", "tp", None)
    k = sh(checkpoint_name(k, "key_proj"), BATCH, "cp", "tp", None)
    v = sh(checkpoint_name(v, "value_proj"), BATCH, "cp", "tp", None)
    k, v = sh(k, BATCH, None, "tp", None), sh(v, BATCH, None, "tp", None)  # all keys and values (cp)
    b, s, h, r = q.shape[0], q.shape[1], q.shape[2], cfg.plan.cp
    ctx = causal_attention(q.reshape(b, r, s // r, h, 1, q.shape[-1]), k, v, cfg.flash_block, window)
    ctx = ctx.reshape(b, s, h, vd)
    ctx = checkpoint_name(sh(ctx, BATCH, "cp", "tp", None), "context")
    return sh.resid(checkpoint_name(jnp.einsum("bshk,hkd->bsd", ctx, p["wo"]), "out_proj"))


def _act(m: ModelSpec):
    return jax.nn.silu if m.gated_mlp else jax.nn.gelu


def dense_mlp(cfg: Setup, sh: Sharder, p: dict, x, wi: str = "wi", wo: str = "wo_mlp"):
    """The MLP of a dense layer (weights p[wi], p[wo]; a MoE layer's shared experts: shared_wi, shared_wo)."""
    m = cfg.model
    hi = jnp.split(jnp.einsum("bsd,dcf->bscf", x, p[wi]), p[wi].shape[1], axis=2)  # 1 or 2 x [b, s, 1, f]
    h = _act(m)(sh(checkpoint_name(hi[0][:, :, 0], "mlpwi_0"), BATCH, "cp", "tp"))
    if m.gated_mlp:
        h = h * sh(checkpoint_name(hi[1][:, :, 0], "mlpwi_1"), BATCH, "cp", "tp")
    out = checkpoint_name(jnp.einsum("bsf,fd->bsd", h, p[wo]), "mlpwo")
    return sh.resid(out)


def capacity(m: ModelSpec, seq_len: int) -> int:
    return max(1, math.ceil(m.experts_per_token * seq_len * m.effective_capacity_factor / m.n_experts))


def _top_k(x, k: int):
    """lax.top_k over the last axis as k rounds of argmax: XLA's SPMD partitioner all-gathers the batch of a
    top_k (a sort), but partitions a reduction along the batch axes it is given."""
    vals, idx = [], []
    for _ in range(k):
        i = jnp.argmax(x, axis=-1)
        hot = jax.nn.one_hot(i, x.shape[-1], dtype=jnp.bool_)
        vals.append(jnp.sum(jnp.where(hot, x, 0), axis=-1))
        idx.append(i.astype(jnp.int32))
        x = jnp.where(hot, -jnp.inf, x)
    return jnp.stack(vals, axis=-1), jnp.stack(idx, axis=-1)


def moe_mlp(cfg: Setup, sh: Sharder, p: dict, x):
    """Top-k routing with per-sequence capacity; tokens reach their experts by gather, return by gather."""
    m = cfg.model
    b, s, d = x.shape
    e, k = m.n_experts, m.experts_per_token
    c = capacity(m, s)
    x = sh(x, BATCH, None, None)
    logits = sh(jnp.einsum("bsd,de->bse", x, p["router"]).astype(jnp.float32), BATCH, None, None)
    # Routing is per sequence: pin every routing tensor to the batch sharding (GSPMD otherwise replicates top_k
    # and the gathers, all-gathering the whole batch).
    gates, idx = _top_k(jax.nn.softmax(logits, axis=-1), k)  # [b, s, k]
    gates, idx = sh(gates, BATCH, None, None), sh(idx, BATCH, None, None)
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    idx = idx.reshape(b, s * k)
    onehot = sh(jax.nn.one_hot(idx, e, dtype=jnp.int32), BATCH, None, None)  # [b, s*k, e]
    pos = sh(jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1), BATCH, None)  # position in its expert
    keep = pos < c
    slot = sh(jnp.where(keep, idx * c + pos, e * c), BATCH, None)  # e*c = the overflow slot (dropped)
    # Which token fills each expert slot: a one-hot without the d_model factor (cheap), then a gather.
    slot_hot = sh(jax.nn.one_hot(slot, e * c, dtype=jnp.float32), BATCH, None, None)  # [b, s*k, e*c]
    token_of = jnp.arange(s * k, dtype=jnp.float32) // k
    tok = sh(jnp.einsum("bts,t->bs", slot_hot, token_of).astype(jnp.int32), BATCH, None)  # [b, e*c]
    xe = sh(jnp.take_along_axis(x, tok[:, :, None], axis=1), BATCH, None, None).reshape(b, e, c, d)
    xe = sh(jnp.transpose(xe, (1, 0, 2, 3)), "ep", ("dp", "fsdp"), None, None)  # all-to-all over ep
    wi = jnp.stack([p[n] for n in expert_in(m)])  # one matmul: the input gradients summed before the tp reduction
    hi = jnp.split(jnp.einsum("ebcd,jedf->ebcjf", xe, wi), wi.shape[0], axis=3)  # [e, b, c, 1, f]
    h = _act(m)(sh(checkpoint_name(hi[0][:, :, :, 0], "mlpwi_0"), "ep", ("dp", "fsdp"), None, "tp"))
    if m.gated_mlp:
        h = h * sh(checkpoint_name(hi[1][:, :, :, 0], "mlpwi_1"), "ep", ("dp", "fsdp"), None, "tp")
    ye = checkpoint_name(jnp.einsum("ebcf,efd->ebcd", h, p["wo_mlp"]), "mlpwo")
    ye = sh(ye, "ep", ("dp", "fsdp"), None, None)
    ye = sh(jnp.transpose(ye, (1, 0, 2, 3)), BATCH, None, None, None).reshape(b, e * c, d)  # all-to-all back
    ye = sh(jnp.concatenate([ye, jnp.zeros((b, 1, d), ye.dtype)], axis=1), BATCH, None, None)
    yk = sh(jnp.take_along_axis(ye, slot[:, :, None], axis=1), BATCH, None, None).reshape(b, s, k, d)
    y = jnp.sum(yk * gates[..., None].astype(yk.dtype), axis=2)
    return sh.resid(y)


def _exclusive_cumsum(x, axis: int = 0):
    return jnp.cumsum(x, axis=axis) - x


def _ragged_all_to_all(x, out, in_off, send, out_off, recv, axis: str, native: bool):
    """jax.lax.ragged_all_to_all; XLA:CPU lacks it, so off TPU/GPU the same exchange as padded chunks (every
    sender's chunk to each receiver padded to the sender's row count) over a dense all_to_all."""
    if native:
        return jax.lax.ragged_all_to_all(x, out, in_off, send, out_off, recv, axis_name=axis)
    cap = x.shape[0]  # the most rows a sender can send one receiver
    i = jnp.arange(cap)
    rows = jnp.where(i[None] < send[:, None], in_off[:, None] + i[None], cap)  # [receivers, cap]; cap: padding
    chunks = jnp.take(x, rows, axis=0, mode="fill", fill_value=0)
    got = jax.lax.all_to_all(chunks, axis, 0, 0)  # got[j] = sender j's chunk for me
    at = jax.lax.all_to_all(out_off[:, None], axis, 0, 0)[:, 0]  # where sender j writes into my buffer
    dest = jnp.where(i[None] < recv[:, None], at[:, None] + i[None], out.shape[0])
    return out.at[dest.reshape(-1)].set(got.reshape(-1, x.shape[1]), mode="drop")


def _grouped_matmul(x, w, sizes, tpu: bool):
    """Rows of x grouped by expert (sizes rows each, the rest padding) times that expert's weight: MaxText's
    megablox grouped matmul on TPU (jax's copy of the kernel), jax.lax.ragged_dot elsewhere."""
    if tpu:
        from jax.experimental.pallas.ops.tpu.megablox import gmm

        return gmm(x, w, sizes, preferred_element_type=x.dtype)
    return jax.lax.ragged_dot(x, w, sizes)


def _to_expert_shards(rows, sizes, ep: int, buf: int, native: bool):
    """Send each expert shard (over 'ep') the rows for its experts, sorted by expert, into a receive buffer of `buf`
    rows, then sort the buffer by local expert: (rows, local group sizes, what the way back needs)."""
    le = sizes.shape[0] // ep
    me = jax.lax.axis_index("ep")
    to_shard = sizes.reshape(ep, le).sum(axis=1)  # rows for each expert shard
    matrix = jax.lax.all_gather(to_shard, "ep")  # [sender, receiver]
    recv = matrix[:, me]
    rows = _ragged_all_to_all(rows, jnp.zeros((buf, rows.shape[1]), rows.dtype), _exclusive_cumsum(to_shard),
                              to_shard, _exclusive_cumsum(matrix, 0)[me], recv, "ep", native)
    local = jax.lax.dynamic_slice_in_dim(jax.lax.all_gather(sizes, "ep"), me * le, le, axis=1)  # [sender, le]
    eid = jnp.repeat(jnp.tile(jnp.arange(le), ep), local.reshape(-1), total_repeat_length=buf)
    eid = jnp.where(jnp.arange(buf) < jnp.sum(recv), eid, le)  # padding rows sort last
    order = jnp.argsort(eid, stable=True)
    back = (order, recv, _exclusive_cumsum(matrix, 1)[:, me], to_shard)
    return jnp.take(rows, order, axis=0), jnp.sum(local, axis=0).astype(jnp.int32), back


def _from_expert_shards(y, n_rows: int, back, native: bool):
    """The experts' outputs back to the chips their rows came from, in the order they were sent."""
    order, recv, offsets, sent = back
    y = jnp.take(y, jnp.argsort(order), axis=0)
    return _ragged_all_to_all(y, jnp.zeros((n_rows, y.shape[1]), y.dtype), _exclusive_cumsum(recv), recv, offsets,
                              sent, "ep", native)


def moe_dropless(cfg: Setup, sh: Sharder, p: dict, x):
    """Dropless top-k MoE as MaxText 0.2.5 runs it (layers/moe.py, sparse_matmul): inside a shard_map over the
    whole mesh each chip sorts its routed token copies by expert, sends each expert shard its rows with a ragged
    all-to-all over ep into a receive buffer sized for the worst case (min(ep, experts / top_k) times the balanced
    rows, MaxText's get_ragged_buffer_size), sorts them by local expert, runs the grouped matmuls on its experts
    (weights all-gathered over their fsdp axes inside, so their gradients are reduce-scattered), sums the tp
    partial outputs, and sends the rows back the same way."""
    m, plan, mesh = cfg.model, cfg.plan, sh.mesh
    e, k, ep = m.n_experts, m.experts_per_token, plan.ep
    platform = mesh.devices.flat[0].platform
    native, tpu = platform in ("tpu", "gpu"), platform == "tpu"
    x = sh(x, BATCH, "cp", None)
    logits = sh(jnp.einsum("bsd,de->bse", x, p["router"]).astype(jnp.float32), BATCH, "cp", None)
    gates, idx = _top_k(jax.nn.softmax(logits, axis=-1), k)  # [b, s, k]
    gates = sh(gates / jnp.sum(gates, axis=-1, keepdims=True), BATCH, "cp", None)
    idx = sh(idx, BATCH, "cp", None)
    we = axis_rules.dim_axes("wi_0", 1, cfg.plan, moe_layer=True)  # the experts' d_model split (embed_moe)

    def local(x, gates, idx, *ws):
        b, s, d = x.shape
        t = b * s * k
        # The gated MLP's two inputs as two grouped matmuls (MaxText's wi_0 and wi_1 kernels), each all-gathered
        # over fsdp here (the transpose: the gradient's reduce-scatter).
        if we:
            ws = [jax.lax.all_gather(w, we, axis=1 + (i == len(ws) - 1), tiled=True) for i, w in enumerate(ws)]
        flat = idx.reshape(t)
        order = jnp.argsort(flat, stable=True)
        rows = jnp.take(x.reshape(b * s, d), order // k, axis=0)  # routed copies, sorted by expert
        sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
        if ep > 1:  # MaxText's worst-case receive buffer
            rows, sizes, back = _to_expert_shards(rows, sizes, ep, int(t * min(ep, e / k)), native)
        h = _act(m)(checkpoint_name(_grouped_matmul(rows, ws[0], sizes, tpu), "mlpwi_0"))
        if m.gated_mlp:
            h = h * checkpoint_name(_grouped_matmul(rows, ws[1], sizes, tpu), "mlpwi_1")
        y = checkpoint_name(_grouped_matmul(h, ws[-1], sizes, tpu), "mlpwo")
        y = jax.lax.psum(y, "tp")  # the tp partial sums (a no-op at tp 1, where it only marks y tp-invariant)
        if ep > 1:
            y = _from_expert_shards(y, t, back, native)
        y = jnp.take(y, jnp.argsort(order), axis=0).reshape(b, s, k, d)
        return jnp.sum(y * gates[..., None].astype(y.dtype), axis=2)

    tok = P(BATCH, "cp", None)
    # check_vma off on TPU: the megablox kernel's output carries no varying-axes type inside the shard_map
    wspec = [P("ep", we or None, "tp")] * len(expert_in(m)) + [P("ep", "tp", we or None)]
    f = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, *wspec), out_specs=tok, check_vma=not tpu)
    return sh.resid(f(x, gates, idx, *[p[n] for n in expert_in(m)], p["wo_mlp"]))


def saved_names(plan: Plan) -> list[str]:
    """MaxText checkpoint names of the tensors the plan keeps on device."""
    ch = plan.remat.choices()
    return [n for t in TENSORS if t != "layer_input" and ch[t] == "device" for n in TENSOR_MAXTEXT_NAMES[t]]


def layer_window(m: ModelSpec, i: int) -> int:
    """The sliding window of layer i (0: it attends to the whole prefix): with local_per_global k, every
    (k + 1)-th layer is global (Gemma 3: five local, then one global); k = 0: every layer local."""
    k = m.local_per_global
    return m.sliding_window if m.sliding_window and (k == 0 or (i + 1) % (k + 1)) else 0


def layer_fn(cfg: Setup, sh: Sharder, moe: bool | None = None, window: int | None = None):
    """One layer under the plan's remat policy; moe: a routed layer, else dense; window: its sliding window (both
    default to layer 0's kind, for stacks of alike layers)."""
    m = cfg.model
    moe = m.is_moe if moe is None else moe
    window = layer_window(m, 0) if window is None else window
    routed = moe_dropless if cfg.dropless and m.capacity_factor == 0 else moe_mlp

    def mlp(p, x):
        if not moe:
            return dense_mlp(cfg, sh, p, x)
        y = routed(cfg, sh, p, x)
        return y + dense_mlp(cfg, sh, p, x, "shared_wi", "shared_wo") if m.n_shared_experts else y

    def f(p, x):
        x = checkpoint_name(x, "decoder_layer_input")
        h = x + (mla_attention if m.is_mla else attention)(cfg, sh, p, sh.unsplit(rmsnorm(x, p["norm1"])), window)
        return sh.resid(h + mlp(p, sh.unsplit(rmsnorm(h, p["norm2"]))))

    plan = cfg.plan
    if plan.remat.count("remat") == 0:  # 'none': nothing recomputed, but the weights are re-gathered
        policy = jax.checkpoint_policies.everything_saveable
    else:
        policy = jax.checkpoint_policies.save_only_these_names(*saved_names(plan))
    return jax.checkpoint(f, policy=policy)


def embed(cfg: Setup, sh: Sharder, table, tokens):
    """The input embedding lookup on the d-sharded table, spelled out as the cost model counts it: the token ids
    are gathered over the table's shard axes (int32, small), every chip looks up its d-slice of those tokens'
    rows, and one all-to-all per shard axis hands each row to the chip that owns its token (the backward pass
    sends the row gradients back). Left to itself, GSPMD picks a different scheme for each mesh (row
    all-gathers over dp, full-table gradient all-reduces or row all-gathers over cp)."""
    w = list(axis_rules.dim_axes("embed", 1, cfg.plan))  # the table's d_model split (embed_vocab)
    batch = [a for a in BATCH if a not in w]  # batch axes the table is replicated over
    seq: list[str] = []
    x = jnp.take(table, sh(tokens, tuple(batch) or None, None), axis=0)
    x = sh(x, tuple(batch) or None, None, tuple(w))
    for a in reversed(list(w)):  # one axis at a time (minor first) from the model dimension to its token
        w.remove(a)
        (seq if a == "cp" else batch).append(a)
        x = sh(x, tuple(b for b in BATCH if b in batch) or None, tuple(seq) or None, tuple(w) or None)
    return sh.resid(x)


def loss_fn(cfg: Setup, sh: Sharder, params: dict, tokens, targets):
    cdt = cfg.cdt
    p = jax.tree.map(lambda a: a.astype(cdt), params)  # the compute copy of the weights
    x = embed(cfg, sh, p["embed"], tokens)
    m = cfg.model
    kinds = [layer_kind(m, i) for i in range(len(p["layers"]))]
    fs = {kind: layer_fn(cfg, sh, *kind) for kind in set(kinds)}
    for kind, lp in zip(kinds, p["layers"], strict=True):  # unrolled: XLA's cost analysis counts a scanned body once
        x = fs[kind](lp, x)
    return head_loss(cfg, sh, p, x, targets)


def head_loss(cfg: Setup, sh: Sharder, p: dict, x, targets):
    """Final norm, logits (fp32, vocab over tp) and mean cross-entropy of the last layer's output x."""
    x = sh.unsplit(rmsnorm(x, p["final_norm"]))
    w_out = p["embed"].T if cfg.model.tied_embeddings else p["unembed"]
    logits = sh(jnp.einsum("bsd,dv->bsv", x, w_out), BATCH, "cp", "tp").astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.sum(logits * jax.nn.one_hot(targets, cfg.model.vocab_size, dtype=logits.dtype), axis=-1)
    return jnp.mean(lse - target_logit)


def adam_update(params, grads, mu, nu, count):
    b1, b2, lr, eps = ADAM["b1"], ADAM["b2"], ADAM["lr"], ADAM["eps"]
    count = count + 1
    mu = jax.tree.map(lambda m_, g: b1 * m_ + (1 - b1) * g, mu, grads)
    nu = jax.tree.map(lambda v_, g: b2 * v_ + (1 - b2) * g * g, nu, grads)
    c1, c2 = 1 - b1 ** count.astype(jnp.float32), 1 - b2 ** count.astype(jnp.float32)
    params = jax.tree.map(lambda w, m_, v_: w - lr * (m_ / c1) / (jnp.sqrt(v_ / c2) + eps), params, mu, nu)
    return params, mu, nu, count


# ---- the step --------------------------------------------------------------------------------------------

@dataclass
class Step:
    """A jitted, sharded training step and its inputs, ready to lower/compile/run."""

    cfg: Setup
    mesh: Mesh
    fn: object  # jitted train step: (params, opt, tokens, targets) -> (params, opt, loss)
    grad_fn: object  # jitted (params, tokens, targets) -> (loss, grads) with the same shardings
    shardings: dict

    def host_params(self, seed: int = 0) -> dict:
        return init_params(self.cfg, seed)

    def inputs(self, seed: int = 0):
        cfg = self.cfg
        host = self.host_params(seed)
        params = jax.device_put(host, self.shardings["params"])
        zeros = jax.tree.map(np.zeros_like, host)
        opt = {"mu": jax.device_put(zeros, self.shardings["moments"]),
               "nu": jax.device_put(zeros, self.shardings["moments"]), "count": jnp.zeros((), jnp.int32)}
        tokens, targets = make_batch(cfg, seed)
        tokens = jax.device_put(tokens, self.shardings["batch"])
        targets = jax.device_put(targets, self.shardings["batch"])
        return params, opt, tokens, targets

    def param_shapes(self) -> dict:
        return init_params(self.cfg, shapes_only=True)

    def abstract_inputs(self):
        """ShapeDtypeStructs with shardings (for ahead-of-time lowering without allocating)."""
        cfg = self.cfg
        shapes = self.param_shapes()

        def sds(tree, shard):
            return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shard)

        params = sds(shapes, self.shardings["params"])
        mom = sds(shapes, self.shardings["moments"])
        rep = NamedSharding(self.mesh, P())
        opt = {"mu": mom, "nu": mom, "count": jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)}
        tok = jax.ShapeDtypeStruct((cfg.global_batch, cfg.seq_len), jnp.int32, sharding=self.shardings["batch"])
        return params, opt, tok, tok


def make_batch(cfg: Setup, seed: int = 0):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, cfg.model.vocab_size, size=(cfg.global_batch, cfg.seq_len + 1), dtype=np.int32)
    return data[:, :-1], data[:, 1:]


def build_step(cfg: Setup, mesh: Mesh | None = None, donate: bool = True) -> Step:
    mesh = mesh or make_mesh(cfg.plan)
    if cfg.plan.pp > 1:  # pipeline stages: shard_map over 'pp' with ppermute (planner.validate.pipeline)
        from planner.validate.pipeline import build_pipeline_step

        return build_pipeline_step(cfg, mesh, donate)
    return jit_step(Step, cfg, mesh, partial(loss_fn, cfg, Sharder(mesh, cfg.plan)), param_specs(cfg),
                    param_specs(cfg, moments=True), donate)


class ScannedStep(Step):
    """A Step whose layer weights are stacked [L, ...] per position of a run of alike blocks (layer_stacks)."""

    def param_shapes(self) -> dict:
        m = self.cfg.model
        stacks = layer_stacks(m)
        depth = max(idx[0] for idx in stacks) + 1  # enough layers to hold each stack's first
        one = init_params(replace(self.cfg, model=replace(m, n_layers=depth)), shapes_only=True)
        one["layers"] = [{k: jax.ShapeDtypeStruct((len(idx), *v.shape), v.dtype)
                          for k, v in one["layers"][idx[0]].items()} for idx in stacks]
        return one


def scanned_loss(cfg: Setup, sh: Sharder, unroll: int, params: dict, tokens, targets):
    """The loss with the layers under jax.lax.scan over stacked fp32 weights, as MaxText runs them
    (scan_layers=true): each run of alike blocks (layer_groups) scanned over stacks of its own, the longest run
    `unroll` blocks per iteration, the others unrolled whole (so that XLA's cost analysis counts them); each
    layer's weights cast to the compute dtype inside the scanned body."""
    m, cdt = cfg.model, cfg.cdt
    groups = layer_groups(m)
    main = max(range(len(groups)), key=lambda g: groups[g][2])
    fns = {kind: layer_fn(cfg, sh, *kind) for kinds, _, _ in groups for kind in kinds}
    p = {k: v.astype(cdt) for k, v in params.items() if k != "layers"}
    x = embed(cfg, sh, p["embed"], tokens)
    at = 0  # the run's first stack
    for g, (kinds, _, _) in enumerate(groups):
        def body(x, lps, kinds=kinds):
            for kind, lp in zip(kinds, lps, strict=True):
                x = fns[kind](jax.tree.map(lambda a: a.astype(cdt), lp), x)
            return x, None

        x, _ = jax.lax.scan(body, x, params["layers"][at:at + len(kinds)], unroll=unroll if g == main else True)
        at += len(kinds)
    return head_loss(cfg, sh, p, x, targets)


def build_scanned_step(cfg: Setup, mesh: Mesh, unroll: int = 1, donate: bool = True) -> ScannedStep:
    """The training step (jit_step, as the unrolled one) over scanned layers (scanned_loss)."""
    stacks = layer_stacks(cfg.model)
    return jit_step(ScannedStep, cfg, mesh, partial(scanned_loss, cfg, Sharder(mesh, cfg.plan), unroll),
                    param_specs(cfg, stacks=stacks), param_specs(cfg, moments=True, stacks=stacks), donate)


def jit_step(kind: type, cfg: Setup, mesh: Mesh, loss, specs: dict, moment_specs: dict, donate: bool):
    """Jit the Adam training step (and the gradient step) of `loss(params, tokens, targets)` with the given
    parameter / moment PartitionSpecs; returns a `kind` (Step or a subclass)."""

    def named(tree):
        return jax.tree.map(lambda s: NamedSharding(mesh, s), tree, is_leaf=lambda s: isinstance(s, P))

    p_sh, m_sh = named(specs), named(moment_specs)
    rep = NamedSharding(mesh, P())
    b_sh = NamedSharding(mesh, P(BATCH, "cp"))
    opt_sh = {"mu": m_sh, "nu": m_sh, "count": rep}

    def grads_of(params, tokens, targets):
        loss_value, grads = jax.value_and_grad(loss)(params, tokens, targets)
        if cfg.plan.zero >= 2:  # ZeRO-2: gradients sharded like the optimizer state
            grads = jax.lax.with_sharding_constraint(grads, m_sh)
        return loss_value, grads

    def train_step(params, opt, tokens, targets):
        loss_value, grads = grads_of(params, tokens, targets)
        if cfg.grad_clip > 0:  # needs every gradient before any update (XLA can't free them layer by layer)
            norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
            grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, cfg.grad_clip / (norm + 1e-6)), grads)
        params, mu, nu, count = adam_update(params, grads, opt["mu"], opt["nu"], opt["count"])
        return params, {"mu": mu, "nu": nu, "count": count}, loss_value

    fn = jax.jit(train_step, in_shardings=(p_sh, opt_sh, b_sh, b_sh), out_shardings=(p_sh, opt_sh, rep),
                 donate_argnums=(0, 1) if donate else ())
    gfn = jax.jit(grads_of, in_shardings=(p_sh, b_sh, b_sh), out_shardings=(rep, p_sh))
    return kind(cfg, mesh, fn, gfn, {"params": p_sh, "moments": m_sh, "batch": b_sh, "opt": opt_sh})
