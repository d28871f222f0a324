"""Per-chip memory: the cost model vs MaxText 0.2.5's real TPU compile (benchmarks/maxtext_memory/results.csv).

Usage: python benchmarks/maxtext_memory_compare.py [--write]
Each row of results.csv is one `train_compile` run (made by `make maxtext-memory`); the model shape comes from
the MaxText preset (models.csv). The plan: ici_fsdp = -1 fills the slice, so fsdp = chips / (tensor*context);
MaxText's per_device_batch_size b gives each model replica b * tensor * context sequences per step,
split into gradient_accumulation_steps micro-steps; weight_dtype and custom remat knobs come from extra_args.
Compiled total = argument + output - alias + temp bytes per chip.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodel.estimate import estimate  # noqa: E402
from costmodel.job import Job  # noqa: E402
from costmodel.model import ModelSpec  # noqa: E402
from costmodel.plan import Plan, Remat, parse_remat  # noqa: E402
from hardware.catalog import load_hardware  # noqa: E402

HERE = ROOT / "benchmarks" / "maxtext_memory"
# Configurations added to run.py after costmodel/memory.py's XLA loop-buffer rule was read off the others.
HOLDOUT = ("l2-13b_v5p32_b2_s4096_minimal", "l3-8b_v5p16_b2_s4096_savedotexceptmlp",
           "mistral-7b_v6e8_b1_s8192_full_tp2", "l3-70b_v5p128_b1_s8192_saveqkv", "qwen3-8b_v6e16_b2_s4096_minimal",
           "l2-7b_v5p32_b4_s2048_full_tp4",
           # added after the tensor-parallel loop buffer was revised (2026-12-01)
           "l3-8b_v5p16_b1_s4096_full_tp2", "l2-70b_v6e64_b1_s4096_full_tp2", "l3-8b_v5p16_b2_s4096_full_tp2",
           # pipeline shapes compiled after the pp rules were read off l2-7b_v5p16_b2_s2048_full_pp2 (the pp2 x dp4
           # row, -22 % then, and the circular one, +9.8 %, were read afterwards and are now among the fitted ones)
           "l2-7b_v5p16_b1_s2048_full_pp4", "l2-7b_v5p16_b2_s2048_full_pp2_m4", "l3-8b_v6e8_b1_s4096_full_pp2",
           # two published v6e recipes (tpu-recipes-v6e rows of runs_dev.csv) with host-offloaded checkpoints
           "trillium-l31-8b_v6e8_b3_s8192_custom", "trillium-l31-70b_v6e64_b2_s8192_custom",
           # the fit check's boundary on v6e, compiled after the fit floor was set (two fit, two refused)
           "l3-8b_v6e8_b2_s8192_full", "l3-8b_v6e8_b1_s8192_savedotexceptmlp", "l3-8b_v6e8_b3_s8192_full",
           "l3-8b_v6e8_b2_s8192_saveqkv",
           # MLA under tp and under a minimal remat policy (DeepSeek-V2-Lite), compiled after the MLA rules were
           # read off MaxText's source (2026-12-01, tenth session)
           "deepseek2-16b_v5p16_b0.5_s4096_full_tp2", "deepseek2-16b_v5p16_b1_s4096_minimal",
           # the output table's size and tying, one at a time, on llama3-8b over fsdp 8 (twelfth session)
           "l3-8b_v5p16_b1_s4096_full", "l3-8b_v5p16_b1_s4096_full_tied", "l3-8b_v5p16_b1_s4096_full_v262k",
           "l3-8b_v5p16_b1_s4096_full_v262k_tied",
           # a published v6e recipe the fit floor put over v6e's HBM (gpt3-175b, 256 chips; fifteenth session)
           "trillium-gpt3-175b_v6e256_b3_s2048_full",
           # the xla_may_fit band (floor up to 10 % over the HBM), compiled after the margin was set
           "l3-8b_v6e8_b3_s4096_savedotexceptmlp", "mistral-7b_v6e8_b2_s8192_savedotexceptmlp",
           "l2-7b_v6e8_b2_s8192_saveqkv", "l2-13b_v6e8_b2_s4096_full", "mistral-7b_v6e8_b6_s8192_full",
           "l2-13b_v6e8_b3_s4096_full",
           # the fit floor just under the HBM (96.7-100 % of it), compiled to test the "fits" side of the boundary
           "l3-8b_v6e8_b3_s4096_saveqkv", "l2-7b_v6e8_b3_s2048_minimal", "l2-7b_v6e8_b5_s8192_full",
           "l2-13b_v6e8_b1_s4096_full")
# benchmarks/validate_tpu.py's plans as MaxText runs them (added 2026-12-01; the two DeepSeek-V2-Lite ones in the
# tenth session, compiled after every rule); the tensor-parallel loop buffer of costmodel.memory.xla_loop_extra_bytes
# was revised after the dense ones (it had been read off one tp config).
VALIDATOR_PLANS = ("l3-8b_v5p8_b1_s4096_full", "l3-8b_v5p8_b1_s4096_minimal", "l3-8b_v5p16_b0.5_s4096_full_tp2",
           "l3-8b_v6e8_b1_s8192_saveqkv", "l3-8b_v6e8_b0.5_s8192_full_cp2", "l2-70b_v5p64_b1_s4096_full",
           "l2-70b_v6e64_b0.5_s4096_full_tp2", "mixtral-8x7b_v5p64_b1_s4096_full_ep4",
           "deepseek2-16b_v5p16_b1_s4096_full", "deepseek2-16b_v5p16_b1_s4096_full_ep4",
           # Gemma 3 12B's sliding windows (2026-12-02, eleventh session, compiled after every rule)
           "gemma3-12b_v5p16_b1_s4096_full",
           # Mixtral in pipeline stages, pp 2 x ep 8 (2026-12-04, twelfth session, compiled after every rule)
           "mixtral-8x7b_v5p32_b1_s2048_full_pp2_ep8")


def model_from_row(r: dict[str, str]) -> ModelSpec:
    experts = int(r["num_experts"] or 1)
    # MLA (attention_type mla; base.yml's MLA defaults are listed for every model, read only then): the query /
    # key head is the no-rope part plus the shared rope part
    mla = r.get("attention_type") == "mla"
    head_dim = int(r["qk_nope_head_dim"]) + int(r["qk_rope_head_dim"]) if mla else int(r["head_dim"])
    mla_fields = dict(q_lora_rank=int(r["q_lora_rank"]), kv_lora_rank=int(r["kv_lora_rank"]),
                      qk_rope_head_dim=int(r["qk_rope_head_dim"]), v_head_dim=int(r["v_head_dim"])) if mla else {}
    # sliding windows (sliding_window_size; read only when the row has it): MaxText's gemma3 decoder block runs
    # five local layers, then a global one (models/gemma3.py, GEMMA3_ATTENTION_PATTERN); attention_type
    # local_sliding makes every layer local; otherwise the window is unused
    window = int(r.get("sliding_window_size") or 0)
    gemma3, local = r["decoder_block"] == "gemma3", r.get("attention_type") == "local_sliding"
    window_fields = dict(sliding_window=window if gemma3 or local else 0, local_per_global=5 if gemma3 else 0)
    return ModelSpec(
        **mla_fields, **window_fields, n_dense_layers=int(r.get("first_num_dense_layers") or 0) if experts > 1 else 0,
        n_shared_experts=int(r.get("shared_experts") or 0) if experts > 1 else 0,
        name=r["model_name"], n_layers=int(r["num_decoder_layers"]), d_model=int(r["emb_dim"]),
        n_heads=int(r["num_query_heads"]), n_kv_heads=int(r["num_kv_heads"]), head_dim=head_dim,
        ffn_dim=int(r["mlp_dim"]), vocab_size=int(r["vocab_size"]), gated_mlp="linear" in r["mlp_activations"],
        tied_embeddings=r["logits_via_embedding"] == "True",
        n_experts=experts if experts > 1 else 0, experts_per_token=int(r["num_experts_per_tok"]) if experts > 1 else 0,
        moe_ffn_dim=int(r["moe_mlp_dim"] or 0) if experts > 1 else 0)


def with_overrides(m: ModelSpec | None, extra: dict[str, str]) -> ModelSpec | None:
    """The model with the run's model-config overrides (override_model_config=true: vocab_size,
    logits_via_embedding)."""
    if m is None:
        return None
    if "vocab_size" in extra:
        m = replace(m, vocab_size=int(extra["vocab_size"]))
    if "logits_via_embedding" in extra:
        m = replace(m, tied_embeddings=extra["logits_via_embedding"].lower() == "true")
    return m


def extra_args(text: str) -> dict[str, str]:
    """MaxText overrides recorded in results.csv's extra_args column ('k=v;k=v' or 'k=v k=v')."""
    items = [t for t in text.replace(";", " ").split() if "=" in t]
    return dict(t.split("=", 1) for t in items)


def remat_of(policy: str, extra: dict[str, str]) -> Remat:
    """MaxText's remat_policy; 'custom' takes its per-tensor knobs (decoder_layer_input=offload, ...)."""
    if policy != "custom":
        return parse_remat(policy)
    knobs = [f"{k}={v}" for k, v in extra.items() if v in ("remat", "device", "offload")]
    return parse_remat("custom:" + ",".join(knobs))


def chips_of(topology: str) -> int:
    kind, n = topology.split("-")
    return int(n) // 2 if kind in ("v5p", "v4") else int(n)  # v5p-N / v4-N count TensorCores


def compare() -> list[dict]:
    models = {r["model_name"]: model_from_row(r) for r in csv.DictReader((HERE / "models.csv").open())}
    out = []
    for r in csv.DictReader((HERE / "results.csv").open()):
        if r.get("status") not in ("ok", "oom") or r["model_name"] not in models:
            continue
        chips = chips_of(r["topology"])
        tp, cp = int(r["ici_tensor"] or 1), int(r["ici_context"] or 1)
        b = float(r["per_device_batch_size"])  # MaxText accepts fractions (global batch = b * chips)
        extra = extra_args(r["extra_args"])
        ga = int(extra.get("gradient_accumulation_steps", 1))
        chip = load_hardware("tpu-" + r["topology"].split("-")[0])
        # pipeline: num_pipeline_microbatches defaults to pp; vpp = the circular repeats; layers within a
        # stage are not scanned (scan_layers_per_stage: false)
        pp = int(extra.get("ici_pipeline_parallelism", 1))
        n_micro = int(extra.get("num_pipeline_microbatches", pp)) if pp > 1 else 1
        m = with_overrides(models.get(r["model_name"]), extra)
        vpp = m.n_layers // (pp * int(extra.get("num_layers_per_pipeline_stage", 1))) if pp > 1 and m else 1
        dp = int(extra.get("ici_data_parallelism", 1))  # replicated weights, optimizer state not sharded over it
        ep = int(extra.get("ici_expert_parallelism", 1))  # experts split over it, the other weights fsdp-like
        plan = Plan(dp=dp, fsdp=chips // (tp * cp * pp * dp * ep), tp=tp, cp=cp, pp=pp, ep=ep, vpp=vpp,
                    micro_batch=round(b * tp * cp * pp / (ga * n_micro)), zero=3 if dp == 1 else 0,
                    remat=remat_of(r["remat_policy"], extra))
        job = Job(seq_len=int(r["max_target_length"]), global_batch=round(b * chips), framework="maxtext",
                  weight_dtype=extra.get("weight_dtype", "float32"), scan_layers=pp == 1)
        cost = estimate(m, chip, job, plan, chips)
        row = {"id": r["id"], "chips": chips, "predicted_bytes": cost.peak_memory_bytes, "fits": cost.fits,
               "usable_bytes": cost.hbm_usable_bytes, "fit_bytes": cost.fit_memory_bytes,
               "group": "holdout" if r["id"] in HOLDOUT else "validator" if r["id"] in VALIDATOR_PLANS else "fitted",
               "breakdown": cost.memory}
        if r["status"] == "oom":  # XLA refused to compile: the model should say it does not fit
            out.append({**row, "xla_bytes": None, "error_pct": None})
            continue
        xla = float(r["total_bytes_per_chip"])
        out.append({**row, "xla_bytes": xla, "error_pct": (cost.peak_memory_bytes - xla) / xla * 100})
    return out


def report(rows: list[dict]) -> str:
    s = io.StringIO()
    s.write(f"{'config':42s} {'chips':>5s} {'model GB':>9s} {'XLA GB':>8s} {'error %':>8s}\n")
    for r in rows:
        tag = {"holdout": "  (holdout)", "validator": "  (validator plan)"}.get(r["group"], "")
        if r["xla_bytes"] is None:
            verdict = "agrees" if not r["fits"] else "DISAGREES"
            s.write(f"{r['id']:42s} {r['chips']:5d} {r['predicted_bytes'] / 1e9:9.2f} {'OOM':>8s} {'':>8s}  "
                    f"XLA refused it (over HBM); model: {'fits' if r['fits'] else 'does not fit'} ({verdict}){tag}\n")
            continue
        s.write(f"{r['id']:42s} {r['chips']:5d} {r['predicted_bytes'] / 1e9:9.2f} {r['xla_bytes'] / 1e9:8.2f} "
                f"{r['error_pct']:+8.1f}{tag}\n")
    for label, group in (("fitted on", "fitted"), ("holdout", "holdout"), ("validator plans", "validator")):
        errs = [abs(r["error_pct"]) for r in rows if r["xla_bytes"] is not None and r["group"] == group]
        if errs:
            s.write(f"\n{label:15s}: mean |error| {sum(errs) / len(errs):.1f}%, worst {max(errs):.1f}%, "
                    f"within 5%: {sum(e <= 5 for e in errs)}/{len(errs)}")
    ooms = [r for r in rows if r["xla_bytes"] is None]
    if ooms:
        s.write(f"\nOOM rows predicted not to fit: {sum(not r['fits'] for r in ooms)}/{len(ooms)}")
    ok = [r for r in rows if r["xla_bytes"] is not None]
    over = [r for r in ok if r["predicted_bytes"] > r["usable_bytes"]]
    s.write(f"\nfit verdict (Cost.fits: the fit floor, costmodel.memory.fit_floor_bytes, against the usable HBM): "
            f"compiles XLA accepted predicted to fit {sum(r['fits'] for r in ok)}/{len(ok)} "
            f"({sum(r['fits'] for r in over)} of the {len(over)} whose predicted total is over the usable HBM)")
    return s.getvalue() + "\n" + peak_report(rows)


def peak_report(rows: list[dict]) -> str:
    """XLA's peak_memory_in_bytes (maxtext_memory/xla_peaks.csv, read with peak_probe/) beside the printed total
    that the rows above compare with; configurations with host offload are left out (their peak counts host
    buffers)."""
    path = HERE / "xla_peaks.csv"
    if not path.exists():
        return ""
    peaks = {r["id"]: float(r["xla_peak_bytes"]) for r in csv.DictReader(path.open())
             if r["status"] == "ok" and r["xla_peak_bytes"] and not float(r["host_temp_bytes"] or 0)}
    pairs = [(r, peaks[r["id"]]) for r in rows if r["xla_bytes"] is not None and r["id"] in peaks]
    if not pairs:
        return ""
    below = sorted((r["xla_bytes"] - p) / r["xla_bytes"] * 100 for r, p in pairs)
    errs = [(r["predicted_bytes"] - p) / p * 100 for r, p in pairs]
    floor = sorted((r["fit_bytes"] - p) / p * 100 for r, p in pairs)
    return (f"\nXLA's own peak (peak_memory_in_bytes, {len(pairs)} compiles without host offload): "
            f"{below[0]:.1f}-{below[-1]:.1f}% below the printed total (median {below[len(below) // 2]:.1f}%); "
            f"the cost model's total against the peak: mean {sum(errs) / len(errs):+.1f}%, within 5%: "
            f"{sum(abs(e) <= 5 for e in errs)}/{len(errs)}; its fit floor (the fit check's figure) against the "
            f"peak: mean {sum(floor) / len(floor):+.1f}%, {floor[0]:+.1f} to {floor[-1]:+.1f}%, within 5%: "
            f"{sum(abs(e) <= 5 for e in floor)}/{len(floor)}\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    text = report(compare())
    print(text)
    if ap.parse_args().write:
        (ROOT / "benchmarks" / "maxtext_memory_report.txt").write_text(text)


if __name__ == "__main__":
    main()
