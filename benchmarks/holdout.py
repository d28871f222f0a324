"""Out-of-sample accuracy: refit the efficiency parameters without the rows being predicted.

Two splits over the published runs (default data/runs/runs_dev.csv):
  k-fold:            5 folds within each chip group (rows of a fold predicted by a fit on the other four);
  leave-source-out:  every row of one source predicted by a fit on the other sources of its chip group (only
                     where a chip group has more than one source).
Prints MAPE per chip group for both; the in-sample figures are in published_runs_report.txt.
Usage: python benchmarks/holdout.py [--file F ...]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodel.calibrate import CALIBRATION_GROUPS, _fit_group  # noqa: E402
from costmodel.estimate import estimate  # noqa: E402
from costmodel.published import load_cases  # noqa: E402


def predict(effs, cases):
    """Percent errors of `cases` under the fitted {chip: efficiency} (a chip missing from the training folds
    takes its group's first fit)."""
    out = []
    for c in cases:
        chip = replace(c.chip, eff=effs.get(c.chip.name, next(iter(effs.values()))))
        t = estimate(c.model, chip, c.job, c.plan).step_time_s
        out.append(abs(t - c.measured_step_time_s) / c.measured_step_time_s * 100)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", action="append", default=None)
    files = ap.parse_args().file or [str(ROOT / "data" / "runs" / "runs_dev.csv")]
    cases = [c for f in files for c in load_cases(f)[0]]
    groups: dict[str, list] = {}
    for c in cases:
        groups.setdefault(CALIBRATION_GROUPS.get(c.chip.name, c.chip.name), []).append(c)
    rng = np.random.default_rng(0)
    print(f"{'chip group':12s} {'rows':>5s} {'5-fold MAPE %':>14s} {'worst %':>8s}   leave-source-out")
    all_err = []
    for g, cs in sorted(groups.items()):
        folds = rng.permutation(len(cs)) % 5
        errs = []
        for k in range(5):
            train = [c for c, f in zip(cs, folds, strict=True) if f != k]
            test = [c for c, f in zip(cs, folds, strict=True) if f == k]
            if not test or len(train) < 3:
                continue
            eff, _ = _fit_group(train)
            errs += predict(eff, test)
        all_err += errs
        lso = []
        sources = sorted({c.source for c in cs})
        if len(sources) > 1:
            for s in sources:
                train = [c for c in cs if c.source != s]
                test = [c for c in cs if c.source == s]
                eff, _ = _fit_group(train)
                e = predict(eff, test)
                lso.append(f"{s}: {np.mean(e):.1f}% (worst {max(e):.0f}%)")
        print(f"{g:12s} {len(cs):5d} {np.mean(errs):14.1f} {max(errs):8.1f}   {'; '.join(lso) or '-'}")
    print(f"{'all':12s} {len(all_err):5d} {np.mean(all_err):14.1f} {max(all_err):8.1f}")


if __name__ == "__main__":
    main()
