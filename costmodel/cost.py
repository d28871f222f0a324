"""The result of costing one plan: step time and its breakdown, memory per chip, collectives, MFU."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

NEAR_LIMIT = 0.05  # a fitting plan within this share of the usable HBM is flagged (Cost.near_limit)


class Role(Enum):
    """What a collective does in the step: programs (the planner's solver) find collectives by role, and by axis
    where needed; the purpose label is for people and may be reworded freely."""

    TP_ACTIVATION = "tp activation"  # a layer's attention / MLP outputs and their gradients reduced over tp
    TP_VOCAB = "tp vocab"  # embedding lookup and logits input: partial sums over tp's vocabulary shards
    SP_REGATHER = "sequence-parallel re-gather"  # the backward's re-gather of sequence-sharded inputs
    WEIGHT_GATHER = "weight gather"  # a layer's sharded weights gathered ahead of its forward (and backward)
    WEIGHT_REGATHER = "weight re-gather"  # gathered again in the backward, hidden behind backward + recompute
    LAYER_GRAD_REDUCE = "layer gradient reduce"  # a layer's gradients reduce-scattered in the backward, hidden
    # behind backward + recompute
    GRAD_REDUCE = "gradient reduce"  # gradients reduced once per step (or per stage, after its loop)
    TABLE_GATHER = "output table gather"  # the sharded output (logits) table gathered
    TABLE_GRAD_REDUCE = "output table gradient reduce"  # and its gradient reduce-scattered
    EMBEDDING_EXCHANGE = "embedding exchange"  # looked-up rows of a d-sharded embedding table to their tokens
    CONTEXT_KV = "context keys/values"  # cp: keys and values gathered, their gradients reduce-scattered
    EXPERT_EXCHANGE = "expert exchange"  # ep: the MoE layers' token dispatch and combine
    PIPELINE_TRANSFER = "pipeline transfer"  # pp: activations to the next stage and gradients back
    ACTIVATION_OFFLOAD = "activation offload"  # offloaded checkpoints to the host and back
    OPTIMIZER_OFFLOAD = "optimizer offload"  # gradients down, updated parameters up for a host optimizer step
    PARAM_OFFLOAD = "parameter offload"  # master parameters streamed in from the host, gradients back


@dataclass(frozen=True)
class Collective:
    """One kind of collective the plan implies, summed over a step, for one chip (role: what it does; purpose: a
    label for people)."""

    axis: str  # mesh axis: dp, fsdp, tp, cp, pp, ep, or 'host' for offload traffic
    kind: str  # all-gather | reduce-scatter | all-reduce | all-to-all | p2p | d2h/h2d
    purpose: str  # e.g. 'weights fwd', 'grads', 'activations'
    count: int  # how many times per step
    bytes_each: float  # buffer size per chip, per occurrence
    level: str  # scale-up | network | host
    time_s: float  # total time over the step if nothing overlapped
    exposed_s: float  # what remains on the critical path after overlap
    role: Role


@dataclass(frozen=True)
class Cost:
    step_time_s: float
    mfu: float
    hfu: float
    tokens_per_s: float
    tflops_per_chip: float  # model TFLOP/s per chip (MFU numerator)
    peak_memory_bytes: float  # per chip, the busiest pipeline stage
    # what the fit check reads: costmodel.memory.fit_floor_bytes under MaxText (XLA), else peak_memory_bytes
    fit_memory_bytes: float
    hbm_usable_bytes: float
    fits: bool  # fit_memory_bytes <= usable HBM (and host memory within the host's)
    overflow_bytes: float  # fit_memory_bytes - usable, 0 when it fits
    host_memory_bytes: float  # per chip, used by offload
    host_fits: bool
    grad_accum: int
    model_flops_per_step: float
    hardware_flops_per_step: float  # matmul FLOPs, recompute included (the HFU numerator)
    time: dict[str, float] = field(default_factory=dict)  # breakdown of step_time_s (sums to it)
    memory: dict[str, float] = field(default_factory=dict)  # breakdown of peak_memory_bytes (sums to it)
    collectives: tuple[Collective, ...] = ()
    vector_flops_per_step: float = 0.0  # element-wise FLOPs (costmodel.flops.layer_vector_flops), all chips
    convention: str = ""  # state convention used for memory ('maxtext' fp32 weights / 'megatron' bf16 + master)
    stage_layers: tuple[int, ...] = ()  # layers on (the first, each middle, the last) pipeline stage; () without pp

    @property
    def fit_below_total(self) -> bool:
        """The fit check reads less than the total (MaxText: costmodel.memory.fit_floor_bytes); show both."""
        return self.fit_memory_bytes < self.peak_memory_bytes

    @property
    def near_limit(self) -> bool:
        """Fits, but with the fit check's figure within NEAR_LIMIT of the usable HBM, where the verdict is not sure:
        of four MaxText compiles whose fit floor sat at 96.7-100 % of v6e's HBM, XLA refused one, needing 5.0 % more
        (benchmarks/maxtext_memory/NOTES.md); compile such a plan (planner validate --target) before a launch."""
        return self.fits and self.fit_memory_bytes > (1.0 - NEAR_LIMIT) * self.hbm_usable_bytes

    @property
    def dominant(self) -> str:
        """The largest entry of the time breakdown."""
        return max(self.time, key=self.time.get) if self.time else ""

    def to_dict(self) -> dict:
        return {
            "step_time_s": self.step_time_s, "mfu": self.mfu, "hfu": self.hfu, "tokens_per_s": self.tokens_per_s,
            "tflops_per_chip": self.tflops_per_chip, "peak_memory_bytes": self.peak_memory_bytes,
            "fit_memory_bytes": self.fit_memory_bytes,
            "hbm_usable_bytes": self.hbm_usable_bytes, "fits": self.fits, "overflow_bytes": self.overflow_bytes,
            "near_limit": self.near_limit,
            "host_memory_bytes": self.host_memory_bytes, "host_fits": self.host_fits,
            "grad_accum": self.grad_accum, "model_flops_per_step": self.model_flops_per_step,
            "hardware_flops_per_step": self.hardware_flops_per_step,
            "vector_flops_per_step": self.vector_flops_per_step, "convention": self.convention,
            "stage_layers": list(self.stage_layers),
            "breakdown": {"time_s": dict(self.time), "memory_bytes": dict(self.memory)},
            "collectives": [{k: v for k, v in c.__dict__.items() if k != "role"} for c in self.collectives],
        }
