"""What the shipped calibration has seen, per chip family: the evidence a step-time interval reads (issue 28).

Written beside the overlays by `planner calibrate --write-shipped` (hardware/calibration/evidence.yaml):
  coverage   of the fitted rows: chips, degrees, precisions, frameworks, remat policies, offload;
  best_mfu   per precision, the highest MFU measured on the family over every usable row of data/runs
             (model FLOPs as costmodel.flops counts them over the measured step time, so it compares with Cost.mfu);
  residuals  leave-source-out log(predicted/measured) percentiles, p10/p90 with sources weighted equally
             (costmodel.holdout), per family and pooled over every family.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from costmodel.estimate import estimate
from costmodel.published import Case
from hardware.catalog import CALIBRATION_DIR
from hardware.errors import InputError, shown_path

EVIDENCE_FILE = "evidence.yaml"
AXES = ("fsdp", "tp", "cp", "pp", "ep", "vpp")  # the degrees whose calibrated range an interval checks


@dataclass(frozen=True)
class Residuals:
    """10th and 90th percentiles of log(predicted / measured) out of source, and how many sources they come from."""

    p10: float
    p90: float
    sources: int


@dataclass(frozen=True)
class FamilyEvidence:
    name: str
    chips: tuple[str, ...]  # presets whose rows are this family's
    sources: tuple[str, ...]  # sources of the fitted rows
    max_chips: int
    max_degree: dict[str, int]  # axis -> largest degree among fitted rows
    precisions: tuple[str, ...]
    frameworks: tuple[str, ...]  # state conventions (Job.framework) of the fitted rows
    remat: tuple[str, ...]  # remat policy names of the fitted rows
    offload: bool  # whether any fitted row offloads to the host
    best_mfu: dict[str, tuple[float, str]]  # precision -> (MFU, 'row id (source)')
    residuals: Residuals | None
    borrows: str = ""  # the family whose fit predicts this one (no fitted rows of its own)


@dataclass(frozen=True)
class Evidence:
    families: dict[str, FamilyEvidence]
    pooled: Residuals | None  # every family's leave-source-out residuals together

    def family_of(self, chip_name: str) -> FamilyEvidence | None:
        return next((f for f in self.families.values() if chip_name in f.chips), None)


# ---- building it from runs ------------------------------------------------------------------------------------

def coverage(cases: list[Case]) -> dict:
    """Ranges of the fitted rows of one family."""
    plans = [c.plan for c in cases]
    return {"sources": sorted({c.source for c in cases}), "rows": len(cases),
            "max_chips": max(p.chips for p in plans),
            "max_degree": {a: max(getattr(p, a) for p in plans) for a in AXES},
            "precisions": sorted({c.job.precision for c in cases}),
            "frameworks": sorted({c.job.framework for c in cases}),
            "remat": sorted({p.remat.name for p in plans}),
            "offload": any(p.offload_optimizer or p.offload_params or p.remat.count("offload") for p in plans)}


def measured_mfu(case: Case) -> float | None:
    """MFU of a measured run: the estimate's MFU scaled by predicted over measured step time (model FLOPs per step /
    (measured step x chips x peak), Cost.mfu's definition, whatever the efficiencies); None if it cannot be costed."""
    try:
        cost = estimate(case.model, case.chip, case.job, case.plan)
    except (InputError, ArithmeticError):
        return None
    return cost.mfu * cost.step_time_s / case.measured_step_time_s


def best_mfu(cases: list[Case], mfu_of=measured_mfu) -> dict[str, dict]:
    """{precision: {mfu, row}}: the highest measured MFU among `cases`."""
    out: dict[str, dict] = {}
    for c in cases:
        mfu = mfu_of(c)
        best = out.get(c.job.precision)
        if mfu is not None and (best is None or mfu > best["mfu"]):
            out[c.job.precision] = {"mfu": round(mfu, 4), "row": f"{c.id} ({c.source})"}
    return dict(sorted(out.items()))


def residual_doc(stats: dict) -> dict:
    return {"log_residual_p10": round(stats["log_residual_p10"], 4),
            "log_residual_p90": round(stats["log_residual_p90"], 4), "sources": len(stats["sources"])}


def evidence_doc(fitted: dict[str, list[Case]], measured: dict[str, list[Case]], summary: dict,
                 members: dict[str, list[str]], lenders: dict[str, str] | None = None, mfu_of=measured_mfu) -> dict:
    """The evidence.yaml document: per family (members: its presets) the coverage of its fitted rows, the best MFU of
    its measured rows and its residual percentiles from `summary` (costmodel.holdout.summarize of leave-source-out
    records); the pooled percentiles from summary['overall']. lenders: family -> the family whose fit it borrows."""
    lenders = lenders or {}
    fams = {}
    for name in sorted(set(fitted) | set(measured)):
        doc = {"chips": sorted(members.get(name, [name]))}
        if name in lenders:
            doc["borrows"] = lenders[name]
        if fitted.get(name):
            doc.update(coverage(fitted[name]))
        doc["best_mfu"] = best_mfu(measured.get(name, []), mfu_of)
        if name in summary["families"]:
            doc["residuals"] = residual_doc(summary["families"][name])
        fams[name] = doc
    pooled = summary.get("overall") or {}
    return {"families": fams, **({"pooled": residual_doc(pooled)} if pooled.get("rows") else {})}


# ---- reading it -----------------------------------------------------------------------------------------------

def parse(doc: dict, where: str = EVIDENCE_FILE) -> Evidence:
    """An Evidence from its YAML document; a malformed one is an InputError naming the field."""
    fams = doc.get("families")
    if not isinstance(fams, dict):
        raise InputError(f"{where}: expected 'families' to map each chip family to its evidence")
    out = {}
    for name, f in fams.items():
        if not isinstance(f, dict):
            raise InputError(f"{where}: families.{name}: expected a mapping")
        try:
            out[str(name)] = FamilyEvidence(
                name=str(name), chips=tuple(f.get("chips", [name])), sources=tuple(f.get("sources", [])),
                max_chips=int(f.get("max_chips", 0)),
                max_degree={a: int(v) for a, v in (f.get("max_degree") or {}).items()},
                precisions=tuple(f.get("precisions", [])), frameworks=tuple(f.get("frameworks", [])),
                remat=tuple(f.get("remat", [])), offload=bool(f.get("offload", False)),
                best_mfu={p: (float(b["mfu"]), str(b["row"])) for p, b in (f.get("best_mfu") or {}).items()},
                residuals=_residuals(f.get("residuals")), borrows=str(f.get("borrows", "")))
        except (TypeError, ValueError, KeyError) as e:
            raise InputError(f"{where}: families.{name}: malformed ({type(e).__name__}: {e})") from None
    return Evidence(out, _residuals(doc.get("pooled")))


def _residuals(d: dict | None) -> Residuals | None:
    if not d:
        return None
    return Residuals(float(d["log_residual_p10"]), float(d["log_residual_p90"]), int(d.get("sources", 0)))


@cache
def shipped(directory: Path = CALIBRATION_DIR) -> Evidence:
    """The shipped evidence (hardware/calibration/evidence.yaml); an empty Evidence when there is none."""
    from hardware.yamlio import read_yaml

    path = Path(directory) / EVIDENCE_FILE
    if not path.is_file():
        return Evidence({}, None)
    return parse(read_yaml(path), shown_path(path))


def build(fit_files: list[str], eval_files: list[str] = (), fit=None) -> dict:
    """evidence_doc for a calibration fitted on `fit_files` and evaluated on `eval_files` too: the residuals are the
    leave-source-out records of the shipped procedure (`fit`, default costmodel.calibrate.fit_rows_unweighted; only
    rows of fitted sources enter a fit), the best MFU comes from every row of both."""
    from dataclasses import replace

    from costmodel import calibrate, holdout
    from costmodel.published import load_cases
    from hardware.chip import Efficiency

    def load(files) -> list[Case]:
        return [replace(c, chip=replace(c.chip, eff=Efficiency())) for f in files for c in load_cases(f)[0]]

    fitted_cases, other = load(fit_files), load(eval_files)
    pool = {c.source for c in fitted_cases}
    records = holdout.leave_source_out(fitted_cases + other, fit or calibrate.fit_rows_unweighted, pool=pool)
    summary = holdout.summarize(records, pool=pool)
    fitted: dict[str, list[Case]] = {}
    measured: dict[str, list[Case]] = {}
    for i, c in enumerate(fitted_cases + other):
        fam = calibrate.family(c.chip.name)
        measured.setdefault(fam, []).append(c)
        if i < len(fitted_cases) and c.chip.name not in calibrate.LENDER:
            fitted.setdefault(fam, []).append(c)
    return evidence_doc(fitted, measured, summary, *family_map(fitted_cases + other))


def family_map(cases: list[Case]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """({family: its presets}, {borrowing family: lender family}) for the families of `cases`
    (costmodel.calibrate's groups and borrowers)."""
    from costmodel import calibrate

    members: dict[str, set[str]] = {}
    for c in cases:
        members.setdefault(calibrate.family(c.chip.name), set()).add(c.chip.name)
    for chip, fam in calibrate.CALIBRATION_GROUPS.items():
        members.setdefault(fam, set()).add(chip)
    lenders = {calibrate.family(b): calibrate.family(lender) for b, lender in calibrate.LENDER.items()}
    return {k: sorted(v) for k, v in members.items()}, lenders


def write(doc: dict, directory: Path = CALIBRATION_DIR, source: str = "") -> Path:
    """evidence.yaml into `directory` (atomically; hardware.fileio.write_text)."""
    import yaml

    from hardware.fileio import write_text

    path = Path(directory) / EVIDENCE_FILE
    header = ("# Written by `planner calibrate --write-shipped`; do not edit by hand. What the calibration has seen "
              "per chip family\n# (costmodel.evidence), read by the step-time interval (costmodel.interval)."
              + (f" Fitted on {source}." if source else "") + "\n")
    write_text(path, header + yaml.safe_dump(doc, sort_keys=False), "--write-shipped")
    shipped.cache_clear()
    return path
