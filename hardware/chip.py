"""What the machine is: a chip, its host, and its interconnect levels (frozen dataclasses).

Profiles live as YAML under `hardware/profiles/`, one per chip; every number there carries its source.
Efficiency parameters are the only fitted numbers; `costmodel.calibrate` fits them from measured runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of the spec-sheet peaks. Named so that calibration can fit them.

    Each field's comment says what it scales. `costmodel.calibrate` fits them to measured runs within
    physical bounds; the shipped fits are `hardware/calibration/NAME.yaml` (how well they predict:
    docs/accuracy.md; sourced microbenchmark priors: docs/priors.md).
    """

    # fraction of peak FLOP/s a large, well-shaped matmul reaches
    matmul_peak: float = 0.75
    # per-chip matmul dimension (elements) at which matmul efficiency halves:
    # eff(d) = matmul_peak * d / (d + matmul_half_dim) for the smallest dim d
    matmul_half_dim: float = 64.0
    # fraction of matmul_peak that fused (flash) attention reaches on its score/context matmuls
    attention: float = 0.7
    # fraction of HBM bandwidth reached by memory-bound ops (norms, activations, optimizer)
    hbm: float = 0.8
    # fraction of scale-up link bandwidth (ICI / NVLink) reached by collectives
    link: float = 0.8
    # fraction of scale-out bandwidth (DCN / InfiniBand) reached by collectives
    net: float = 0.7
    # fraction of overlappable communication (fsdp/dp/cp/offload) that compute hides
    overlap: float = 0.85
    # fraction of tensor-parallel activation collectives hidden behind the layer's matmuls
    # (0 for Megatron-2021-style blocking all-reduces; XLA's async collective matmuls hide most)
    tp_overlap: float = 0.0
    # fraction of activation offload traffic (device<->host DMA) hidden behind compute; 0.5 until
    # calibrated, since host DMA also competes with collectives for HBM and the host link
    host_overlap: float = 0.5
    # fraction of the nominal fp8/int8 speed-up over bf16 that training matmuls realise
    # (scaling and casts around each quantized matmul eat part of it)
    lowp_gain: float = 1.0
    # fixed per-step time (launch, data loading, logging)
    step_overhead_s: float = 0.0


@dataclass(frozen=True)
class Level:
    """One interconnect level, innermost first.

    kind: 'torus' (TPU ICI: links to torus neighbours), 'switch' (NVLink: all-to-all in a domain),
          'network' (DCN / InfiniBand between slices or nodes).
    domain_chips: chips in one domain of this level (a TPU slice's maximum, a GPU node); 0 = unbounded.
    bw_per_dir_Bps: per-link one-direction bandwidth for a torus; per-chip one-direction bandwidth otherwise.
    torus_dims: 3 for v4/v5p, 2 for v5e/v6e; 0 for non-torus levels.
    ring_base_latency_s, ring_step_latency_s: NCCL's ring latency model (GPU levels; 0 = not modelled, the ring
    pays latency_s per hop of hierarchical rings): a ring collective pays the base once and every step of its
    flat ring the step latency of the level it crosses (hardware.topology.ring_latency).
    wrap_rule: 'cube4' (wraparound only on whole 4x4x4 cubes: axis length multiple of 4, slice >= 64 chips),
               'len16' (wraparound only on axes of length 16), or '' (no torus).
    """

    name: str
    kind: str
    domain_chips: int
    bw_per_dir_Bps: float
    latency_s: float
    torus_dims: int = 0
    wrap_rule: str = ""
    ring_base_latency_s: float = 0.0
    ring_step_latency_s: float = 0.0


@dataclass(frozen=True)
class Chip:
    """A hardware profile: one accelerator with its host and interconnect. SI units throughout."""

    name: str
    vendor: str  # 'tpu' | 'gpu' | 'cpu'
    description: str
    peak_bf16_flops: float
    peak_fp8_flops: float  # 0 when the chip has no faster fp8 path
    peak_int8_flops: float  # 0 when the chip has no faster int8 path
    hbm_bytes: float
    hbm_bw_Bps: float
    host_mem_bytes: float  # host DRAM available per chip
    host_link_Bps: float  # host<->device bandwidth per chip, one direction
    levels: tuple[Level, ...]
    chips_per_host: int
    max_chips: int  # largest job this profile describes (a pod, multislice or cluster limit)
    hbm_reserve_frac: float = 0.05  # HBM kept free for runtime, fragmentation and compiler scratch
    # host DRAM bandwidth per chip: the node's CPU memory bandwidth / chips_per_host; 0 = not known
    host_mem_bw_Bps: float = 0.0
    power_w: float = 0.0  # chip power at load, for energy estimates (0 = unknown)
    eff: Efficiency = field(default_factory=Efficiency)
    # A preset with no calibration runs of its own names its nearest calibrated relative here; its efficiencies are
    # then that preset's fitted overlay (hardware.catalog.with_calibration). '' = none.
    calibration_sibling: str = ""
    sources: tuple[str, ...] = ()

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s for a matmul precision; falls back to bf16 where no faster path exists."""
        if precision == "fp8" and self.peak_fp8_flops > 0:
            return self.peak_fp8_flops
        if precision == "int8" and self.peak_int8_flops > 0:
            return self.peak_int8_flops
        return self.peak_bf16_flops

    def effective_peak_flops(self, precision: str) -> float:
        """Peak used for timing: bf16 plus the realised fraction (eff.lowp_gain) of a low-precision speed-up."""
        bf16 = self.peak_bf16_flops
        return bf16 + self.eff.lowp_gain * (self.peak_flops(precision) - bf16)

    @property
    def host_update_Bps(self) -> float:
        """Bandwidth an optimizer step on the host CPU streams its state at: the host DRAM's share per chip (Adam
        is memory-bound); where the profile does not know it, the host link's (slower on every profile that has
        both), so an unknown host is costed on the slow side."""
        return self.host_mem_bw_Bps or self.host_link_Bps

    @property
    def usable_hbm_bytes(self) -> float:
        return self.hbm_bytes * (1.0 - self.hbm_reserve_frac)

    @property
    def scale_up(self) -> Level:
        """The innermost (fastest) level: the ICI torus or the NVLink domain."""
        return self.levels[0]

    @property
    def is_tpu(self) -> bool:
        return self.vendor == "tpu"

    def with_efficiency(self, **kw: float) -> Chip:
        return replace(self, eff=replace(self.eff, **kw))


EFFICIENCY_FIELDS = tuple(f.name for f in fields(Efficiency))
