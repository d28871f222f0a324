"""What is being trained: sequence length, global batch, precision and framework convention."""

from __future__ import annotations

from dataclasses import dataclass

from hardware.errors import InputError

PRECISIONS = ("bf16", "fp16", "fp8", "int8")
FRAMEWORKS = ("maxtext", "megatron")


@dataclass(frozen=True)
class Job:
    """seq_len in tokens, global_batch in sequences per optimizer step.

    framework picks the state convention: 'maxtext' keeps fp32 weights (4 B) and fp32 Adam moments, computes in
    bf16; 'megatron' keeps bf16 weights (2 B) plus fp32 master weights and moments in the optimizer (12 B).
    """

    seq_len: int
    global_batch: int
    precision: str = "bf16"
    framework: str = "maxtext"

    def __post_init__(self) -> None:
        if self.seq_len <= 0:
            raise InputError(f"seq_len must be a positive integer, got {self.seq_len}")
        if self.global_batch <= 0:
            raise InputError(f"global_batch must be a positive integer, got {self.global_batch}")
        if self.precision not in PRECISIONS:
            raise InputError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.framework not in FRAMEWORKS:
            raise InputError(f"framework must be one of {', '.join(FRAMEWORKS)}, got {self.framework!r}")

    @property
    def tokens(self) -> int:
        return self.seq_len * self.global_batch
