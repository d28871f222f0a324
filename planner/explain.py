"""Why a plan costs what it costs, and what the nearest changes would do.

`explain(model, chip, job, plan, chips)` costs one plan and returns an `Explanation`:
  * a waterfall of the step: compute split by op group (attention projections, attention core, MLP, logits),
    recompute, memory-bound ops, exposed communication per mesh axis and interconnect level, pipeline bubble,
    optimizer update, exposed offload traffic and fixed overhead; the entries sum to the step time;
  * memory per chip by category against the usable HBM;
  * the bottleneck in one sentence (the largest term of the time breakdown, with the usual remedy);
  * what-ifs: the plan's nearest neighbours (tp x2 / /2 traded with fsdp or dp, pp x2 / /2, micro-batch x2 / /2,
    remat one step lighter / heavier, one more slice, optimizer offload on/off) plus the planner's own best
    remat/offload assignment for the same mesh (planner/remat.py), each costed; neighbours that break a
    divisibility or layout rule are listed as skipped with the reason.

No I/O and no rendering here: the CLI prints an `Explanation` (or its `to_dict()`) and plots.py draws it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from costmodel.cost import Cost
from costmodel.estimate import dcn_split, estimate, op_time, stage_times
from costmodel.flops import layer_ops, logits_op
from costmodel.interval import Interval, step_time_interval
from costmodel.job import Job
from costmodel.model import ModelSpec
from costmodel.plan import REMAT_POLICIES, Plan, Remat
from hardware.chip import Chip
from hardware.errors import InputError

# Op names of costmodel.flops.layer_ops / logits_op grouped for the waterfall.
OP_GROUPS = {"qkv_proj": "attention projections", "mla_down": "attention projections",
             "out_proj": "attention projections", "attention": "attention core", "router": "MLP", "mlp_in": "MLP",
             "mlp_out": "MLP", "logits": "logits"}
AXIS_NAMES = {"tp": "tensor-parallel", "fsdp": "FSDP", "dp": "data-parallel", "cp": "context-parallel",
              "pp": "pipeline", "ep": "expert-parallel"}
PLANNER_WHAT_IF = "planner's remat/offload, same mesh"
GROUP_LABELS = {"MLP": "MLP matmuls", "attention projections": "attention projections",
                "attention core": "attention core", "logits": "logits matmul"}
COLLECTIVE_PLURAL = {"all-gather": "all-gathers", "reduce-scatter": "reduce-scatters", "all-reduce": "all-reduces",
                     "all-to-all": "all-to-alls", "p2p": "point-to-point transfers"}


# ---- the data --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Term:
    """One bar of the step waterfall. `key` is the Cost.time key it belongs to (compute, comm_fsdp, ...)."""

    key: str
    label: str
    seconds: float
    share: float  # of the step time
    start_s: float  # where the bar starts in the waterfall

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class WhatIf:
    """One neighbouring plan and its predicted cost (or why it could not be costed)."""

    label: str
    plan: Plan
    chips: int
    cost: Cost | None = None
    error: str = ""
    delta_pct: float = 0.0  # step time change vs the base plan (negative = faster)
    detail: str = ""  # what the change is when the label does not say (the planner's remat/offload choice)

    def to_dict(self) -> dict:
        d = {"label": self.label, "chips": self.chips, "plan": plan_brief(self.plan)}
        if self.detail:
            d["detail"] = self.detail
        if self.cost is None:
            return {**d, "skipped": self.error}
        c = self.cost
        return {**d, "step_time_s": c.step_time_s, "delta_pct": self.delta_pct, "mfu": c.mfu,
                "peak_memory_bytes": c.peak_memory_bytes, "fit_memory_bytes": c.fit_memory_bytes, "fits": c.fits,
                "overflow_bytes": c.overflow_bytes,
                "tokens_per_s": c.tokens_per_s}


@dataclass(frozen=True)
class Bottleneck:
    term: str  # the largest Cost.time key, or 'memory' when the plan does not fit
    share: float  # of the step time (overflow / usable HBM for 'memory')
    sentence: str
    overhead_term: str = ""  # the largest term other than compute (what to attack on a compute-bound step)


@dataclass(frozen=True)
class Explanation:
    model: str
    hardware: str
    chips: int
    plan: Plan
    cost: Cost
    waterfall: tuple[Term, ...]
    memory: dict[str, float]  # category -> bytes per chip (the busiest stage)
    bottleneck: Bottleneck
    what_ifs: tuple[WhatIf, ...] = field(default_factory=tuple)
    interval: Interval | None = None  # the step time's likely range (costmodel.interval)

    @property
    def headroom_bytes(self) -> float:
        return self.cost.hbm_usable_bytes - self.cost.fit_memory_bytes

    @property
    def costed_what_ifs(self) -> list[WhatIf]:
        return [w for w in self.what_ifs if w.cost is not None]

    @property
    def best_what_if(self) -> WhatIf | None:
        """The fastest neighbour on the same chips that fits, if it beats the base plan."""
        ok = [w for w in self.costed_what_ifs
              if w.cost.fits and w.chips == self.chips and w.cost.step_time_s < self.cost.step_time_s]
        return min(ok, key=lambda w: w.cost.step_time_s) if ok else None

    def to_dict(self) -> dict:
        best = self.best_what_if
        return {
            "model": self.model, "hardware": self.hardware, "chips": self.chips, "plan": plan_brief(self.plan),
            "step_time_s": self.cost.step_time_s, "mfu": self.cost.mfu, "fits": self.cost.fits,
            "waterfall": [t.to_dict() for t in self.waterfall],
            "memory": {"categories_bytes": dict(self.memory), "peak_bytes": self.cost.peak_memory_bytes,
                       "fit_bytes": self.cost.fit_memory_bytes,
                       "usable_bytes": self.cost.hbm_usable_bytes, "headroom_bytes": self.headroom_bytes,
                       "host_bytes": self.cost.host_memory_bytes},
            "bottleneck": dict(self.bottleneck.__dict__),
            "what_ifs": [w.to_dict() for w in self.what_ifs if w.cost is not None],
            "skipped_what_ifs": [w.to_dict() for w in self.what_ifs if w.cost is None],
            "best_what_if": best.label if best else None,
            "cost": self.cost.to_dict(),
            **(self.interval.to_dict() if self.interval else {}),
        }


def plan_brief(plan: Plan) -> dict:
    """The plan's degrees and choices as plain data (the same keys as cli.render.plan_dict)."""
    return {**plan.degrees(), "vpp": plan.vpp, "micro_batch": plan.micro_batch, "zero": plan.zero,
            "sequence_parallel": plan.sequence_parallel, "remat": plan.remat.summary(),
            "offload_optimizer": plan.offload_optimizer, "offload_params": plan.offload_params,
            "slices": plan.slices}


# ---- the waterfall ---------------------------------------------------------------------------------------

def compute_by_group(m: ModelSpec, chip: Chip, job: Job, plan: Plan, accum: int) -> dict[str, float]:
    """Seconds of forward+backward compute per op group over the step (the busiest stage).

    Mirrors costmodel.estimate.stage_times: backward = 2x forward for matmuls, 2.5x for flash attention; the
    logits matmul runs on the last stage, forward once and backward twice.
    """
    peak = chip.effective_peak_flops(job.precision) if hasattr(chip, "effective_peak_flops") \
        else chip.peak_flops(job.precision)
    tokens = plan.micro_batch * job.seq_len / plan.cp
    st = stage_times(m, chip, job, plan)  # which stage is the busiest (Megatron's uneven split: maybe a middle one)
    out: dict[str, float] = {}
    for moe, count in ((False, m.n_dense_mlp_layers), (True, m.n_moe_layers)):
        if count == 0:
            continue
        n = st.kinds[moe]
        for op in layer_ops(m, tokens, job.seq_len, plan.tp, plan.cp, moe, job.attention):
            t = op_time(op, chip, peak) * (3.5 if op.is_attention else 3.0)
            g = OP_GROUPS.get(op.name, op.name)
            out[g] = out.get(g, 0.0) + accum * n * t
    if st.head > 0:
        out["logits"] = out.get("logits", 0.0) + accum * 3 * op_time(logits_op(m, tokens, plan.tp), chip, peak)
    return out


def level_names(chip: Chip) -> dict[str, str]:
    """Cost's level words ('scale-up', 'network', 'host') -> the profile's level names (ICI, DCN, NVLink, IB)."""
    up, net = chip.levels[0].name, chip.levels[-1].name
    pretty = {"ici": "ICI", "dcn": "DCN", "nvlink": "NVLink", "ib": "InfiniBand"}
    return {"scale-up": pretty.get(up, up), "network": pretty.get(net, net), "host": "host link", "none": ""}


def comm_by_level(cost: Cost, chip: Chip) -> dict[tuple[str, str], float]:
    """Exposed seconds per (axis, level name), scaled so each axis sums to its Cost.time entry."""
    names = level_names(chip)
    raw: dict[tuple[str, str], float] = {}
    for c in cost.collectives:
        if c.axis != "host":
            key = (c.axis, names.get(c.level, c.level))
            raw[key] = raw.get(key, 0.0) + c.exposed_s
    out = {}
    for (axis, lvl), t in raw.items():
        total = cost.time.get(f"comm_{axis}", 0.0)
        axis_raw = sum(v for (a, _), v in raw.items() if a == axis)
        out[(axis, lvl)] = t * total / axis_raw if axis_raw > 0 else 0.0
    return out


def waterfall(m: ModelSpec, chip: Chip, job: Job, plan: Plan, cost: Cost) -> list[Term]:
    """The step as consecutive bars that sum to cost.step_time_s; zero terms are left out."""
    parts: list[tuple[str, str, float]] = []
    compute = cost.time.get("compute", 0.0)
    groups = compute_by_group(m, chip, job, plan, cost.grad_accum)
    g_sum = sum(groups.values())
    if g_sum > 0 and abs(g_sum - compute) <= 0.25 * compute:
        # The groups' shares, scaled to sum exactly to the cost model's compute term (they match it to rounding
        # while this mirrors stage_times; a small drift there still leaves sensible shares).
        order = ("MLP", "attention projections", "attention core", "logits")
        for g in sorted(groups, key=lambda k: order.index(k) if k in order else len(order)):
            parts.append(("compute", GROUP_LABELS.get(g, g), groups[g] * compute / g_sum))
    else:  # the cost model changed under us: keep its own single term
        parts.append(("compute", "compute", compute))
    labels = {"recompute": "recompute (remat)", "memory_bound": "memory-bound ops", "bubble": "pipeline bubble",
              "optimizer": "optimizer update", "offload": "host offload (exposed)", "overhead": "fixed overhead"}
    comm = comm_by_level(cost, chip)
    for key, t in cost.time.items():
        if key == "compute":
            continue
        if key.startswith("comm_"):
            axis = key[5:]
            for (a, lvl), tl in sorted(comm.items()):
                if a == axis:
                    parts.append((key, f"{axis} comm ({lvl})" if lvl else f"{axis} comm", tl))
            if not any(a == axis for a, _ in comm):
                parts.append((key, f"{axis} comm", t))
            continue
        parts.append((key, labels.get(key, key), t))
    step = cost.step_time_s
    out, start = [], 0.0
    for key, label, t in parts:
        if t <= 0:
            continue
        out.append(Term(key, label, t, t / step if step > 0 else 0.0, start))
        start += t
    return out


# ---- the bottleneck --------------------------------------------------------------------------------------

REMAT_LADDER_MAXTEXT = ("none", "minimal", "save_qkv_proj", "full")
REMAT_LADDER_MEGATRON = ("none", "selective", "save_qkv_proj", "full")


def remat_ladder(job: Job) -> tuple[str, ...]:
    """Remat policies from lightest (most memory, least recompute) to heaviest."""
    return REMAT_LADDER_MAXTEXT if job.fw.jax_remat else REMAT_LADDER_MEGATRON  # JAX remat policy names


def remat_neighbours(remat: Remat, job: Job) -> tuple[str | None, str | None]:
    """(one step lighter, one step heavier) along the ladder; a custom policy is placed by its remat count."""
    ladder = remat_ladder(job)
    counts = [REMAT_POLICIES[p].count("remat") for p in ladder]
    if remat.name in ladder:
        i = ladder.index(remat.name)
        return (ladder[i - 1] if i > 0 else None), (ladder[i + 1] if i + 1 < len(ladder) else None)
    k = remat.count("remat")
    lighter = [p for p, c in zip(ladder, counts, strict=True) if c < k]
    heavier = [p for p, c in zip(ladder, counts, strict=True) if c > k]
    # A policy with the same recompute but a different tensor choice (e.g. minimal vs selective) sits on the
    # rung of that count: its neighbours are the rungs around it.
    return (lighter[-1] if lighter else None), (heavier[0] if heavier else None)


def _pct(x: float) -> str:
    return f"{x * 100:.0f}%"


def _dominant_collective(cost: Cost, axis: str) -> tuple[str, str]:
    """(plural kind, level) of the collective with the largest exposed time on `axis`."""
    cs = [c for c in cost.collectives if c.axis == axis]
    if not cs:
        return "collectives", ""
    c = max(cs, key=lambda c: c.exposed_s)
    kinds = sorted({x.kind for x in cs if x.exposed_s > 0.1 * c.exposed_s})
    words = " and ".join(COLLECTIVE_PLURAL.get(k, k) for k in kinds) or COLLECTIVE_PLURAL.get(c.kind, c.kind)
    return words, c.level


def _advice(term: str, share: float, cost: Cost, chip: Chip, job: Job, plan: Plan) -> tuple[str, str]:
    """(what the term is and how much of the step it takes, the usual remedy) for one time term."""
    p = _pct(share)
    lv = level_names(chip)
    up, net = lv["scale-up"], lv["network"]
    if term == "compute":
        return (f"matmuls take {p} of the step at {cost.mfu * 100:.1f}% MFU",
                "larger per-chip matmuls (lower tp, bigger micro-batch) or more chips")
    if term == "recompute":
        lighter, _ = remat_neighbours(plan.remat, job)
        head = (cost.hbm_usable_bytes - cost.fit_memory_bytes) / 2**30
        alt = f"a lighter remat policy ({lighter})" if lighter else "a lighter remat policy"
        return (f"recomputation takes {p} of the step",
                f"{alt} saves it if memory allows ({head:.1f} GiB headroom per chip), or offload saved tensors")
    if term == "memory_bound":
        return (f"memory-bound ops (norms, residuals, rotary, activation functions) take {p} of the step",
                "they scale with tokens per chip; sequence-parallel tp shards them, fused kernels cut their traffic")
    if term.startswith("comm_"):
        axis = term[5:]
        kinds, level = _dominant_collective(cost, axis)
        where = {"network": net, "scale-up": up}.get(level, level)
        name = AXIS_NAMES.get(axis, axis)
        what = f"exposed {name} {kinds} over {where} take {p} of the step"
        if axis == "fsdp":
            fix = (f"reduce fsdp across slices (put dp over {net})" if level == "network" and chip.is_tpu
                   else "reduce fsdp (trade with tp or dp)") + " or raise the micro-batch so compute hides them"
        elif axis == "tp":
            fix = (f"keep tp inside one {up} domain" if level == "network" else "lower tp (trade with fsdp)") + \
                  " or raise the micro-batch to lengthen the matmuls that hide them"
        elif axis == "dp":
            fix = "accumulate more micro-steps per gradient reduction (bigger global batch) or shard with fsdp"
        elif axis == "cp":
            fix = "lower cp (trade with fsdp or tp) unless the sequence needs it for memory"
        elif axis == "ep":
            fix = f"keep ep inside one {up} domain or lower it"
        elif axis == "pp":
            fix = "lower pp or keep pipeline stages on faster links"
        else:
            fix = "shrink this axis"
        return what, fix
    if term == "bubble":
        return (f"the pipeline bubble takes {p} of the step ({plan.pp} stages, {cost.grad_accum} micro-batches)",
                "more micro-batches (smaller micro-batch or bigger global batch), virtual stages (vpp) or lower pp")
    if term == "optimizer":
        return (f"the optimizer update takes {p} of the step (HBM-bound on the local shard)",
                "shard optimizer state over more chips (fsdp or zero) or accumulate more micro-steps per update")
    if term == "offload":
        return (f"host offload traffic takes {p} of the step over the {chip.host_link_Bps / 1e9:.0f} GB/s host link",
                "offload less, only where memory demands it")
    if term == "overhead":
        return f"fixed per-step overhead takes {p} of the step", "a bigger global batch amortises it"
    return f"{term} takes {p} of the step", "change the plan"


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def bottleneck(cost: Cost, chip: Chip, job: Job, plan: Plan) -> Bottleneck:
    """The largest term of the time breakdown in one sentence; a plan that does not fit is memory-bound first.

    A compute-bound step (compute is the largest term) names the largest loss after it as what to attack.
    """
    step = cost.step_time_s
    terms = {k: v for k, v in cost.time.items() if v > 0}
    top = max(terms, key=terms.get) if terms else "compute"
    share = terms.get(top, 0.0) / step if step > 0 else 0.0
    rest = {k: v for k, v in terms.items() if k != "compute"}
    over = max(rest, key=rest.get) if rest else ""
    what, fix = _advice(top, share, cost, chip, job, plan)
    if top == "compute":
        sentence = f"Compute-bound: {what}"
        if over and rest[over] / step >= 0.02:
            o_what, o_fix = _advice(over, rest[over] / step, cost, chip, job, plan)
            sentence += f"; the largest loss is that {o_what}: {o_fix}"
        else:
            sentence += f": {fix}"
    else:
        sentence = f"{_cap(what)}: {fix}"
    if not cost.fits:
        if cost.fit_memory_bytes > cost.hbm_usable_bytes:
            big = max(cost.memory, key=cost.memory.get)
            msg = (f"Does not fit: {cost.fit_memory_bytes / 2**30:.1f} GiB per chip against "
                   f"{cost.hbm_usable_bytes / 2**30:.1f} GiB usable ({big} is the largest at "
                   f"{cost.memory[big] / 2**30:.1f} GiB): heavier remat, more fsdp/tp/pp, or offload")
        else:
            msg = (f"Does not fit: host memory {cost.host_memory_bytes / 2**30:.1f} GiB per chip exceeds the "
                   f"{chip.host_mem_bytes / 2**30:.0f} GiB available: offload less")
        return Bottleneck("memory", cost.overflow_bytes / cost.hbm_usable_bytes,
                          f"{msg}. Once it fits: {sentence[:1].lower()}{sentence[1:]}", over)
    return Bottleneck(top, share, sentence, over)


# ---- what-ifs --------------------------------------------------------------------------------------------

def _trade(plan: Plan, up: str, down: str, factor: int = 2) -> Plan | None:
    """Multiply axis `up` by factor and divide `down` by it (same chip count); None if `down` is not divisible."""
    d = getattr(plan, down)
    if d % factor:
        return None
    return plan.with_(**{up: getattr(plan, up) * factor, down: d // factor})


def neighbours(chip: Chip, job: Job, plan: Plan, chips: int) -> list[tuple[str, Plan, int]]:
    """(label, plan, chips) for each nearest change; validity is left to the cost model."""
    out: list[tuple[str, Plan, int]] = []

    def add(label: str, p: Plan | None, n: int = chips) -> None:
        if p is not None and p != plan:
            out.append((label, p, n))

    # Tensor parallelism doubled or halved, trading with the batch-sharded axes.
    for other in ("fsdp", "dp"):
        if getattr(plan, other) > 1:
            add(f"tp x2, {other} /2", _trade(plan, "tp", other))
    if plan.tp > 1:
        takers = [a for a in ("fsdp", "dp") if getattr(plan, a) > 1] or ["fsdp"]
        for other in takers:
            add(f"tp /2, {other} x2", _trade(plan, other, "tp"))
    # Pipeline stages doubled or halved.
    for other in ("fsdp", "dp"):
        if getattr(plan, other) > 1:
            add(f"pp x2, {other} /2", _trade(plan, "pp", other))
            break
    if plan.pp > 1:
        other = "fsdp" if plan.fsdp > 1 or plan.dp == 1 else "dp"
        p = _trade(plan, other, "pp")
        add(f"pp /2, {other} x2", p.with_(vpp=1) if p is not None and p.pp == 1 else p)
    # Micro-batch.
    add("micro-batch x2", plan.with_(micro_batch=plan.micro_batch * 2))
    if plan.micro_batch > 1 and plan.micro_batch % 2 == 0:
        add("micro-batch /2", plan.with_(micro_batch=plan.micro_batch // 2))
    # Remat one rung lighter / heavier.
    lighter, heavier = remat_neighbours(plan.remat, job)
    if lighter:
        add(f"remat {lighter} (lighter)", plan.with_(remat=REMAT_POLICIES[lighter]))
    if heavier:
        add(f"remat {heavier} (heavier)", plan.with_(remat=REMAT_POLICIES[heavier]))
    # More hardware: one more TPU slice (over DCN), or twice the GPUs (dp x2).
    if chip.is_tpu and chip.scale_up.kind == "torus":
        if plan.slices == 1:
            add(f"+1 slice ({chips * 2} chips, dp x2 over DCN)", plan.with_(slices=2, dp=plan.dp * 2), chips * 2)
        elif chips % plan.slices == 0:
            try:
                dcn = dcn_split(plan)
            except InputError:
                dcn = {}
            axis = next((a for a, v in dcn.items() if v == plan.slices), None)
            if axis is not None:
                s = plan.slices
                deg = getattr(plan, axis) // s * (s + 1)
                add(f"+1 slice ({chips // s * (s + 1)} chips, {axis} {getattr(plan, axis)} -> {deg})",
                    plan.with_(slices=s + 1, **{axis: deg}), chips // s * (s + 1))
    else:
        add(f"2x chips (dp x2: {chips * 2} chips)", plan.with_(dp=plan.dp * 2), chips * 2)
    # Optimizer state on host (or back in HBM).
    if plan.offload_optimizer:
        add("optimizer back in HBM", plan.with_(offload_optimizer=False))
    else:
        add("offload optimizer to host", plan.with_(offload_optimizer=True))
    return out


def best_remat_for_mesh(m: ModelSpec, chip: Chip, job: Job, plan: Plan) -> Plan | None:
    """The same degrees and micro-batch with the planner's best remat/offload choice (planner/remat.py's CP-SAT
    program), or None when no assignment fits."""
    from planner.candidates import Constraints, Mesh
    from planner.remat import solve_mesh

    mesh = Mesh(dp=plan.dp, fsdp=plan.fsdp, tp=plan.tp, cp=plan.cp, pp=plan.pp, ep=plan.ep, vpp=plan.vpp,
                micro_batch=plan.micro_batch, zero=plan.zero, slices=plan.slices, split=plan.split_accounting,
                fp8_params=plan.fp8_param_gather)
    r = solve_mesh(m, chip, job, mesh, Constraints())
    if r.choice is None:
        return None
    return plan.with_(remat=r.choice.remat, offload_optimizer=r.choice.offload_optimizer,
                      offload_params=r.choice.offload_params, recompute_num_layers=r.choice.recompute_num_layers,
                      overlap_moe_expert_parallel_comm=r.choice.ep_overlap)


def what_ifs(m: ModelSpec, chip: Chip, job: Job, plan: Plan, chips: int, base: Cost,
             with_planner: bool = True) -> list[WhatIf]:
    """Cost every neighbour; rule-breaking ones come back with `error` set instead of a cost.

    with_planner: add the planner's best remat/offload assignment for the same mesh as one more what-if."""
    out = []
    cands = neighbours(chip, job, plan, chips)
    detail: dict[str, str] = {}
    if with_planner:
        try:
            best = best_remat_for_mesh(m, chip, job, plan)
        except InputError:
            best = None
        if best is not None and best != plan:
            tag = best.remat.summary() + (" + optimizer offload" if best.offload_optimizer else "") + \
                (" + parameter offload" if best.offload_params else "")
            cands.append((PLANNER_WHAT_IF, best, chips))
            detail = {PLANNER_WHAT_IF: tag}
    for label, p, n in cands:
        try:
            c = estimate(m, chip, job, p, n)
        except InputError as e:
            out.append(WhatIf(label, p, n, None, str(e), detail=detail.get(label, "")))
            continue
        delta = (c.step_time_s / base.step_time_s - 1) * 100 if base.step_time_s > 0 else math.nan
        out.append(WhatIf(label, p, n, c, "", delta, detail.get(label, "")))
    return out


def explain(m: ModelSpec, chip: Chip, job: Job, plan: Plan, chips: int | None = None,
            with_what_ifs: bool = True, with_planner: bool = True) -> Explanation:
    """Cost `plan` and explain it (see the module docstring). Raises InputError if the plan itself is invalid.

    with_planner: include the planner's remat/offload choice for the same mesh among the what-ifs."""
    chips = plan.chips if chips is None else chips
    cost = estimate(m, chip, job, plan, chips)
    wf = waterfall(m, chip, job, plan, cost)
    wi = what_ifs(m, chip, job, plan, chips, cost, with_planner) if with_what_ifs else []
    return Explanation(m.name, chip.name, chips, plan, cost, tuple(wf), dict(cost.memory),
                       bottleneck(cost, chip, job, plan), tuple(wi), step_time_interval(cost, chip, job, plan))
