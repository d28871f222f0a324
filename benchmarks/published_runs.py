"""Published-run benchmark: predicted vs measured step time for every usable row of runs_dev.csv.

Usage: python benchmarks/published_runs.py [--file data/runs/runs_dev.csv] [--write]
Prints a table per row and MAPE per source and hardware; --write saves benchmarks/published_runs_report.txt.
The efficiency parameters come from `planner calibrate --file <same csv>` (hardware/calibration/*.yaml), so
these figures are in-sample for the calibration; nothing is fitted per row.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodel.published import evaluate, load_cases, mape  # noqa: E402


def report(file: Path) -> str:
    cases, skipped = load_cases(file)
    rows = evaluate(cases)
    out = io.StringIO()
    ok = [r for r in rows if "error_pct" in r]
    out.write(f"# published runs: {file.name}: {len(ok)} estimated, {len(skipped)} skipped\n")
    out.write(f"{'id':48s} {'hardware':10s} {'pred s':>9s} {'meas s':>9s} {'err %':>7s} {'mem GiB':>8s} "
              f"{'fit GiB':>8s} fits\n")
    for r in ok:
        out.write(f"{r['id']:48s} {r['hardware']:10s} {r['predicted_step_time_s']:9.3f} "
                  f"{r['measured_step_time_s']:9.3f} {r['error_pct']:+7.1f} "
                  f"{r['predicted_peak_memory_bytes'] / 2**30:8.1f} {r['predicted_fit_memory_bytes'] / 2**30:8.1f} "
                  f"{r['fits']}\n")
    for k, v in skipped.items():
        out.write(f"{k:48s} skipped: {v}\n")
    out.write("\n# MAPE (%)\n")
    for k, v in mape(rows).items():
        out.write(f"{k:40s} {v:6.1f}\n")
    worst = max(ok, key=lambda r: abs(r["error_pct"]))
    out.write(f"{'worst row':40s} {worst['error_pct']:+6.1f}  ({worst['id']})\n")
    within = sum(abs(r["error_pct"]) <= 25 for r in ok)
    out.write(f"{'rows within 25%':40s} {within}/{len(ok)}\n")
    fits = sum(bool(r["fits"]) for r in ok)
    out.write(f"{'rows predicted to fit in memory':40s} {fits}/{len(ok)}\n")
    out.write("(mem GiB: the predicted peak, under MaxText XLA's memory_analysis() total; fit GiB: what the fit check\n"
              " reads, under MaxText the floor XLA compiles into, costmodel.memory.fit_floor_bytes)\n")
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", default=str(ROOT / "data" / "runs" / "runs_dev.csv"))
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    text = report(Path(args.file))
    print(text)
    if args.write:
        (ROOT / "benchmarks" / "published_runs_report.txt").write_text(text)


if __name__ == "__main__":
    main()
