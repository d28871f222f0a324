"""Published-plan baseline: does the planner's suggestion beat the plan the authors ran, by the cost model's own clock?

Usage: python benchmarks/published_baseline.py [--file data/runs/runs_dev.csv] [--write]
For the MaxText v5e and v4 tables and the Megatron-LM A100 rows (PTD-P) of the runs CSV, the search runs on the
same job and framework convention, and the table gives

    ratio = predicted step time of the suggested plan / predicted step time of the published plan

Both sides are the same cost model: ratio <= 1 says the search found the published plan or one the model thinks
at least as fast, nothing about the model's accuracy. A published plan over the memory limit is marked. Megatron
rows get a second ratio with fsdp = 1 (the PTD-P space). --write saves benchmarks/published_baseline_report.txt.
(details and results: docs/search.md)
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodel.estimate import estimate  # noqa: E402
from costmodel.published import load_cases  # noqa: E402
from planner.candidates import Constraints  # noqa: E402
from planner.solve import search  # noqa: E402

SOURCES = ("maxtext2023-v5e", "maxtext2023-v4", "narayanan2021-table1", "narayanan2021-table2")
DEFAULT_FILE = ROOT / "data" / "runs" / "runs_dev.csv"


def short(plan) -> str:
    d = " ".join(f"{a}{v}" for a, v in plan.degrees().items() if v > 1)
    extra = f" mb{plan.micro_batch}" + (f" vpp{plan.vpp}" if plan.vpp > 1 else "") + (" z1" if plan.zero == 1 else "")
    return d + extra + f" {plan.remat.name if plan.remat.name != 'custom' else 'custom'}" \
        + (" +opt" if plan.offload_optimizer else "") + (" +par" if plan.offload_params else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default=str(DEFAULT_FILE))
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    cases, _ = load_cases(a.file)
    cases = [c for c in cases if c.source in SOURCES and c.job.framework in ("maxtext", "megatron")]
    out = io.StringIO()
    head = (f"{'id':36s} {'hw':9s} {'chips':>5s} {'published plan':34s} {'pub s':>8s} {'fits':>4s} "
            f"{'suggested plan':44s} {'sugg s':>8s} {'ratio':>6s} {'search s':>8s} {'fsdp=1: ratio, plan'}")
    print(head)
    out.write(head + "\n")
    ratios = []
    ratios_ptdp: list[float] = []
    for c in cases:
        pub = estimate(c.model, c.chip, c.job, c.plan)
        t = time.perf_counter()
        s = search(c.model, c.chip, c.job, c.plan.chips, Constraints(slices=c.plan.slices), top=1)
        dt = time.perf_counter() - t
        if s.plans:
            best = s.plans[0]
            ratio = best.cost.step_time_s / pub.step_time_s
            ratios.append((ratio, c.id, pub.fits))
            ptdp = ""
            if c.job.framework == "megatron":
                s2 = search(c.model, c.chip, c.job, c.plan.chips, Constraints(fixed={"fsdp": 1},
                                                                                slices=c.plan.slices), top=1)
                if s2.plans:
                    r2 = s2.plans[0].cost.step_time_s / pub.step_time_s
                    ptdp = f"{r2:6.3f} {short(s2.plans[0].plan)}"
                    ratios_ptdp.append(r2)
            line = (f"{c.id:36s} {c.chip.name:9s} {c.plan.chips:5d} {short(c.plan):34s} {pub.step_time_s:8.3f} "
                    f"{'yes' if pub.fits else 'NO':>4s} {short(best.plan):44s} {best.cost.step_time_s:8.3f} "
                    f"{ratio:6.3f} {dt:8.2f} {ptdp}")
        else:
            line = (f"{c.id:36s} {c.chip.name:9s} {c.plan.chips:5d} {short(c.plan):34s} {pub.step_time_s:8.3f} "
                    f"{'yes' if pub.fits else 'NO':>4s} {'(nothing fits)':44s} {'':8s} {'':6s} {dt:8.2f}")
        print(line, flush=True)
        out.write(line + "\n")
    fit = [r for r, _, f in ratios if f]
    summary = [f"\n# {len(ratios)} rows searched; ratio = suggested / published predicted step time",
               f"# max ratio {max(r for r, _, _ in ratios):.3f} ({max(ratios)[1]}), "
               f"mean {sum(r for r, _, _ in ratios) / len(ratios):.3f}, "
               f"rows with ratio <= 1.0: {sum(r <= 1.0 + 1e-9 for r, _, _ in ratios)}",
               f"# rows whose published plan fits the model's memory: {len(fit)}; max ratio among them "
               f"{max(fit) if fit else float('nan'):.3f}",
               f"# Megatron rows searched with fsdp = 1: {len(ratios_ptdp)}, max ratio "
               f"{max(ratios_ptdp) if ratios_ptdp else float('nan'):.3f}"]
    for line in summary:
        print(line)
        out.write(line + "\n")
    if a.write:
        (ROOT / "benchmarks" / "published_baseline_report.txt").write_text(out.getvalue())


if __name__ == "__main__":
    main()
