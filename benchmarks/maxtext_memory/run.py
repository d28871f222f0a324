#!/usr/bin/env python3
"""Ground-truth per-chip HBM figures from MaxText's ahead-of-time TPU compile.

For each configuration below this runs MaxText's real training step through
``python -m maxtext.trainers.pre_train.train_compile`` (XLA:TPU on the CPU host for a fake
``compile_topology``), parses the ``Memory analysis: CompiledMemoryStats(...)`` line and appends
one row to ``results.csv``; configs with an ``ok`` or ``oom`` row are skipped (resumable).
Run it with the Python of the MaxText environment (``requirements.txt``, ``Makefile.inc``)::

    /work/maxtext-env/bin/python benchmarks/maxtext_memory/run.py [--only ID] [--list] [--models-only]

total_bytes_per_chip = argument + output - alias + temp  (device HBM only; XLA's usual
peak-footprint formula). generated_code and host_* bytes are reported separately.
(evidence and details: docs/memory_validation.md)
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repo root: the log parser lives in planner/verify.py (stdlib only)
from planner.verify import FLOPS_RE, OOM_RE, parse_memory, total_bytes  # noqa: E402

RESULTS = HERE / "results.csv"
MODELS_CSV = HERE / "models.csv"
OUT_DIR = Path(os.environ.get("MAXTEXT_OUT", "/work/maxtext-out"))

COLUMNS = [
    "id", "model_name", "topology", "chips", "ici_fsdp", "ici_tensor", "ici_context",
    "per_device_batch_size", "max_target_length", "remat_policy", "extra_args",
    "argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "total_bytes_per_chip",
    "compile_seconds", "maxtext_version", "libtpu_version",
    # extra columns (not in the original brief) -----------------------------------
    "generated_code_bytes", "host_argument_bytes", "host_output_bytes", "host_alias_bytes",
    "host_temp_bytes", "total_gib_per_chip", "flops_per_chip", "jax_version", "peak_rss_mb",
    "status", "error",
]


@dataclass
class Config:
    id: str
    model: str
    topology: str
    batch: float  # per_device_batch_size (MaxText accepts fractions: global batch = batch * chips)
    seq: int
    remat: str = "full"
    fsdp: int = -1
    tensor: int = 1
    context: int = 1
    extra: dict = field(default_factory=dict)


# Ordered by value: the first ones are cheap and give the cleanest deltas.
CONFIGS: list[Config] = [
    # llama2-7b on 4 chips: batch / seq / remat sweeps on one mesh
    Config("l2-7b_v5p8_b1_s2048_full", "llama2-7b", "v5p-8", 1, 2048, "full"),
    Config("l2-7b_v5p8_b2_s2048_full", "llama2-7b", "v5p-8", 2, 2048, "full"),
    Config("l2-7b_v5p8_b1_s2048_minimal", "llama2-7b", "v5p-8", 1, 2048, "minimal"),
    Config("l2-7b_v5p8_b1_s2048_savedotexceptmlp", "llama2-7b", "v5p-8", 1, 2048, "save_dot_except_mlp"),
    Config("l2-7b_v5p8_b4_s2048_qkvoffload", "llama2-7b", "v5p-8", 4, 2048, "qkv_proj_offloaded"),
    # llama3-8b on v6e-8: long sequence, TP, context parallel
    Config("l3-8b_v6e8_b1_s8192_full", "llama3-8b", "v6e-8", 1, 8192, "full"),
    Config("l3-8b_v6e8_b2_s4096_saveqkv_tp2", "llama3-8b", "v6e-8", 2, 4096, "save_qkv_proj", tensor=2),
    Config("l3-8b_v6e8_b1_s8192_full_cp2", "llama3-8b", "v6e-8", 1, 8192, "full", context=2),
    # 70B class on 64 chips
    Config("l2-70b_v5p128_b1_s4096_full", "llama2-70b", "v5p-128", 1, 4096, "full"),
    Config("l2-70b_v5p128_b2_s4096_saveqkv", "llama2-70b", "v5p-128", 2, 4096, "save_qkv_proj"),
    Config("l3-70b_v6e64_b1_s8192_full_tp4", "llama3-70b", "v6e-64", 1, 8192, "full", tensor=4,
           extra={"allow_split_physical_axes": "true"}),  # tp=4 on an 8x8 torus needs a split axis
    Config("l3-70b_v5p128_b1_s8192_full_tp4", "llama3-70b", "v5p-128", 1, 8192, "full", tensor=4),
    # MoE and a GPT-3 style model
    Config("mixtral-8x7b_v5p64_b1_s4096_full", "mixtral-8x7b", "v5p-64", 1, 4096, "full"),
    Config("gpt3-6b_v6e16_b2_s2048_minimal", "gpt3-6b", "v6e-16", 2, 2048, "minimal",
           extra={"override_model_config": "true"}),  # gpt3-6b.yml pins max_target_length=1024
    Config("l2-7b_v5p16_b4_s4096_full_tp2", "llama2-7b", "v5p-16", 4, 4096, "full", tensor=2),
    # second batch: single-knob deltas against the baselines above
    Config("l2-7b_v5p8_b1_s4096_full", "llama2-7b", "v5p-8", 1, 4096, "full"),
    Config("l2-7b_v5p8_b1_s2048_full_bf16w", "llama2-7b", "v5p-8", 1, 2048, "full",
           extra={"weight_dtype": "bfloat16"}),
    Config("l3-8b_v6e8_b1_s8192_custom_inputoffload", "llama3-8b", "v6e-8", 1, 8192, "custom",
           extra={"decoder_layer_input": "offload"}),
    Config("l2-70b_v5p128_b1_s4096_minimal", "llama2-70b", "v5p-128", 1, 4096, "minimal"),
    Config("l2-7b_v5p8_b2_s2048_full_ga2", "llama2-7b", "v5p-8", 2, 2048, "full",
           extra={"gradient_accumulation_steps": 2}),
    Config("gpt3-175b_v5p128_b1_s2048_full", "gpt3-175b", "v5p-128", 1, 2048, "full"),
    # holdout: added after costmodel/memory.py's XLA loop-buffer rule was read off the configs above (and their
    # layer-count sweeps); not used to derive it
    Config("l2-13b_v5p32_b2_s4096_minimal", "llama2-13b", "v5p-32", 2, 4096, "minimal"),
    Config("l3-8b_v5p16_b2_s4096_savedotexceptmlp", "llama3-8b", "v5p-16", 2, 4096, "save_dot_except_mlp"),
    Config("mistral-7b_v6e8_b1_s8192_full_tp2", "mistral-7b", "v6e-8", 1, 8192, "full", tensor=2),
    Config("l3-70b_v5p128_b1_s8192_saveqkv", "llama3-70b", "v5p-128", 1, 8192, "save_qkv_proj"),
    Config("qwen3-8b_v6e16_b2_s4096_minimal", "qwen3-8b", "v6e-16", 2, 4096, "minimal"),
    Config("l2-7b_v5p32_b4_s2048_full_tp4", "llama2-7b", "v5p-32", 4, 2048, "full", tensor=4),
    # the seven plans of benchmarks/validate_tpu.py, as MaxText runs them (one sequence per batch shard)
    Config("l3-8b_v5p8_b1_s4096_full", "llama3-8b", "v5p-8", 1, 4096, "full"),
    Config("l3-8b_v5p8_b1_s4096_minimal", "llama3-8b", "v5p-8", 1, 4096, "minimal"),
    Config("l3-8b_v5p16_b0.5_s4096_full_tp2", "llama3-8b", "v5p-16", 0.5, 4096, "full", tensor=2),
    Config("l3-8b_v6e8_b1_s8192_saveqkv", "llama3-8b", "v6e-8", 1, 8192, "save_qkv_proj"),
    Config("l3-8b_v6e8_b0.5_s8192_full_cp2", "llama3-8b", "v6e-8", 0.5, 8192, "full", context=2),
    Config("l2-70b_v5p64_b1_s4096_full", "llama2-70b", "v5p-64", 1, 4096, "full"),
    Config("l2-70b_v6e64_b0.5_s4096_full_tp2", "llama2-70b", "v6e-64", 0.5, 4096, "full", tensor=2,
           extra={"allow_split_physical_axes": "true"}),  # tp=2 on an 8x8 torus needs a split axis
    # the tp plans above with two sequences per replica (the loop's tp buffer and the micro-batch)
    Config("l3-8b_v5p16_b1_s4096_full_tp2", "llama3-8b", "v5p-16", 1, 4096, "full", tensor=2),
    Config("l3-8b_v5p16_b2_s4096_full_tp2", "llama3-8b", "v5p-16", 2, 4096, "full", tensor=2),
    Config("l2-70b_v6e64_b1_s4096_full_tp2", "llama2-70b", "v6e-64", 1, 4096, "full", tensor=2,
           extra={"allow_split_physical_axes": "true"}),
    # pipeline parallelism (GPipe: one layer block of 16 per stage, no circular repeats)
    Config("l2-7b_v5p16_b2_s2048_full_pp2", "llama2-7b", "v5p-16", 2, 2048, "full",
           extra={"ici_pipeline_parallelism": 2, "num_layers_per_pipeline_stage": 16}),
    # more pipeline shapes, compiled after the pp rules were read off the row above (holdout)
    Config("l2-7b_v5p16_b2_s2048_full_pp2_dp4", "llama2-7b", "v5p-16", 2, 2048, "full", fsdp=1,
           extra={"ici_pipeline_parallelism": 2, "num_layers_per_pipeline_stage": 16, "ici_data_parallelism": 4}),
    Config("l2-7b_v5p16_b1_s2048_full_pp4", "llama2-7b", "v5p-16", 1, 2048, "full",
           extra={"ici_pipeline_parallelism": 4, "num_layers_per_pipeline_stage": 8}),
    Config("l2-7b_v5p16_b2_s2048_full_pp2_m4", "llama2-7b", "v5p-16", 2, 2048, "full",
           extra={"ici_pipeline_parallelism": 2, "num_layers_per_pipeline_stage": 16,
                  "num_pipeline_microbatches": 4}),
    Config("l2-7b_v5p16_b2_s2048_full_pp2_circ2", "llama2-7b", "v5p-16", 2, 2048, "full",
           extra={"ici_pipeline_parallelism": 2, "num_layers_per_pipeline_stage": 8}),
    Config("l3-8b_v6e8_b1_s4096_full_pp2", "llama3-8b", "v6e-8", 1, 4096, "full",
           extra={"ici_pipeline_parallelism": 2, "num_layers_per_pipeline_stage": 16}),
    # expert parallelism (the validator's MoE TPU plan, benchmarks/validate_tpu.py)
    Config("mixtral-8x7b_v5p64_b1_s4096_full_ep4", "mixtral-8x7b", "v5p-64", 1, 4096, "full",
           extra={"ici_expert_parallelism": 4}),
    Config("mixtral-8x7b_v5p64_b1_s4096_full_ep2", "mixtral-8x7b", "v5p-64", 1, 4096, "full",
           extra={"ici_expert_parallelism": 2}),
    Config("mixtral-8x7b_v5p64_b1_s4096_full_ep8", "mixtral-8x7b", "v5p-64", 1, 4096, "full",
           extra={"ici_expert_parallelism": 8}),
    # DeepSeek-V2-Lite (MLA without a query latent, 64 routed experts top-6 + 2 shared, first layer dense): the
    # validator's DeepSeek TPU plans (benchmarks/validate_tpu.py, added 2026-12-01, tenth session)
    Config("deepseek2-16b_v5p16_b1_s4096_full", "deepseek2-16b", "v5p-16", 1, 4096, "full"),
    Config("deepseek2-16b_v5p16_b1_s4096_full_ep4", "deepseek2-16b", "v5p-16", 1, 4096, "full",
           extra={"ici_expert_parallelism": 4}),
    # MLA's tensor-parallel and remat rules (costmodel: down-projections on every tp rank, rerun under any remat),
    # read off MaxText's source, against its compile (holdout)
    Config("deepseek2-16b_v5p16_b0.5_s4096_full_tp2", "deepseek2-16b", "v5p-16", 0.5, 4096, "full", tensor=2),
    Config("deepseek2-16b_v5p16_b1_s4096_minimal", "deepseek2-16b", "v5p-16", 1, 4096, "minimal"),
    # sliding windows (Gemma 3 12B: five 1024-token local layers per global one, 262K vocabulary, tied): the
    # validator's Gemma 3 TPU plan (added 2026-12-02, eleventh session, after every memory rule)
    Config("gemma3-12b_v5p16_b1_s4096_full", "gemma3-12b", "v5p-16", 1, 4096, "full"),
    # the output table's vocabulary and tying, one at a time, on llama3-8b over fsdp 8 (twelfth session: Gemma 3's
    # 262K tied table was -11 % against MaxText's compile; is it the size or the tying?)
    Config("l3-8b_v5p16_b1_s4096_full", "llama3-8b", "v5p-16", 1, 4096, "full"),
    Config("l3-8b_v5p16_b1_s4096_full_tied", "llama3-8b", "v5p-16", 1, 4096, "full",
           extra={"override_model_config": "true", "logits_via_embedding": "true"}),
    Config("l3-8b_v5p16_b1_s4096_full_v262k", "llama3-8b", "v5p-16", 1, 4096, "full",
           extra={"override_model_config": "true", "vocab_size": 262144}),
    Config("l3-8b_v5p16_b1_s4096_full_v262k_tied", "llama3-8b", "v5p-16", 1, 4096, "full",
           extra={"override_model_config": "true", "vocab_size": 262144, "logits_via_embedding": "true"}),
    # MoE in pipeline stages: the validator's Mixtral pp 2 x ep 8 TPU plan (added 2026-12-04, twelfth session, after
    # every memory rule; 2 micro-batches of 8 sequences)
    Config("mixtral-8x7b_v5p32_b1_s2048_full_pp2_ep8", "mixtral-8x7b", "v5p-32", 1, 2048, "full", fsdp=1,
           extra={"ici_pipeline_parallelism": 2, "num_layers_per_pipeline_stage": 16, "ici_expert_parallelism": 8}),
    # published v6e recipes that ran (tpu-recipes-v6e rows of runs_dev.csv) and that the cost model predicted over
    # the chip's HBM (32.8 and 33.9 GiB against 30.4 usable): what MaxText's own compile holds
    Config("trillium-l31-8b_v6e8_b3_s8192_custom", "llama3.1-8b", "v6e-8", 3, 8192, "custom",
           extra={"decoder_layer_input": "offload", "out_proj": "offload", "query_proj": "offload",
                  "key_proj": "offload", "value_proj": "offload"}),
    Config("trillium-l31-70b_v6e64_b2_s8192_custom", "llama3.1-70b", "v6e-64", 2, 8192, "custom",
           extra={"decoder_layer_input": "offload", "query_proj": "offload", "key_proj": "offload",
                  "value_proj": "offload"}),
    # a published v6e recipe that ran and that the fit floor puts 9 % over v6e's HBM (tpu-recipes-v6e gpt_3_175b_bf16:
    # per_device_batch_size 3, full remat; the recipe's XLA flags not set; added 2026-12-05, fifteenth session)
    Config("trillium-gpt3-175b_v6e256_b3_s2048_full", "gpt3-175b", "v6e-256", 3, 2048, "full"),
    # the band where Cost.xla_may_fit says XLA may compile a plan the fit floor puts over the HBM (floor at most 10 %
    # over, costmodel.memory.XLA_SQUEEZE_MARGIN): compiled after the margin was set (fifteenth session, holdout), four
    # inside it (floor 3-9 % over v6e's 31.24 GiB) and two beyond it (11-13 % over)
    Config("l3-8b_v6e8_b3_s4096_savedotexceptmlp", "llama3-8b", "v6e-8", 3, 4096, "save_dot_except_mlp"),
    Config("mistral-7b_v6e8_b2_s8192_savedotexceptmlp", "mistral-7b", "v6e-8", 2, 8192, "save_dot_except_mlp"),
    Config("l2-7b_v6e8_b2_s8192_saveqkv", "llama2-7b", "v6e-8", 2, 8192, "save_qkv_proj"),
    Config("l2-13b_v6e8_b2_s4096_full", "llama2-13b", "v6e-8", 2, 4096, "full"),
    Config("mistral-7b_v6e8_b6_s8192_full", "mistral-7b", "v6e-8", 6, 8192, "full"),
    Config("l2-13b_v6e8_b3_s4096_full", "llama2-13b", "v6e-8", 3, 4096, "full"),
    # the other side of the boundary: plans the fit floor puts just under v6e's HBM (96.7-100 % of it), where a wrong
    # "fits" would be the costly error (fifteenth session, holdout)
    Config("l3-8b_v6e8_b3_s4096_saveqkv", "llama3-8b", "v6e-8", 3, 4096, "save_qkv_proj"),
    Config("l2-7b_v6e8_b3_s2048_minimal", "llama2-7b", "v6e-8", 3, 2048, "minimal"),
    Config("l2-7b_v6e8_b5_s8192_full", "llama2-7b", "v6e-8", 5, 8192, "full"),
    Config("l2-13b_v6e8_b1_s4096_full", "llama2-13b", "v6e-8", 1, 4096, "full"),
    # the fit check's boundary, compiled after the fit floor (costmodel.memory.fit_floor_bytes) was set: two the
    # floor says fit although their totals are over v6e's 31.24 GiB, two it says do not (holdout)
    Config("l3-8b_v6e8_b2_s8192_full", "llama3-8b", "v6e-8", 2, 8192, "full"),
    Config("l3-8b_v6e8_b1_s8192_savedotexceptmlp", "llama3-8b", "v6e-8", 1, 8192, "save_dot_except_mlp"),
    Config("l3-8b_v6e8_b3_s8192_full", "llama3-8b", "v6e-8", 3, 8192, "full"),
    Config("l3-8b_v6e8_b2_s8192_saveqkv", "llama3-8b", "v6e-8", 2, 8192, "save_qkv_proj"),
]


def maxtext_dir() -> Path:
    import maxtext  # noqa: PLC0415  (only importable inside the MaxText env)

    return Path(maxtext.__file__).resolve().parent


def pkg_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def chips_for(topology: str, mt: Path) -> int:
    """Chips in one slice of ``topology``, read from MaxText's accelerator_to_spec_map."""
    spec = (mt / "utils" / "accelerator_to_spec_map.py").read_text()
    # "v5p-8": SystemCharacteristics("tpu", "v5:2x2x1", "megacore", (2, 2, 1), 4, ...)
    m = re.search(r'"%s":\s*SystemCharacteristics\(\s*"[^"]*",\s*"[^"]*",\s*"[^"]*",\s*\([^)]*\),\s*(\d+)'
                  % re.escape(topology), spec)
    if m:
        return int(m.group(1))
    gen, n = topology.split("-")
    return int(n) // 2 if gen in ("v4", "v5p") else int(n)


def read_rows() -> list[dict]:
    if not RESULTS.exists():
        return []
    with RESULTS.open(newline="") as f:
        return list(csv.DictReader(f))


def write_rows(rows: list[dict]) -> None:
    tmp = RESULTS.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    tmp.replace(RESULTS)


def run_one(cfg: Config, mt: Path, timeout: int) -> dict:
    log_dir = OUT_DIR / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    args = {
        "compile_topology": cfg.topology,
        "compile_topology_num_slices": 1,
        "model_name": cfg.model,
        "per_device_batch_size": cfg.batch,
        "max_target_length": cfg.seq,
        "ici_fsdp_parallelism": cfg.fsdp,
        "ici_tensor_parallelism": cfg.tensor,
        "ici_context_parallelism": cfg.context,
        "remat_policy": cfg.remat,
        "dataset_type": "synthetic",
        "enable_checkpointing": "false",
        "run_name": cfg.id,
        "base_output_directory": str(OUT_DIR / "runs"),
    }
    args.update(cfg.extra)
    cmd = [sys.executable, "-m", "maxtext.trainers.pre_train.train_compile", str(mt / "configs" / "base.yml")]
    cmd += [f"{k}={v}" for k, v in args.items()]
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another libtpu user (e.g. planner validate) may be running
    log_path = log_dir / f"{cfg.id}.log"
    t0 = time.time()
    status, err, rss_kb = "ok", "", 0
    with log_path.open("w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(OUT_DIR),
                                start_new_session=True)
        while True:  # os.wait4 gives this child's own peak RSS
            pid, wstatus, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                rc, rss_kb = os.waitstatus_to_exitcode(wstatus), usage.ru_maxrss
                proc.returncode = rc
                break
            if time.time() - t0 > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                _, wstatus, usage = os.wait4(proc.pid, 0)
                proc.returncode = rc = -9
                rss_kb, status, err = usage.ru_maxrss, "timeout", f"timeout after {timeout}s"
                break
            time.sleep(1)
    secs = time.time() - t0
    text = log_path.read_text(errors="replace")
    mem = parse_memory(text)
    oom = OOM_RE.search(text)
    if status == "ok" and (rc != 0 or mem is None):
        if oom:  # XLA refuses to compile a step that does not fit in HBM: a real (negative) data point
            status, err = "oom", oom.group(0)
        else:
            status = "error"
            tail = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(("I1", "W1"))][-3:]
            err = f"rc={rc}: " + " | ".join(tail)[-400:]
    row = {
        "id": cfg.id, "model_name": cfg.model, "topology": cfg.topology,
        "chips": chips_for(cfg.topology, mt), "ici_fsdp": cfg.fsdp, "ici_tensor": cfg.tensor,
        "ici_context": cfg.context, "per_device_batch_size": cfg.batch, "max_target_length": cfg.seq,
        "remat_policy": cfg.remat, "extra_args": " ".join(f"{k}={v}" for k, v in cfg.extra.items()),
        "compile_seconds": f"{secs:.1f}", "maxtext_version": pkg_version("maxtext"),
        "libtpu_version": pkg_version("libtpu"), "jax_version": pkg_version("jax"),
        "peak_rss_mb": f"{rss_kb / 1024:.0f}",
        "status": status, "error": err.replace("\n", " "),
    }
    if mem and status == "ok":
        a, o, al, t = (mem["argument_size_in_bytes"], mem["output_size_in_bytes"],
                       mem["alias_size_in_bytes"], mem["temp_size_in_bytes"])
        total = total_bytes(mem)
        fl = FLOPS_RE.search(text)
        row.update({
            "argument_bytes": a, "output_bytes": o, "alias_bytes": al, "temp_bytes": t,
            "total_bytes_per_chip": total, "total_gib_per_chip": f"{total / 2**30:.3f}",
            "generated_code_bytes": mem.get("generated_code_size_in_bytes", ""),
            "host_argument_bytes": mem.get("host_argument_size_in_bytes", ""),
            "host_output_bytes": mem.get("host_output_size_in_bytes", ""),
            "host_alias_bytes": mem.get("host_alias_size_in_bytes", ""),
            "host_temp_bytes": mem.get("host_temp_size_in_bytes", ""),
            "flops_per_chip": f"{float(fl.group(1)):.4g}" if fl else "",
        })
    return row


MODEL_KEYS = [
    ("emb_dim", "base_emb_dim"), ("num_query_heads", "base_num_query_heads"),
    ("num_kv_heads", "base_num_kv_heads"), ("head_dim", "head_dim"), ("mlp_dim", "base_mlp_dim"),
    ("moe_mlp_dim", "base_moe_mlp_dim"), ("num_decoder_layers", "base_num_decoder_layers"),
    ("vocab_size", "vocab_size"), ("mlp_activations", "mlp_activations"),
    ("num_experts", "num_experts"), ("num_experts_per_tok", "num_experts_per_tok"),
    ("decoder_block", "decoder_block"), ("logits_via_embedding", "logits_via_embedding"),
    ("fused_qkv", "fused_qkv"), ("opt_type", "opt_type"),
    # DeepSeek's layout (added with the deepseek2-16b configs): leading dense layers, shared experts, MLA
    ("first_num_dense_layers", "first_num_dense_layers"), ("shared_experts", "shared_experts"),
    ("attention_type", "attention_type"), ("q_lora_rank", "q_lora_rank"), ("kv_lora_rank", "kv_lora_rank"),
    ("qk_nope_head_dim", "qk_nope_head_dim"), ("qk_rope_head_dim", "qk_rope_head_dim"),
    ("v_head_dim", "v_head_dim"),
    # sliding windows (added with the gemma3-12b config; decoder_block gemma3: five local layers per global one)
    ("sliding_window_size", "sliding_window_size"),
]


def write_models_csv(mt: Path, models: list[str]) -> None:
    import yaml  # noqa: PLC0415

    base = yaml.safe_load((mt / "configs" / "base.yml").read_text())
    with MODELS_CSV.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model_name", *[k for k, _ in MODEL_KEYS], "source"])
        for name in models:
            y = yaml.safe_load((mt / "configs" / "models" / f"{name}.yml").read_text()) or {}
            vals = []
            for _, key in MODEL_KEYS:
                v = y.get(key, base.get(key, ""))
                if key == "base_moe_mlp_dim" and "num_experts" not in y:
                    v = ""
                if isinstance(v, list):
                    v = "+".join(str(x) for x in v)
                vals.append(v)
            w.writerow([name, *vals, f"maxtext/configs/models/{name}.yml (+base.yml defaults)"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", help="run only this config id (repeatable)")
    ap.add_argument("--force", action="store_true", help="re-run even if an ok row exists")
    ap.add_argument("--timeout", type=int, default=1500, help="seconds per compile")
    ap.add_argument("--budget-min", type=float, default=0, help="stop starting new compiles after N minutes")
    ap.add_argument("--list", action="store_true", help="list config ids and exit")
    ap.add_argument("--models-only", action="store_true", help="only (re)write models.csv")
    ns = ap.parse_args()

    if ns.list:
        done = {r["id"]: r["status"] for r in read_rows()}
        for c in CONFIGS:
            print(f"{c.id:45s} {done.get(c.id, '-')}")
        return 0

    mt = maxtext_dir()
    write_models_csv(mt, sorted({c.model for c in CONFIGS}))
    rows = read_rows()
    if rows:  # keep the derived chips column consistent with the spec map
        for r in rows:
            r["chips"] = chips_for(r["topology"], mt)
        write_rows(rows)
    if ns.models_only:
        return 0

    todo = CONFIGS
    if ns.only:
        unknown = set(ns.only) - {c.id for c in CONFIGS}
        if unknown:
            ap.error(f"unknown config id(s): {sorted(unknown)}")
        todo = [c for c in CONFIGS if c.id in ns.only]
    start = time.time()
    for cfg in todo:
        rows = read_rows()
        if not ns.force and any(r["id"] == cfg.id and r["status"] in ("ok", "oom") for r in rows):
            print(f"skip {cfg.id} (already in {RESULTS.name})", flush=True)
            continue
        if ns.budget_min and time.time() - start > ns.budget_min * 60:
            print(f"budget of {ns.budget_min} min used; stopping before {cfg.id}", flush=True)
            break
        print(f"compile {cfg.id} ...", flush=True)
        row = run_one(cfg, mt, ns.timeout)
        rows = [r for r in read_rows() if r["id"] != cfg.id] + [row]
        write_rows(rows)
        print(f"  {row['status']} in {row['compile_seconds']} s: total={row.get('total_gib_per_chip', '?')} GiB/chip "
              f"(arg={row.get('argument_bytes', '?')}, temp={row.get('temp_bytes', '?')}) {row['error'][:200]}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
