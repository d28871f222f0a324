"""`export(planfile, fmt) -> str`: a plan file as a MaxText config, Megatron-LM arguments, or plan-file JSON.

When the framework cannot express the plan exactly, the text is for the nearest plan it can run, and the warnings
say what changed together with the predicted cost of both plans (printed to stderr by `export`, returned by
`export_result`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from costmodel.constraints import check_plan
from costmodel.cost import Cost
from costmodel.estimate import estimate
from hardware.errors import InputError, unknown
from hardware.fileio import check_output_path, write_text
from planner.adapt import Adapted, cost_comparison
from planner.export_maxtext import maxtext_text
from planner.export_megatron import megatron_text
from planner.planfile import PlanFile, planfile_text

FORMATS = ("maxtext", "megatron", "json")


@dataclass(frozen=True)
class Exported:
    text: str
    adapted: Adapted  # the plan and job the text describes
    warnings: tuple[str, ...]  # one line each; empty when the plan was expressed exactly
    cost: Cost | None = None  # the predicted cost of the exported plan (None: it cannot be costed)


class ExportDoesNotFit(Exception):
    """The exported plan is predicted not to fit in memory: nothing is written unless forced (exit 1)."""


def export_result(pf: PlanFile, fmt: str) -> Exported:
    if fmt not in FORMATS:
        raise unknown("export format", fmt, FORMATS)
    check_plan(pf.model, pf.hardware, pf.job, pf.plan, pf.chips)
    if fmt == "json":
        cost = estimate(pf.model, pf.hardware, pf.job, pf.plan, pf.chips)
        return Exported(planfile_text(pf, "json", cost), Adapted(pf.plan, pf.job), (), cost)
    text, ad = (maxtext_text if fmt == "maxtext" else megatron_text)(pf)
    warnings = [f"{fmt} export: {n}" for n in ad.notes]
    if ad.plan != pf.plan or ad.job != pf.job:
        changed = _changed(pf, ad)
        if changed:
            warnings.append(f"{fmt} export: {cost_comparison(pf, ad)}")
    return Exported(text, ad, tuple(warnings), _cost_or_none(pf, ad))


def _cost_or_none(pf: PlanFile, ad: Adapted) -> Cost | None:
    try:
        return estimate(pf.model, pf.hardware, ad.job, ad.plan, pf.chips)
    except InputError:
        return None


def does_not_fit(res: Exported) -> str:
    """'' when the exported plan is predicted to fit (or cannot be costed), else why it does not."""
    c = res.cost
    if c is None or c.fits:
        return ""
    return (f"the exported plan is predicted not to fit: it needs {c.fit_memory_bytes / 2**30:.1f} GiB per chip "
            f"of {c.hbm_usable_bytes / 2**30:.1f} usable" + ("" if c.host_fits else ", and more host memory than "
                                                             "there is") + "; nothing written (--force writes it)")


def _changed(pf: PlanFile, ad: Adapted) -> bool:
    """True when the exported plan can cost differently (not only a renamed remat policy or an inert SP flag)."""
    a, b = pf.plan, ad.plan
    if a.remat.choices() != b.remat.choices() or ad.job != pf.job:
        return True
    blank = dict(remat=b.remat)
    if a.tp == 1:
        blank["sequence_parallel"] = b.sequence_parallel
    return a.with_(**blank) != b


def _stderr(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr)


def export(pf: PlanFile, fmt: str, warn: Callable[[str], None] | None = _stderr) -> str:
    """The config text for `fmt` (maxtext | megatron | json); warnings go to `warn` (default: stderr)."""
    res = export_result(pf, fmt)
    if warn is not None:
        for w in res.warnings:
            warn(w)
    return res.text


def write_export(pf: PlanFile, fmt: str, out: str | None, warn: Callable[[str], None] | None = _stderr,
                 flag: str = "--out", force: bool = False) -> str:
    """Export and write to `out` (None: only return the text): the path is checked before the export is built, the
    file written atomically (hardware.fileio), so a failure leaves an existing file as it was. A plan predicted
    not to fit raises ExportDoesNotFit (nothing written) unless `force`. Returns the text."""
    if out is not None:
        check_output_path(out, flag)
    res = export_result(pf, fmt)
    for w in res.warnings if warn is not None else ():
        warn(w)
    if not force and (why := does_not_fit(res)):
        raise ExportDoesNotFit(why)
    text = res.text
    if out is not None:
        write_text(out, text, flag)
    return text
