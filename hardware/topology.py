"""How mesh axes lie on the interconnect, and what a collective over one axis costs.

TPU: each slice is an ICI torus (2D or 3D); slices are joined over DCN. Mesh axes are laid innermost first
(tensor, context, expert, fsdp, pipeline, data) onto the torus dimensions; the DCN degrees of each axis
span slices. GPU: an NVLink switch domain per node, a scale-out network between nodes; axes laid innermost
first fill a node before spilling across nodes.

Collective times are a latency-bandwidth model of ring algorithms (Thakur et al. 2005; the scaling book's
TPU chapter): a ring all-gather of B bytes (the gathered size) over n chips moves (n-1)/n * B per chip.
Hierarchical groups (part inside the fast level, part across the network) pay each phase on its own level,
with the network phase carrying B/inner bytes per chip (each member of a node uses its own NIC: multi-rail).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cache

from hardware.chip import Chip, Level
from hardware.errors import InputError


@dataclass(frozen=True)
class AxisLink:
    """One mesh axis of `size` chips: `inner` of them inside one scale-up domain, `outer` domains apart."""

    axis: str
    size: int
    inner: int
    outer: int
    inner_bw_Bps: float  # effective one-direction ring bandwidth per chip inside the domain (before eff.link)
    outer_bw_Bps: float  # per-chip network bandwidth across domains (before eff.net)
    inner_latency_s: float
    outer_latency_s: float
    torus_dims: int = 0  # torus dimensions the inner part spans (TPU); 0 on switches
    # NCCL's ring latency model (base, step inside the domain, step across domains), from the levels'
    # ring_base_latency_s / ring_step_latency_s; () = the hierarchical rings' hop latencies
    nccl_ring: tuple[float, float, float] = ()

    @property
    def level(self) -> str:
        if self.size == 1:
            return "none"
        return "network" if self.outer > 1 else "scale-up"


# ---- TPU slice shapes --------------------------------------------------------------------------------

# [G-v5p] https://cloud.google.com/tpu/docs/v5p (and the v4 page): below one 4x4x4 cube a 3D slice is 2x2x1, 2x2x2,
# 2x2x4 or 2x4x4 (v5p-8 .. v5p-64); [G-v5e] https://cloud.google.com/tpu/docs/v5e: 1x1, 2x2, 2x4, 4x4 ... 16x16.
SUB_CUBE_SHAPES = {(1, 2, 2), (2, 2, 2), (2, 2, 4), (2, 4, 4)}


def _torus_dim_choices(level: Level) -> list[int]:
    """Allowed lengths of one torus dimension: 1, 2 and multiples of 4 up to 16 (2D) or 24 (3D)."""
    top = 16 if level.torus_dims == 2 else 24
    return [1, 2] + list(range(4, top + 1, 4)) if level.torus_dims == 3 else [1, 2, 4, 8, 16]


@cache
def _shapes(dims: int, max_dim_list: tuple[int, ...], max_chips: int,
            orderable: bool = True) -> dict[int, tuple[int, ...]]:
    """The most cubic shape for each chip count that a slice can have; `orderable`: only the shapes Cloud TPU
    offers (SUB_CUBE_SHAPES below a cube, no 1xN 2D slice), else also part of such a slice (a cost query on 1 or 2
    chips of a v5p-8)."""
    best: dict[int, tuple[int, ...]] = {}
    for shape in itertools.combinations_with_replacement(max_dim_list, dims):
        n = math.prod(shape)
        if n > max_chips:
            continue
        if dims == 3 and n >= 64 and any(d % 4 for d in shape):
            continue  # slices of 64+ chips are built from whole 4x4x4 cubes
        if orderable and dims == 3 and n < 64 and tuple(sorted(shape)) not in SUB_CUBE_SHAPES:
            continue  # below one cube only these shapes are offered
        if orderable and dims == 2 and n > 1 and min(shape) == 1:
            continue  # 2D slices: 1x1, then 2x2 and larger [G-v5e]
        key = (max(shape), shape)
        if n not in best or key < (max(best[n]), best[n]):
            best[n] = tuple(sorted(shape))
    return best


def slice_shape(chip: Chip, slice_chips: int) -> tuple[int, ...]:
    """Torus shape of one slice of `slice_chips` chips (sorted ascending): an orderable one, else part of one (for
    costing a plan on a few chips); an InputError with the nearest orderable sizes otherwise."""
    ici = chip.scale_up
    if ici.kind != "torus":
        return (slice_chips,)
    choices = tuple(_torus_dim_choices(ici))
    shapes = _shapes(ici.torus_dims, choices, ici.domain_chips)
    if slice_chips not in shapes:
        part = _shapes(ici.torus_dims, choices, ici.domain_chips, orderable=False)
        if slice_chips in part and slice_chips < min(n for n in shapes if n > 1):
            return part[slice_chips]
        near = sorted(shapes, key=lambda n: (abs(n - slice_chips), n))[:5]
        raise InputError(f"chips per slice: {chip.name} cannot form a slice of {slice_chips} chips; "
                         f"nearest valid slice sizes: {', '.join(map(str, sorted(near)))}")
    return shapes[slice_chips]


def valid_slice_sizes(chip: Chip) -> list[int]:
    """Chip counts of the slices Cloud TPU offers for this generation."""
    ici = chip.scale_up
    if ici.kind != "torus":
        return []
    return sorted(_shapes(ici.torus_dims, tuple(_torus_dim_choices(ici)), ici.domain_chips))


def _wraps(level: Level, length: int, full_dim: int, slice_chips: int) -> bool:
    """Whether a ring along `length` chips of a torus dimension of `full_dim` has a wraparound link."""
    if length != full_dim or length <= 2:
        return False
    if level.wrap_rule == "cube4":
        return slice_chips >= 64 and length % 4 == 0
    if level.wrap_rule == "len16":
        return length == 16
    return False


# ---- laying axes out ---------------------------------------------------------------------------------

def lay_out(chip: Chip, ici: dict[str, int], dcn: dict[str, int], order: tuple[str, ...]) -> dict[str, AxisLink]:
    """Place each axis: `ici` degrees inside a slice/node, `dcn` degrees across slices/nodes (TPU), in `order`.

    GPUs take only `ici` (the whole job); axes spill from the NVLink node across the network by stride.
    """
    up = chip.scale_up
    net = chip.levels[-1] if len(chip.levels) > 1 else chip.levels[0]
    if up.kind == "torus":
        return _lay_out_torus(chip, up, net, ici, dcn, order)
    return _lay_out_switch(up, net, ici, order)


def _lay_out_torus(chip: Chip, up: Level, net: Level, ici: dict[str, int], dcn: dict[str, int],
                   order: tuple[str, ...]) -> dict[str, AxisLink]:
    slice_chips = math.prod(ici.values())
    shape = sorted(slice_shape(chip, slice_chips), reverse=True)  # biggest dims first for the inner axes
    remaining = list(shape)
    links: dict[str, AxisLink] = {}
    for axis in order:
        n_in, n_out = ici.get(axis, 1), dcn.get(axis, 1)
        bw, dims_used, left = 0.0, 0, n_in
        for i, cap in enumerate(remaining):
            if left == 1:
                break
            if cap == 1:
                continue
            take = math.gcd(left, cap) if math.gcd(left, cap) > 1 else min(left, cap)
            wrap = _wraps(up, take, shape[i], slice_chips)
            bw += up.bw_per_dir_Bps * (2 if wrap else 1)  # bidirectional ring with wraparound: both directions
            dims_used += 1
            remaining[i] = max(1, cap // take)
            left = max(1, left // take)
        links[axis] = AxisLink(axis, n_in * n_out, n_in, n_out, bw or up.bw_per_dir_Bps, net.bw_per_dir_Bps,
                               up.latency_s, net.latency_s, dims_used)
    return links


def _lay_out_switch(up: Level, net: Level, degrees: dict[str, int], order: tuple[str, ...]) -> dict[str, AxisLink]:
    node = up.domain_chips or math.prod(degrees.values())
    nccl = up.ring_step_latency_s > 0 and net.ring_step_latency_s > 0
    stride = 1
    links: dict[str, AxisLink] = {}
    for axis in order:
        n = degrees.get(axis, 1)
        inner = n if stride * n <= node else max(1, min(n, node // stride))
        outer = max(1, n // inner)
        ring = ((net if outer > 1 else up).ring_base_latency_s, up.ring_step_latency_s, net.ring_step_latency_s)
        links[axis] = AxisLink(axis, n, inner, outer, up.bw_per_dir_Bps, net.bw_per_dir_Bps,
                               up.latency_s, net.latency_s, nccl_ring=ring if nccl else ())
        stride *= n
    return links


# ---- collective times --------------------------------------------------------------------------------

def _ring(n: int, nbytes: float, bw: float, lat: float) -> float:
    """Ring all-gather / reduce-scatter: (n-1)/n of the full buffer over the ring bandwidth, n-1 latency steps."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / bw + (n - 1) * lat


def ring_latency(link: AxisLink, kind: str, flat: bool = False) -> float:
    """The latency part of a ring all-gather / reduce-scatter over `link` (an all-reduce: both rings).

    NCCL (link.nccl_ring; NVIDIA/nccl src/graph/tuning.cc, Ring/Simple): one flat ring over all n ranks,
    latency = baseLat + (nsteps - nInterSteps) x intra-node step + nInterSteps x network step, with nsteps = n - 1
    (all-reduce 2(n - 1)) and nInterSteps = nodes - 1 (all-reduce 2(nodes - 1)); the base is paid once. (Every
    step of a multi-node ring pays at least 3 x getNetOverhead = 3 us, below NVLink's 3.4 us.) Otherwise
    hierarchical rings, one hop latency per step of each ring (flat: n - 1 network hops)."""
    rings = 2 if kind == "all-reduce" else 1
    if link.nccl_ring:
        base, step_in, step_out = link.nccl_ring
        return base + rings * ((link.size - link.outer) * step_in + (link.outer - 1) * step_out)
    if flat and link.outer > 1:
        return rings * (link.size - 1) * link.outer_latency_s
    return rings * ((link.inner - 1) * link.inner_latency_s + (link.outer - 1) * link.outer_latency_s)


def collective_time(link: AxisLink, kind: str, nbytes: float, link_eff: float = 1.0, net_eff: float = 1.0,
                    flat: bool = False) -> float:
    """Seconds for one collective over `link`. nbytes: full (unsharded) buffer per chip for all-gather,
    reduce-scatter and all-reduce; bytes each chip sends for all-to-all and p2p.
    flat: one ring over all members, so every rank's network share goes through its own single NIC
    ((n-1)/n of the buffer), instead of the hierarchical/multi-rail split."""
    if link.size <= 1 or nbytes <= 0:
        return 0.0
    bw_in, bw_out = link.inner_bw_Bps * link_eff, link.outer_bw_Bps * net_eff
    if kind in ("all-gather", "reduce-scatter", "all-reduce"):
        if flat and link.outer > 1:
            t = _ring(link.size, nbytes, bw_out, 0.0)
        else:
            t = _ring(link.inner, nbytes, bw_in, 0.0) + _ring(link.outer, nbytes / link.inner, bw_out, 0.0)
        return (2 * t if kind == "all-reduce" else t) + ring_latency(link, kind, flat)
    if kind == "all-to-all":
        # Each chip keeps 1/n and sends the rest; on a torus the bisection limits a ring all-to-all to ~n/4
        # times the point-to-point cost (scaling book, TPU chapter); switches and networks are full-bisection.
        frac_in = (link.inner - 1) / link.size
        frac_out = (link.size - link.inner) / link.size
        torus_penalty = max(1.0, link.inner / 4) if link.torus_dims else 1.0
        return (frac_in * nbytes * torus_penalty / bw_in + frac_out * nbytes / bw_out
                + link.inner_latency_s + (link.outer_latency_s if link.outer > 1 else 0.0))
    if kind == "p2p":
        if link.outer > 1:
            return nbytes / bw_out + link.outer_latency_s
        per_link = bw_in / max(1, 2 * link.torus_dims) if link.torus_dims else bw_in
        return nbytes / per_link + link.inner_latency_s
    raise ValueError(f"unknown collective kind {kind!r}")
