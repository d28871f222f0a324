"""Fit a chip's efficiency parameters (hardware.chip.Efficiency) to measured step times.

Least squares (scipy) on log(predicted / measured), within physical bounds, with a weak pull towards the defaults
so that a parameter the data cannot see stays where it was; with priors (priors=True, docs/priors.md) a parameter
that has a prior in hardware/priors.yaml is pulled by ((x - mean) / sd)^2 instead, the residuals counted in units
of RESIDUAL_SD. One set of <= 11 numbers per chip, written as an overlay (hardware/calibration/NAME.yaml) only when
asked (`planner calibrate --write-shipped`, or `--overlay-dir DIR`).

--weighting sources (default, issue 28): each source's rows get equal total weight, at most MAX_ROWS_PER_SOURCE
rows per chip (fit_rows); --weighting rows (every row weight 1) is what the shipped overlays use.
(details: docs/accuracy.md, 'Calibration: how sources are weighted')
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import numpy as np
import yaml

from costmodel.estimate import estimate
from costmodel.published import Case
from hardware.catalog import CALIBRATION_DIR
from hardware.chip import Chip, Efficiency
from hardware.errors import InputError, excerpt, shown_path, unknown
from hardware.fileio import check_output_path, write_text

# name: (lower, upper, prior scale) - physical bounds of each efficiency parameter
BOUNDS: dict[str, tuple[float, float, float]] = {
    "matmul_peak": (0.3, 0.95, 0.3),
    "matmul_half_dim": (0.0, 256.0, 128.0),
    "attention": (0.3, 1.0, 0.3),
    "hbm": (0.5, 1.0, 0.3),
    "link": (0.3, 1.0, 0.3),
    "net": (0.05, 1.0, 0.5),
    "overlap": (0.0, 1.0, 0.5),
    "tp_overlap": (0.0, 1.0, 0.5),
    "host_overlap": (0.0, 1.0, 0.5),
    "lowp_gain": (0.0, 1.0, 0.5),
    "step_overhead_s": (0.0, 0.5, 0.5),
}
PRIOR_WEIGHT = 0.1
# With priors: the noise of one row's log(predicted / measured), which scales the data term against the prior term.
# 0.06 = the root mean square of the log residuals of the calibration fitted without priors on its own rows (254
# rows of runs_dev.csv + maxtext2023-v5p.csv, every row weight 1; per group 0.025-0.067; set before the shipped
# fit took in AXLearn's and Marin's rows, and kept); docs/priors.md.
RESIDUAL_SD = 0.06
MAX_ROWS_PER_SOURCE = 40  # rows of one source (on one chip) entering a fit (module docstring)
# How rows weigh in a fit (calibrate --weighting; module docstring): 'sources' is the default, the one procedure that
# is tractable and fair on every file of data/runs; 'rows' is the earlier one, which the shipped overlays keep
# because its leave-source-out figure is the better one (benchmarks/holdout_report.txt).
WEIGHTINGS = {
    "sources": f"each source the same total weight; at most {MAX_ROWS_PER_SOURCE} rows of a source per chip "
               "(costmodel.calibrate.fit_sources)",
    "rows": "every row weight 1, every row fitted (costmodel.calibrate.fit_rows_unweighted)",
}
ACCURACY_FILE = "accuracy.yaml"  # the out-of-source summary written beside the shipped overlays
PRIORS_NOTE = ("penalized towards hardware/priors.yaml: ((x - mean) / sd)^2 added per parameter with a prior "
               "(docs/priors.md); the others pulled weakly towards the defaults")
PRIORS_FILE = Path(__file__).resolve().parents[1] / "hardware" / "priors.yaml"  # docs/priors.md


@cache
def _prior_table() -> dict[str, dict[str, tuple[float, float]]]:
    """{preset: {parameter: (mean, sd)}} from hardware/priors.yaml (every preset its family lists); a malformed
    entry is a one-line InputError naming it."""
    from hardware.yamlio import read_yaml

    out: dict[str, dict[str, tuple[float, float]]] = {}
    for fam, spec in (read_yaml(PRIORS_FILE).get("families") or {}).items():
        table = {}
        for name, p in ((spec or {}).get("priors") or {}).items():
            where = f"{shown_path(PRIORS_FILE)}: families.{fam}.priors.{name}"
            if name not in BOUNDS:
                raise unknown("efficiency parameter", f"{where}", list(BOUNDS))
            mean, sd = (p or {}).get("mean"), (p or {}).get("sd")
            if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (mean, sd)) or not (
                    sd > 0 and BOUNDS[name][0] <= mean <= BOUNDS[name][1]):
                raise InputError(f"{where}: expected mean within {BOUNDS[name][:2]} and sd > 0, got {mean}, {sd}")
            table[name] = (float(mean), float(sd))
        for preset in (spec or {}).get("presets") or ():
            out[str(preset)] = table
    return out


def priors_of(chip_name: str) -> dict[str, tuple[float, float]]:
    """The chip's priors {parameter: (mean, sd)} (hardware/priors.yaml; {} for a chip no family lists)."""
    return _prior_table().get(chip_name, {})


def start_efficiency(chip_name: str, priors: bool = False) -> Efficiency:
    """What a fit on no row gives: the default efficiencies, or with `priors` the prior means where the chip has
    them (the values a penalized fit pulls towards)."""
    if not priors:
        return Efficiency()
    return replace(Efficiency(), **{k: mu for k, (mu, _) in priors_of(chip_name).items()})


def _chip_with(chip: Chip, names: list[str], x: np.ndarray) -> Chip:
    return replace(chip, eff=replace(chip.eff, **dict(zip(names, map(float, x), strict=True))))


def residuals(chip: Chip, cases: list[Case]) -> np.ndarray:
    out = []
    for c in cases:
        try:
            t = estimate(c.model, chip, c.job, c.plan).step_time_s
        except InputError:
            continue
        out.append(math.log(t / c.measured_step_time_s))
    return np.asarray(out)


def fit(chip: Chip, cases: list[Case], names: list[str] | None = None) -> tuple[Efficiency, dict[str, float]]:
    """Best efficiency parameters for `chip` on its `cases`; returns (efficiency, fit statistics)."""
    from scipy.optimize import least_squares  # here: scipy.optimize takes ~1 s to import, and only a fit needs it

    names = list(names or BOUNDS)
    x0 = np.array([getattr(chip.eff, n) for n in names], dtype=float)
    lo = np.array([BOUNDS[n][0] for n in names])
    hi = np.array([BOUNDS[n][1] for n in names])
    scale = np.array([BOUNDS[n][2] for n in names])
    x0 = np.clip(x0, lo + 1e-9, hi - 1e-9)
    prior = x0.copy()

    def f(x: np.ndarray) -> np.ndarray:
        r = residuals(_chip_with(chip, names, x), cases)
        return np.concatenate([r, PRIOR_WEIGHT * (x - prior) / scale])

    sol = least_squares(f, x0, bounds=(lo, hi), loss="linear", diff_step=1e-3, max_nfev=200)
    best = _chip_with(chip, names, sol.x)
    r = residuals(best, cases)
    pct = np.abs(np.expm1(r)) * 100
    stats = {"rows": len(r), "mape_pct": float(pct.mean()), "worst_pct": float(pct.max())}
    return best.eff, stats


def overlay_text(chip_name: str, eff: Efficiency, stats: dict[str, float], source: str) -> str:
    """The overlay YAML: statistics to 2 decimals and parameters to 4, so that a refit on the same rows writes
    the same bytes."""
    doc = {
        "chip": chip_name,
        "fitted_on": source,
        "rows": int(stats["rows"]),
        "mape_pct": round(stats["mape_pct"], 2),
        "worst_pct": round(stats["worst_pct"], 2),
        **({"source_mape_pct": round(stats["source_mape_pct"], 2)} if "source_mape_pct" in stats else {}),
        **({"fit_rows": int(stats["fit_rows"]), "sources": list(stats["sources"]),
            "weighting": WEIGHTINGS[stats.get("weighting", "sources")]} if "fit_rows" in stats else {}),
        **({"priors": PRIORS_NOTE} if stats.get("priors") else {}),
        "eff": {k: round(float(v), 4) for k, v in eff.__dict__.items()},
    }
    header = "# Written by `planner calibrate`; do not edit by hand. Efficiency overlay for the sourced profile.\n"
    return header + yaml.safe_dump(doc, sort_keys=False)


def overlay_path(chip_name: str, directory: Path = CALIBRATION_DIR) -> Path:
    return Path(directory) / f"{chip_name}.yaml"


def write_overlay(chip_name: str, eff: Efficiency, stats: dict[str, float], source: str,
                  directory: Path = CALIBRATION_DIR, flag: str = "--write-shipped") -> Path:
    """Write NAME.yaml in `directory` atomically (hardware.fileio.write_text): a failed write leaves the old
    overlay as it was."""
    return write_text(overlay_path(chip_name, directory), overlay_text(chip_name, eff, stats, source), flag)


# Chips with the same silicon share one fit of the chip parameters (their rows differ only in HBM capacity).
CALIBRATION_GROUPS = {"a100-40gb": "a100", "a100-80gb": "a100"}
# Parameters of the cluster rather than the silicon: fitted per chip within a group, since the rows of each
# chip come from different clusters (A100-40GB: MosaicML's llm-foundry runs only; A100-80GB: those and NVIDIA's
# Selene runs of Narayanan et al. 2021).
PER_MEMBER = ("net",)
# Chips without enough published runs borrow the fit of their closest measured relative, marked as borrowed in the
# overlay: H200 is H100's die with more/faster HBM; B200 runs the same CUDA/NCCL stack one generation on. Their own
# rows (4 H200, 1 B200 in data/runs) are never fitted: they are predicted with the lender's fit, a test of the model
# on a chip it was not fitted to.
BORROWERS = {"h100-sxm": ("h200", "b200")}
LENDER = {b: lender for lender, bs in BORROWERS.items() for b in bs}


def family(chip_name: str) -> str:
    """The chip family a chip's rows are reported under: its calibration group (a100-40gb, a100-80gb -> a100), or
    its own name (a borrower is its own family, predicted with its lender's fit)."""
    return CALIBRATION_GROUPS.get(chip_name, chip_name)


def fit_family(chip_name: str) -> str:
    """The family whose fit predicts a chip: its own, or its lender's (BORROWERS)."""
    return family(LENDER.get(chip_name, chip_name))


def estimable(cases: list[Case]) -> tuple[list[Case], dict[str, str]]:
    """The cases the cost model can estimate, and {id: reason} for the others (a plan the model cannot split,
    e.g. 126 layers over pp 8); whether a plan can be estimated does not depend on the efficiencies."""
    ok, skipped = [], {}
    for c in cases:
        try:
            estimate(c.model, c.chip, c.job, c.plan)
        except (InputError, ArithmeticError) as e:
            skipped[c.id] = str(e)
            continue
        ok.append(c)
    return ok, skipped


def fit_rows(cases: list[Case], cap: int = MAX_ROWS_PER_SOURCE) -> list[Case]:
    """At most `cap` rows of each source on each chip, in the given order: a source with more is sorted by (chips,
    model size, sequence length, id) and `cap` rows evenly spaced over that order are kept, so the subsample spans
    its scales and shapes; the same rows always give the same subsample."""
    by_source: dict[tuple[str, str], list[Case]] = {}
    for c in cases:
        by_source.setdefault((c.source, c.chip.name), []).append(c)
    keep: set[int] = set()
    for rows in by_source.values():  # (source, chip): every chip of a group keeps its rows (PER_MEMBER parameters)
        if len(rows) <= cap:
            keep.update(id(c) for c in rows)
            continue
        order = sorted(rows, key=lambda c: (c.plan.chips, c.model.total_params(), c.job.seq_len, c.id))
        keep.update(id(order[int(i)]) for i in np.round(np.linspace(0, len(order) - 1, cap)))
    return [c for c in cases if id(c) in keep]


def source_weights(cases: list[Case]) -> np.ndarray:
    """Row weights giving every source the same total weight, len(cases) / sources (mean row weight 1)."""
    counts: dict[str, int] = {}
    for c in cases:
        counts[c.source] = counts.get(c.source, 0) + 1
    return np.array([len(cases) / (len(counts) * counts[c.source]) for c in cases], dtype=float)


def fit_procedure(cases: list[Case], weighting: str = "sources", priors: bool = False,
                  copies: dict[str, int] | None = None) -> dict[str, Efficiency]:
    """One group's rows fitted as WEIGHTINGS[weighting] says, rows the model cannot estimate left out; `priors`:
    penalized towards hardware/priors.yaml (_fit_group); `copies` {source: times drawn}, a bootstrap resample (a
    source not named is left out; default each once). Returns {chip: efficiency} ({} without a row)."""
    rows = estimable(cases)[0]
    if copies is not None:
        rows = [c for c in rows if copies.get(c.source, 0) > 0]
    rows = fit_rows(rows) if weighting == "sources" else rows
    if not rows:
        return {}
    return _fit_group(rows, procedure_weights(rows, weighting, copies), priors=priors)[0]


def procedure_weights(rows: list[Case], weighting: str, copies: dict[str, int] | None = None) -> np.ndarray | None:
    """Row weights of a procedure: 'rows' 1 (None), or the times its source was drawn; 'sources' source_weights,
    each drawn copy of a source counting as a source of its own (mean row weight 1 either way for 'sources')."""
    if copies is None:
        return source_weights(rows) if weighting == "sources" else None
    drawn = np.array([float(copies[c.source]) for c in rows])
    if weighting == "rows":
        return drawn
    counts: dict[str, int] = {}
    for c in rows:
        counts[c.source] = counts.get(c.source, 0) + 1
    k = sum(copies[s] for s in counts)  # sources in the resample, copies counted
    return np.array([len(rows) * copies[c.source] / (k * counts[c.source]) for c in rows], dtype=float)


def fit_sources(cases: list[Case], priors: bool = False) -> dict[str, Efficiency]:
    """The calibration procedure on one group's rows: sources weighted equally, at most MAX_ROWS_PER_SOURCE rows of
    each (fit_rows), rows the model cannot estimate left out; returns {chip: efficiency} ({} without a row)."""
    return fit_procedure(cases, "sources", priors)


def fit_rows_unweighted(cases: list[Case], priors: bool = False) -> dict[str, Efficiency]:
    """The procedure of the shipped overlays (every row weight 1, no subsample); `priors` as fit_procedure."""
    return fit_procedure(cases, "rows", priors)


@dataclass(frozen=True)
class Procedure:
    """A calibration procedure as costmodel.holdout's fit function: called on rows it fits them; start(chip) is what
    it predicts a chip with when no row can be fitted (start_efficiency), named by start_label."""

    weighting: str = "sources"
    priors: bool = False

    def __call__(self, cases: list[Case]) -> dict[str, Efficiency]:
        fit_fn = fit_sources if self.weighting == "sources" else fit_rows_unweighted  # looked up now: tests spy
        return fit_fn(cases, priors=self.priors)

    def start(self, chip_name: str) -> Efficiency:
        return start_efficiency(chip_name, self.priors)

    @property
    def start_label(self) -> str:
        return "priors" if self.priors else "defaults"


def fit_stats(effs: dict[str, Efficiency], cases: list[Case]) -> dict:
    """In-sample statistics of a fit over all of the group's estimable `cases`: rows, MAPE over rows, MAPE with each
    source weighing the same, worst row, and the sources."""
    errs, by_source = [], {}
    for c in cases:
        chip = replace(c.chip, eff=effs.get(c.chip.name, next(iter(effs.values()), Efficiency())))
        try:
            t = estimate(c.model, chip, c.job, c.plan).step_time_s
        except (InputError, ArithmeticError):
            continue
        e = abs(t - c.measured_step_time_s) / c.measured_step_time_s * 100
        errs.append(e)
        by_source.setdefault(c.source, []).append(e)
    if not errs:
        return {"rows": 0, "mape_pct": math.nan, "source_mape_pct": math.nan, "worst_pct": math.nan, "sources": []}
    return {"rows": len(errs), "mape_pct": float(np.mean(errs)),
            "source_mape_pct": float(np.mean([np.mean(v) for v in by_source.values()])),
            "worst_pct": float(np.max(errs)), "sources": sorted(by_source)}


def calibrate_all(files: str | list[str], only: list[str] | None = None, directory: Path | None = None,
                  flag: str = "--write-shipped", weighting: str = "sources", evaluate: list[str] | None = None,
                  priors: bool = False):
    """Fit every chip (or group of chips) that has rows in `files` (WEIGHTINGS[weighting]: by default each source
    the same total weight, fit_sources); yield (name, eff, stats, overlay paths). Overlays are written (atomically)
    into `directory` only when one is given - hardware/calibration (CALIBRATION_DIR) is the shipped one, and there
    the leave-source-out accuracy of the same procedure on the same rows goes into accuracy.yaml (write_accuracy)
    after the last group, with the rows of the `evaluate` files predicted out of source too (never fitted; their
    sources must not be among the fitted ones); every path is checked before the first fit. Rows of borrowers
    (BORROWERS) are not fitted. `priors`: each fit penalized towards hardware/priors.yaml (_fit_group). No usable
    row is an InputError."""
    from hardware.catalog import with_calibration

    if weighting not in WEIGHTINGS:
        raise unknown("weighting", weighting, list(WEIGHTINGS))
    files = [files] if isinstance(files, str) else list(files)
    cases = _load(files, only)
    extra = _load_evaluated(list(evaluate or ()), only, {c.source for c in cases})
    groups = _groups(cases)
    source = "+".join(Path(f).name for f in files)
    shipped = directory is not None and flag == "--write-shipped"
    if directory is not None:
        for members in groups:
            for name in _overlay_names(members):
                check_output_path(overlay_path(name, directory), flag)
        if shipped:
            check_output_path(Path(directory) / ACCURACY_FILE, flag)
    for members, cs in groups.items():
        rows = estimable(cs)[0]
        rows = fit_rows(rows) if weighting == "sources" else rows
        if not rows:
            raise InputError(f"--file {shown_path(' + '.join(files))}: no row of {', '.join(members)} can be "
                             "estimated; nothing to fit")
        effs = _fit_group(rows, source_weights(rows) if weighting == "sources" else None, priors=priors)[0]
        stats = {**fit_stats(effs, cs), "fit_rows": len(rows), "weighting": weighting, "priors": priors}
        paths = [] if directory is None else _write_group(members, effs, stats, source, directory, flag)
        with_calibration.cache_clear()
        yield "+".join(members), effs[members[0]], stats, ", ".join(str(p) for p in paths)
    if shipped:
        write_accuracy(cases, source, Path(directory), flag, weighting, extra,
                       "+".join(Path(f).name for f in evaluate or ()), priors)


def _load(files: list[str], only: list[str] | None) -> list[Case]:
    """The usable rows of `files` (of the `only` presets; a borrower's rows come with its lender's), each case's chip
    reset to the default efficiencies so that a refit does not depend on the previous overlay."""
    from costmodel.published import load_cases
    from hardware.catalog import preset_names

    for name in only or ():
        if name not in preset_names():
            raise unknown("hardware", name, preset_names())
        if name in LENDER:
            raise InputError(f"--hardware {name}: borrows the fit of {LENDER[name]} (its rows are not fitted; "
                             f"costmodel.calibrate.BORROWERS); calibrate {LENDER[name]}")
    loaded = [load_cases(f) for f in files]
    cases = [c for cs, _ in loaded for c in cs if not only or LENDER.get(c.chip.name, c.chip.name) in only]
    if not [c for c in cases if c.chip.name not in LENDER]:
        raise InputError(_no_rows(files, only, {k: v for _, sk in loaded for k, v in sk.items()}))
    return [replace(c, chip=replace(c.chip, eff=Efficiency())) for c in cases]


def _load_evaluated(files: list[str], only: list[str] | None, fitted: set[str]) -> list[Case]:
    """The usable rows of the `evaluate` files (of the `only` presets and their borrowers), chips reset to the
    defaults; a source that is also fitted is an InputError (a source is either fitted or evaluated)."""
    from costmodel.published import load_cases

    cases = [replace(c, chip=replace(c.chip, eff=Efficiency())) for f in files for c in load_cases(f)[0]
             if not only or LENDER.get(c.chip.name, c.chip.name) in only]
    both = sorted({c.source for c in cases} & fitted)
    if both:
        raise InputError(f"--evaluate: source(s) {excerpt(', '.join(both))} also in --file; a source is either "
                         "fitted or only predicted")
    return cases


def _groups(cases: list[Case]) -> dict[tuple[str, ...], list[Case]]:
    """The fitted rows (borrowers' left out) by calibration group (sorted member names)."""
    by_group: dict[str, list[Case]] = {}
    for c in cases:
        if c.chip.name not in LENDER:
            by_group.setdefault(family(c.chip.name), []).append(c)
    return {tuple(sorted({c.chip.name for c in cs})): cs for _, cs in sorted(by_group.items())}


def accuracy_text(summary: dict, source: str, previous: dict | None = None, weighting: str = "sources",
                  evaluated_on: str = "", priors: bool = False) -> str:
    """accuracy.yaml: the leave-source-out summary per chip family (costmodel.holdout.summarize), figures to 2
    decimals and log residuals to 4; families not in `summary` are kept from `previous` (a run with --hardware)."""
    fams = dict((previous or {}).get("families") or {})
    for name, f in summary["families"].items():
        fams[name] = {
            "fitted_on": source,
            **({"evaluated_on": evaluated_on} if evaluated_on else {}),
            "rows": int(f["rows"]),
            "sources": list(f["sources"]),
            "calibration_sources": list(f["calibration_sources"]),
            "out_of_source_mape_pct": round(f["mape_pct"], 2),
            "out_of_source_source_mape_pct": round(f["source_mape_pct"], 2),
            "log_residual_p10": round(f["log_residual_p10"], 4),
            "log_residual_p90": round(f["log_residual_p90"], 4),
            "predicted_by": f["predicted_by"],
        }
    doc = {"method": ACCURACY_METHOD_PRIORS if priors else ACCURACY_METHOD, "weighting": WEIGHTINGS[weighting],
           **({"priors": PRIORS_NOTE} if priors else {}), "families": dict(sorted(fams.items()))}
    header = ("# Written by `planner calibrate --write-shipped`; do not edit by hand. Out-of-source accuracy of the "
              "shipped\n# calibration (costmodel.holdout.leave_source_out); percentiles of log(predicted/measured), "
              "sources weighted equally.\n")
    return header + yaml.safe_dump(doc, sort_keys=False)


ACCURACY_METHOD = ("leave-source-out at calibration time: every row of a source predicted by a fit on the other "
                   "sources of its chip family (the same procedure as the overlays); a family with one source is "
                   "predicted with the default efficiencies (no fit); borrowers by their lender's fit without the "
                   "held-out source")
ACCURACY_METHOD_PRIORS = ACCURACY_METHOD.replace("the default efficiencies (no fit)",
                                                 "the prior means of hardware/priors.yaml (no fit)")


def write_accuracy(cases: list[Case], source: str, directory: Path, flag: str = "--write-shipped",
                   weighting: str = "sources", extra: list[Case] | None = None, evaluated_on: str = "",
                   priors: bool = False) -> Path:
    """Leave-source-out over `cases` (all chips of the calibration's files) and the `extra` rows (predicted, never
    fitted), and its summary in accuracy.yaml, merged with the families already there (atomic write)."""
    from costmodel.holdout import leave_source_out, summarize
    from hardware.yamlio import read_yaml

    path = Path(directory) / ACCURACY_FILE
    previous = read_yaml(path) if path.is_file() else None
    pool = {c.source for c in cases}
    summary = summarize(leave_source_out(cases + list(extra or ()), Procedure(weighting, priors), pool=pool),
                        pool=pool)
    return write_text(path, accuracy_text(summary, source, previous, weighting, evaluated_on, priors), flag)


def _no_rows(files: list[str], only: list[str] | None, skipped: dict[str, str]) -> str:
    """The one-line reason nothing can be fitted: which file, which presets, how many rows were skipped and why."""
    where = f"--file {shown_path(' + '.join(files))}"
    which = f" for --hardware {', '.join(only)}" if only else ""
    if not skipped:
        return f"{where}: no usable row{which}; expected rows in the runs_dev.csv schema with measured step times"
    first_id, first = next(iter(skipped.items()))
    return (f"{where}: no usable row{which} ({len(skipped):,} skipped, e.g. {excerpt(first_id, 40)}: "
            f"{excerpt(first, 120)})")


def _overlay_names(members: tuple[str, ...]) -> list[str]:
    """The overlays a group's fit writes: its members, and the chips that borrow from them (BORROWERS)."""
    return [*members, *(b for m in members for b in BORROWERS.get(m, ()) if b not in members)]


def _write_group(members: tuple[str, ...], effs: dict[str, Efficiency], stats: dict[str, float], source: str,
                 directory: Path, flag: str) -> list[Path]:
    """Each member's overlay, then the borrowers' (marked as borrowed from their lender)."""
    paths = [write_overlay(m, effs[m], stats, source, directory, flag) for m in members]
    for lender in members:
        for borrower in BORROWERS.get(lender, ()):
            if borrower not in members:
                paths.append(write_overlay(borrower, effs[members[0]], stats,
                                           f"{source} (borrowed from {lender})", directory, flag))
    return paths


def _fit_group(cases: list[Case], weights: np.ndarray | None = None,
               priors: bool = False) -> tuple[dict[str, Efficiency], dict[str, float]]:
    """Fit one efficiency set shared by all chips of the cases (same silicon, different HBM), with the
    PER_MEMBER (cluster) parameters fitted per chip when the group has several; returns {chip: efficiency}.
    `weights` (one per case; default 1) scale each row's squared log residual (source_weights). Every parameter is
    pulled towards its default by PRIOR_WEIGHT * (x - default) / scale; with `priors`, a parameter that has a prior
    in hardware/priors.yaml adds ((x - mean) / sd)^2 instead and starts from its mean (_pull)."""
    from scipy.optimize import least_squares  # here: scipy.optimize takes ~1 s to import, and only a fit needs it

    root_w = np.ones(len(cases)) if weights is None else np.sqrt(np.asarray(weights, dtype=float))
    members = sorted({c.chip.name for c in cases})
    shared = [n for n in BOUNDS if len(members) == 1 or n not in PER_MEMBER]
    names = shared + [(n, m) for n in BOUNDS if n not in shared for m in members]
    key = [n if isinstance(n, str) else n[0] for n in names]
    lo = np.array([BOUNDS[k][0] for k in key])
    hi = np.array([BOUNDS[k][1] for k in key])
    x0, penalty = _pull(names, members[0], lo, hi, priors)

    def effs_of(x: np.ndarray) -> dict[str, Efficiency]:
        out = {}
        for m in members:
            kw = {(n if isinstance(n, str) else n[0]): float(v) for n, v in zip(names, x, strict=True)
                  if isinstance(n, str) or n[1] == m}
            out[m] = Efficiency(**kw)
        return out

    def res(x: np.ndarray) -> np.ndarray:
        effs = effs_of(x)
        out = []
        for c in cases:
            chip = replace(c.chip, eff=effs[c.chip.name])
            t = estimate(c.model, chip, c.job, c.plan).step_time_s
            out.append(math.log(t / c.measured_step_time_s))
        return np.asarray(out)

    data_w = root_w / RESIDUAL_SD if priors else root_w  # the log residuals in units of their noise (RESIDUAL_SD)

    def f(x: np.ndarray) -> np.ndarray:
        return np.concatenate([data_w * res(x), penalty(x)])

    sol = least_squares(f, x0, bounds=(lo, hi), loss="linear", diff_step=1e-3, max_nfev=200)
    x = sol.x
    if len(members) > 1:
        # A cluster parameter is seen only by rows whose communication is exposed, so its gradient is often zero
        # at the start: scan each one over its bounds, then polish everything from the best point.
        for i, n in enumerate(names):
            if isinstance(n, tuple):
                grid = np.linspace(lo[i], hi[i], 20)
                cost = [float(np.sum(f(np.where(np.arange(len(x)) == i, g, x)) ** 2)) for g in grid]
                x = np.where(np.arange(len(x)) == i, grid[int(np.argmin(cost))], x)
        x = least_squares(f, x, bounds=(lo, hi), loss="linear", diff_step=1e-3, max_nfev=200).x
    pct = np.abs(np.expm1(res(x))) * 100
    return effs_of(x), {"rows": len(pct), "mape_pct": float(pct.mean()), "worst_pct": float(pct.max())}


def _pull(names: list, first: str, lo: np.ndarray, hi: np.ndarray, priors: bool):
    """(start point, penalty(x)) of _fit_group over `names` (a shared parameter's name, or (name, member)): the
    weak pull PRIOR_WEIGHT * (x - default) / BOUNDS scale towards the clipped defaults, and with `priors` (x - mean)
    / sd for each parameter with a prior (priors_of: the member's, a shared one's `first` member's), in the units the
    priors are stated in (fractions, elements, seconds), starting from the mean clipped into the bounds."""
    key = [n if isinstance(n, str) else n[0] for n in names]
    default = np.clip(np.array([getattr(Efficiency(), k) for k in key], dtype=float), lo + 1e-9, hi - 1e-9)
    scale = np.array([BOUNDS[k][2] for k in key])
    table = [priors_of(first if isinstance(n, str) else n[1]) if priors else {} for n in names]
    has = np.array([k in t for k, t in zip(key, table, strict=True)])
    mean = np.array([t[k][0] if k in t else 0.0 for k, t in zip(key, table, strict=True)])
    sd = np.array([t[k][1] if k in t else 1.0 for k, t in zip(key, table, strict=True)])
    x0 = np.where(has, np.clip(mean, lo + 1e-9, hi - 1e-9), default)

    def penalty(x: np.ndarray) -> np.ndarray:
        weak = PRIOR_WEIGHT * (x - default) / scale
        return np.where(has, (x - mean) / sd, weak) if has.any() else weak
    return x0, penalty
