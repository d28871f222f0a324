"""Validator sweep on 8 CPU devices: the cost model against XLA over model families x meshes x remat policies.

    .venv/bin/python benchmarks/validate_sweep.py [--out benchmarks/validate_sweep_report.txt]

The 14-plan benchmark (benchmarks/validate_cpu.py) is the fixed target set; this sweep looks for the regions where
the cost model and XLA part, over four shape families (llama3-8b: GQA + SwiGLU; gpt3-175b: MHA + GeLU, tied
embeddings; mixtral-8x7b: top-2 of 8; deepseek-v3: MLA, a dense layer and a shared expert), thirteen meshes of 8
devices and remat none / selective / full. FLOPs, memory and collective bytes only (no timing): about 7 s per plan
on the 2-core dev machine. Prints one line per plan that misses a tolerance, then the counts per quantity.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.validate import set_host_devices  # noqa: E402  (no jax yet)

MODELS = ("llama3-8b", "gpt3-175b", "mixtral-8x7b", "deepseek-v3-671b")
MESHES = (dict(dp=8), dict(fsdp=8), dict(tp=2, dp=4), dict(tp=4, dp=2), dict(tp=2, fsdp=4), dict(tp=4, fsdp=2),
          dict(tp=2, dp=4, sequence_parallel=False), dict(cp=2, dp=4), dict(cp=4, fsdp=2), dict(ep=2, dp=4),
          dict(ep=4, fsdp=2), dict(ep=8), dict(ep=2, tp=2, dp=2))
REMATS = ("none", "selective", "full")
QUANTITIES = ("flops", "memory_bytes", "state_bytes")


def plans():
    """(model, mesh, remat) of the sweep: ep only for MoE models, cp only for dense ones (the validator routes
    tokens per whole sequence)."""
    for model, mesh, remat in itertools.product(MODELS, MESHES, REMATS):
        moe = model in ("mixtral-8x7b", "deepseek-v3-671b")
        if ("ep" in mesh and not moe) or ("cp" in mesh and moe):
            continue
        yield model, mesh, remat


def label(mesh: dict) -> str:
    return "-".join(f"{k}{v}" if k != "sequence_parallel" else "nosp" for k, v in mesh.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "validate_sweep_report.txt"))
    args = ap.parse_args()
    set_host_devices(8)
    from costmodel.catalog import load_model
    from costmodel.plan import Plan, remat_policy
    from hardware.catalog import load_hardware
    from planner.validate.compare import run_plan

    chip, t0 = load_hardware("cpu-host"), time.time()
    lines, tally = [], {}
    for model, mesh, remat in plans():
        r = run_plan(f"{model}/{label(mesh)}/{remat}", load_model(model), Plan(remat=remat_policy(remat), **mesh),
                     chip, steps=1, time_steps=False)
        if r.error:
            lines.append(f"{r.name:45s} error: {r.error}")
            continue
        misses = []
        for c in r.checks:
            q = "collective_bytes" if c.quantity.startswith("collective_bytes") else c.quantity
            if q not in (*QUANTITIES, "collective_bytes"):
                continue
            ok, n = tally.get(q, (0, 0))
            tally[q] = (ok + c.ok, n + 1)
            if not c.ok:
                misses.append(f"{c.quantity.removeprefix('collective_bytes:')} {c.error_pct:+.1f}%")
        if misses:
            lines.append(f"{r.name:45s} " + ", ".join(misses))
        print(lines[-1] if misses else f"{r.name:45s} ok", flush=True)
    n_plans = sum(1 for _ in plans())
    summary = [f"# {n_plans} plans (4 model families x 13 meshes x 3 remat policies; ep for MoE, cp for dense), "
               f"scaled to d_model 128, 2 layers, seq 128; tolerances: FLOPs 3 %, memory and collectives 10 %",
               "# plans with a check outside its tolerance:", *lines, "",
               *(f"{q:18s} {ok} of {n} within tolerance" for q, (ok, n) in tally.items()),
               f"# wall time {time.time() - t0:.0f} s"]
    Path(args.out).write_text("\n".join(summary) + "\n")
    print("\n".join(summary[-len(tally) - 1:]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
