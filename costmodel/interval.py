"""A likely range (80 %) for a step time, and the ways a plan lies outside the evidence (issue 28, item 6).

Rules, in order (evidence: hardware/calibration/evidence.yaml, costmodel.evidence):
  1. Width from out-of-source residuals: [t / exp(p90), t / exp(p10)], p10/p90 the leave-source-out percentiles of
     log(predicted / measured) of the chip's family. A family measured by fewer than MIN_SOURCES sources, or a plan
     with any extrapolation, takes the union with the percentiles pooled over every family.
  2. Extrapolations, in words: a chip without runs of its own, more chips or a larger degree than any fitted run,
     a precision, framework or remat policy no fitted run used, host offload never measured.
  3. Slow end by mechanism: never above the best MFU measured on the family (t x MFU / best), and with host offload
     never measured, the host transfers the model hides counted as exposed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from costmodel.cost import Cost
from costmodel.evidence import Evidence, FamilyEvidence, Residuals, shipped
from costmodel.job import Job
from costmodel.plan import Plan
from hardware.chip import Chip

LEVEL = 0.8  # the interval's nominal coverage: the 10th to the 90th percentile of the residuals
MIN_SOURCES = 3  # fewer sources give the offsets of those sources, not the spread between sources


@dataclass(frozen=True)
class Interval:
    low_s: float
    high_s: float
    family: str  # the evidence family that set it ('' when none)
    basis: str  # which residuals set the width, in words
    extrapolations: tuple[str, ...]
    best_mfu: float | None  # the best MFU measured on the family in the job's precision (None: none measured)

    def to_dict(self) -> dict:
        return {"step_time_interval_s": [self.low_s, self.high_s], "interval_level": LEVEL,
                "interval_basis": self.basis, "extrapolations": list(self.extrapolations),
                "best_measured_mfu": self.best_mfu}


def step_time_interval(cost: Cost, chip: Chip, job: Job, plan: Plan, ev: Evidence | None = None) -> Interval:
    """The interval of `cost.step_time_s` for `plan` of `job` on `chip` (module docstring)."""
    ev = shipped() if ev is None else ev
    fam, notes = _family(chip, ev)
    cov = _coverage_family(fam, ev)
    if cov is not None:
        notes += outside(cov, job, plan)
    res, basis = _residuals(fam, ev, bool(notes))
    t = cost.step_time_s
    low, high = t / math.exp(res.p90), t / math.exp(res.p10)
    best = _best_mfu(fam, cov, job.precision)
    if best is not None and cost.mfu > best[0]:
        notes.append(f"MFU {cost.mfu * 100:.1f} % is above the best measured on {cov.name if cov else chip.name} "
                     f"({best[0] * 100:.1f} %, {best[1]}): slow end at that MFU")
        high = max(high, t * cost.mfu / best[0])
    hidden = sum(c.time_s - c.exposed_s for c in cost.collectives if c.level == "host")
    if hidden > 0 and (cov is None or not cov.offload):
        high = max(high, (t + hidden) / math.exp(res.p10))
    return Interval(low, high, fam.name if fam else "", basis, tuple(notes), best[0] if best else None)


def _family(chip: Chip, ev: Evidence) -> tuple[FamilyEvidence | None, list[str]]:
    """The chip's evidence family, else its calibration sibling's (hardware.catalog.calibration_owner)."""
    fam = ev.family_of(chip.name)
    if fam is not None:
        if fam.borrows:
            return fam, [f"no fitted runs of {chip.name}: efficiencies from the {fam.borrows} fit"]
        return fam, []
    from hardware.catalog import calibration_owner

    owner = calibration_owner(chip)
    sib = ev.family_of(owner) if owner else None
    if sib is not None:
        return sib, [f"no measured runs of {chip.name}: efficiencies from the {owner} fit"]
    return None, [f"no calibration evidence for {chip.name}"]


def evidence_family(chip: Chip, ev: Evidence) -> FamilyEvidence | None:
    """The family whose fitted rows bound plans on `chip` (its own, its lender's or its sibling's)."""
    return _coverage_family(_family(chip, ev)[0], ev)


def _coverage_family(fam: FamilyEvidence | None, ev: Evidence) -> FamilyEvidence | None:
    """The family whose fitted rows bound the plan: its own, or its lender's for a borrower."""
    if fam is not None and fam.borrows:
        return ev.families.get(fam.borrows)
    return fam if fam is not None and fam.sources else None


def outside(cov: FamilyEvidence, job: Job, plan: Plan) -> list[str]:
    """How `plan` lies outside the fitted rows of `cov`, one phrase per way."""
    out = []
    if plan.chips > cov.max_chips:
        out.append(f"{plan.chips} chips: more than the largest calibrated run on {cov.name} ({cov.max_chips})")
    for axis, top in cov.max_degree.items():
        if getattr(plan, axis) > top:
            out.append(f"{axis}={getattr(plan, axis)}: beyond the calibrated runs on {cov.name} ({axis} up to {top})")
    for what, value, seen in (("precision", job.precision, cov.precisions), ("framework", job.framework,
                                                                           cov.frameworks),
                              ("remat policy", plan.remat.name, cov.remat)):
        if value not in seen:
            out.append(f"{what} {value}: no calibrated run on {cov.name} ({', '.join(seen) or 'none'})")
    offloads = plan.offload_optimizer or plan.offload_params or plan.remat.count("offload")
    if offloads and not cov.offload:
        out.append(f"host offload: never measured on {cov.name} (slow end: transfers not overlapped)")
    return out


def _residuals(fam: FamilyEvidence | None, ev: Evidence, extrapolated: bool) -> tuple[Residuals, str]:
    own = fam.residuals if fam is not None else None
    pooled = ev.pooled
    if own is not None and own.sources >= MIN_SOURCES and not extrapolated:
        return own, f"{fam.name}: leave-source-out residuals of {own.sources} sources"
    if pooled is None:
        return own or Residuals(0.0, 0.0, 0), "no residuals shipped: a point, not a range"
    if own is None:
        return pooled, f"every family's leave-source-out residuals ({pooled.sources} sources)"
    why = "outside the calibrated runs" if extrapolated else f"only {own.sources} source(s) on {fam.name}"
    return (Residuals(min(own.p10, pooled.p10), max(own.p90, pooled.p90), own.sources),
            f"{fam.name} widened to every family's residuals ({why})")


def _best_mfu(fam: FamilyEvidence | None, cov: FamilyEvidence | None, precision: str) -> tuple[float, str] | None:
    for f in (fam, cov):
        if f is not None and precision in f.best_mfu:
            return f.best_mfu[precision]
    return None
