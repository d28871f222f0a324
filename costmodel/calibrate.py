"""Fit a chip's efficiency parameters (hardware.chip.Efficiency) to measured step times.

Robust least squares (scipy, soft-L1 loss) on log(predicted / measured), within physical bounds, with a weak
pull towards the defaults so that a parameter the data cannot see stays where it was. Nothing is fitted per
run: one set of <= 9 numbers per chip. The result is written as an overlay (hardware/calibration/NAME.yaml)
that the catalog applies on top of the sourced profile.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import yaml
from scipy.optimize import least_squares

from costmodel.estimate import estimate
from costmodel.published import Case
from hardware.catalog import CALIBRATION_DIR
from hardware.chip import Chip, Efficiency
from hardware.errors import InputError

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


def write_overlay(chip_name: str, eff: Efficiency, stats: dict[str, float], source: str,
                  directory: Path = CALIBRATION_DIR) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{chip_name}.yaml"
    doc = {
        "chip": chip_name,
        "fitted_on": source,
        "rows": int(stats["rows"]),
        "mape_pct": round(stats["mape_pct"], 2),
        "worst_pct": round(stats["worst_pct"], 2),
        "eff": {k: round(float(v), 4) for k, v in eff.__dict__.items()},
    }
    header = "# Written by `planner calibrate`; do not edit by hand. Efficiency overlay for the sourced profile.\n"
    path.write_text(header + yaml.safe_dump(doc, sort_keys=False))
    return path


# Chips with the same silicon, host and network share one fit (their rows differ only in HBM capacity).
CALIBRATION_GROUPS = {"a100-40gb": "a100", "a100-80gb": "a100"}
# Chips without published runs borrow the fit of their closest measured relative, marked as borrowed in the
# overlay: H200 is H100's die with more/faster HBM; B200 runs the same CUDA/NCCL stack one generation on.
BORROWERS = {"h100-sxm": ("h200", "b200")}


def calibrate_all(files: str | list[str], only: list[str] | None = None, write: bool = True):
    """Fit every chip (or group of chips) that has rows in `files`; yield (name, eff, stats, overlay path)."""
    from costmodel.published import load_cases
    from hardware.catalog import load_hardware, preset_names, with_calibration

    files = [files] if isinstance(files, str) else list(files)
    cases = [c for f in files for c in load_cases(f)[0]]
    file = "+".join(Path(f).name for f in files)
    if only:
        for name in only:
            if name not in preset_names():
                from hardware.errors import unknown

                raise unknown("hardware", name, preset_names())
        cases = [c for c in cases if c.chip.name in only]
    groups: dict[str, list[Case]] = {}
    for c in cases:
        groups.setdefault(CALIBRATION_GROUPS.get(c.chip.name, c.chip.name), []).append(c)
    for _group, cs in sorted(groups.items()):
        members = sorted({c.chip.name for c in cs})
        base = load_hardware(members[0])
        # Start from the defaults so that a refit does not depend on the previous overlay.
        base = replace(base, eff=Efficiency())

        def strip(c: Case, _b=base) -> Case:
            chip = replace(c.chip, eff=_b.eff)
            return replace(c, chip=chip)

        cs = [strip(c) for c in cs]
        eff, stats = _fit_group(cs)
        paths = [write_overlay(m, eff, stats, file) if write else None for m in members]
        for lender in members:
            for borrower in BORROWERS.get(lender, ()):
                if write and borrower not in members:
                    paths.append(write_overlay(borrower, eff, stats, f"{file} (borrowed from {lender})"))
        with_calibration.cache_clear()
        yield "+".join(members), eff, stats, ", ".join(str(p) for p in paths if p)


def _fit_group(cases: list[Case]) -> tuple[Efficiency, dict[str, float]]:
    """Fit one efficiency set shared by all chips of the cases (same silicon, different HBM)."""
    names = list(BOUNDS)
    x0 = np.array([getattr(Efficiency(), n) for n in names], dtype=float)
    lo = np.array([BOUNDS[n][0] for n in names])
    hi = np.array([BOUNDS[n][1] for n in names])
    scale = np.array([BOUNDS[n][2] for n in names])
    x0 = np.clip(x0, lo + 1e-9, hi - 1e-9)

    def chipped(x: np.ndarray) -> list[Case]:
        kw = dict(zip(names, map(float, x), strict=True))
        return [replace(c, chip=replace(c.chip, eff=replace(c.chip.eff, **kw))) for c in cases]

    def res(cs: list[Case]) -> np.ndarray:
        out = []
        for c in cs:
            t = estimate(c.model, c.chip, c.job, c.plan).step_time_s
            out.append(math.log(t / c.measured_step_time_s))
        return np.asarray(out)

    def f(x: np.ndarray) -> np.ndarray:
        return np.concatenate([res(chipped(x)), PRIOR_WEIGHT * (x - x0) / scale])

    sol = least_squares(f, x0, bounds=(lo, hi), loss="linear", diff_step=1e-3, max_nfev=200)
    r = res(chipped(sol.x))
    pct = np.abs(np.expm1(r)) * 100
    eff = Efficiency(**dict(zip(names, map(float, sol.x), strict=True)))
    return eff, {"rows": len(r), "mape_pct": float(pct.mean()), "worst_pct": float(pct.max())}
