"""Validator benchmark on 8 CPU devices: cost model vs XLA per plan, then step-time calibration of cpu-host.

    .venv/bin/python benchmarks/validate_cpu.py [--set cpu8] [--steps 5] [--fast-compile] [--out DIR]

Runs every plan of the set (planner/validate/plans.py) in this process, prints predicted vs XLA per quantity,
times steps (median after a warm-up), fits the cpu-host efficiency parameters to the measured times
(costmodel.calibrate.fit with CPU-wide bounds), and reports Spearman rank correlation and median step-time error
before and after. Writes benchmarks/validate_cpu_report.txt and benchmarks/validate_cpu_profile.yaml (a
profile `--hardware` accepts). Each plan compiles in 5-20 s on the 2-core dev machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.validate import set_host_devices  # noqa: E402  (no jax yet)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="cpu8")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--hardware", default="cpu-host")
    ap.add_argument("--fast-compile", action="store_true", help="XLA backend opt level 0 (faster compile, slower "
                                                                  "steps)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks"))
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args()

    set_host_devices(args.devices)
    if args.fast_compile:
        os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

    from costmodel.catalog import load_model
    from hardware.catalog import PROFILE_DIR, load_hardware
    from planner.validate.calibrate_cpu import cases_from, fit_efficiency, predicted_times, summary, write_profile
    from planner.validate.compare import run_plan
    from planner.validate.plans import PLAN_SETS
    from planner.validate.scale import Scale

    chip = load_hardware(args.hardware)
    scale = Scale(d_model=args.d_model, seq_len=args.seq_len)
    lines: list[str] = []

    def out(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    t0 = time.time()
    results = []
    for name, model, plan in PLAN_SETS[args.set]:
        r = run_plan(name, load_model(model), plan, chip, devices=args.devices, steps=args.steps, scale=scale)
        print(f"  [{time.time() - t0:5.0f} s] {name}: " + (r.error or f"compiled in {r.compile_s:.1f} s"),
              file=sys.stderr, flush=True)
        results.append(r)

    out(f"# Validator on {args.devices} CPU devices: cost model ({chip.name}) vs XLA, set '{args.set}'")
    out(f"# scaled models: d_model {args.d_model}, 2 layers, seq {args.seq_len}, fp32 compute; "
        f"{'XLA backend opt level 0' if args.fast_compile else 'default XLA optimisation'}; "
        f"{args.steps} timed steps after warm-up")
    out()
    out(f"{'plan':26s} {'quantity':42s} {'predicted':>12s} {'XLA':>12s} {'error %':>8s}  ok")
    for r in results:
        if r.error:
            out(f"{r.name:26s} FAILED: {r.error}")
            continue
        for c in r.checks:
            err = "-" if c.error_pct is None else f"{c.error_pct:+.1f}"
            xla = "-" if c.xla is None else f"{c.xla:.5g}"
            out(f"{r.name:26s} {c.quantity:42s} {c.predicted:12.5g} {xla:>12s} {err:>8s}  {'yes' if c.ok else 'NO'}")
    out()
    out("# XLA collectives by kind@mesh axes (bytes per step per device)")
    for r in results:
        if not r.error:
            out(f"{r.name:26s} " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(r.xla["collectives_by_axis"].items())))

    cases = cases_from(results, chip)
    meas = [c.measured_step_time_s for c in cases]
    before = predicted_times(cases, chip)
    cal, stats = fit_efficiency(cases, chip)
    after = predicted_times(cases, cal)
    out()
    out("# Step time: measured (median) vs predicted, before and after fitting the efficiency parameters")
    out(f"{'plan':26s} {'measured s':>11s} {'spread s':>9s} {'before s':>10s} {'err %':>8s} {'after s':>10s} "
        f"{'err %':>8s}")
    by = {r.name: r for r in results}
    for c, m, b, a in zip(cases, meas, before, after, strict=True):
        ts = by[c.id].step_times_s
        out(f"{c.id:26s} {m:11.4f} {max(ts) - min(ts):9.4f} {b:10.4f} {(b / m - 1) * 100:+8.1f} {a:10.4f} "
            f"{(a / m - 1) * 100:+8.1f}")
    sb, sa = summary(before, meas), summary(after, meas)
    out(f"before calibration: Spearman {sb['spearman']:.3f}, median |error| {sb['median_error_pct']:.1f}%, "
        f"max {sb['max_error_pct']:.1f}%")
    out(f"after calibration:  Spearman {sa['spearman']:.3f}, median |error| {sa['median_error_pct']:.1f}%, "
        f"max {sa['max_error_pct']:.1f}%  (in-sample: {stats['rows']} plans)")
    out("fitted efficiency: " + ", ".join(f"{k}={v:.4g}" for k, v in cal.eff.__dict__.items()))
    out(f"# total wall time {time.time() - t0:.0f} s")
    odir = Path(args.out)
    odir.mkdir(parents=True, exist_ok=True)
    prof = write_profile(cal, PROFILE_DIR / f"{args.hardware}.yaml", odir / "validate_cpu_profile.yaml",
                         f"[FIT] efficiencies fitted by benchmarks/validate_cpu.py on {len(cases)} validator plans")
    (odir / "validate_cpu_report.txt").write_text("\n".join(lines) + "\n")
    print(f"wrote {odir / 'validate_cpu_report.txt'} and {prof}", file=sys.stderr)


if __name__ == "__main__":
    main()
