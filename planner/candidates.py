"""Mesh candidates: every way to lay a job on `chips` chips that the divisibility and topology rules allow.

A `Mesh` fixes everything about a plan except the per-tensor remat/offload choices and the optimizer/parameter
offload (those are the CP-SAT program's decisions, planner/remat.py). The rules, all checked here: the degrees
multiply to the chips; tp, cp, ep and pp * vpp divide what they split (unevenly where the framework can:
Framework.uneven_pp; under Megatron-Core also with the embedding and/or the loss counted as a layer:
split_settings); cp leaves at least MIN_TOKENS_PER_CP_RANK tokens per rank; the batch splits dp * fsdp * ep
ways into micro-batches; tp and cp stay inside the fastest level (GPUs: the NVLink domain; TPUs: only dp, pp and
fsdp span slices); zero in {0, 1} (2 when pinned by --fix); sequence parallelism on; and whatever else
costmodel.constraints.check_plan refuses (the framework's own rules). The list in full: docs/costmodel.md,
"Mesh candidates".

Chip counts: a GPU job is one partial node (1..8 GPUs) or whole nodes. A TPU job is `slices` identical slices
of a valid slice size (hardware.topology.valid_slice_sizes); a multi-slice job uses slices made of whole hosts.
The default slice count is the smallest such k.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from costmodel.constraints import check_plan, fp8_params_allowed
from costmodel.estimate import dcn_split
from costmodel.job import Job
from costmodel.model import ModelSpec
from costmodel.plan import AXES, REMAT_POLICIES, Plan, Remat, pipeline_split, remat_policy
from hardware.chip import Chip
from hardware.errors import InputError, did_you_mean, excerpt
from hardware.topology import valid_slice_sizes

MIN_TOKENS_PER_CP_RANK = 256  # context parallelism below this many tokens per rank is never worth a candidate
MAX_VPP = 8
# The largest job the planner takes, checked before any work: 8x the largest shipped profile's max_chips
# (131,072 GPUs); a profile's own max_chips is checked once it is loaded (check_chips).
MAX_CHIPS = 2**20
DEFAULT_TOKENS_PER_BATCH = 4 * 2**20  # ~4M tokens per optimizer step (Llama/GPT-3 scale batches)
FIX_INT_KEYS = (*AXES, "vpp", "micro_batch", "zero")
FIX_ALIASES = {"mb": "micro_batch", "micro-batch": "micro_batch", "microbatch": "micro_batch",
               "offload_opt": "offload_optimizer", "optimizer_offload": "offload_optimizer",
               "param_offload": "offload_params", "offload_parameters": "offload_params"}
FIX_KEYS = (*FIX_INT_KEYS, "remat", "offload_optimizer", "offload_params")


@dataclass(frozen=True, order=True)
class Mesh:
    """A plan without its remat/offload choices. Field order is the canonical tie-break order."""

    dp: int
    fsdp: int
    tp: int
    cp: int
    pp: int
    ep: int
    vpp: int
    micro_batch: int
    zero: int
    slices: int
    # (1 if the embedding, 1 if the loss) counts as a layer of the pipeline split: Megatron-Core's
    # --account-for-embedding/loss-in-pipeline-split (Plan.split_accounting; split_settings)
    split: tuple[int, int] = (0, 0)
    fp8_params: bool = False  # Megatron-Core's --fp8-param-gather, on wherever it is allowed (fp8_params_allowed)

    def plan(self, remat: Remat | None = None, offload_optimizer: bool = False,
             offload_params: bool = False, recompute_num_layers: int = 0, ep_overlap: bool = False) -> Plan:
        return Plan(dp=self.dp, fsdp=self.fsdp, tp=self.tp, cp=self.cp, pp=self.pp, ep=self.ep, vpp=self.vpp,
                    micro_batch=self.micro_batch, zero=self.zero, sequence_parallel=True,
                    remat=remat or REMAT_POLICIES["full"], offload_optimizer=offload_optimizer,
                    offload_params=offload_params, slices=self.slices, recompute_num_layers=recompute_num_layers,
                    overlap_moe_expert_parallel_comm=ep_overlap,
                    account_for_embedding_in_pipeline_split=bool(self.split[0]),
                    account_for_loss_in_pipeline_split=bool(self.split[1]), fp8_param_gather=self.fp8_params)

    @property
    def layout(self) -> Mesh:
        """This mesh without its split flags: `search` keeps one plan per layout (the flags the cost model
        prefers)."""
        return replace(self, split=(0, 0))

    @property
    def batch_shards(self) -> int:
        return self.dp * self.fsdp * self.ep


@dataclass(frozen=True)
class Constraints:
    """What the user pinned: --max-tp, --fix axis=value,..., --slices."""

    max_tp: int | None = None
    fixed: dict[str, int] = field(default_factory=dict)  # degrees, vpp, micro_batch, zero
    remat: Remat | None = None  # all six tensor choices pinned to one policy
    policies: tuple[Remat, ...] | None = None  # only these whole-layer policies (what a framework can express)
    offload_optimizer: bool | None = None
    offload_params: bool | None = None
    slices: int | None = None
    limits: Constraints | None = None  # the target framework's own limits without the user's pins (what-ifs keep them)

    def relaxed(self) -> Constraints:
        """These constraints without the user's pins: the framework's limits, or nothing but --max-tp."""
        return self.limits or Constraints(max_tp=self.max_tp)

    def for_mesh(self, m: ModelSpec, chip: Chip, job: Job, mesh: Mesh) -> Constraints:
        """These constraints plus the offload switches the cost model's rules forbid on this mesh."""
        kw = {}
        for name, flag in (("offload_optimizer", dict(offload_optimizer=True)), ("offload_params",
                                                                                dict(offload_params=True))):
            if getattr(self, name) is None:
                try:
                    check_plan(m, chip, job, mesh.plan(self.remat, **flag))
                except InputError:
                    kw[name] = False
        return replace(self, **kw) if kw else self

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.fixed.items()]
        if self.remat is not None:
            parts.append(f"remat={self.remat.name}")
        elif self.policies is not None:
            parts.append("remat in " + "|".join(p.name for p in self.policies))
        for k in ("offload_optimizer", "offload_params"):
            if getattr(self, k) is not None:
                parts.append(f"{k}={int(getattr(self, k))}")
        if self.max_tp is not None:
            parts.append(f"max_tp={self.max_tp}")
        if self.slices is not None:
            parts.append(f"slices={self.slices}")
        return ", ".join(parts)


def _bool(key: str, text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise InputError(f"--fix {key}: expected true or false (1/0), got {text!r}")


def parse_fix(text: str | None, max_tp: int | None = None, slices: int | None = None) -> Constraints:
    """'dp=2,tp=4,mb=1,remat=full,offload_optimizer=0' -> Constraints. Unknown keys name the nearest one."""
    fixed: dict[str, int] = {}
    remat = opt = par = None
    given: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        key, eq, val = item.partition("=")
        key = key.strip().lower().replace("-", "_")
        key = FIX_ALIASES.get(key, key)
        if not eq or not val.strip():
            raise InputError(f"--fix: expected axis=value items such as dp=2,tp=4, got {excerpt(item)}")
        if key not in FIX_KEYS:
            raise InputError(f"--fix: unknown key {excerpt(key)}{did_you_mean(key, FIX_KEYS)}; "
                             f"expected one of {', '.join(FIX_KEYS)}")
        if key in given:
            raise InputError(f"--fix: {given[key]} and {item}: {key} given twice; give it once")
        given[key] = item
        if key == "remat":
            remat = remat_policy(val.strip())
        elif key == "offload_optimizer":
            opt = _bool(key, val)
        elif key == "offload_params":
            par = _bool(key, val)
        else:
            try:
                v = int(val)
            except ValueError:
                raise InputError(f"--fix {key}: expected an integer, got {val.strip()!r}") from None
            lo, hi = (0, 3) if key == "zero" else (1, MAX_CHIPS)
            if not lo <= v <= hi:
                raise InputError(f"--fix {key}: expected {'0..3' if key == 'zero' else f'1..{MAX_CHIPS:,}'}, "
                                 f"got {v}")
            fixed[key] = v
    if max_tp is not None and max_tp < 1:
        raise InputError(f"--max-tp: expected a positive integer, got {max_tp}")
    if max_tp is not None and fixed.get("tp", 1) > max_tp:
        raise InputError(f"--fix {given['tp']} and --max-tp {max_tp}: contradictory (tp over the limit); give one")
    if slices is not None and slices < 1:
        raise InputError(f"--slices: expected a positive integer, got {slices}")
    return Constraints(max_tp=max_tp, fixed=fixed, remat=remat, offload_optimizer=opt, offload_params=par,
                       slices=slices)


# ---- chip counts and slices ------------------------------------------------------------------------------

def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def slice_options(chip: Chip, chips: int) -> list[int]:
    """Slice counts k that form `chips` TPU chips: chips/k a valid slice size, whole hosts when k > 1."""
    sizes = set(valid_slice_sizes(chip))
    return [k for k in divisors(chips)
            if chips // k in sizes and (k == 1 or (chips // k) % chip.chips_per_host == 0)]


def formable(chip: Chip, chips: int) -> bool:
    if chips < 1 or chips > chip.max_chips:
        return False
    if chip.scale_up.kind == "torus":
        return bool(slice_options(chip, chips))
    node = chip.scale_up.domain_chips
    return not node or chips <= node or chips % node == 0


def nearest_formable(chip: Chip, chips: int, count: int = 4) -> list[int]:
    """Up to `count` valid chip counts nearest to `chips` (half below, half above where possible)."""
    below, above = [], []
    n = min(chips, chip.max_chips + 1) - 1
    while n >= 1 and len(below) < count // 2:
        if formable(chip, n):
            below.append(n)
        n -= 1
    n = max(chips, 0) + 1
    while n <= chip.max_chips and len(above) < count - len(below):
        if formable(chip, n):
            above.append(n)
        n += 1
    return sorted(below + above)


def check_chips(chip: Chip, chips: int) -> None:
    """InputError unless the topology can form `chips` chips; names the nearest counts that it can."""
    if chips is None or chips < 1:
        raise InputError(f"--chips: expected a positive integer, got {chips}")
    if chips > MAX_CHIPS:
        raise InputError(f"--chips: expected at most {MAX_CHIPS:,} (the planner's bound), got {chips:,}")
    if chips > chip.max_chips:
        raise InputError(f"--chips: {chips} exceeds the {chip.name} profile's maximum of {chip.max_chips} chips")
    if formable(chip, chips):
        return
    near = ", ".join(map(str, nearest_formable(chip, chips)))
    if chip.scale_up.kind == "torus":
        why = (f"{chip.name} cannot form {chips} chips as identical slices of a valid slice size "
               f"(multi-slice jobs use whole {chip.chips_per_host}-chip hosts)")
    else:
        why = f"{chip.name} jobs use up to one {chip.scale_up.domain_chips}-GPU node or whole nodes"
    raise InputError(f"--chips: {why}; nearest valid chip counts: {near}")


def default_slices(chip: Chip, chips: int, requested: int | None = None) -> int:
    """Slices for a TPU job: `requested` if it is valid, else the smallest valid count. GPUs: 1."""
    if chip.scale_up.kind != "torus":
        if requested not in (None, 1):
            raise InputError("--slices: multi-slice jobs are for TPUs; GPU jobs span nodes automatically")
        return 1
    options = slice_options(chip, chips)
    if requested is None:
        if not options:
            check_chips(chip, chips)
        return options[0]
    if requested not in options:
        raise InputError(f"--slices: {chips} chips cannot be split into {requested} slices of a valid "
                         f"{chip.name} slice size; valid slice counts: {', '.join(map(str, options))}")
    return requested


def default_global_batch(chips: int, seq_len: int, tokens_per_batch: int | None = None) -> int:
    """Sequences per step for about `tokens_per_batch` tokens (default ~4M), rounded to a multiple of q.

    q is the largest divisor of `chips` no larger than the target with chips/q a power of two, so that a plan
    exists whose batch shards use every chip's share of the batch (model-parallel axes are powers of two)."""
    tokens = DEFAULT_TOKENS_PER_BATCH if tokens_per_batch is None else tokens_per_batch
    if tokens < 1:
        raise InputError(f"--tokens-per-batch: expected a positive integer, got {tokens}")
    target = max(1.0, tokens / seq_len)
    qs = [q for q in divisors(chips) if q <= target and (chips // q) & (chips // q - 1) == 0]
    q = max(qs) if qs else max(d for d in divisors(chips) if d <= target)
    return max(q, round(target / q) * q)


# ---- the candidates ----------------------------------------------------------------------------------------


def in_node(n: int, node: int, chips: int) -> bool:
    """Whether an axis group of n chips stays inside one NVLink node (node = 0: TPU, no such limit)."""
    return not node or node % n == 0 or (chips < node and chips % n == 0)


# (embedding, loss) counted as a layer of the pipeline split (Plan.split_accounting), besides (0, 0)
SPLIT_SETTINGS = ((1, 0), (0, 1), (1, 1))


def split_settings(m: ModelSpec, job: Job, pp: int, vpp: int) -> tuple[tuple[int, int], ...]:
    """The ways the layers go onto pp stages of vpp chunks, as (embedding, loss) flags: (0, 0) for an even split or,
    where the framework can (Framework.uneven_pp), Megatron-LM's uneven one; under Megatron-Core (pp > 1) also each
    of its account-for-embedding/loss settings that Megatron's checks accept (costmodel.plan.split_accounted).
    Llama 3 405B (126 layers) over pp 8 x vpp 8: only (1, 1), 15/16/15; over 16 x 2: (0, 0) 8/8/6 and (1, 1) 7/8/7."""
    even = m.n_layers % (pp * vpp) == 0
    out = [(0, 0)] if even or (job.fw.uneven_pp and pipeline_split(m.n_layers, pp, vpp) is not None) else []
    if job.fw.megatron_core and pp > 1:
        out += [s for s in SPLIT_SETTINGS if pipeline_split(m.n_layers, pp, vpp, *s) is not None]
    return tuple(out)


def splits(m: ModelSpec, job: Job, pp: int, vpp: int) -> bool:
    """Whether the layers go onto pp stages of vpp chunks in some way the framework runs (split_settings)."""
    return bool(split_settings(m, job, pp, vpp))


def axis_options(m: ModelSpec, chip: Chip, job: Job, chips: int, cons: Constraints) -> dict[str, list[int]]:
    """Allowed degrees per model-parallel axis (tp, cp, pp, ep) before combining them."""
    ds = divisors(chips)
    node = chip.scale_up.domain_chips if chip.scale_up.kind != "torus" else 0
    tp = [t for t in ds if (t == 1 or (m.n_heads % t == 0 and (m.n_kv_heads % t == 0 or t % m.n_kv_heads == 0)))
          and (cons.max_tp is None or t <= cons.max_tp) and (not node or t <= node)]
    cp = [c for c in ds if job.seq_len % c == 0 and (c == 1 or job.seq_len // c >= MIN_TOKENS_PER_CP_RANK)
          and (not node or c <= node)]
    pp = [p for p in ds if splits(m, job, p, 1)]
    ep = [e for e in ds if m.is_moe and m.n_experts % e == 0] if m.is_moe else [1]
    out = {"tp": tp, "cp": cp, "pp": pp, "ep": ep}
    for axis in out:
        if axis in cons.fixed:
            out[axis] = [v for v in out[axis] if v == cons.fixed[axis]]
    return out


def candidates(m: ModelSpec, chip: Chip, job: Job, chips: int, cons: Constraints | None = None,
               slices: int | None = None) -> Iterator[Mesh]:
    """Every mesh candidate, in canonical order. Nothing about cost; only the rules in the module docstring."""
    cons = cons or Constraints()
    if slices is None:
        slices = default_slices(chip, chips, cons.slices)
    fx = cons.fixed
    for tp, cp, pp, ep in _model_parallel_degrees(m, chip, job, chips, cons):
        rest = chips // (tp * cp * pp * ep)
        for fsdp in divisors(rest):
            dp = rest // fsdp
            if fx.get("dp", dp) != dp or fx.get("fsdp", fsdp) != fsdp:
                continue
            yield from _meshes(m, chip, job, slices, fx, dp, fsdp, tp, cp, pp, ep)


def _model_parallel_degrees(m: ModelSpec, chip: Chip, job: Job, chips: int,
                            cons: Constraints) -> Iterator[tuple[int, int, int, int]]:
    """(tp, cp, pp, ep) allowed by the rules whose product divides the chip count, tp * cp within one node."""
    opts = axis_options(m, chip, job, chips, cons)
    node = chip.scale_up.domain_chips if chip.scale_up.kind != "torus" else 0
    for tp in opts["tp"]:
        for cp in opts["cp"]:
            if not in_node(tp * cp, node, chips):
                continue
            for pp in opts["pp"]:
                for ep in opts["ep"]:
                    if chips % (tp * cp * pp * ep) == 0:
                        yield tp, cp, pp, ep


def _meshes(m: ModelSpec, chip: Chip, job: Job, slices: int, fx: dict[str, int], dp: int, fsdp: int, tp: int,
            cp: int, pp: int, ep: int) -> Iterator[Mesh]:
    shards = dp * fsdp * ep
    if job.global_batch % shards:
        return
    if slices > 1:
        try:
            dcn_split(Plan(dp=dp, fsdp=fsdp, tp=tp, cp=cp, pp=pp, ep=ep, slices=slices))
        except InputError:
            return
    per_replica = job.global_batch // shards
    zeros = ([0, 1] + ([2] if fx.get("zero") == 2 else [])) if dp > 1 else [0]  # ZeRO-2 when pinned
    vpps = [1] + ([v for v in (2, 4, 8, 16, 32) if v <= MAX_VPP] if pp > 1 else [])
    settings = {v: split_settings(m, job, pp, v) for v in vpps}
    # the job allows fp8 parameters at all (framework, precision): checked once, then per mesh (zero, fsdp)
    fp8_job = fp8_params_allowed(job, Plan(zero=1))
    for mb in divisors(per_replica):
        if fx.get("micro_batch", mb) != mb:
            continue
        accum = per_replica // mb
        for vpp in vpps:
            if fx.get("vpp", vpp) != vpp or (vpp > 1 and accum % pp):
                continue
            for zero, split in itertools.product(zeros, settings[vpp]):
                if fx.get("zero", zero) != zero:
                    continue
                mesh = Mesh(dp, fsdp, tp, cp, pp, ep, vpp, mb, zero, slices, split)
                mesh = replace(mesh, fp8_params=fp8_job and fp8_params_allowed(job, mesh.plan()))
                try:  # the cost model's own rules, framework rules included (e.g. MaxText: zero 1 needs fsdp = 1)
                    check_plan(m, chip, job, mesh.plan())
                except InputError:
                    continue
                yield mesh


def model_parallel_limit(m: ModelSpec, chip: Chip, job: Job, chips: int, cons: Constraints) -> int:
    """The most chips one sequence can be spread over (tp * cp * pp * ep) under the rules, ignoring the batch."""
    return max((tp * cp * pp * ep for tp, cp, pp, ep in _model_parallel_degrees(m, chip, job, chips, cons)),
               default=0)


def _has_candidates(m: ModelSpec, chip: Chip, job: Job, chips: int, cons: Constraints) -> bool:
    try:
        return next(iter(candidates(m, chip, job, chips, cons)), None) is not None
    except InputError:
        return False


def usable_batches(m: ModelSpec, chip: Chip, job: Job, chips: int, cons: Constraints, count: int = 4) -> list[int]:
    """Up to `count` global batches nearest to job.global_batch for which some mesh candidate exists."""
    shard_counts = [d for d in divisors(chips)]
    b = job.global_batch
    near = sorted({k * s for s in shard_counts for k in (b // s, b // s + 1, 2 * (b // s + 1)) if k >= 1},
                  key=lambda x: (abs(x - b), x))
    out = []
    for x in near[:200]:
        if x != b and _has_candidates(m, chip, replace(job, global_batch=x), chips, cons):
            out.append(x)
            if len(out) == count:
                break
    return sorted(out)


def default_batch_for(m: ModelSpec, chip: Chip, chips: int, seq_len: int, precision: str, framework: str,
                      cons: Constraints, tokens_per_batch: int | None = None) -> tuple[int, str]:
    """The default global batch (default_global_batch), doubled up to 64x when no mesh can take it (e.g. too
    few sequences for the model-parallel limit, or a framework's pipeline rule); returns (batch, note). A batch
    the user asked for (tokens_per_batch) is never changed: that is an error naming the batch that would work."""
    base = default_global_batch(chips, seq_len, tokens_per_batch)
    for factor in (1, 2, 4, 8, 16, 32, 64):
        b = base * factor
        if _has_candidates(m, chip, Job(seq_len, b, precision, framework), chips, cons):
            if factor > 1 and tokens_per_batch is not None:
                raise InputError(f"--tokens-per-batch: {base} sequences of {seq_len} tokens leave no valid plan on "
                                 f"{chips} x {chip.name} under {framework}; {b} sequences "
                                 f"({b * seq_len / 2**20:.0f}M tokens) would: ask for that batch")
            note = "" if factor == 1 else (f"global batch {b} ({b * seq_len / 2**20:.1f}M tokens): the default "
                                           f"{base} leaves no valid plan on {chips} chips")
            return b, note
    return base, ""


def binding_pins(m: ModelSpec, chip: Chip, job: Job, chips: int, cons: Constraints,
                 most: int = 20_000) -> list[str]:
    """The pins of `cons.fixed` without which some mesh exists, each with the nearest value that does
    ('tp=3 binds (nearest that exists: tp=2)'); `most` meshes looked at per pin."""
    out = []
    for key, want in cons.fixed.items():
        rest = replace(cons, fixed={k: v for k, v in cons.fixed.items() if k != key})
        try:
            seen = {getattr(mesh, key) for mesh in itertools.islice(candidates(m, chip, job, chips, rest), most)}
        except InputError:
            continue
        if seen:
            near = min(seen, key=lambda v: (abs(v - want), v))
            out.append(f"{key}={want} binds (nearest that exists: {key}={near})")
    return out


def explain_no_candidates(m: ModelSpec, chip: Chip, job: Job, chips: int, cons: Constraints) -> InputError:
    """Why no mesh exists: a global batch too small or not divisible, or over-tight --fix constraints."""
    limit = model_parallel_limit(m, chip, job, chips, Constraints(max_tp=cons.max_tp))
    if limit == 0:
        return InputError(f"--chips: no way to lay {m.name} on {chips} x {chip.name} under the divisibility "
                          "rules (tp | n_heads, pp | n_layers or a Megatron uneven split, cp | seq_len)")
    min_shards = chips // limit
    if job.global_batch < min_shards:
        seqs = f"{job.global_batch} sequence{'s' * (job.global_batch != 1)}"
        return InputError(f"--global-batch: {seqs} is too small for {chips} chips: one "
                          f"sequence spans at most {limit} chips (tp*cp*pp*ep), so the {min_shards} data-parallel "
                          f"ranks need a global batch of at least {min_shards} (a multiple of it)")
    if cons.fixed or cons.max_tp is not None or cons.slices is not None:
        if _has_candidates(m, chip, job, chips, Constraints()):
            opts = axis_options(m, chip, job, chips, Constraints(max_tp=cons.max_tp))
            allowed = [f"{a} is one of {', '.join(map(str, opts[a]))}" for a, v in cons.fixed.items()
                       if a in opts and v not in opts[a]]
            binds = binding_pins(m, chip, job, chips, cons)
            hint = (f" (here {'; '.join(allowed)})" if allowed else "") + (
                f": {'; '.join(binds)}" if binds else " (each pin alone admits plans, together none: drop one)")
            return InputError(f"--fix: no plan for {m.name} on {chips} x {chip.name} satisfies "
                              f"{cons.describe()} with global batch {job.global_batch}{hint}")
    near = usable_batches(m, chip, job, chips, cons)
    hint = f"; nearest usable global batches: {', '.join(map(str, near))}" if near else ""
    return InputError(f"--global-batch: no plan for {m.name} on {chips} x {chip.name} takes a global batch of "
                      f"{job.global_batch} (it must split over dp*fsdp*ep ranks into micro-batches that the "
                      f"{job.framework} rules accept){hint}")
