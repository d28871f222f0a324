"""Elastic re-planning: the best plan when a running job loses or gains chips, and what the switch costs.

`replan(m, chip, job, old_plan, new_chips)`: the new count must be one the topology can form; the planner search
runs at it, keeping the global batch if any plan fits, else the nearest batch within MAX_BATCH_CHANGE whose best
plan reaches NEAR_BEST of the best throughput. Resharding cost: the parameter + optimizer bytes each chip must
receive (state block-sharded over the data-sharding axes inside each model-parallel shard; a chip keeps the
overlap of its old and new blocks; a changed tp/pp/ep layout moves everything), the busiest chip's bytes over
one link of the slowest level the job spans, against writing, restarting from and reading a checkpoint. After an
unplanned loss, in-memory resharding needs a live replica of every lost shard (weights: dp > 1 with zero < 3;
optimizer state: dp > 1 with zero = 0). TPU: a new slice shape is a new allocation; only link time is counted.
(the model step by step: docs/goodput.md)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from costmodel.cost import Cost
from costmodel.estimate import estimate
from costmodel.goodput import Reliability, checkpoint_size, ckpt_bandwidth
from costmodel.job import Job
from costmodel.memory import memory_terms, state_convention
from costmodel.model import ModelSpec
from costmodel.plan import Plan
from hardware.chip import Chip
from hardware.errors import InputError
from planner.candidates import check_chips, divisors

MAX_BATCH_TRIES = 8  # other global batches tried when the old one has no fitting plan
MAX_BATCH_CHANGE = 0.125  # ... within this fraction of the old batch
NEAR_BEST = 0.9  # take the nearest batch whose throughput is within 10% of the best batch tried


class NoPlanFits(InputError):
    """A valid job that no plan fits at the new count (the CLI exits 1 for it, not 2 as for bad input)."""


@dataclass(frozen=True)
class Reshard:
    old_state_bytes_per_chip: float
    new_state_bytes_per_chip: float
    moved_bytes_per_chip: float  # the busiest chip
    moved_bytes_total: float
    link_Bps: float
    level: str
    transfer_s: float  # the busiest chip's bytes over its link
    reshard_s: float  # restart + transfer
    checkpoint_write_s: float
    checkpoint_read_s: float
    checkpoint_restart_s: float  # checkpoint write (planned) + restart + checkpoint read
    checkpoint_bytes: float
    replicas_survive_loss: bool  # every shard has a live replica after losing chips (dp replication)
    recommended: str  # 'reshard' or 'checkpoint'


@dataclass(frozen=True)
class Replan:
    old_chips: int
    new_chips: int
    old_plan: Plan
    new_plan: Plan
    old_job: Job
    new_job: Job
    old_cost: Cost | None
    new_cost: Cost
    batch_kept: bool
    batch_note: str
    reshard: Reshard
    searched: str  # 'planner search' or 'scaled data axes'


# ---- resharding ---------------------------------------------------------------------------------------------

def _state_components(m: ModelSpec, chip: Chip, job: Job, plan: Plan) -> dict[str, tuple[float, int]]:
    """{'weights'|'optimizer': (bytes per chip, data-sharding degree)}."""
    w_b, _, o_b, _ = state_convention(job)
    accum = max(1, job.global_batch // (plan.batch_shards * plan.micro_batch))
    mt = memory_terms(m, chip, job, plan, accum)
    w_shards = plan.fsdp * (plan.dp if plan.zero == 3 else 1)
    o_shards = plan.fsdp * (plan.dp if plan.zero >= 1 else 1)
    return {"weights": (mt.param_elems * w_b, w_shards), "optimizer": (mt.optimizer_param_elems * o_b, o_shards)}


def block_overlap(r: int | np.ndarray, d_old: int, d_new: int) -> float | np.ndarray:
    """Fraction of the whole (model-parallel shard's) state that data rank r holds in both layouts (r may be an
    array of ranks)."""
    a0, a1 = (r % d_old) / d_old, (r % d_old + 1) / d_old
    b0, b1 = (r % d_new) / d_new, (r % d_new + 1) / d_new
    return np.maximum(0.0, np.minimum(a1, b1) - np.maximum(a0, b0))


def moved_bytes(old: dict[str, tuple[float, int]], new: dict[str, tuple[float, int]], old_data_ranks: int,
                new_data_ranks: int, same_model_layout: bool) -> tuple[float, float]:
    """(busiest chip's received bytes, mean over the new data ranks) for one model-parallel shard position.
    One array operation over the ranks (up to planner.candidates.MAX_CHIPS of them), not a loop per rank."""
    r = np.arange(new_data_ranks)
    keeps = (r < old_data_ranks) if same_model_layout else np.zeros(new_data_ranks, dtype=bool)
    need = np.zeros(new_data_ranks)
    for key, (b_new, d_new) in new.items():
        whole = b_new * d_new  # this model-parallel shard's state of this kind
        need += b_new - np.where(keeps, block_overlap(r, old[key][1], d_new) * whole, 0.0)
    need = np.maximum(need, 0.0)
    return float(need.max()), float(need.mean())


def link_for(chip: Chip, chips: int, slices: int = 1) -> tuple[float, str]:
    """One-direction bandwidth a chip gets on the slowest level a `chips`-chip job spans, and that level's name.
    Multi-slice TPU jobs span DCN."""
    up = chip.scale_up
    if len(chip.levels) == 1 or (slices == 1 and up.domain_chips and chips <= up.domain_chips):
        return up.bw_per_dir_Bps * chip.eff.link, up.name
    lvl = chip.levels[-1]
    return lvl.bw_per_dir_Bps * chip.eff.net, lvl.name


def reshard_cost(m: ModelSpec, chip: Chip, old_job: Job, old_plan: Plan, new_job: Job, new_plan: Plan,
                 rel: Reliability | None = None) -> Reshard:
    rel = rel or Reliability()
    old, new = _state_components(m, chip, old_job, old_plan), _state_components(m, chip, new_job, new_plan)
    same = all(getattr(old_plan, a) == getattr(new_plan, a) for a in ("tp", "pp", "ep"))
    mp_new = new_plan.tp * new_plan.pp * new_plan.ep * new_plan.cp
    mp_old = old_plan.tp * old_plan.pp * old_plan.ep * old_plan.cp
    busiest, mean = moved_bytes(old, new, old_plan.chips // mp_old, new_plan.chips // mp_new, same)
    bw, level = link_for(chip, max(old_plan.chips, new_plan.chips), max(old_plan.slices, new_plan.slices))
    ck = checkpoint_size(m, chip, new_job, new_plan)
    n = new_plan.chips
    restore = ck.total_bytes / ckpt_bandwidth(rel.ckpt_read_Bps, rel.ckpt_aggregate_Bps, n)
    write = ck.total_bytes / ckpt_bandwidth(rel.ckpt_write_Bps, rel.ckpt_aggregate_Bps, old_plan.chips)
    transfer = busiest / bw
    reshard_s = rel.restart_s + transfer
    ckpt_s = rel.restart_s + write + restore  # planned: write a fresh checkpoint, restart, read it back
    replicas = old_plan.dp > 1 and old_plan.zero == 0
    return Reshard(
        old_state_bytes_per_chip=sum(b for b, _ in old.values()),
        new_state_bytes_per_chip=sum(b for b, _ in new.values()),
        moved_bytes_per_chip=busiest, moved_bytes_total=mean * n, link_Bps=bw, level=level, transfer_s=transfer,
        reshard_s=reshard_s, checkpoint_write_s=write, checkpoint_read_s=restore, checkpoint_restart_s=ckpt_s,
        checkpoint_bytes=ck.total_bytes, replicas_survive_loss=replicas,
        recommended="reshard" if reshard_s <= ckpt_s else "checkpoint")


# ---- the search at the new count -----------------------------------------------------------------------------

def batch_options(global_batch: int, chips: int, min_shards: int = 1, tries: int = MAX_BATCH_TRIES,
                  max_change: float = MAX_BATCH_CHANGE) -> list[int]:
    """The nearest batches other than `global_batch` divisible by a batch-shard count s of `chips`
    (s >= min_shards), within max_change of it, nearest first (ties: the smaller)."""
    near: set[int] = set()
    for s in divisors(chips):
        if s < min_shards:
            continue
        lo = (global_batch // s) * s
        near.update(b for b in (lo, lo + s) if b >= 1 and abs(b - global_batch) <= max_change * global_batch)
    return sorted(near - {global_batch}, key=lambda b: (abs(b - global_batch), b))[:tries]


def _search_best(m: ModelSpec, chip: Chip, job: Job, chips: int) -> tuple[Plan, Cost] | None:
    from planner.solve import search

    try:
        s = search(m, chip, job, chips, top=1, explain=False)
    except InputError:
        return None
    return (s.plans[0].plan, s.plans[0].cost) if s.plans else None


def _scaled_best(m: ModelSpec, chip: Chip, job: Job, chips: int, old: Plan) -> tuple[Plan, Cost] | None:
    """Fallback without the planner search: keep the model-parallel axes, remat and offload; rescale dp/fsdp."""
    mp = old.tp * old.cp * old.pp * old.ep
    if chips % mp:
        return None
    data = chips // mp
    best = None
    for fsdp in divisors(data):
        dp = data // fsdp
        shards = dp * fsdp * old.ep
        if job.global_batch % shards:
            continue
        for mb in divisors(job.global_batch // shards):
            plan = old.with_(dp=dp, fsdp=fsdp, micro_batch=mb, zero=old.zero if dp > 1 else 0,
                             slices=math.gcd(old.slices, chips) if chip.scale_up.kind == "torus" else 1)
            try:
                cost = estimate(m, chip, job, plan, chips)
            except InputError:
                continue
            if cost.fits and (best is None or cost.step_time_s < best[1].step_time_s):
                best = (plan, cost)
    return best


def replan(m: ModelSpec, chip: Chip, job: Job, old_plan: Plan, new_chips: int, rel: Reliability | None = None,
           use_search: bool = True) -> Replan:
    """The best plan at `new_chips` (keeping the global batch if possible) and the cost of switching to it."""
    check_chips(chip, new_chips)
    try:
        old_cost = estimate(m, chip, job, old_plan)
    except InputError:
        old_cost = None
    if use_search:
        try:
            import planner.solve  # noqa: F401
        except ImportError:
            use_search = False
    search = (lambda j: _search_best(m, chip, j, new_chips)) if use_search else \
        (lambda j: _scaled_best(m, chip, j, new_chips, old_plan))
    b = job.global_batch
    found = search(job)
    if found is None:
        # Nearest batches whose shard count leaves at most the model-parallel limit per sequence.
        from planner.candidates import Constraints, model_parallel_limit

        mp = old_plan.tp * old_plan.cp * old_plan.pp * old_plan.ep
        if use_search:
            limit = model_parallel_limit(m, chip, job, new_chips, Constraints()) or 1
            base, min_shards = new_chips, max(1, new_chips // limit)
        else:
            base, min_shards = (new_chips // mp if new_chips % mp == 0 else new_chips), 1
        tried = []
        for bb in batch_options(job.global_batch, base, min_shards):
            r = search(replace(job, global_batch=bb))
            if r is not None:
                tried.append((bb, r))
        if tried:
            best_tps = max(r[1].tokens_per_s for _, r in tried)
            b, found = next((bb, r) for bb, r in tried if r[1].tokens_per_s >= NEAR_BEST * best_tps)
    if found is None:
        raise NoPlanFits(f"no plan for {m.name} fits on {new_chips} x {chip.name} at global batch "
                         f"{job.global_batch} or any usable batch within {MAX_BATCH_CHANGE * 100:g}% of it")
    plan, cost = found
    new_job = replace(job, global_batch=b)
    kept = b == job.global_batch
    if kept:
        note = f"global batch kept at {b} sequences"
    else:
        note = (f"global batch {job.global_batch} has no fitting plan on {new_chips} chips; nearest that fits: {b} "
                f"sequences ({(b - job.global_batch) / job.global_batch * 100:+.1f}% tokens per step: rescale the "
                "learning rate or warm up again if the optimizer is batch-sensitive)")
    rs = reshard_cost(m, chip, job, old_plan, new_job, plan, rel)
    return Replan(old_plan.chips, new_chips, old_plan, plan, job, new_job, old_cost, cost, kept, note, rs,
                  "planner search" if use_search else "scaled data axes")
