"""What is being trained: sequence length, global batch, precision and framework convention."""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.framework import REGISTRY, Framework, framework
from hardware.errors import InputError

MAX_TOKENS_PER_STEP = 2**40  # a sanity bound (published runs step ~4M-60M tokens): keeps times in int64 ns
PRECISIONS = ("bf16", "fp16", "fp8", "int8")
FRAMEWORKS = tuple(REGISTRY)  # costmodel.framework: one record each
WEIGHT_DTYPES = ("float32", "bfloat16")
# The attention kernel: fused flash attention (every framework's default: MaxText 'autoselected' on TPU, Megatron's
# TE/flash) or plain dot-product attention that writes the s x s scores to HBM (MaxText attention=dot_product,
# AXLearn's MultiheadAttention without the -flash variant): costmodel.flops.score_accesses.
ATTENTION_KERNELS = ("flash", "dot_product")


@dataclass(frozen=True)
class Job:
    """seq_len in tokens, global_batch in sequences per optimizer step.

    framework names the training stack whose conventions apply (costmodel.framework: its record, `fw`).
    weight_dtype "bfloat16" (MaxText's `weight_dtype`) stores the weights and both Adam moments in bf16, where
    the framework has that setting. scan_layers is MaxText's `scan_layers` (default true): the layers run under
    one lax.scan, whose backward loop keeps extra buffers (costmodel.memory.xla_loop_extra_bytes); false unrolls
    them (read only where Framework.scanned_layers). attention: the kernel (ATTENTION_KERNELS).
    """

    seq_len: int
    global_batch: int
    precision: str = "bf16"
    framework: str = "maxtext"
    weight_dtype: str = "float32"
    scan_layers: bool = True
    attention: str = "flash"

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
        fw = framework(self.framework)
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise InputError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {self.weight_dtype!r}")
        fw.state_bytes(self.weight_dtype)  # raises where the framework has no such layout
        if self.attention not in ATTENTION_KERNELS:
            raise InputError(f"attention must be one of {', '.join(ATTENTION_KERNELS)}, got {self.attention!r}")

    @property
    def fw(self) -> Framework:
        """The framework's record (costmodel.framework)."""
        return REGISTRY[self.framework]

    @property
    def tokens(self) -> int:
        return self.seq_len * self.global_batch
