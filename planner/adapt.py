"""What a training framework can express: the nearest plan it can run, and notes on what changed.

Each exporter first maps the plan file's plan onto the framework (`Adapted`); changes that alter the cost come
with a note (printed as a warning together with both predicted costs), changes that cannot alter it (a flag
that has no effect, a policy renamed to the framework's name for the same choices) are silent.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.estimate import estimate
from costmodel.job import Job
from costmodel.plan import REMAT_POLICIES, TENSORS, Plan, Remat
from hardware.errors import InputError

GIB = 2**30


@dataclass(frozen=True)
class Adapted:
    """The plan and job a framework config will run, and why they differ from the plan file's (if they do)."""

    plan: Plan
    job: Job
    notes: tuple[str, ...] = ()


def named_policy(remat: Remat, names: tuple[str, ...]) -> Remat | None:
    """The first policy in `names` with exactly `remat`'s per-tensor choices, or None."""
    for n in names:
        if REMAT_POLICIES[n].choices() == remat.choices():
            return REMAT_POLICIES[n]
    return None


def in_hbm(remat: Remat) -> frozenset[str]:
    """Tensors (other than the layer input) that stay in HBM between forward and backward."""
    return frozenset(t for t in TENSORS if t != "layer_input" and getattr(remat, t) == "device")


def nearest_policy(remat: Remat, names: tuple[str, ...]) -> Remat:
    """The policy in `names` whose set of HBM-resident tensors differs from `remat`'s in the fewest tensors.

    Offloaded tensors count as not resident (they leave HBM like rematerialised ones), so the nearest policy
    does not need more HBM than the original. Ties go to the policy listed first (list most recompute first)."""
    have = in_hbm(remat)
    return min((REMAT_POLICIES[n] for n in names), key=lambda r: len(in_hbm(r) ^ have))


def describe_cost(job: Job, plan: Plan, pf) -> str:
    try:
        c = estimate(pf.model, pf.hardware, job, plan, pf.chips)
    except InputError as e:
        return f"cannot be costed ({e})"
    fit = "" if c.fits else ", does not fit"
    need = f" (needs {c.fit_memory_bytes / GIB:.1f})" if c.fit_below_total else ""
    return f"{c.step_time_s:.3f} s/step, MFU {100 * c.mfu:.1f} %, {c.peak_memory_bytes / GIB:.1f} GiB/chip{need}{fit}"


def cost_comparison(pf, adapted: Adapted) -> str:
    """One line with the predicted cost of the plan file's plan and of the exported one."""
    return (f"predicted: plan file {describe_cost(pf.job, pf.plan, pf)}; "
            f"exported {describe_cost(adapted.job, adapted.plan, pf)}")
