"""What is being trained: sequence length, global batch, precision and framework convention."""

from __future__ import annotations

from dataclasses import dataclass

from hardware.errors import InputError

MAX_TOKENS_PER_STEP = 2**40  # a sanity bound (published runs step ~4M-60M tokens): keeps times in int64 ns
PRECISIONS = ("bf16", "fp16", "fp8", "int8")
FRAMEWORKS = ("maxtext", "megatron", "pytorch-fsdp", "deepspeed")
WEIGHT_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Job:
    """seq_len in tokens, global_batch in sequences per optimizer step.

    framework picks the conventions of the training stack (costmodel.memory.CONVENTIONS):
      maxtext:      fp32 weights and Adam moments, bf16 compute, fp32 gradient accumulator (JAX/XLA).
      megatron:     bf16 weights, fp32 main gradients, fp32 master weights + moments in the optimizer (12 B).
      pytorch-fsdp: fp32 sharded weights (amp_bf16 compute), fp32 gradients accumulated in place (llm-foundry).
      deepspeed:    Megatron's state layout; ZeRO-3 parameter gathers run as flat collectives over the data
                    group (one NIC per rank across nodes, no multi-rail aggregation), as DeepSpeed 2021 did.
    weight_dtype (maxtext only) is MaxText's `weight_dtype`: "bfloat16" stores the weights and both Adam
    moments in bf16 (gradients stay fp32, MaxText's `grad_dtype` default). scan_layers (maxtext only) is
    MaxText's `scan_layers` (default true): the layers run under one lax.scan, whose backward loop keeps extra
    buffers (costmodel.memory.xla_loop_extra_bytes); false unrolls them.
    """

    seq_len: int
    global_batch: int
    precision: str = "bf16"
    framework: str = "maxtext"
    weight_dtype: str = "float32"
    scan_layers: bool = True

    def __post_init__(self) -> None:
        if self.seq_len <= 0:
            raise InputError(f"seq_len must be a positive integer, got {self.seq_len}")
        if self.global_batch <= 0:
            raise InputError(f"global_batch must be a positive integer, got {self.global_batch}")
        if self.seq_len * self.global_batch > MAX_TOKENS_PER_STEP:
            raise InputError(f"global_batch: {self.global_batch} sequences x {self.seq_len} tokens is "
                             f"{self.seq_len * self.global_batch:.3g} tokens per step; expected at most 2^40 (1.1e12)")
        if self.precision not in PRECISIONS:
            raise InputError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.framework not in FRAMEWORKS:
            raise InputError(f"framework must be one of {', '.join(FRAMEWORKS)}, got {self.framework!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise InputError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {self.weight_dtype!r}")
        if self.weight_dtype == "bfloat16" and self.framework != "maxtext":
            raise InputError(f"weight_dtype bfloat16 is a maxtext setting; framework {self.framework!r} has its own "
                             "state layout (expected --framework maxtext)")

    @property
    def tokens(self) -> int:
        return self.seq_len * self.global_batch
