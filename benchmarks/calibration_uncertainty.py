"""Uncertainty of the fitted efficiency parameters: a bootstrap over sources (issue 28, item 2).

For each calibration group of the chosen files (costmodel.calibrate: a100-40gb + a100-80gb fit together, borrowers'
rows are never fitted), DRAWS resamples of its sources with replacement (numpy default_rng(SEED)) are refitted with
the calibration procedure (costmodel.calibrate.fit_procedure; a source drawn m times weighs m times). Reported per
chip family and parameter: the fit on all sources, the bootstrap median and 10-90 % range, the prior of
hardware/priors.yaml and the fit's z against it, and flags: on a bound (with the share of draws on it, and why), or
seen by no row (the fit leaves it where it starts). A family with k sources has only C(2k-1, k) distinct resamples
(fits are reused); with one source every draw is the same: its range is zero by construction, not a certainty.
--files shipped: the shipped procedure's files (holdout.SHIPPED_FILES) with every row weight 1; all: every
runs CSV of data/runs with sources weighted equally (more sources per family, not what ships).
Usage: python benchmarks/calibration_uncertainty.py [--files shipped|all] [--priors on|off|both] [--draws N] [--write]
--write saves benchmarks/calibration_uncertainty_report.txt (without --files: shipped, priors off and on, then all
with priors on). About 10 minutes on one core for shipped with both settings of the priors.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from costmodel import calibrate  # noqa: E402
from costmodel.published import Case, load_cases  # noqa: E402
from hardware.chip import Efficiency  # noqa: E402

DRAWS = 200
SEED = 2028  # fixed: the same draws on every run (issue 28)
REPORT = ROOT / "benchmarks" / "calibration_uncertainty_report.txt"


def load(which: str) -> tuple[list[Case], str, str]:
    """(cases with default efficiencies, the files' names, the weighting) of --files shipped | all."""
    import holdout as bench  # benchmarks/holdout.py: the runs files and the shipped procedure's files

    files = [bench.RUNS / f for f in bench.SHIPPED_FILES] if which == "shipped" else bench.runs_files()[0]
    cases = [replace(c, chip=replace(c.chip, eff=Efficiency())) for f in files for c in load_cases(f)[0]]
    return cases, " + ".join(f.name for f in files), "rows" if which == "shipped" else "sources"


def draws(sources: list[str], n: int, seed: int) -> list[dict[str, int]]:
    """n resamples of `sources` with replacement, each {source: times drawn}."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        picked = rng.integers(0, len(sources), len(sources))
        out.append({s: int(np.sum(picked == i)) for i, s in enumerate(sources) if np.any(picked == i)})
    return out


def values(effs: dict[str, Efficiency], members: tuple[str, ...]) -> dict[str, float]:
    """{parameter label: value}: shared parameters once, PER_MEMBER ones per chip ('net[a100-40gb]'); NaN for a
    member without a row in the resample."""
    first = next(m for m in members if m in effs)
    out = {}
    for name in calibrate.BOUNDS:
        if name in calibrate.PER_MEMBER and len(members) > 1:
            out.update({f"{name}[{m}]": getattr(effs[m], name) if m in effs else np.nan for m in members})
        else:
            out[name] = getattr(effs[first], name)
    return out


def seen(effs: dict[str, Efficiency], rows: list[Case]) -> dict[str, bool]:
    """Whether any row's predicted time moves when a parameter moves by 1 % of its range (finite difference)."""
    def times(e: dict[str, Efficiency]) -> np.ndarray:
        return np.exp(np.asarray([calibrate.residuals(replace(c.chip, eff=e[c.chip.name]), [c])[0] for c in rows]))

    base = times(effs)
    out = {}
    for name, (lo, hi, _) in calibrate.BOUNDS.items():
        step = 0.01 * (hi - lo)
        moved = {m: replace(e, **{name: getattr(e, name) + (step if getattr(e, name) + step <= hi else -step)})
                 for m, e in effs.items()}
        out[name] = bool(np.max(np.abs(times(moved) / base - 1)) > 1e-6)
    return out


def on_bound(name: str, v: float) -> str:
    """'lower' / 'upper' when v sits within 0.1 % of the range from a bound of BOUNDS, else ''."""
    lo, hi, _ = calibrate.BOUNDS[name.split("[")[0]]
    tol = 1e-3 * (hi - lo)
    return "lower" if v <= lo + tol else "upper" if v >= hi - tol else ""


def pushed(effs: dict[str, Efficiency], rows: list[Case], weights: np.ndarray | None, label: str, side: str) -> bool:
    """Whether the rows' weighted squared log residuals grow when the parameter (`label`: 'net[a100-80gb]' moves
    one member's) moves off its `side` bound by 1 % of its range: the data, not the pull, hold it there."""
    name, _, member = label.rstrip("]").partition("[")
    lo, hi, _ = calibrate.BOUNDS[name]
    step = 0.01 * (hi - lo) * (1 if side == "lower" else -1)
    moved = {m: replace(e, **{name: getattr(e, name) + step}) if m == member or not member else e
             for m, e in effs.items()}
    w = np.ones(len(rows)) if weights is None else weights

    def cost(e: dict[str, Efficiency]) -> float:
        r = [calibrate.residuals(replace(c.chip, eff=e[c.chip.name]), [c])[0] for c in rows]
        return float(np.sum(w * np.square(r)))
    return cost(moved) > cost(effs)


def reason(name: str, side: str, sees: bool, push: bool, prior: tuple[float, float] | None, priors: bool) -> str:
    """Why a parameter sits on a bound, from what the fit knows: no row sees it, the rows push it there, or the pull
    towards where the fit starts keeps it there; and where its prior puts the bound."""
    lo, hi, _ = calibrate.BOUNDS[name.split("[")[0]]
    bound = lo if side == "lower" else hi
    start = "its prior mean (clipped)" if priors and prior else "its default"
    z = f"{(bound - prior[0]) / prior[1]:+.1f}" if prior else ""
    where = f"; the prior {prior[0]:g} +- {prior[1]:g} puts the bound at z {z}" if prior else "; no prior"
    if not sees:
        return f"seen by no row: stays at {start}, which is the bound {bound:g}" + where
    if push:
        return f"the rows push it {'down' if side == 'lower' else 'up'} to the {side} bound {bound:g}" + where
    return f"the rows alone would move it off the bound; the pull towards {start} ({bound:g}) holds it" + where


def group_report(members: tuple[str, ...], cases: list[Case], weighting: str, priors: bool, n: int,
                 seed: int) -> str:
    """The table of one calibration group under one setting of the priors."""
    rows = calibrate.estimable(cases)[0]
    sources = sorted({c.source for c in rows})
    full = calibrate.fit_procedure(rows, weighting, priors)
    fitted = calibrate.fit_rows(rows) if weighting == "sources" else rows
    weights = calibrate.procedure_weights(fitted, weighting)
    memo: dict[tuple, dict[str, float]] = {}
    boots = []
    for d in draws(sources, n, seed):
        key = tuple(sorted(d.items()))
        if key not in memo:
            memo[key] = values(calibrate.fit_procedure(rows, weighting, priors, copies=d), members)
        boots.append(memo[key])
    fam = calibrate.family(members[0])
    pri = calibrate.priors_of(members[0])
    sees = seen(full, rows)
    out = io.StringIO()
    out.write(f"\n## {fam} ({', '.join(members)}): {len(rows)} rows, {len(sources)} source(s) "
              f"({', '.join(sources)}); {len(memo)} distinct resample(s) of {n} draws\n")
    out.write(f"{'parameter':22s} {'fit':>9s} {'median':>9s} {'p10':>9s} {'p90':>9s} {'prior':>15s} {'z':>5s}  flag\n")
    flags = []
    for label, v in values(full, members).items():
        base = label.split("[")[0]
        b = np.array([x[label] for x in boots], dtype=float)
        p = pri.get(base)
        z = f"{(v - p[0]) / p[1]:+5.1f}" if p else ""
        side = on_bound(label, v)
        b = b[~np.isnan(b)]  # a resample without the member's rows says nothing of its own parameter
        share = np.mean([on_bound(label, x) == side for x in b]) if side else 0.0
        flag = (f"ON {side.upper()} BOUND ({share:.0%} of draws)" if side else "") + ("" if sees[base] else
                                                                                     " unseen by rows")
        prior = f"{p[0]:g} +- {p[1]:g}" if p else "-"
        out.write(f"{label:22s} {v:9.4g} {np.median(b):9.4g} {np.percentile(b, 10):9.4g} {np.percentile(b, 90):9.4g} "
                  f"{prior:>15s} {z:>5s}  {flag.strip()}\n")
        if side:
            push = sees[base] and pushed(full, fitted, weights, label, side)
            flags.append(f"  {fam} {label} = {v:.4g}: {reason(label, side, sees[base], push, p, priors)}")
    if len(sources) == 1:
        out.write("  (one source: every draw is that source, so the range is zero by construction)\n")
    return out.getvalue() + ("".join(f"{f}\n" for f in flags) if flags else "")


def report(settings: list[tuple[str, bool]], n: int, seed: int) -> str:
    """The report over `settings`, each (files: 'shipped' | 'all', priors)."""
    start = time.perf_counter()
    out = io.StringIO()
    out.write("# Bootstrap over sources of the fitted efficiency parameters (benchmarks/calibration_uncertainty.py)\n"
              f"# {n} draws of each family's sources with replacement, numpy default_rng({seed}); a source drawn m "
              "times weighs m times.\n# fit: on all of the family's sources; median, p10, p90: over the draws; prior: "
              "hardware/priors.yaml (mean +- sd),\n# z = (fit - mean) / sd. ON BOUND: within 0.1 % of the range of "
              "costmodel.calibrate.BOUNDS (share of draws there too);\n# unseen by rows: no row's time moves with it "
              "at the fitted value (it stays where the fit starts).\n")
    loaded = {}
    for which, priors in settings:
        if which not in loaded:
            loaded[which] = load(which)
        cases, names, weighting = loaded[which]
        on = f"on (RESIDUAL_SD {calibrate.RESIDUAL_SD:g})" if priors else "off"
        out.write(f"\n# ===== files: {names}; fit: {calibrate.WEIGHTINGS[weighting]}; priors {on} =====\n")
        for members, cs in calibrate._groups(cases).items():
            out.write(group_report(members, cs, weighting, priors, n, seed))
    out.write(f"\n# {time.perf_counter() - start:.0f} s\n")
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", choices=("shipped", "all"), default=None, help="default: shipped (with --write: "
                    "shipped with priors off and on, then all with priors on)")
    ap.add_argument("--priors", choices=("on", "off", "both"), default="both")
    ap.add_argument("--draws", type=int, default=DRAWS)
    ap.add_argument("--write", action="store_true", help=f"save {REPORT.relative_to(ROOT)}")
    args = ap.parse_args()
    if args.draws < 1:
        ap.error(f"--draws: expected a positive number of resamples, got {args.draws}")
    priors = {"on": [True], "off": [False], "both": [False, True]}[args.priors]
    settings = [(args.files or "shipped", p) for p in priors]
    if args.write and args.files is None:
        settings = [("shipped", False), ("shipped", True), ("all", True)]
    text = report(settings, args.draws, SEED)
    print(text)
    if args.write:
        REPORT.write_text(text)


if __name__ == "__main__":
    main()
