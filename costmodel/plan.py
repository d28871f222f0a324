"""Execution strategy: parallel degrees, micro-batching, rematerialisation and offload (frozen dataclasses).

Mesh axes (MaxText names in brackets): dp [data], fsdp [fsdp], tp [tensor], cp [context], pp [stage],
ep [expert]. The batch is sharded over dp * fsdp * ep; one micro-batch of `micro_batch` sequences is shared
by the tp * cp * pp chips of a model replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hardware.errors import InputError, excerpt, unknown

AXES = ("dp", "fsdp", "tp", "cp", "pp", "ep")
# Megatron-Core's TransformerConfig flags (and pretrain_gpt.py's --account-for-...-in-pipeline-split)
SPLIT_FLAGS = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
# Megatron-Core's ModelParallelConfig flag (--overlap-moe-expert-parallel-comm): the expert all-to-all of one
# micro-batch runs behind another micro-batch's computation (combined 1F1B; DeepSeek's DualPipe does the same)
EP_OVERLAP = "overlap_moe_expert_parallel_comm"
# Megatron-Core's --recompute-num-layers under --recompute-granularity full --recompute-method block: only the first
# N layers of each model chunk are recomputed (costmodel.plan.recomputed_share; docs/recompute_num_layers.md)
RECOMPUTE_LAYERS = "recompute_num_layers"
# Megatron-Core's --cpu-offloading-num-layers N (TransformerConfig.cpu_offloading_num_layers): the saved activations
# of the first N layers go to host memory after their forward and come back before their backward
# (costmodel.plan.cpu_offload_windows; docs/cpu_offload_layers.md)
CPU_OFFLOAD_LAYERS = "cpu_offload_layers"
# Megatron-LM's --fp8-param-gather (Megatron-Core TransformerConfig.fp8_param, DistributedDataParallelConfig.
# fp8_param_gather; NeMo's fp8_params): the GEMM weights are Transformer Engine Float8Tensors instead of bf16, the
# fp32 main parameters stay in the distributed optimizer, and the parameter all-gather carries fp8 (docs/fp8_params.md)
FP8_PARAMS = "fp8_param_gather"
# Megatron-LM's --grad-reduce-in-bf16 (validate_args clears accumulate_allreduce_grads_in_fp32, which
# training.py get_megatron_ddp_config passes as DistributedDataParallelConfig.grad_reduce_in_fp32; NeMo's
# grad_reduce_in_fp32=False, Apex distributed_fused_adam's grad_sync_dtype bf16): the main-gradient buffer and its
# reduce-scatter / all-reduce in bf16 instead of fp32 (costmodel.framework.bf16_grad_layout; docs/grad_reduce_bf16.md)
GRAD_BF16 = "grad_reduce_in_bf16"
# Megatron-Core's on/off options: Plan fields of these names, written and read under them everywhere (plan files,
# JSON, the CLI), and its layer counts (0: off), with what 0 means
MEGATRON_SWITCHES = (*SPLIT_FLAGS, EP_OVERLAP, FP8_PARAMS, GRAD_BF16)
MEGATRON_COUNTS = {RECOMPUTE_LAYERS: "0: every layer", CPU_OFFLOAD_LAYERS: "0: off"}
# Innermost (fastest interconnect) to outermost: tensor innermost; data and pipeline outermost.
AXIS_ORDER_INNER_TO_OUTER = ("tp", "cp", "ep", "fsdp", "pp", "dp")

# The tensors of one layer whose fate remat decides (MaxText checkpoint names in brackets).
TENSORS = ("layer_input", "qkv_proj", "context", "out_proj", "mlp_in", "mlp_out")
TENSOR_MAXTEXT_NAMES = {
    "layer_input": ("decoder_layer_input",),
    "qkv_proj": ("query_proj", "key_proj", "value_proj"),
    "context": ("context",),
    "out_proj": ("out_proj",),
    "mlp_in": ("mlpwi_0", "mlpwi_1"),
    "mlp_out": ("mlpwo",),
}
CHOICES = ("device", "remat", "offload")  # keep in HBM / recompute in backward / move to host memory


@dataclass(frozen=True)
class Remat:
    """Per-tensor choice for each saved tensor of a layer. `name` is the policy it came from."""

    layer_input: str = "device"
    qkv_proj: str = "remat"
    context: str = "remat"
    out_proj: str = "remat"
    mlp_in: str = "remat"
    mlp_out: str = "remat"
    name: str = "custom"

    def __post_init__(self) -> None:
        for t in TENSORS:
            if getattr(self, t) not in CHOICES:
                raise InputError(f"remat tensor {t!r}: expected one of {', '.join(CHOICES)}, got {getattr(self, t)!r}")

    def choices(self) -> dict[str, str]:
        return {t: getattr(self, t) for t in TENSORS}

    def count(self, choice: str) -> int:
        return sum(1 for t in TENSORS if getattr(self, t) == choice)

    def summary(self) -> str:
        if self.name != "custom":
            return self.name
        parts = [f"{t}={c}" for t, c in self.choices().items() if c != "remat" and t != "layer_input"]
        if self.layer_input != "device":
            parts.insert(0, f"layer_input={self.layer_input}")
        return "custom(" + ",".join(parts) + ")" if parts else "full"


def _policy(name: str, **kw: str) -> Remat:
    return Remat(name=name, **kw)


_SAVE_ALL = dict(qkv_proj="device", context="device", out_proj="device", mlp_in="device", mlp_out="device")
# Named policies: MaxText 0.2.5 `remat_policy` names (layers/decoders.py) and Megatron's none/selective/full.
REMAT_POLICIES: dict[str, Remat] = {
    "none": _policy("none", **_SAVE_ALL),
    # Megatron selective: core attention (scores, softmax, context) recomputed, all projections kept.
    "selective": _policy("selective", **{**_SAVE_ALL, "context": "remat"}),
    "full": _policy("full"),
    # MaxText `minimal`: all matmul outputs without batch dims saved; attention context recomputed.
    "minimal": _policy("minimal", **{**_SAVE_ALL, "context": "remat"}),
    "minimal_with_context": _policy("minimal_with_context", **_SAVE_ALL),
    "save_dot_with_context_except_mlp": _policy("save_dot_with_context_except_mlp", qkv_proj="device",
                                                context="device", out_proj="device"),
    "save_dot_except_mlpwi": _policy("save_dot_except_mlpwi", qkv_proj="device", out_proj="device",
                                     mlp_out="device"),
    "save_dot_except_mlp": _policy("save_dot_except_mlp", qkv_proj="device", out_proj="device"),
    "save_qkv_proj": _policy("save_qkv_proj", qkv_proj="device"),
    "save_out_proj": _policy("save_out_proj", out_proj="device"),
    "qkv_proj_offloaded": _policy("qkv_proj_offloaded", qkv_proj="offload"),
    "minimal_offloaded": _policy("minimal_offloaded", qkv_proj="offload", out_proj="offload", mlp_in="offload",
                                 mlp_out="offload"),
}


def remat_policy(name: str) -> Remat:
    """A named policy (none, selective, full, or a MaxText remat_policy name)."""
    if name not in REMAT_POLICIES:
        raise unknown("remat policy", name, REMAT_POLICIES)
    return REMAT_POLICIES[name]


def parse_remat(text: str) -> Remat:
    """A policy name, or 'custom:tensor=choice,...' (unlisted tensors: layer_input=device, others remat).

    Tensor names may be ours (qkv_proj, mlp_in, ...) or MaxText's (query_proj, mlpwi_0, decoder_layer_input ...).
    """
    if not text.startswith("custom"):
        return remat_policy(text)
    spec = text.partition(":")[2]
    by_maxtext = {mt: ours for ours, names in TENSOR_MAXTEXT_NAMES.items() for mt in names}
    by_maxtext["mlpwi"] = "mlp_in"
    by_maxtext["qkv_proj"] = "qkv_proj"
    kw: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, _, val = item.partition("=")
        tensor = key if key in TENSORS else by_maxtext.get(key)
        if tensor is None:
            raise unknown("remat tensor", key, sorted(set(TENSORS) | set(by_maxtext)))
        val = {"recompute": "remat", "save": "device"}.get(val, val)
        if kw.get(tensor, val) != val:  # MaxText's query/key/value_proj all name our qkv_proj: equal is fine
            raise InputError(f"--remat {excerpt(text)}: tensor {tensor!r} given twice with different choices "
                             f"({kw[tensor]}, {val}); give each tensor once")
        kw[tensor] = val
    return Remat(name="custom", **kw)


@dataclass(frozen=True)
class Plan:
    """An explicit parallel plan for `chips` chips in `slices` TPU slices (GPU jobs: slices = 1)."""

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    vpp: int = 1  # virtual pipeline stages (model chunks) per pipeline rank
    micro_batch: int = 1  # sequences per micro-step per model replica (one batch shard)
    zero: int = 0  # optimizer(1)/+grad(2)/+param(3) sharding over the dp axis; the fsdp axis is always ZeRO-3
    sequence_parallel: bool = True  # Megatron-style SP on the tp axis (reduce-scatter/all-gather, sharded norms)
    remat: Remat = field(default_factory=lambda: REMAT_POLICIES["full"])
    offload_optimizer: bool = False  # optimizer state (and its update) on host memory
    offload_params: bool = False  # master parameters on host memory, streamed in per step
    slices: int = 1  # TPU slices over DCN
    vocab_tiles: int = 1  # logits and loss computed in this many chunks of the tokens (MaxText num_vocab_tiling)
    # Megatron-Core: the embedding (the loss) counts as one layer of the pipeline split (split_accounted)
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    # the ep all-to-all hidden behind another micro-batch's compute (EP_OVERLAP; costmodel.estimate.expert_exchange)
    overlap_moe_expert_parallel_comm: bool = False
    # Megatron-Core block recompute: under remat full only the first N layers of each chunk are recomputed, the
    # others keep everything (remat none); 0: every layer follows the remat policy (RECOMPUTE_LAYERS)
    recompute_num_layers: int = 0
    # Megatron-Core layer CPU offload: the saved activations of N of the stage's layers on host (CPU_OFFLOAD_LAYERS);
    # 0: off
    cpu_offload_layers: int = 0
    # Megatron-Core fp8 parameters (FP8_PARAMS): GEMM weights stored and all-gathered in fp8 (precision fp8 only)
    fp8_param_gather: bool = False
    # Megatron-Core bf16 main gradients (GRAD_BF16): gradients stored and reduced in 2 B (off: fp32, Megatron's default)
    grad_reduce_in_bf16: bool = False

    def __post_init__(self) -> None:
        for name in (*AXES, "vpp", "micro_batch", "slices", "vocab_tiles"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InputError(f"plan field {name!r}: expected a positive integer, got {v!r}")
        if self.zero not in (0, 1, 2, 3):
            raise InputError(f"plan field 'zero': expected 0, 1, 2 or 3, got {self.zero!r}")
        for name, zero in MEGATRON_COUNTS.items():
            n = getattr(self, name)
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise InputError(f"plan field {name!r}: expected a non-negative integer ({zero}), got {n!r}")
        for name in MEGATRON_SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"plan field {name!r}: expected true or false, got {getattr(self, name)!r}")

    @property
    def split_accounting(self) -> tuple[int, int]:
        """(1 if the embedding, 1 if the loss) counts as a layer of the pipeline split (Megatron-Core's flags)."""
        return int(self.account_for_embedding_in_pipeline_split), int(self.account_for_loss_in_pipeline_split)

    @property
    def chips(self) -> int:
        return self.dp * self.fsdp * self.tp * self.cp * self.pp * self.ep

    @property
    def batch_shards(self) -> int:
        """How many ways the batch is split: dp * fsdp * ep."""
        return self.dp * self.fsdp * self.ep

    def degrees(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    def with_(self, **kw) -> Plan:
        return replace(self, **kw)


def pipeline_split(n_layers: int, pp: int, vpp: int = 1, embedding: int = 0,
                   loss: int = 0) -> tuple[int, int, int] | None:
    """Layers on (the first, each middle, the last) pipeline stage; None when the layers cannot be split.

    embedding / loss (1 or 0): Megatron-Core counts the embedding / the loss as a layer of the split
    (split_accounted). Without them: pp * vpp divides n_layers: L / pp everywhere. Otherwise Megatron-LM's uneven
    split (--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers): the pp - 2 middle stages take m
    layers each and the two end stages share the rest, the last (which also computes the logits and the loss) no
    more than the first; m is c = vpp * ceil(L / (pp * vpp)), or c - vpp when that alone leaves the end stages
    room and no stage above c (so the busiest stage is always c, as small as any split makes it). Every stage's
    count must be a positive multiple of vpp (Megatron's rule with virtual stages).
    Llama 3 405B: 126 layers over 16 stages = 7 + 14 x 8 + 7 (Dubey et al. 2024, section 3.3.2: one layer fewer
    on the first and the last stage); DeepSeek-V3's 61 over 16 = 3 + 14 x 4 + 2; 61 over 12 = 6 + 10 x 5 + 5."""
    if embedding or loss:
        try:
            return split_accounted(n_layers, pp, vpp, embedding, loss)
        except InputError:
            return None
    if n_layers % (pp * vpp) == 0:
        return (n_layers // pp,) * 3
    if pp < 2 or n_layers % vpp:
        return None
    c = vpp * -(-n_layers // (pp * vpp))
    best = None
    for mid in ((c,) if pp == 2 else (c, c - vpp)):
        rest = n_layers - (pp - 2) * mid  # layers left for the two end stages
        last = vpp * (rest // (2 * vpp))
        first = rest - last
        if mid < vpp or last < vpp or first > c:
            continue
        split = (first, mid if pp > 2 else first, last)
        if best is None or max(split) < max(best):
            best = split
    return best


def _accounted(embedding: int, loss: int) -> str:
    """The Megatron-Core flags that are set, as named in messages."""
    names = [n for n, on in zip(SPLIT_FLAGS, (embedding, loss), strict=True) if on]
    return " and ".join(names)


def split_accounted(n_layers: int, pp: int, vpp: int = 1, embedding: int = 0,
                    loss: int = 0) -> tuple[int, int, int]:
    """Layers on (the first, each middle, the last) stage when Megatron-Core counts the embedding (loss) as a
    layer: (L + embedding + loss) / pp per rank, vpp chunks of equal size, the first chunk of the first rank (the
    last chunk of the last rank) one layer fewer; Megatron's divisibility checks as one-line InputErrors.
    Source: Megatron-LM megatron/core/transformer/transformer_config.py TransformerConfig.__post_init__ (the
    checks) and megatron/core/transformer/transformer_block.py get_num_layers_to_build (the counts). 126 layers,
    pp 8, vpp 8, both flags: 128 / 8 = 16 per rank, 2 per chunk: 15 / 16 / 15 (the end chunks hold 1 layer).
    A stage left with no layer at all (Megatron allows it) is refused: the cost model costs layers per stage."""
    total = n_layers + embedding + loss  # the layers the split divides
    flags = _accounted(embedding, loss)
    if total % pp:
        raise InputError(f"pp: num_layers {total} (after {flags}) must be divisible by pipeline_model_parallel_size "
                         f"{pp} (Megatron-Core's check); expected a pp that divides {total}")
    per_rank = total // pp
    if per_rank % vpp:
        raise InputError(f"vpp: number of layers on each pipeline rank {per_rank} (after {flags}) must be divisible "
                         f"by virtual_pipeline_model_parallel_size {vpp} (Megatron-Core's check)")
    if pp == 1:
        return (n_layers,) * 3  # one rank: its first chunk is the first, its last the last (all L layers)
    first, last = per_rank - embedding, per_rank - loss
    if min(first, last) < 1:
        raise InputError(f"pp: {n_layers} layers over {pp} stages with {flags} leave an end stage with no layer "
                         f"({per_rank} per rank); expected at least one layer on every stage (a smaller pp)")
    return first, per_rank if pp > 2 else first, last


def chunk_layer_counts(n_layers: int, plan: Plan) -> list[list[int]]:
    """Layers of each model chunk on each pipeline rank ([rank][chunk]) under Megatron-Core's split with the
    plan's split flags: per_rank / vpp each, the first chunk of rank 0 (the last of the last rank) one fewer
    (get_num_layers_to_build)."""
    embedding, loss = plan.split_accounting
    split_accounted(n_layers, plan.pp, plan.vpp, embedding, loss)  # Megatron's checks
    per_chunk = (n_layers + embedding + loss) // (plan.pp * plan.vpp)
    out = [[per_chunk] * plan.vpp for _ in range(plan.pp)]
    out[0][0] -= embedding
    out[-1][-1] -= loss
    return out


def plan_split(n_layers: int, plan: Plan) -> tuple[int, int, int] | None:
    """pipeline_split for the plan's pp, vpp and split flags."""
    return pipeline_split(n_layers, plan.pp, plan.vpp, *plan.split_accounting)


def stage_layer_counts(n_layers: int, pp: int, vpp: int = 1, embedding: int = 0, loss: int = 0) -> list[int]:
    """Layers on each pipeline stage, first to last (pipeline_split spelled out; [n_layers] without pp)."""
    if pp == 1:
        return [n_layers]
    first, mid, last = pipeline_split(n_layers, pp, vpp, embedding, loss)
    return [first, *[mid] * (pp - 2), last]


def busiest_stage_layers(n_layers: int, plan: Plan) -> int:
    """Layers on the pipeline stage that holds the most (all of them without pp); n_layers / pp when even.
    Raises InputError when pipeline_split cannot split them (Megatron-Core's message under the split flags)."""
    if any(plan.split_accounting):
        return max(split_accounted(n_layers, plan.pp, plan.vpp, *plan.split_accounting))
    split = pipeline_split(n_layers, plan.pp, plan.vpp)
    if split is None:
        raise InputError(f"pp*vpp: n_layers {n_layers} cannot be split over pp={plan.pp} stages x vpp={plan.vpp} "
                         f"(every stage needs a positive multiple of vpp layers); use a pp*vpp that divides "
                         f"{n_layers}")
    return max(split)


def recomputed_share(plan: Plan, stage_layers: float) -> float:
    """Share of a stage's layers the remat policy recomputes: 1 unless recompute_num_layers N is set; then the
    first N layers of each of the stage's vpp chunks (Megatron-LM megatron/core/recompute.py checkpointed_forward,
    recompute_method 'block': layer_idx < recompute_num_layers checkpointed, the rest run without checkpoint),
    i.e. min(N, layers per chunk) / (layers per chunk); chunks taken as equal (stage_layers / vpp)."""
    if not plan.recompute_num_layers:
        return 1.0
    per_chunk = stage_layers / plan.vpp  # layers of one model chunk of this stage
    return min(plan.recompute_num_layers, per_chunk) / per_chunk


def cpu_offload_windows(n_offload: int, n_layers: int) -> list[int]:
    """Layers of compute each of the n_offload offloaded layers' host copy overlaps, one way (the same count in the
    forward's device-to-host copy and the backward's reload). Transformer Engine's cpu_offload.py
    AsyncDoubleBufferGroupOffloadHandler (Megatron-Core TransformerBlock's offload context, one group a layer):
    layer_window_map[i] = (L // N) * (i + 1) - 1, plus i + 1 for the first L % N groups, else plus that last
    i + 1; group 0 is copied from the end of layer 0 to window[0], group i from window[i - 1] to window[i], each
    freed on device at its window's end; the reloads run the same windows backwards."""
    window, extra = [], 0
    for i in range(n_offload):
        w = (n_layers // n_offload) * (i + 1) - 1  # TE's layer_window_map[i]
        if i < n_layers % n_offload:
            extra = i + 1
        window.append(w + extra)
    return [window[0]] + [b - a for a, b in zip(window, window[1:], strict=False)]
