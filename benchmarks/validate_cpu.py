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

NOTES = """
# How the two sides were brought together, and what is left (evidence: the by-axis lines above, the optimized
# HLO's op_name metadata, XLA's buffer assignment and live ranges; bytes for d_model 128, seq 128, 2 layers, fp32)
# Validator / XLA:CPU side (the validator now runs the plan as Megatron and MaxText do):
#  - attention: flash-style (planner.validate.flash) with blocks of seq/4, so no s x s scores are kept, as the
#    cost model assumes; flash_flops_adjustment adds its whole diagonal blocks and backward QK^T recompute.
#  - XLA:CPU's cpu-all-reduce-combiner merged every gradient all-reduce into one at the end of the backward pass,
#    keeping all unreduced gradients live (fsdp8: 8x the sharded gradients); disabled (planner.validate.CPU_FLAGS).
#  - remat 'none' runs under jax.checkpoint(everything_saveable): without it XLA merged each weight's forward and
#    backward all-gathers and kept every gathered layer (fsdp8-none: all-gather -45 %, memory +29 % vs FSDP).
#  - fused QKV ([d, kv, g+2, hd], split by KV head over tp) and gated-MLP input ([d, 2, f]) projections, split
#    with jnp.split: one tp reduction of their input gradient each (XLA:CPU reduced q, k, v, wi_0, wi_1 one by
#    one: tp4-nosp had 18 all-reduces per step for 12).
#  - norm outputs gathered over tp before the column-split matmuls (Megatron's sequence parallelism; GSPMD had
#    gathered the weights over tp instead and swapped splits with all-to-alls).
#  - the embedding lookup spelled out (ids gathered, local d-slice lookup, one all-to-all per weight-shard axis);
#    MoE top-k as argmax rounds (XLA's top_k partitioner all-gathered the batch's router probabilities).
#  - all-reduce+reduce-scatter: XLA:CPU has no reduce-scatter creator; both kinds are compared together.
# Cost-model side (changes the validator found, each also in the published-run calibration):
#  - Job.scan_layers (MaxText scan_layers): the scanned backward loop's extra stacks are not counted for unrolled
#    layers (the validator unrolls; dp8/fsdp4-dp2/cp4 over-predictions of 9-28 % before).
#  - tp: the vocab-parallel embedding and the logits' input gradient (2 all-reduces per micro-step); the
#    sequence-parallel re-gather of the attention/MLP inputs in the backward (2 all-gathers per layer under any
#    remat); a MoE layer's MLP collectives carry its routed tokens (k x capacity).
#  - fsdp: the embedding rows' all-to-all (forward and backward, per weight-shard axis).
#  - cp: K/V as 2 all-gathers + 1 reduce-scatter per layer (was 3 all-gathers).
#  - MoE: MaxText's all-to-alls are not split over tp; with nothing recomputed a MoE layer keeps its dispatched
#    tokens and expert outputs; element-wise FLOPs (costmodel.flops.layer_vector_flops) in the flops check.
#  - MoE under MaxText (found on the TPU, benchmarks/validate_tpu.py): ep shards the non-expert weights like fsdp
#    (MaxText's `embed` rule lists `expert`); the validator now does the same, so their gradients are
#    reduce-scattered over ep with the layer (the ep all-reduce is gone) and moe-ep4-dp2 memory went from +2.9 %
#    to -3.6 %. The validator routes with capacity factor 1, so MaxText's worst-case dropless buffers
#    (costmodel.memory.routed_buffer_factor) are not in its prediction.
#  - DeepSeek's layout (deepseek-ep4-dp2-selective, 2026-12-01): the validator runs multi-head latent
#    attention (MaxText's MLA layer: low-rank query and key/value latents, a shared rope key, values narrower than
#    keys), a leading dense layer and shared experts (a dense MLP beside the routed ones). Cost-model fixes from
#    it: a shared expert keeps no dispatched copy or pre-combine output (remat-none memory of deepseek-v3 ep4-dp2
#    +13 % -> +10 %); under a JAX remat policy that recomputes anything the ep all-to-alls are rerun (6 per MoE
#    layer, not 4: the routed tokens are no named checkpoint; selective ep2-fsdp2-tp2 all-to-all -25 % / -29 % on
#    deepseek / mixtral, now exact); MLA's down-projections are not split over tp (MaxText maps their latent axes
#    to no mesh axis, Megatron-Core duplicates them): weights, per-chip FLOPs and hardware FLOPs count them on
#    every tp rank (dense MLA, tp 4: FLOPs -10.6 % -> -1.0 %). Its row: FLOPs -0.5 %, memory +7.2 % (temp +11 %:
#    the shared expert's and the dense layer's intermediates counted in full), collectives exact.
#  - the routed experts' gate and up weights are two arrays since 2026-12-01 (MaxText's wi_0 / wi_1, for the TPU
#    compile); the capacity-routed step stacks them for one matmul, one more copy of a layer's expert inputs:
#    moe-ep4-dp2-full memory -3.6 % -> -5.4 %, deepseek-ep4-dp2-selective +8.6 % -> +7.2 %.
#  - sliding windows (no preset has one; tests and the equality check use llama3-8b with Gemma 3's pattern): the
#    blockwise attention skips the blocks outside the window; FLOPs within 2 % on the plans tried.
# Outside this set (benchmarks/validate_sweep.py: 4 model families x 13 meshes x 3 remat policies, 120 plans;
# FLOPs 96/120, state 120/120, memory 75/120, collectives 258/303 within tolerance, with the flash barriers kept):
#  - tp with sequence parallelism: memory -10 % to -30 % (gpt3's shape most, tp 4 more than tp 2): XLA:CPU keeps
#    ten or more full-width [tokens, d] temporaries in a layer's backward (the gathered inputs and the partial
#    sums before their reduce-scatter), where the cost model's working set holds the sequence-split tensors; at
#    full width these are a few hundred MB beside tens of GB (the TPU tp plans: +1.1 % / +8.4 %).
#  - cp: memory +13 % to +22 % under selective/full remat (the cp4 gap above).
#  - MoE with tp but no ep: all-gather +12 % to +25 % (the routed tokens' tp traffic rule was read off ep x tp);
#    MoE with fsdp x tp and full remat: all-gather -18 % to -24 %; the 131 KB device reorder with ep x fsdp.
#  - gpt3 dp8 all-reduce -16.7 %: XLA:CPU reduces the tied embedding table's two gradients (lookup and logits)
#    separately; frameworks (and XLA's reassociation on accelerators) reduce their sum once.
#  - deepseek tp4 selective FLOPs had been -3.7 % / -5.4 %: MaxText's minimal policies keep query/key/value but not
#    MLA's latents, so the down-projections rerun under any remat (costmodel.estimate.rerun_once_ops; the remat
#    surrogate's rho_k); now -0.1 % / -2.0 %.
# Pipeline (pp2-dp4-full; planner.validate.pipeline follows MaxText's pipeline module):
#  - the step is manual over pp and dp: each gradient is reduced over dp once per step (GSPMD had all-reduced each
#    tick's partial sums: all-reduce -71 %); the tables sit on every stage, their gradients reduced over dp x pp;
#    the logits' batch is split over the stages (the last stage sends each stage its share).
#  - cost model (maxtext convention, read off MaxText's source and one pp compile, benchmarks/maxtext_memory):
#    M + pp - 1 iterations' checkpoints kept, both tables on every stage, logits of M / pp micro-batches per chip,
#    a stage shift per iteration but the last, layer collectives on every iteration (the bubble's too), no
#    gradient-accumulation carry; FLOPs, state and collectives now match exactly.
#  - memory: read off the step with the ticks as one lax.scan (MaxText's form, one [M, ...] input/output buffer
#    like MaxText's state_io; the unrolled step's XLA:CPU schedule defers every tick's weight-gradient products to
#    the end, -29 %). Like MaxText's compiled pipeline, the scanned loop carries the stage's gradients
#    (costmodel.memory.maxtext_stage_buffers, read off MaxText's layer sweeps): -1.7 % to +7.0 % on the pp plans
#    (-12 % before that term).
# What is left:
#  - cp4-dp2-full memory +17 %: 32 tokens per device, so one gathered fp32 layer and its unreduced gradient are
#    60 % of the predicted temp; the cost model sums the phase maxima (gathered layer + logits + working set),
#    while XLA:CPU peaks in the loss phase without the layer buffers. Kept: on the TPU compiles of MaxText the
#    sum is what XLA holds.
#  - moe-ep2-fsdp2-tp2-none collective-permute (131 KB, 2 % of its traffic): GSPMD reorders devices between the
#    MoE dispatch shardings (the embedding rows' all-to-all lands in (dp, ep, fsdp) batch order); not counted.
#  - matmul_flops (informational): XLA:CPU rewrites some flash block products as multiply-reduce fusions, which
#    cost_analysis counts (flops check) but the dot count misses; selective plans are 2-4 % over because XLA
#    does not rerun their flash forward.
#  - dp8-full temp +17 % with memory +6 %, pp2 temp +11-13 % with memory +5-7 %: the state dominates memory.
#  - pp2-fsdp2-dp2-full all-gather +31 %, all-reduce+reduce-scatter -45 %: the cost model counts what MaxText's
#    TPU step does (benchmarks/maxtext_memory/NOTES.md): fsdp gathers on each of the M + pp - 1 iterations (its
#    loop bodies hold them) and one reduce-scatter of the stage's gradients after the loop; XLA:CPU hoists the
#    validator's gathers out of the tick loop (unrolled or scanned alike) and reduces per micro-batch.
# cpu-host profile: costmodel.calibrate.BOUNDS (matmul_peak >= 0.3, hbm >= 0.2) cannot express a host CPU, so the
# validator fits with wider CPU bounds.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="cpu8")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per plan per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds over all plans (interleaved timing)")
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
    from planner.validate.calibrate_cpu import (
        cases_from,
        fit_efficiency,
        predicted_times,
        summary,
        time_in_rounds,
        write_profile,
    )
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
        r = run_plan(name, load_model(model), plan, chip, devices=args.devices, steps=0, scale=scale,
                     time_steps=False, keep_runner=True)
        print(f"  [{time.time() - t0:5.0f} s] {name}: " + (r.error or f"compiled in {r.compile_s:.1f} s"),
              file=sys.stderr, flush=True)
        results.append(r)

    time_in_rounds(results, chip, args.rounds, args.steps,
                   log=lambda msg: print(f"  [{time.time() - t0:5.0f} s] {msg}", file=sys.stderr, flush=True))

    out(f"# Validator on {args.devices} CPU devices: cost model ({chip.name}) vs XLA, set '{args.set}'")
    out(f"# scaled models: d_model {args.d_model}, 2 layers, seq {args.seq_len}, fp32 compute; "
        f"{'XLA backend opt level 0' if args.fast_compile else 'default XLA optimisation'}; "
        f"step time: median over {args.rounds} interleaved rounds of the fastest of {args.steps} steps")
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
    # Leave one out: each plan predicted by a profile fitted on the others.
    loo = [predicted_times([c], fit_efficiency(cases[:i] + cases[i + 1:], chip)[0])[0] for i, c in enumerate(cases)]
    sl = summary(loo, meas)
    out(f"leave-one-out:      Spearman {sl['spearman']:.3f}, median |error| {sl['median_error_pct']:.1f}%, "
        f"max {sl['max_error_pct']:.1f}%  (each plan predicted by a fit on the other {len(cases) - 1})")
    out(f"# total wall time {time.time() - t0:.0f} s")
    if args.set == "cpu8" and args.d_model == 128 and args.seq_len == 128:
        out(NOTES.rstrip())
    odir = Path(args.out)
    odir.mkdir(parents=True, exist_ok=True)
    prof = write_profile(cal, PROFILE_DIR / f"{args.hardware}.yaml", odir / "validate_cpu_profile.yaml",
                         f"[FIT] efficiencies fitted by benchmarks/validate_cpu.py on {len(cases)} validator plans")
    (odir / "validate_cpu_report.txt").write_text("\n".join(lines) + "\n")
    print(f"wrote {odir / 'validate_cpu_report.txt'} and {prof}", file=sys.stderr)


if __name__ == "__main__":
    main()
