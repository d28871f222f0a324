"""The search: the K fastest plans that fit, over every mesh candidate and every remat/offload assignment.

Outer loop: best-first over mesh candidates (planner/candidates.py) with admissible lower bounds on a mesh's
best step time, so that only meshes that could enter the top K are solved: LB0 (compute, memory-bound passes,
1F1B bubble and fixed overhead; no estimate() call), LB0 + the MoE all-to-alls over ep, and LB1 (one estimate()
with nothing recomputed or offloaded, less what remat or optimizer offload can remove); a mesh whose least-memory
assignment overflows HBM is dropped. A popped LB0 entry is refined and pushed back; a popped LB1 entry is solved
exactly (planner/remat.py: CP-SAT over the probed surrogate, verified with estimate()). The search stops when the
next bound exceeds the K-th best verified step time, so the result equals what evaluating every mesh would give
(`exhaustive=True` does that, without pruning, to check it).
Order of plans (and ties): step time, then peak memory, then the canonical mesh tuple (dp, fsdp, tp, cp, pp,
ep, vpp, micro_batch, zero, slices, split flags), then the remat/offload choice. One plan per layout in the top K
(a mesh with its best pipeline-split flags: _keep).
(details: docs/search.md, 'Lower bounds and pruning')
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

from costmodel.cost import NEAR_LIMIT, Cost, Role
from costmodel.estimate import estimate, expert_exchange_floor_s, stage_times
from costmodel.interval import Interval, step_time_interval
from costmodel.job import Job
from costmodel.memory import memory_terms, stage_kinds
from costmodel.model import ModelSpec
from costmodel.plan import REMAT_POLICIES, Plan
from hardware.chip import Chip
from hardware.errors import InputError
from planner.candidates import (
    Constraints,
    Mesh,
    candidates,
    check_chips,
    default_slices,
    explain_no_candidates,
    formable,
)
from planner.remat import MeshResult, brute_force, exposed, hideable, min_memory_choice, result_key, solve_mesh

GIB = 2**30
BRUTE_FORCE_LIMIT = 20_000  # exhaustive mode brute-forces remat choices when meshes x choices is at most this
FEASIBILITY_CHECKS = 400  # meshes tried per what-if when explaining an infeasible job


@dataclass(frozen=True)
class PlanResult:
    plan: Plan
    cost: Cost
    mesh: Mesh
    interval: Interval | None = None  # the step time's likely range (costmodel.interval), set by `suggest`
    in_margin: bool = False  # fits, but not with the headroom `suggest` asks for

    def key(self) -> tuple:
        from planner.remat import Choice

        return result_key(self.cost, self.mesh, Choice(self.plan.remat, self.plan.offload_optimizer,
                                                       self.plan.offload_params, self.plan.recompute_num_layers,
                                                       self.plan.overlap_moe_expert_parallel_comm))


@dataclass
class SearchStats:
    candidates: int = 0  # mesh candidates the rules allow
    bounded: int = 0  # meshes costed once for LB1
    solved: int = 0  # meshes whose remat/offload program was solved
    infeasible: int = 0  # solved meshes where nothing fits
    brute_forced: int = 0  # meshes solved by enumerating every assignment
    resolves: int = 0  # extra CP-SAT solves after a verification miss
    estimates: int = 0  # estimate() calls
    exhaustive: bool = False

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Infeasible:
    reason: str
    suggestions: tuple[str, ...]
    min_memory_bytes: float  # the smallest per-chip HBM any candidate reaches
    min_memory_plan: Plan | None

    def to_dict(self) -> dict:
        return {"reason": self.reason, "suggestions": list(self.suggestions),
                "min_memory_bytes": self.min_memory_bytes}


@dataclass
class Suggestion:
    model: ModelSpec
    chip: Chip
    chips: int
    slices: int
    job: Job
    constraints: Constraints
    plans: list[PlanResult] = field(default_factory=list)
    stats: SearchStats = field(default_factory=SearchStats)
    infeasible: Infeasible | None = None
    goodput: dict = field(default_factory=dict)  # id(PlanResult) -> costmodel.goodput.Goodput when re-ranked
    headroom: float = 0.0  # share of the usable HBM a plan leaves free to be listed first
    ranked_by: str = "expected"  # 'conservative' (slow end of the interval), 'expected' or 'days_to_train'


def _accum(job: Job, mesh: Mesh) -> int:
    """Micro-steps per optimizer step on this mesh (gradient accumulation, or pipeline micro-batches)."""
    return job.global_batch // (mesh.batch_shards * mesh.micro_batch)


def _stages_key(m: ModelSpec, mesh: Mesh, cache: dict) -> tuple:
    """What the busiest stage's times depend on besides tp, cp and the micro-batch: each stage's (dense, MoE, logits)
    layers (costmodel.memory.stage_kinds), which pp, vpp and the split flags set (memoised in `cache`)."""
    key = ("stages", mesh.pp, mesh.vpp, mesh.split)
    if key not in cache:
        cache[key] = (mesh.pp, tuple(stage_kinds(m, mesh.plan())))
    return cache[key]


def _lb0(m: ModelSpec, chip: Chip, job: Job, mesh: Mesh, cache: dict) -> float:
    key = (mesh.tp, mesh.cp, mesh.micro_batch, _stages_key(m, mesh, cache))
    if key not in cache:
        st = stage_times(m, chip, job, mesh.plan(REMAT_POLICIES["none"]))
        cache[key] = st.fwd + st.bwd + st.elementwise
    per_micro = cache[key]
    accum = _accum(job, mesh)
    return accum * per_micro + (mesh.pp - 1) / mesh.vpp * per_micro + chip.eff.step_overhead_s


def _ep_overlap_possible(job: Job, mesh: Mesh) -> bool:
    """The expert all-to-all overlap may apply on this mesh (planner.remat.ep_overlap_applies, before the
    assignment is known)."""
    return job.fw.ep_overlap and mesh.ep > 1 and (mesh.pp == 1 or mesh.vpp > 1)


def _lb_exchange(m: ModelSpec, chip: Chip, job: Job, mesh: Mesh) -> float:
    """The ep all-to-alls every assignment of the mesh pays (costmodel.estimate.expert_exchange_floor_s)."""
    if mesh.ep == 1:  # (before building a Plan: this runs for every candidate mesh)
        return 0.0
    if _ep_overlap_possible(job, mesh):  # the overlap may hide them (planner.remat.with_ep_overlap)
        return 0.0
    return expert_exchange_floor_s(m, chip, job, mesh.plan(REMAT_POLICIES["none"]), _accum(job, mesh))


def _min_hbm(m: ModelSpec, chip: Chip, job: Job, mesh: Mesh, ch) -> float:
    """HBM the least-memory assignment needs (its fit_bytes; costmodel.memory only: a fifth of an estimate())."""
    plan = mesh.plan(ch.remat, ch.offload_optimizer, ch.offload_params)
    accum = _accum(job, mesh)
    return memory_terms(m, chip, job, plan, accum).fit_bytes


def _lb1(c0: Cost, optimizer_offload_allowed: bool, ep_overlap_possible: bool = False) -> float:
    """LB1: the no-remat estimate less what any assignment can hide (recompute, optimizer offload, and the
    exposed expert all-to-alls where the overlap may apply: planner.remat.with_ep_overlap)."""
    opt = c0.time.get("optimizer", 0.0) if optimizer_offload_allowed else 0.0
    a2a = exposed(c0, Role.EXPERT_EXCHANGE) if ep_overlap_possible else 0.0
    return c0.step_time_s - hideable(c0) - opt - a2a


def search(m: ModelSpec, chip: Chip, job: Job, chips: int, cons: Constraints | None = None, top: int = 5,
           exhaustive: bool = False, brute: bool | None = None, explain: bool = True) -> Suggestion:
    """The `top` best plans (one per mesh) for `job` on `chips` chips. Raises InputError for bad input.

    exhaustive: solve every mesh (no pruning). brute: cost every remat/offload assignment of every solved mesh
    with estimate() instead of CP-SAT (default: in exhaustive mode when that is at most BRUTE_FORCE_LIMIT calls).
    """
    cons = cons or Constraints()
    if top < 1:
        raise InputError(f"--top: expected a positive integer, got {top}")
    check_chips(chip, chips)
    slices = default_slices(chip, chips, cons.slices)
    meshes = list(candidates(m, chip, job, chips, cons, slices))
    if not meshes:
        raise explain_no_candidates(m, chip, job, chips, cons)
    stats = SearchStats(candidates=len(meshes), exhaustive=exhaustive)
    if brute is None:
        from planner.remat import all_choices

        brute = exhaustive and len(meshes) * len(all_choices(cons)) <= BRUTE_FORCE_LIMIT
    out = Suggestion(m, chip, chips, slices, job, cons, stats=stats)

    cache: dict = {}
    templates: dict = {}
    heap = [(_lb0(m, chip, job, mesh, cache), 0, mesh) for mesh in meshes]
    heapq.heapify(heap)
    best: list[PlanResult] = []  # sorted, at most `top`
    base: dict[Mesh, Cost] = {}
    lowest: tuple[float, Mesh | None, Plan | None] = (math.inf, None, None)
    while heap:
        bound, stage, mesh = heapq.heappop(heap)
        if not exhaustive and len(best) >= top and bound > best[-1].cost.step_time_s:
            break
        if stage == 0 and not exhaustive:
            floor = _lb_exchange(m, chip, job, mesh)
            if floor > 0:  # refine LB0 with the ep all-to-alls (cheap), then come back for LB1
                heapq.heappush(heap, (bound + floor, 1, mesh))
                continue
            stage = 1
        if stage == 1 and not exhaustive:
            mesh_cons = cons.for_mesh(m, chip, job, mesh)
            low = _min_hbm(m, chip, job, mesh, min_memory_choice(mesh_cons))
            if low > chip.usable_hbm_bytes:  # nothing fits on this mesh: no need to bound or solve it
                stats.infeasible += 1
                if low < lowest[0]:
                    lowest = (low, mesh, None)
                continue
            c0 = estimate(m, chip, job, mesh.plan(REMAT_POLICIES["none"]))
            stats.bounded += 1
            stats.estimates += 1
            base[mesh] = c0
            overlap = _ep_overlap_possible(job, mesh)
            heapq.heappush(heap, (max(bound, _lb1(c0, mesh_cons.offload_optimizer is not False, overlap)), 2, mesh))
            continue
        if brute:
            r = brute_force(m, chip, job, mesh, cons)
        else:
            r = solve_mesh(m, chip, job, mesh, cons, base.pop(mesh, None), None if exhaustive else templates)
        _record(stats, r)
        if r.min_hbm_bytes < lowest[0]:
            lowest = (r.min_hbm_bytes, mesh, None)
        if r.cost is None:
            stats.infeasible += 1
            continue
        _keep(best, PlanResult(r.choice.plan(mesh), r.cost, mesh), top)
    out.plans = best
    if not best and explain:
        out.infeasible = explain_infeasible(m, chip, job, chips, cons, lowest[0], lowest[1])
    return out


def _keep(best: list[PlanResult], res: PlanResult, top: int) -> None:
    """Add `res` to the sorted top list, one plan per layout (Mesh.layout: a mesh and its split-flag variants
    keep the best of them). Exact under the search's pruning: a variant not yet solved has a bound above the
    top-th plan, so it could only replace a sibling that is faster than it."""
    twin = next((i for i, r in enumerate(best) if r.mesh.layout == res.mesh.layout), None)
    if twin is not None:
        if best[twin].key() <= res.key():
            return
        del best[twin]
    best.append(res)
    best.sort(key=PlanResult.key)
    del best[top:]


RANKINGS = ("conservative", "expected")
RERANK_POOL = 2  # `suggest` ranks the RERANK_POOL x top fastest plans by their interval


def default_framework(chip: Chip) -> str:
    """The training stack a plan is costed and exported for unless one is named: MaxText on TPUs, Megatron-LM on
    GPUs (each vendor's reference stack: MaxText is Google's, Megatron-LM NVIDIA's)."""
    return "megatron" if chip.vendor == "gpu" else "maxtext"


def with_headroom(chip: Chip, headroom: float) -> Chip:
    """`chip` with `headroom` of its usable HBM kept free too: usable' = usable x (1 - headroom)."""
    if not 0.0 <= headroom < 1.0:
        raise InputError(f"--headroom: expected a share of the usable HBM in [0, 1), got {headroom}")
    return replace(chip, hbm_reserve_frac=1.0 - (1.0 - chip.hbm_reserve_frac) * (1.0 - headroom))


def suggest(m: ModelSpec, chip: Chip, job: Job, chips: int, cons: Constraints | None = None, top: int = 5,
            exhaustive: bool = False, headroom: float = NEAR_LIMIT, rank: str = "conservative") -> Suggestion:
    """The `top` plans an expert would launch: those that fit with `headroom` of the usable HBM free come first
    (plans that fit only inside it follow, marked in_margin), each with its step-time interval, ranked by the slow
    end of it ('conservative') or by the step time ('expected') among the RERANK_POOL x top fastest."""
    if rank not in RANKINGS:
        raise InputError(f"--rank: expected one of {', '.join(RANKINGS)}, got {rank!r}")
    pool = top * (RERANK_POOL if rank == "conservative" else 1)
    roomy_chip = with_headroom(chip, headroom)
    s = search(m, roomy_chip, job, chips, cons, top=pool, exhaustive=exhaustive, explain=False)
    found = list(s.plans)
    backed = evidence_constraints(cons, chip) if rank == "conservative" else None
    more = _backed_search(m, roomy_chip, job, chips, backed, top, exhaustive) if backed is not None else None
    if more is not None:
        s.stats = _merge(s.stats, more.stats)
        found += [r for r in more.plans if r.plan not in {f.plan for f in found}]
    roomy = [_recost(m, chip, job, r, False) for r in found]
    tight: list[PlanResult] = []
    if len(roomy) < top and headroom > 0:
        full = search(m, chip, job, chips, cons, top=pool, exhaustive=exhaustive)
        seen = {r.plan for r in roomy}
        tight = [_recost(m, chip, job, r, True) for r in full.plans if r.plan not in seen]
        s.stats, s.infeasible = _merge(s.stats, full.stats), full.infeasible
    elif not roomy:
        s.infeasible = search(m, chip, job, chips, cons, top=1).infeasible
    key = (lambda r: (r.interval.high_s, r.key())) if rank == "conservative" else PlanResult.key
    s.plans = (sorted(roomy, key=key) + sorted(tight, key=key))[:top]
    s.chip, s.headroom, s.ranked_by = chip, headroom, rank
    return s


def _backed_search(m: ModelSpec, chip: Chip, job: Job, chips: int, backed: Constraints, top: int,
                   exhaustive: bool) -> Suggestion | None:
    """The extra search within what the evidence backs; None when no plan lies there (1T on 18,432 v5p: every
    layout needs cp > 1, which no v5p run split), so the ranking falls back to the main search's plans."""
    try:
        return search(m, chip, job, chips, backed, top=top, exhaustive=exhaustive, explain=False)
    except InputError:
        return None


def evidence_constraints(cons: Constraints | None, chip: Chip) -> Constraints | None:
    """`cons` narrowed to what the chip family's calibration runs used: their named remat policies, no host offload,
    no axis they never split (cp, pp, ep, vpp at 1) and tp up to theirs (costmodel.evidence), so that a
    conservative ranking also sees the plans the evidence backs best.
    None when nothing narrower exists (remat pinned, or no named policy calibrated)."""
    from costmodel.evidence import shipped
    from costmodel.interval import evidence_family

    cons = cons or Constraints()
    fam = evidence_family(chip, shipped())
    if fam is None or cons.remat is not None:
        return None
    allowed = cons.policies or tuple(REMAT_POLICIES.values())
    policies = tuple(p for p in allowed if p.name in fam.remat)
    if not policies:
        return None
    unseen = {a: 1 for a in ("cp", "pp", "ep", "vpp") if fam.max_degree.get(a, 1) == 1 and a not in cons.fixed}
    max_tp = min(cons.max_tp or fam.max_degree.get("tp", 1), fam.max_degree.get("tp", 1))
    return replace(cons, policies=policies, offload_optimizer=False, offload_params=False,
                   fixed={**cons.fixed, **unseen}, max_tp=max_tp)


def _recost(m: ModelSpec, chip: Chip, job: Job, r: PlanResult, in_margin: bool) -> PlanResult:
    """The plan costed against the chip's whole usable HBM, with its interval."""
    cost = estimate(m, chip, job, r.plan)
    return replace(r, cost=cost, interval=step_time_interval(cost, chip, job, r.plan), in_margin=in_margin)


def _merge(a: SearchStats, b: SearchStats) -> SearchStats:
    out = SearchStats(**{k: v + getattr(b, k) if isinstance(v, int) and not isinstance(v, bool) else v
                         for k, v in a.__dict__.items()})
    out.candidates = max(a.candidates, b.candidates)
    return out


def _record(stats: SearchStats, r: MeshResult) -> None:
    stats.solved += 1
    stats.estimates += r.estimates
    stats.brute_forced += r.brute_force
    stats.resolves += max(0, r.resolves)


def best_plan(m: ModelSpec, chip: Chip, chips: int, job: Job) -> tuple[Plan, Cost] | None:
    """The single best plan, or None when nothing fits (used by `planner sweep`)."""
    s = search(m, chip, job, chips, top=1, explain=False)
    return (s.plans[0].plan, s.plans[0].cost) if s.plans else None


# ---- when nothing fits ----------------------------------------------------------------------------------------

def _any_fits(m: ModelSpec, chip: Chip, job: Job, chips: int, cons: Constraints) -> Mesh | None:
    """A mesh whose least-memory assignment fits, trying the most sharded meshes first (bounded effort)."""
    from planner.remat import evaluate

    try:
        meshes = list(candidates(m, chip, job, chips, cons))
    except InputError:
        return None
    meshes.sort(key=lambda s: (s.micro_batch, -(s.fsdp * s.tp * s.pp * s.cp * s.ep), s))
    for mesh in meshes[:FEASIBILITY_CHECKS]:
        try:
            if evaluate(m, chip, job, mesh, min_memory_choice(cons.for_mesh(m, chip, job, mesh))).fits:
                return mesh
        except InputError:
            continue
    return None


def explain_infeasible(m: ModelSpec, chip: Chip, job: Job, chips: int, cons: Constraints, min_bytes: float,
                       min_mesh: Mesh | None) -> Infeasible:
    """Nothing fits: say by how much, and name the smallest changes that do fit."""
    usable = chip.usable_hbm_bytes
    plan = None
    if min_mesh is not None:
        ch = min_memory_choice(cons.for_mesh(m, chip, job, min_mesh))
        plan = min_mesh.plan(ch.remat, ch.offload_optimizer, ch.offload_params)
    least = ("full recompute and activation, optimizer and parameter offload" if cons.policies is None else
             "the least memory the framework's remat policies and offloads allow")
    reason = (f"no plan fits: even with {least} the smallest footprint is {min_bytes / GIB:.1f} GiB per chip "
              f"against {usable / GIB:.1f} GiB usable on {chip.name}" if math.isfinite(min_bytes) else "no plan fits")
    free = cons.relaxed()
    tips: list[str] = []
    for factor in (2, 4, 8, 16):
        n = chips * factor
        if not formable(chip, n):
            continue
        for b in (job.global_batch, job.global_batch * factor):
            j = replace(job, global_batch=b)
            if _any_fits(m, chip, j, n, free) is not None:
                extra = "" if b == job.global_batch else f" with --global-batch {b}"
                tips.append(f"more chips: --chips {n} ({factor}x){extra} fits")
                break
        if tips:
            break
    if job.seq_len >= 2:
        j = replace(job, seq_len=job.seq_len // 2, global_batch=job.global_batch * 2)
        if _any_fits(m, chip, j, chips, free) is not None:
            tips.append(f"shorter sequences: --seq-len {j.seq_len} --global-batch {j.global_batch} (same tokens) fits")
    for halvings in range(1, 11):  # MaxText's accumulation buffers and pipelines in flight grow with the batch
        b = job.global_batch >> halvings
        if b < 1:
            break
        j = replace(job, global_batch=b)
        if _any_fits(m, chip, j, chips, free) is not None:
            tips.append(f"a smaller global batch: --global-batch {b} ({b * job.seq_len / 2**20:.2f}M tokens) fits")
            break
    framework = set(free.describe().split(", "))
    pins = [p for p in cons.describe().split(", ") if p and p not in framework and not p.startswith("max_tp=")
            and not p.startswith("slices=")]
    if pins:
        if _any_fits(m, chip, job, chips, replace(free, slices=cons.slices)) is not None:
            tips.append(f"drop --fix {', '.join(pins)}: a plan fits without it")
    if not tips:
        tips.append(f"nothing tried fits (up to {16 * chips} chips, half the sequence length); use hardware with more "
                    "HBM or a smaller model")
    return Infeasible(reason, tuple(tips), min_bytes, plan)


# ---- comparing plans -------------------------------------------------------------------------------------------

def why_better(a: PlanResult, b: PlanResult) -> str:
    """One line on why `a` beats `b`: the breakdown term that differs most."""
    keys = sorted(set(a.cost.time) | set(b.cost.time))
    diffs = {k: b.cost.time.get(k, 0.0) - a.cost.time.get(k, 0.0) for k in keys}
    k = max(keys, key=lambda k: (abs(diffs[k]), k))
    gap = b.cost.step_time_s - a.cost.step_time_s
    pct = gap / b.cost.step_time_s * 100 if b.cost.step_time_s else 0.0
    if gap == 0:
        ma, mb = a.cost.peak_memory_bytes, b.cost.peak_memory_bytes
        if ma < mb:
            return (f"ties with the runner-up on step time and needs less memory per chip ({ma / GIB:.1f} GiB vs "
                    f"{mb / GIB:.1f} GiB)")
        return "ties with the runner-up on step time and memory; ranked first by the canonical mesh order"
    word = "less" if diffs[k] > 0 else "more"
    return (f"{pct:.1f}% faster than the runner-up ({gap:.3f} s per step); the largest difference is {k}: "
            f"{abs(diffs[k]):.3f} s {word} ({a.cost.time.get(k, 0.0):.3f} s vs {b.cost.time.get(k, 0.0):.3f} s)")
