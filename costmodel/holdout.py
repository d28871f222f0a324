"""Out-of-sample accuracy of the calibration: step times predicted for rows their fit never saw (issue 28).

Pure functions, no printing. Every split returns one record (a dict) per predicted row:
  split, id, source, framework, family, chip, chips, predicted_s, measured_s, error_pct, log_residual, predicted_by
with log_residual = log(predicted / measured) and predicted_by what predicted the row ('fit', 'defaults', 'priors'
or 'lender ...'). Splits, each within a fit family (costmodel.calibrate.family with the chips that borrow its fit):
in_sample, leave_source_out (a family measured by one source: the defaults), leave_framework_out, leave_scale_out
(a fit on rows with chips <= the family's median chip count predicts the larger runs). Fits go through `fit`
(default costmodel.calibrate.fit_sources); `pool` names the sources whose rows may be fitted. Predictions use only
the fitted (or default) efficiencies, never the shipped overlays.
(details: docs/accuracy.md, 'Held-out splits: costmodel/holdout.py')
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from costmodel import calibrate
from costmodel.estimate import estimate
from costmodel.published import Case
from hardware.chip import Efficiency
from hardware.errors import InputError

FitFn = Callable[[list[Case]], dict[str, Efficiency]]
SPLITS = ("in_sample", "leave_source_out", "leave_framework_out", "leave_scale_out")


def _default_fit(cases: list[Case]) -> dict[str, Efficiency]:
    return calibrate.fit_sources(cases)  # looked up at call time, so that a test can spy on it


def _families(cases: list[Case]) -> dict[str, list[Case]]:
    """Cases by fit family, each chip reset to the default efficiencies (no shipped overlay reaches a prediction)."""
    out: dict[str, list[Case]] = {}
    for c in cases:
        out.setdefault(calibrate.fit_family(c.chip.name), []).append(
            replace(c, chip=replace(c.chip, eff=Efficiency())))
    return dict(sorted(out.items()))


def _fitted(cases: list[Case], pool: set[str] | None = None) -> list[Case]:
    """The rows a fit may use: not a borrower's, and from a source of `pool` when one is given."""
    return [c for c in cases if c.chip.name not in calibrate.LENDER and (pool is None or c.source in pool)]


def _fit_once(train: list[Case], fit: FitFn, memo: dict) -> dict[str, Efficiency]:
    if not train:
        return {}
    key = tuple(sorted((c.source, c.id, c.chip.name) for c in train))
    if key not in memo:
        memo[key] = fit(train)
    return memo[key]


def predict(cases: list[Case], effs: dict[str, Efficiency], split: str, fit: FitFn | None = None) -> list[dict]:
    """Records for `cases` under the fitted {chip: efficiency}. A chip without its own entry takes its lender's, else
    the fit's first; with no fit (empty `effs`), what `fit` starts from (its start(chip), e.g. the prior means of
    calibrate.Procedure(priors=True); its lender's for a borrower), else the defaults. A row the model cannot
    estimate gives no record."""
    first = next(iter(effs.values()), None)
    start, label = getattr(fit, "start", None), getattr(fit, "start_label", "defaults")
    out = []
    for c in cases:
        lender = calibrate.LENDER.get(c.chip.name)
        eff = effs.get(c.chip.name) or (effs.get(lender) if lender else None) or first
        chip = replace(c.chip, eff=eff or (start(lender or c.chip.name) if start else Efficiency()))
        try:
            t = estimate(c.model, chip, c.job, c.plan).step_time_s
        except (InputError, ArithmeticError):
            continue
        how = "fit" if eff is not None else label if start else "defaults"
        out.append({"split": split, "id": c.id, "source": c.source, "framework": c.framework,
                    "family": calibrate.family(c.chip.name), "chip": c.chip.name, "chips": c.plan.chips,
                    "predicted_s": t, "measured_s": c.measured_step_time_s,
                    "error_pct": (t - c.measured_step_time_s) / c.measured_step_time_s * 100,
                    "log_residual": math.log(t / c.measured_step_time_s),
                    "predicted_by": f"lender {how}" if lender else how})
    return out


def _leave_one_out(cases: list[Case], split: str, key: Callable[[Case], str], fit: FitFn | None,
                   memo: dict | None, pool: set[str] | None) -> list[dict]:
    fit = fit or _default_fit
    memo = {} if memo is None else memo
    out = []
    for cs in _families(cases).values():
        for value in sorted({key(c) for c in cs}):
            train = [c for c in _fitted(cs, pool) if key(c) != value]
            out += predict([c for c in cs if key(c) == value], _fit_once(train, fit, memo), split, fit)
    return out


def in_sample(cases: list[Case], fit: FitFn | None = None, memo: dict | None = None,
              pool: set[str] | None = None) -> list[dict]:
    """Every row predicted by the fit on all fitted rows of its family (the calibration itself)."""
    fit = fit or _default_fit
    memo = {} if memo is None else memo
    return [r for cs in _families(cases).values()
            for r in predict(cs, _fit_once(_fitted(cs, pool), fit, memo), "in_sample", fit)]


def leave_source_out(cases: list[Case], fit: FitFn | None = None, memo: dict | None = None,
                     pool: set[str] | None = None) -> list[dict]:
    """Every row of a source predicted by a fit on the other sources of its family (no row of that source in the
    fit); a family with one source: the defaults."""
    return _leave_one_out(cases, "leave_source_out", lambda c: c.source, fit, memo, pool)


def leave_framework_out(cases: list[Case], fit: FitFn | None = None, memo: dict | None = None,
                        pool: set[str] | None = None) -> list[dict]:
    """Every row of a framework predicted by a fit on the family's rows of the other frameworks."""
    return _leave_one_out(cases, "leave_framework_out", lambda c: c.framework, fit, memo, pool)


def scale_threshold(cases: list[Case], pool: set[str] | None = None) -> int:
    """N of leave_scale_out: the median chip count of the family's fitted rows (the lower middle of an even count)."""
    chips = [c.plan.chips for c in _fitted(cases, pool)] or [c.plan.chips for c in cases]
    return int(sorted(chips)[(len(chips) - 1) // 2]) if chips else 0


def leave_scale_out(cases: list[Case], fit: FitFn | None = None, memo: dict | None = None,
                    pool: set[str] | None = None) -> list[dict]:
    """Rows with more chips than the family's scale_threshold, predicted by a fit on its rows with at most that many
    (a family whose rows all sit at or below N gives no record)."""
    fit = fit or _default_fit
    memo = {} if memo is None else memo
    out = []
    for cs in _families(cases).values():
        n = scale_threshold(cs, pool)
        test = [c for c in cs if c.plan.chips > n]
        if test:
            out += predict(test, _fit_once([c for c in _fitted(cs, pool) if c.plan.chips <= n], fit, memo),
                           "leave_scale_out", fit)
    return out


def all_splits(cases: list[Case], fit: FitFn | None = None, pool: set[str] | None = None,
               splits: tuple[str, ...] = SPLITS) -> dict[str, list[dict]]:
    """The records of each of `splits`, {split: records}, sharing fits between splits. `pool`: only rows of these
    sources may be fitted (every row is still predicted; a row of another source is then out of source for every
    fit, as a reserved evaluation row would be)."""
    memo: dict = {}
    funcs = {"in_sample": in_sample, "leave_source_out": leave_source_out, "leave_framework_out": leave_framework_out,
             "leave_scale_out": leave_scale_out}
    return {s: funcs[s](cases, fit, memo, pool) for s in splits}


def weighted_quantile(values: list[float], weights: list[float], q: float) -> float:
    """The q-quantile of `values` with `weights` (linear between the weight midpoints)."""
    order = np.argsort(values)
    v, w = np.asarray(values, dtype=float)[order], np.asarray(weights, dtype=float)[order]
    mid = (np.cumsum(w) - w / 2) / w.sum()
    return float(np.interp(q, mid, v))


def _stats(records: list[dict]) -> dict:
    """Rows, sources, MAPE over rows, MAPE with every source weighing the same, and the 10th/90th percentiles of the
    log residuals with every source weighing the same."""
    by_source: dict[str, list[dict]] = {}
    for r in records:
        by_source.setdefault(r["source"], []).append(r)
    weights = [1 / (len(by_source) * len(by_source[r["source"]])) for r in records]
    logs = [r["log_residual"] for r in records]
    return {"rows": len(records), "sources": sorted(by_source),
            "mape_pct": float(np.mean([abs(r["error_pct"]) for r in records])),
            "source_mape_pct": float(np.mean([np.mean([abs(r["error_pct"]) for r in rs])
                                              for rs in by_source.values()])),
            "log_residual_p10": weighted_quantile(logs, weights, 0.1),
            "log_residual_p90": weighted_quantile(logs, weights, 0.9),
            "predicted_by": ", ".join(sorted({r["predicted_by"] for r in records}))}


def summarize(records: list[dict], key: str = "family", pool: set[str] | None = None) -> dict:
    """{'families': {value of `key`: stats}, 'overall': stats} over `records` (one split's), where stats holds rows,
    sources, calibration_sources (those whose rows of the family may enter its fit: not a borrower's, and in `pool`
    when given), mape_pct, source_mape_pct, log_residual_p10/p90 (sources weighted equally) and predicted_by."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r[key], []).append(r)
    fams = {}
    for name, rs in sorted(groups.items()):
        fams[name] = {**_stats(rs), "calibration_sources": sorted(
            {r["source"] for r in rs if r["chip"] not in calibrate.LENDER and (pool is None or r["source"] in pool)})}
    return {"families": fams, "overall": _stats(records) if records else {"rows": 0, "sources": []}}
