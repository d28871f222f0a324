"""Coverage of the step-time intervals out of source (issue 28, item 6): does the 80 % interval hold 70-90 % of rows
of sources the calibration never saw?

For every source S of a chip family, the evidence is rebuilt without S (costmodel.evidence: coverage of the other
fitted rows, their best MFU, the leave-source-out residuals of the other sources) and each row of S gets the interval
of its leave-source-out prediction (costmodel.interval.step_time_interval). The prediction's MFU is the row's model
FLOPs over the predicted time; the host-transfer term uses the default efficiencies (rows with offload are few).
Fitted on benchmarks/holdout.py's SHIPPED_FILES with the shipped procedure (every row weight 1, priors on), every
file of data/runs predicted.
Usage: python benchmarks/interval_coverage.py [--out benchmarks/interval_coverage_report.txt]
"""

from __future__ import annotations

import argparse
import glob
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodel import calibrate, evidence, holdout  # noqa: E402
from costmodel.estimate import estimate  # noqa: E402
from costmodel.interval import LEVEL, step_time_interval  # noqa: E402
from costmodel.published import load_cases  # noqa: E402
from hardware.chip import Efficiency  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from holdout import SHIPPED_FILES as FIT_FILES  # noqa: E402  (one home: the shipped procedure's files)


def load(files: list[str]) -> list:
    return [replace(c, chip=replace(c.chip, eff=Efficiency())) for f in files for c in load_cases(f)[0]]


def evidence_without(source: str, fitted, cases, records, mfu, members, lenders) -> evidence.Evidence:
    """The shipped evidence as it would be had `source` never been measured."""
    keep = [r for r in records if r["source"] != source]
    fit_by: dict[str, list] = {}
    meas_by: dict[str, list] = {}
    for c in cases:
        if c.source == source:
            continue
        fam = calibrate.family(c.chip.name)
        meas_by.setdefault(fam, []).append(c)
        if id(c) in fitted:
            fit_by.setdefault(fam, []).append(c)
    doc = evidence.evidence_doc(fit_by, meas_by, holdout.summarize(keep), members, lenders,
                                mfu_of=lambda c: mfu.get(id(c)))
    return evidence.parse(doc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs = ROOT / "data" / "runs"
    fit_files = [str(runs / f) for f in FIT_FILES]
    other = sorted(f for f in glob.glob(str(runs / "*.csv")) if Path(f).name not in FIT_FILES
                   and Path(f).name != "published_runs_dev.csv")
    fitted_cases, rest = load(fit_files), load(other)
    cases = fitted_cases + rest
    fitted = {id(c) for c in fitted_cases if c.chip.name not in calibrate.LENDER}
    pool = {c.source for c in fitted_cases}
    records = holdout.leave_source_out(cases, calibrate.Procedure("rows", priors=True), pool=pool)
    base = {}
    mfu = {}
    for c in cases:
        try:
            c0 = estimate(c.model, c.chip, c.job, c.plan)
        except Exception:  # noqa: BLE001 - a row the model cannot cost has no record either
            continue
        base[(c.source, c.id, c.chip.name)] = (c, c0)
        mfu[id(c)] = c0.mfu * c0.step_time_s / c.measured_step_time_s
    members, lenders = evidence.family_map(cases)
    ev_by_source = {s: evidence_without(s, fitted, cases, records, mfu, members, lenders)
                    for s in sorted({r["source"] for r in records})}
    rows = []
    for r in records:
        c, c0 = base[(r["source"], r["id"], r["chip"])]
        k = c0.mfu * c0.step_time_s
        cost = replace(c0, step_time_s=r["predicted_s"], mfu=k / r["predicted_s"])
        iv = step_time_interval(cost, c.chip, c.job, c.plan, ev_by_source[r["source"]])
        inside = iv.low_s <= r["measured_s"] <= iv.high_s
        rows.append({**r, "low": iv.low_s, "high": iv.high_s, "inside": inside,
                     "above": r["measured_s"] > iv.high_s, "extrapolated": bool(iv.extrapolations)})
    text = report(rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


def _cov(rs: list[dict]) -> tuple[float, float, float, float]:
    """(coverage over rows, coverage sources equal, share measured slower than the slow end, median high/low)."""
    by: dict[str, list[dict]] = {}
    for r in rs:
        by.setdefault(r["source"], []).append(r)
    rows = float(np.mean([r["inside"] for r in rs]))
    src = float(np.mean([np.mean([r["inside"] for r in v]) for v in by.values()]))
    above = float(np.mean([r["above"] for r in rs]))
    width = float(np.median([r["high"] / r["low"] for r in rs]))
    return rows * 100, src * 100, above * 100, width


def report(rows: list[dict]) -> str:
    out = [f"# Coverage of the {LEVEL:.0%} step-time intervals out of source (benchmarks/interval_coverage.py)",
           f"# fitted on {' + '.join(FIT_FILES)}; every row predicted leave-source-out; evidence rebuilt without",
           "# the row's source. Target: 70-90 % of rows inside.",
           "",
           f"{'family':<10} {'rows':>5} {'src':>4} {'inside %':>9} {'src-equal %':>12} {'slower %':>9} "
           f"{'high/low':>9} {'extrap. %':>10}"]
    fams = sorted({r["family"] for r in rows})
    for name in fams + ["overall"]:
        rs = [r for r in rows if name == "overall" or r["family"] == name]
        a, b, c, w = _cov(rs)
        ext = float(np.mean([r["extrapolated"] for r in rs])) * 100
        out.append(f"{name:<10} {len(rs):>5} {len({r['source'] for r in rs}):>4} {a:>9.1f} {b:>12.1f} {c:>9.1f} "
                   f"{w:>9.2f} {ext:>10.1f}")
    out += ["", "# per source", f"{'family':<10} {'source':<26} {'rows':>5} {'inside %':>9} {'slower %':>9} "
                                f"{'median log resid':>17}"]
    for name in fams:
        for s in sorted({r["source"] for r in rows if r["family"] == name}):
            rs = [r for r in rows if r["family"] == name and r["source"] == s]
            a, _, c, _ = _cov(rs)
            med = float(np.median([math.log(r["predicted_s"] / r["measured_s"]) for r in rs]))
            out.append(f"{name:<10} {s:<26} {len(rs):>5} {a:>9.1f} {c:>9.1f} {med:>+17.3f}")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
