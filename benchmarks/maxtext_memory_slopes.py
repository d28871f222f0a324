"""Per-layer memory slope: the cost model vs MaxText 0.2.5's TPU compile at several layer counts.

Usage: python benchmarks/maxtext_memory_slopes.py
benchmarks/maxtext_memory/layer_sweeps.csv holds MaxText compiles of one configuration at 2-4 layer counts
(`base_num_decoder_layers=N override_model_config=true`, otherwise as in run.py). The bytes one more layer adds
per chip separate per-layer buffers (weights, gradients, checkpoints and the loop's extra buffer) from fixed
ones (embedding, logits, one layer's working set); costmodel/memory.py's XLA loop rule was read off these.
"""

from __future__ import annotations

import csv
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.maxtext_memory_compare import HERE, chips_of, model_from_row  # noqa: E402
from costmodel.estimate import estimate  # noqa: E402
from costmodel.job import Job  # noqa: E402
from costmodel.plan import Plan, parse_remat  # noqa: E402
from hardware.catalog import load_hardware  # noqa: E402


def predicted_total(r: dict[str, str], layers: int, models: dict) -> float:
    chips, tp, b = chips_of(r["topology"]), int(r["ici_tensor"]), int(r["per_device_batch_size"])
    m = replace(models[r["model_name"]], n_layers=layers)
    plan = Plan(fsdp=chips // tp, tp=tp, micro_batch=b * tp, zero=3, remat=parse_remat(r["remat_policy"]))
    job = Job(seq_len=int(r["max_target_length"]), global_batch=b * chips)
    return estimate(m, load_hardware("tpu-" + r["topology"].split("-")[0]), job, plan, chips).peak_memory_bytes


def main() -> None:
    models = {r["model_name"]: model_from_row(r) for r in csv.DictReader((HERE / "models.csv").open())}
    groups: dict[str, list[dict]] = {}
    for r in csv.DictReader((HERE / "layer_sweeps.csv").open()):
        groups.setdefault(r["id"].rsplit("_L", 1)[0], []).append(r)
    print(f"{'sweep':24s} {'layers':>9s} {'XLA GB/layer':>13s} {'model GB/layer':>15s} {'error %':>8s}")
    for name, rows in groups.items():
        rows.sort(key=lambda r: int(r["num_decoder_layers"]))
        lo, hi = rows[-2], rows[-1]
        la, lb = int(lo["num_decoder_layers"]), int(hi["num_decoder_layers"])
        xla = sum(float(hi[k]) - float(lo[k]) for k in ("argument_bytes", "temp_bytes")) / (lb - la)
        model = (predicted_total(hi, lb, models) - predicted_total(lo, la, models)) / (lb - la)
        print(f"{name:24s} {la:>4d}->{lb:<4d} {xla / 1e9:13.3f} {model / 1e9:15.3f} {(model - xla) / xla * 100:+8.1f}")


if __name__ == "__main__":
    main()
