"""Fit a profile's efficiency parameters to validator step times, and rank-check the fit (no jax here).

Reuses costmodel.calibrate.fit (robust least squares on log(predicted / measured)). The fit runs with the
validator's fp32 activations (compare.activation_bytes) and with bounds wide enough for a host CPU, whose
realised fraction of a numpy-measured peak on tiny, unoptimised matmuls can be a few percent - far below the
accelerator bounds in costmodel.calibrate.BOUNDS.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from dataclasses import replace
from pathlib import Path

import yaml

from costmodel.estimate import estimate
from costmodel.published import Case
from hardware.chip import Chip
from planner.validate.compare import PlanResult, activation_bytes

# Parameters the validator's plan set can see (collective bandwidth via link; fixed cost via step_overhead_s).
FIT_NAMES = ["matmul_peak", "matmul_half_dim", "attention", "hbm", "link", "step_overhead_s"]
CPU_BOUNDS = {"matmul_peak": (0.005, 0.95, 0.3), "hbm": (0.005, 1.0, 0.5), "link": (0.001, 1.0, 0.5),
              "attention": (0.05, 1.0, 0.5), "step_overhead_s": (0.0, 1.0, 0.5)}


@contextlib.contextmanager
def cpu_bounds():
    import costmodel.calibrate as cc

    old = dict(cc.BOUNDS)
    cc.BOUNDS.update(CPU_BOUNDS)
    try:
        yield
    finally:
        cc.BOUNDS.clear()
        cc.BOUNDS.update(old)


def cases_from(results: list[PlanResult], chip: Chip) -> list[Case]:
    return [Case(r.name, "planner validate", r.model, chip, r.job, r.plan, r.measured_step_s)
            for r in results if not r.error and r.step_times_s]


def predicted_times(cases: list[Case], chip: Chip, act_bytes: int = 4) -> list[float]:
    with activation_bytes(act_bytes):
        return [estimate(c.model, chip, c.job, c.plan).step_time_s for c in cases]


def spearman(a: list[float], b: list[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic) if len(a) > 2 else float("nan")


def summary(pred: list[float], meas: list[float]) -> dict[str, float]:
    errs = [abs(p / m - 1) * 100 for p, m in zip(pred, meas, strict=True)]
    return {"spearman": spearman(pred, meas), "median_error_pct": statistics.median(errs) if errs else math.nan,
            "max_error_pct": max(errs) if errs else math.nan}


def fit_efficiency(cases: list[Case], chip: Chip, act_bytes: int = 4):
    """(calibrated chip, fit stats) over `cases` (each Case carries `chip` with the starting efficiency)."""
    from costmodel.calibrate import fit

    with cpu_bounds(), activation_bytes(act_bytes):
        eff, stats = fit(chip, [replace(c, chip=chip) for c in cases], FIT_NAMES)
    return replace(chip, eff=eff), stats


def write_profile(chip: Chip, base_yaml: Path, out: Path, note: str) -> Path:
    """The base profile file with the fitted `eff:` block appended: a file `--hardware` accepts."""
    doc = yaml.safe_load(base_yaml.read_text())
    doc["eff"] = {k: round(float(v), 6) for k, v in chip.eff.__dict__.items()}
    doc["name"] = chip.name
    doc.setdefault("sources", []).append(note)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# Written by planner calibrate --out (or validate --calibrate-out, benchmarks/validate_cpu.py): "
                   f"{base_yaml.name}\n# with efficiencies fitted to measured validator step times.\n"
                   + yaml.safe_dump(doc, sort_keys=False))
    return out


def time_in_rounds(results: list[PlanResult], chip: Chip, rounds: int = 5, steps: int = 2, log=None) -> None:
    """Time every plan kept with run_plan(keep_runner=True) in interleaved rounds (each sample: the fastest of
    `steps` steps), so that load drift on a shared machine hits all plans alike; add their step_time_s checks."""
    from planner.validate.compare import step_time_check

    for k in range(rounds):
        for r in results:
            if r.runner is not None:
                r.step_times_s.append(min(r.runner.run(steps)))
        if log:
            log(f"timing round {k + 1}/{rounds}")
    for r in results:
        if r.runner is not None:
            r.checks.append(step_time_check(r, r.predicted_step_s, chip))
            r.loss = r.runner.last_loss
            r.runner = None
