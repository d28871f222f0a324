#!/usr/bin/env python3
"""XLA's peak_memory_in_bytes for run.py's configurations, beside the total MaxText prints.

MaxText's train_compile prints memory_analysis() without the peak of XLA's buffer assignment; this recompiles each
configuration of run.py with peak_probe/ first on PYTHONPATH (which prints it) and appends one row per config to
xla_peaks.csv (results.csv is left alone). Resumable: configs already in xla_peaks.csv are skipped.

    /work/maxtext-env/bin/python benchmarks/maxtext_memory/peaks.py [--only ID ...] [--budget-min N]
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEAKS = HERE / "xla_peaks.csv"
FIELDS = ["id", "status", "total_bytes_per_chip", "xla_peak_bytes", "host_temp_bytes"]


def done_ids() -> set[str]:
    if not PEAKS.exists():
        return set()
    with PEAKS.open(newline="") as f:
        return {r["id"] for r in csv.DictReader(f)}


def append(row: dict) -> None:
    new = not PEAKS.exists()
    with PEAKS.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow(row)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append")
    ap.add_argument("--budget-min", type=float, default=0)
    ap.add_argument("--timeout", type=int, default=1500)
    ns = ap.parse_args()
    os.environ.setdefault("MAXTEXT_OUT", "/tmp/maxtext-peaks")
    os.environ["PYTHONPATH"] = str(HERE / "peak_probe") + os.pathsep + os.environ.get("PYTHONPATH", "")
    sys.path.insert(0, str(HERE))
    import run  # noqa: PLC0415  (reads MAXTEXT_OUT at import)

    mt, start, have = run.maxtext_dir(), time.time(), done_ids()
    for cfg in run.CONFIGS:
        if (ns.only and cfg.id not in ns.only) or cfg.id in have:
            continue
        if ns.budget_min and time.time() - start > ns.budget_min * 60:
            print(f"budget of {ns.budget_min} min used; stopping before {cfg.id}", flush=True)
            break
        row = run.run_one(cfg, mt, ns.timeout)
        log = (run.OUT_DIR / "logs" / f"{cfg.id}.log").read_text(errors="replace")
        peak = re.findall(r"PEAK_MEMORY_IN_BYTES (\d+)", log)
        append({**row, "xla_peak_bytes": peak[-1] if peak else ""})
        print(f"{cfg.id}: {row['status']}, total {row.get('total_bytes_per_chip', '?')}, peak "
              f"{peak[-1] if peak else '?'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
