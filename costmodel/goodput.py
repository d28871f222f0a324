"""Goodput: what failures, checkpoints and restarts cost a long training run, and the time and money to train N tokens.

First order, as in Young 1974 and Daly 2006: job MTBF M = chip MTBF / chips; checkpoint write C; restart R (fixed
restart + restore + waiting for a host when no hot spare is free); interval tau, optimum tau* = sqrt(2 C M);

    goodput = tau / (tau + C) * (1 - (R + (tau + C) / 2) / M)       (clamped at 0)

Hot spares: the hosts in repair are Poisson (an M/G/inf queue), so a spare is free with probability
P(Poisson < spare hosts). Defaults: chip MTBF 50,677 chip-hours from Llama 3 405B's 419 interruptions in 54 days
on 16,384 H100s (Llama 3 Herd of Models, 2024, section 3.3.4; TPUs and other GPUs ASSUMED the same); checkpoint
bandwidth min(chips * 1 GB/s ASSUMED, 2 TB/s Tectonic cap); restart 10 min, replacement 30 min, repair 24 h
ASSUMED. Every default is overridable.
(the model, each default and its source: docs/goodput.md)
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace

from costmodel.cost import Cost
from costmodel.job import Job
from costmodel.memory import memory_terms, state_convention
from costmodel.model import ModelSpec
from costmodel.plan import Plan
from hardware.chip import Chip
from hardware.errors import InputError

HOUR = 3600.0
DAY = 86400.0

# Llama 3 405B: 419 unexpected interruptions, 54 days, 16,384 H100 GPUs -> chip-hours per interruption.
LLAMA3_CHIP_MTBF_H = 16384 * 54 * 24 / 419
DEFAULT_MTBF_H = {"gpu": LLAMA3_CHIP_MTBF_H, "tpu": LLAMA3_CHIP_MTBF_H, "cpu": LLAMA3_CHIP_MTBF_H}
MTBF_SOURCE = {
    "gpu": "Llama 3 (Meta 2024): 419 unexpected interruptions / 54 days on 16,384 H100",
    "tpu": "ASSUMED = GPU figure (no published per-chip TPU interruption rate found)",
    "cpu": "ASSUMED = GPU figure",
}
DEFAULT_RESTART_S = 600.0  # ASSUMED: detect, reschedule, re-initialise, recompile
DEFAULT_REPLACE_S = 1800.0  # ASSUMED: wait for a replacement host when no hot spare is free
DEFAULT_REPAIR_H = 24.0  # ASSUMED: a failed host is out this long before it can serve as a spare again
DEFAULT_CKPT_PER_CHIP_BPS = 1e9  # ASSUMED per chip, write and read
DEFAULT_CKPT_AGGREGATE_BPS = 2e12  # Llama 3: Tectonic 2 TB/s sustained


@dataclass(frozen=True)
class Reliability:
    """Failure and checkpoint parameters. None = the default for the chip's vendor (see the module docstring)."""

    mtbf_h: float | None = None  # per chip, hours between job-interrupting failures
    restart_s: float = DEFAULT_RESTART_S
    replace_s: float = DEFAULT_REPLACE_S
    repair_h: float = DEFAULT_REPAIR_H
    ckpt_write_Bps: float = DEFAULT_CKPT_PER_CHIP_BPS  # per chip
    ckpt_read_Bps: float = DEFAULT_CKPT_PER_CHIP_BPS  # per chip
    ckpt_aggregate_Bps: float = DEFAULT_CKPT_AGGREGATE_BPS  # storage cap for the whole job
    spares: int = 0  # hot-spare chips (used in whole hosts)
    interval_s: float | None = None  # checkpoint interval; None = Young's optimum

    def __post_init__(self) -> None:
        for name in ("mtbf_h", "ckpt_write_Bps", "ckpt_read_Bps", "ckpt_aggregate_Bps", "repair_h", "interval_s"):
            v = getattr(self, name)
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise InputError(f"{name}: expected a positive number, got {v}")
        for name in ("restart_s", "replace_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise InputError(f"{name}: expected a non-negative number, got {v}")
        if not isinstance(self.spares, int) or self.spares < 0:
            raise InputError(f"spares: expected a non-negative integer, got {self.spares}")

    def chip_mtbf_h(self, chip: Chip) -> float:
        return self.mtbf_h if self.mtbf_h is not None else DEFAULT_MTBF_H.get(chip.vendor, LLAMA3_CHIP_MTBF_H)


# ---- pure formulas ---------------------------------------------------------------------------------------

def job_mtbf_s(chip_mtbf_h: float, chips: int) -> float:
    """Mean time between job-interrupting failures for `chips` chips that fail independently."""
    return chip_mtbf_h * HOUR / chips


def young_interval_s(ckpt_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval sqrt(2 C M)."""
    return math.sqrt(2.0 * ckpt_s * mtbf_s)


def daly_interval_s(ckpt_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order optimum: sqrt(2CM) * (1 + sqrt(C/2M)/3 + C/(18M)) - C for C < 2M, else M."""
    if ckpt_s >= 2 * mtbf_s:
        return mtbf_s
    x = ckpt_s / (2 * mtbf_s)
    return math.sqrt(2 * ckpt_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - ckpt_s


def goodput_fraction(interval_s: float, ckpt_s: float, restart_s: float, mtbf_s: float) -> float:
    """Useful compute / wall time: tau/(tau+C) * (1 - (R + (tau+C)/2) / M), clamped to [0, 1]."""
    seg = interval_s + ckpt_s
    g = interval_s / seg * (1.0 - (restart_s + seg / 2.0) / mtbf_s)
    return min(1.0, max(0.0, g))


def poisson_cdf(k: int, mean: float) -> float:
    """P(X <= k) for X ~ Poisson(mean); 0 for k < 0. Closed form: the regularised upper incomplete gamma
    function Q(k + 1, mean) (scipy.special.pdtr), in constant time for any k (summing the k + 1 terms took one
    loop per spare host, and returned 0 for every k once exp(-mean) underflowed, mean > 745)."""
    if k < 0:
        return 0.0
    from scipy.special import pdtr  # imported here: only runs with hot spares pay its import

    return min(1.0, float(pdtr(k, mean)))


def spare_coverage(spare_hosts: int, failures_per_h: float, repair_h: float) -> float:
    """Probability a free hot-spare host is there when a failure happens (hosts in repair ~ Poisson)."""
    return poisson_cdf(spare_hosts - 1, failures_per_h * repair_h)


def check_spares(spares: int, chips: int) -> int:
    """Hot spares are at most the job's chips: a larger pool is billed to the job but cannot all be in use
    (with spares = chips every running chip can fail at once and still find one)."""
    if spares > chips:
        raise InputError(f"--spares: expected at most the job's {chips:,} chips, got {spares:,}")
    return spares


def parse_count(text: str | float | int, name: str = "--train-tokens") -> float:
    """'15T', '300B', '2.5e12', '1_000M' -> a positive number (K, M, B/G, T, P suffixes, powers of 1000)."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        s = str(text).strip().replace("_", "").replace(",", "")
        mult = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "P": 1e15}
        mt = re.fullmatch(r"([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)([KMBGTPkmbgtp]?)", s)
        if not mt:
            raise InputError(f"{name}: expected a number such as 15T, 300B or 2.5e12, got {text!r}")
        value = float(mt.group(1)) * mult[mt.group(2).upper()]
    if not (value > 0 and math.isfinite(value)):
        raise InputError(f"{name}: expected a positive number, got {text!r}")
    return value


# ---- checkpoint size ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CheckpointSize:
    total_bytes: float  # unique state: every parameter's weights + optimizer state, once
    per_chip_state_bytes: float  # what one chip holds (replicas included): weights + optimizer
    bytes_per_param: int


def checkpoint_size(m: ModelSpec, chip: Chip, job: Job, plan: Plan) -> CheckpointSize:
    """Weights + optimizer state in the framework's convention (gradients and activations are not saved).

    Replicated shards (dp with zero < 3) are written once, so the total is parameters x bytes per parameter,
    not per-chip state x chips."""
    w_b, _, o_b, _ = state_convention(job)
    accum = max(1, job.global_batch // max(1, plan.batch_shards * plan.micro_batch))
    mt = memory_terms(m, chip, job, plan, accum)
    per_chip = mt.param_elems * w_b + mt.optimizer_param_elems * o_b
    return CheckpointSize(float(m.total_params()) * (w_b + o_b), per_chip, w_b + o_b)


def ckpt_bandwidth(per_chip_Bps: float, aggregate_Bps: float, chips: int) -> float:
    return min(per_chip_Bps * chips, aggregate_Bps)


# ---- the goodput report ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Goodput:
    chips: int
    spares: int
    spare_hosts: int
    chip_mtbf_h: float
    mtbf_source: str
    job_mtbf_h: float
    failures_per_day: float
    checkpoint_bytes: float
    checkpoint_write_s: float
    checkpoint_restore_s: float
    interval_s: float  # the checkpoint interval used (default: Young's, rounded to whole steps)
    young_interval_s: float
    daly_interval_s: float
    spare_coverage: float  # probability a failure finds a free spare host
    restart_s: float  # expected time from a failure until training resumes (excludes lost work)
    lost_work_s: float  # expected recomputed work per failure: (tau + C) / 2
    checkpoint_overhead: float  # fraction of wall time spent writing checkpoints
    failure_overhead: float  # fraction of wall time spent on restarts and lost work
    goodput: float
    step_time_s: float
    tokens_per_s: float
    effective_tokens_per_day: float
    train_tokens: float | None = None
    days_to_train: float | None = None  # expected wall-clock days, failures included
    ideal_days: float | None = None  # at the step time, no failures and no checkpoints
    chip_hours: float | None = None  # billed: (chips + spares) x wall-clock hours
    cost: float | None = None  # chip_hours x price
    price_per_chip_hour: float | None = None
    energy_kwh: float | None = None  # active chips x power_w x wall time (chip power only: no host, no PUE)

    def to_dict(self) -> dict:
        return asdict(self)


def goodput_from(step_time_s: float, tokens_per_step: float, ckpt: CheckpointSize, chip: Chip, chips: int,
                 rel: Reliability | None = None, train_tokens: float | None = None,
                 price_per_chip_hour: float | None = None) -> Goodput:
    """The goodput of a plan whose step time and checkpoint size are known (pure arithmetic, no costing)."""
    rel = rel or Reliability()
    if chips < 1:
        raise InputError(f"chips: expected a positive integer, got {chips}")
    check_spares(rel.spares, chips)
    if train_tokens is not None and not (train_tokens > 0 and math.isfinite(train_tokens)):
        raise InputError(f"--train-tokens: expected a positive number, got {train_tokens}")
    if price_per_chip_hour is not None and not (price_per_chip_hour > 0 and math.isfinite(price_per_chip_hour)):
        raise InputError(f"--price-per-chip-hour: expected a positive number, got {price_per_chip_hour}")
    chip_mtbf = rel.chip_mtbf_h(chip)
    mtbf = job_mtbf_s(chip_mtbf, chips)
    write = ckpt.total_bytes / ckpt_bandwidth(rel.ckpt_write_Bps, rel.ckpt_aggregate_Bps, chips)
    restore = ckpt.total_bytes / ckpt_bandwidth(rel.ckpt_read_Bps, rel.ckpt_aggregate_Bps, chips)
    spare_hosts = rel.spares // max(1, chip.chips_per_host)
    cover = spare_coverage(spare_hosts, HOUR / mtbf, rel.repair_h)
    restart = rel.restart_s + restore + (1.0 - cover) * rel.replace_s
    young = young_interval_s(write, mtbf)
    # Checkpoints happen between steps: Young's optimum rounded to a whole number of steps (at least one).
    tau = rel.interval_s if rel.interval_s is not None else max(1, round(young / step_time_s)) * step_time_s
    g = goodput_fraction(tau, write, restart, mtbf)
    seg = tau + write
    ck_over = write / seg
    fail_over = max(0.0, 1.0 - ck_over - g)
    tps = tokens_per_step / step_time_s
    out = Goodput(
        chips=chips, spares=rel.spares, spare_hosts=spare_hosts, chip_mtbf_h=chip_mtbf,
        mtbf_source=MTBF_SOURCE.get(chip.vendor, "") if rel.mtbf_h is None else "user (--mtbf-hours)",
        job_mtbf_h=mtbf / HOUR, failures_per_day=DAY / mtbf, checkpoint_bytes=ckpt.total_bytes,
        checkpoint_write_s=write, checkpoint_restore_s=restore, interval_s=tau, young_interval_s=young,
        daly_interval_s=daly_interval_s(write, mtbf), spare_coverage=cover, restart_s=restart,
        lost_work_s=seg / 2.0, checkpoint_overhead=ck_over, failure_overhead=fail_over, goodput=g,
        step_time_s=step_time_s, tokens_per_s=tps, effective_tokens_per_day=tps * DAY * g)
    if train_tokens is None:
        return out
    ideal = train_tokens / tps
    wall = math.inf if g <= 0 else ideal / g
    hours = wall / HOUR
    billed = (chips + rel.spares) * hours
    energy = chips * chip.power_w * hours / 1000.0 if chip.power_w > 0 else None
    return replace(out, train_tokens=train_tokens, days_to_train=wall / DAY, ideal_days=ideal / DAY,
                   chip_hours=billed, price_per_chip_hour=price_per_chip_hour,
                   cost=billed * price_per_chip_hour if price_per_chip_hour else None, energy_kwh=energy)


def goodput(m: ModelSpec, chip: Chip, job: Job, plan: Plan, cost: Cost, rel: Reliability | None = None,
            train_tokens: float | None = None, price_per_chip_hour: float | None = None) -> Goodput:
    """Goodput, checkpoint interval and time/cost to train for one costed plan."""
    return goodput_from(cost.step_time_s, job.tokens, checkpoint_size(m, chip, job, plan), chip, plan.chips, rel,
                        train_tokens, price_per_chip_hour)


# ---- ranking (for `suggest --train-tokens`) -------------------------------------------------------------------

def _plan_cost(item) -> tuple[Plan, Cost]:
    if isinstance(item, tuple | list) and len(item) >= 2:
        return item[0], item[1]
    return item.plan, item.cost


def rank_by_time_to_train(results: Iterable, m: ModelSpec, chip: Chip, job: Job, train_tokens: float,
                          price_per_chip_hour: float | None = None, rel: Reliability | None = None,
                          ) -> list[tuple[object, Goodput]]:
    """Rank costed plans by expected wall-clock days to train `train_tokens` (ties: cost, then step time).

    `results`: (plan, cost) pairs or objects with `.plan` and `.cost`. Plans that do not fit in memory are
    dropped. Returns [(item, Goodput)], fastest to finish first."""
    ranked = []
    for item in results:
        plan, cost = _plan_cost(item)
        if not cost.fits:
            continue
        ranked.append((item, goodput(m, chip, job, plan, cost, rel, train_tokens, price_per_chip_hour)))
    ranked.sort(key=lambda r: (r[1].days_to_train, r[1].cost or 0.0, r[1].step_time_s))
    return ranked
