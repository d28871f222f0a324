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
from costmodel.estimate import estimate
from hardware.errors import unknown
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


def export_result(pf: PlanFile, fmt: str) -> Exported:
    if fmt not in FORMATS:
        raise unknown("export format", fmt, FORMATS)
    check_plan(pf.model, pf.hardware, pf.job, pf.plan, pf.chips)
    if fmt == "json":
        cost = estimate(pf.model, pf.hardware, pf.job, pf.plan, pf.chips)
        return Exported(planfile_text(pf, "json", cost), Adapted(pf.plan, pf.job), ())
    text, ad = (maxtext_text if fmt == "maxtext" else megatron_text)(pf)
    warnings = [f"{fmt} export: {n}" for n in ad.notes]
    if ad.plan != pf.plan or ad.job != pf.job:
        changed = _changed(pf, ad)
        if changed:
            warnings.append(f"{fmt} export: {cost_comparison(pf, ad)}")
    return Exported(text, ad, tuple(warnings))


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
                 flag: str = "--out") -> str:
    """Export and write to `out`: the path is checked before the export is built, and the file written atomically
    (hardware.fileio), so a failure leaves an existing file as it was. Returns the text."""
    if out is not None:
        check_output_path(out, flag)
    text = export(pf, fmt, warn)
    if out is not None:
        write_text(out, text, flag)
    return text
