"""Out-of-sample accuracy of the step-time model: refit the efficiency parameters without the rows being predicted.

Counts, per chip family, the error of every row of every runs CSV in data/runs/ predicted by fits that never saw
it: in-sample, leave-source-out, leave-framework-out, leave-scale-out (costmodel.holdout). The fit is
costmodel.calibrate.fit_sources; --priors on penalizes it towards hardware/priors.yaml; --compare adds the
shipped overlays' procedure (every row weight 1, fitted on SHIPPED_FILES: runs_dev.csv and the XLA sources).
Usage: python benchmarks/holdout.py [--file F ...] [--priors off|on|both] [--compare] [--write]
--write saves benchmarks/holdout_report.txt (with --compare, --priors both). About 3 minutes on one core per
setting of --priors, 1.5 more per setting with --compare.
(details: docs/accuracy.md, 'Held-out splits: benchmarks/holdout.py')
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodel import calibrate, holdout  # noqa: E402
from costmodel.published import load_cases  # noqa: E402
from hardware.errors import InputError  # noqa: E402

RUNS = ROOT / "data" / "runs"
SHIPPED_FILES = ("runs_dev.csv", "maxtext2023-v5p.csv", "axlearn.csv", "marin-speedrun.csv")  # the shipped fit's
SHIPPED_PRIORS = True  # the shipped overlays are fitted with priors (their 'priors' key; docs/priors.md)
LABELS = {"in_sample": "in-sample", "leave_source_out": "leave-source-out",
          "leave_framework_out": "leave-framework-out", "leave_scale_out": "leave-scale-out"}


def runs_files(folder: Path = RUNS) -> tuple[list[Path], dict[str, str]]:
    """The runs CSVs of `folder` (sorted), and {file: why not} for the CSVs that lack the runs schema."""
    files, other = [], {}
    for p in sorted(folder.glob("*.csv")):
        try:
            load_cases(p)
        except InputError as e:
            other[p.name] = str(e).replace(f"--file {p}: ", "")
            continue
        files.append(p)
    return files, other


def _cell(recs: list[dict]) -> str:
    if not recs:
        return "-"
    s = holdout.summarize(recs)["overall"]
    return f"{s['mape_pct']:5.1f} ({s['source_mape_pct']:5.1f})"


def family_table(splits: dict[str, list[dict]], cases) -> str:
    out = io.StringIO()
    by = {k: defaultdict(list) for k in splits}
    for k, recs in splits.items():
        for r in recs:
            by[k][r["family"]].append(r)
    families = sorted({r["family"] for recs in splits.values() for r in recs})
    fams = holdout._families(cases)
    cols = [k for k in holdout.SPLITS if k in splits]
    out.write(f"{'family':10s} {'rows':>5s} {'src':>3s} " + " ".join(f"{LABELS[k]:>20s}" for k in cols) + "   N\n")
    for f in families:
        rows = by["in_sample"][f] if "in_sample" in by else next(v[f] for v in by.values())
        n = holdout.scale_threshold(fams[calibrate.fit_family(next(iter(rows))["chip"])]) if rows else 0
        out.write(f"{f:10s} {len(rows):5d} {len({r['source'] for r in rows}):3d} "
                  + " ".join(f"{_cell(by[k][f]):>20s}" for k in cols) + f"   {n}\n")
    all_rows = splits.get("in_sample") or next(iter(splits.values()))
    out.write(f"{'overall':10s} {len(all_rows):5d} {len({r['source'] for r in all_rows}):3d} "
              + " ".join(f"{_cell(splits[k]):>20s}" for k in cols) + "\n")
    return out.getvalue()


def source_table(recs: list[dict]) -> str:
    out = io.StringIO()
    by = defaultdict(list)
    for r in recs:
        by[(r["family"], r["source"])].append(r)
    out.write(f"{'family':10s} {'source':26s} {'rows':>5s} {'MAPE %':>7s} {'median err %':>13s}  predicted by\n")
    for (f, s), rs in sorted(by.items()):
        e = [r["error_pct"] for r in rs]
        out.write(f"{f:10s} {s:26s} {len(rs):5d} {np.mean(np.abs(e)):7.1f} {np.median(e):+13.1f}  "
                  f"{rs[0]['predicted_by']}\n")
    return out.getvalue()


def percentile_table(recs: list[dict]) -> str:
    out = io.StringIO()
    s = holdout.summarize(recs)
    out.write(f"{'family':10s} {'p10':>7s} {'p90':>7s}   (log(predicted/measured); x{'':s} = exp)\n")
    for f, v in [*s["families"].items(), ("overall", s["overall"])]:
        out.write(f"{f:10s} {v['log_residual_p10']:+7.3f} {v['log_residual_p90']:+7.3f}   "
                  f"x{np.exp(v['log_residual_p10']):.2f} .. x{np.exp(v['log_residual_p90']):.2f}\n")
    return out.getvalue()


def report(files: list[Path], compare: bool, skipped_files: dict[str, str], settings: tuple[bool, ...]) -> str:
    start = time.perf_counter()
    loaded = [(p, *load_cases(p)) for p in files]
    cases = [c for _, cs, _ in loaded for c in cs]
    out = io.StringIO()
    out.write("# Out-of-sample accuracy of the step-time model (benchmarks/holdout.py, costmodel.holdout)\n")
    for p, cs, sk in loaded:
        out.write(f"#   {p.name}: {len(cs)} usable rows, {len(sk)} skipped\n")
    for name, why in skipped_files.items():
        out.write(f"#   {name}: not a runs file ({why})\n")
    out.write(f"# fit: {calibrate.WEIGHTINGS['sources']}\n")
    out.write("# cells: MAPE % over rows (in brackets: every source weighing the same); rows the model cannot\n"
              "# estimate (a plan it cannot split) are left out; N: the leave-scale-out threshold (median chips)\n")
    for priors in settings:
        out.write(f"\n# ===== every file fitted, priors {_on(priors)} =====\n")
        splits = holdout.all_splits(cases, calibrate.Procedure("sources", priors))
        out.write(family_table(splits, cases))
        out.write("\n# leave-source-out per source (median err < 0: predicted too fast)\n")
        out.write(source_table(splits["leave_source_out"]))
        out.write("\n# leave-source-out: 10th / 90th percentiles of the log residuals, sources weighted equally\n")
        out.write(percentile_table(splits["leave_source_out"]))
    if compare:
        out.write(compare_shipped(loaded, cases))
    out.write(f"\n# {time.perf_counter() - start:.0f} s\n")
    return out.getvalue()


def _change(a: float, b: float) -> str:
    return f"{a:6.1f} -> {b:6.1f} ({b - a:+5.1f})"


def _on(priors: bool) -> str:
    return "on" if priors else "off"


def compare_shipped(loaded: list, cases: list) -> str:
    """Leave-source-out of the shipped procedure (every row weight 1, SHIPPED_FILES fitted, every row predicted),
    priors off and on, with the change per family (sources weighing the same)."""
    out = io.StringIO()
    pool = {c.source for p, cs, _ in loaded if p.name in SHIPPED_FILES for c in cs}
    out.write(f"\n# --compare: leave-source-out of the shipped overlays' procedure (every row weight 1) fitted on "
              f"{' + '.join(SHIPPED_FILES)}\n# only; every row of every file predicted (rows of other sources by "
              "the fit on all of those files). The calibration\n# fitted on every file above has the worse "
              "out-of-source figure (sources weighing the same), so the shipped\n# overlays stay fitted on these "
              f"files; they ship with priors {_on(SHIPPED_PRIORS)}: those are the figures of "
              "hardware/calibration/accuracy.yaml.\n")
    summaries = {}
    for priors in (False, True):
        recs = holdout.leave_source_out(cases, calibrate.Procedure("rows", priors), pool=pool)
        summaries[priors] = holdout.summarize(recs)
        out.write(f"\n# priors {_on(priors)}"
                  + (f" ({calibrate.PRIORS_NOTE}; RESIDUAL_SD {calibrate.RESIDUAL_SD:g})" if priors else "") + "\n")
        out.write(family_table({"leave_source_out": recs}, cases))
        out.write(source_table(recs))
        out.write(percentile_table(recs))
    out.write("\n# priors on vs off, leave-source-out of the shipped procedure: MAPE % with sources weighing the same "
              "(over rows)\n")
    off, on = summaries[False], summaries[True]
    for name in [*off["families"], "overall"]:
        a, b = (off["overall"], on["overall"]) if name == "overall" else (off["families"][name], on["families"][name])
        out.write(f"{name:10s} {_change(a['source_mape_pct'], b['source_mape_pct'])}   rows "
                  f"{_change(a['mape_pct'], b['mape_pct'])}\n")
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", action="append", default=None, help="runs CSV (repeat); default: data/runs/*.csv")
    ap.add_argument("--compare", action="store_true", help="also the shipped procedure (SHIPPED_FILES, "
                    "every row weight 1), priors off and on")
    ap.add_argument("--priors", choices=("off", "on", "both"), default=None,
                    help="fits penalized towards hardware/priors.yaml (default off; both with --write)")
    ap.add_argument("--write", action="store_true", help="save benchmarks/holdout_report.txt")
    args = ap.parse_args()
    files, other = ([Path(f) for f in args.file], {}) if args.file else runs_files()
    priors = args.priors or ("both" if args.write else "off")
    settings = {"off": (False,), "on": (True,), "both": (False, True)}[priors]
    text = report(files, args.compare or args.write, other, settings)
    print(text)
    if args.write:
        (ROOT / "benchmarks" / "holdout_report.txt").write_text(text)


if __name__ == "__main__":
    main()
