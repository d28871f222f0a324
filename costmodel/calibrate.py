"""Fit a chip's efficiency parameters (hardware.chip.Efficiency) to measured step times.

Robust least squares (scipy, soft-L1 loss) on log(predicted / measured), within physical bounds, with a weak
pull towards the defaults so that a parameter the data cannot see stays where it was. Nothing is fitted per
run: one set of <= 9 numbers per chip. The result is an overlay (hardware/calibration/NAME.yaml) that the
catalog applies on top of the sourced profile, written only when asked (`planner calibrate --write-shipped`, or
`--overlay-dir DIR` for a copy elsewhere).
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


def overlay_text(chip_name: str, eff: Efficiency, stats: dict[str, float], source: str) -> str:
    """The overlay YAML: statistics to 2 decimals and parameters to 4, so that a refit on the same rows writes
    the same bytes."""
    doc = {
        "chip": chip_name,
        "fitted_on": source,
        "rows": int(stats["rows"]),
        "mape_pct": round(stats["mape_pct"], 2),
        "worst_pct": round(stats["worst_pct"], 2),
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
# Chips without published runs borrow the fit of their closest measured relative, marked as borrowed in the
# overlay: H200 is H100's die with more/faster HBM; B200 runs the same CUDA/NCCL stack one generation on.
BORROWERS = {"h100-sxm": ("h200", "b200")}


def calibrate_all(files: str | list[str], only: list[str] | None = None, directory: Path | None = None,
                  flag: str = "--write-shipped"):
    """Fit every chip (or group of chips) that has rows in `files`; yield (name, eff, stats, overlay paths).
    Overlays are written (atomically) into `directory` only when one is given - hardware/calibration
    (CALIBRATION_DIR) is the shipped one; every path is checked before the first fit. No usable row is an
    InputError."""
    from hardware.catalog import with_calibration

    files = [files] if isinstance(files, str) else list(files)
    groups = _groups(files, only)
    source = "+".join(Path(f).name for f in files)
    if directory is not None:
        for members in groups:
            for name in _overlay_names(members):
                check_output_path(overlay_path(name, directory), flag)
    for members, cs in groups.items():
        effs, stats = _fit_group(cs)
        paths = [] if directory is None else _write_group(members, effs, stats, source, directory, flag)
        with_calibration.cache_clear()
        yield "+".join(members), effs[members[0]], stats, ", ".join(str(p) for p in paths)


def _groups(files: list[str], only: list[str] | None) -> dict[tuple[str, ...], list[Case]]:
    """The usable rows of `files` (of the `only` presets), by calibration group (sorted member names), each case's
    chip reset to the default efficiencies so that a refit does not depend on the previous overlay."""
    from costmodel.published import load_cases
    from hardware.catalog import preset_names

    for name in only or ():
        if name not in preset_names():
            raise unknown("hardware", name, preset_names())
    loaded = [load_cases(f) for f in files]
    cases = [c for cs, _ in loaded for c in cs if not only or c.chip.name in only]
    if not cases:
        raise InputError(_no_rows(files, only, {k: v for _, sk in loaded for k, v in sk.items()}))
    by_group: dict[str, list[Case]] = {}
    for c in cases:
        by_group.setdefault(CALIBRATION_GROUPS.get(c.chip.name, c.chip.name), []).append(c)
    out = {}
    for _, cs in sorted(by_group.items()):
        members = tuple(sorted({c.chip.name for c in cs}))
        out[members] = [replace(c, chip=replace(c.chip, eff=Efficiency())) for c in cs]
    return out


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


def _fit_group(cases: list[Case]) -> tuple[dict[str, Efficiency], dict[str, float]]:
    """Fit one efficiency set shared by all chips of the cases (same silicon, different HBM), with the
    PER_MEMBER (cluster) parameters fitted per chip when the group has several; returns {chip: efficiency}."""
    members = sorted({c.chip.name for c in cases})
    shared = [n for n in BOUNDS if len(members) == 1 or n not in PER_MEMBER]
    names = shared + [(n, m) for n in BOUNDS if n not in shared for m in members]
    key = [n if isinstance(n, str) else n[0] for n in names]
    x0 = np.array([getattr(Efficiency(), k) for k in key], dtype=float)
    lo = np.array([BOUNDS[k][0] for k in key])
    hi = np.array([BOUNDS[k][1] for k in key])
    scale = np.array([BOUNDS[k][2] for k in key])
    x0 = np.clip(x0, lo + 1e-9, hi - 1e-9)

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

    def f(x: np.ndarray) -> np.ndarray:
        return np.concatenate([res(x), PRIOR_WEIGHT * (x - x0) / scale])

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
