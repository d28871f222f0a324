"""Exports to MaxText 0.2.5 / Megatron-LM, imports back, nearest-plan warnings, and `planner export / import`."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from costmodel.catalog import load_model, preset_names
from costmodel.job import Job
from costmodel.plan import REMAT_POLICIES, Plan, parse_remat
from hardware.catalog import load_hardware
from hardware.errors import InputError
from planner.export import FORMATS, export, export_result
from planner.export_maxtext import AXIS_KEYS
from planner.import_configs import import_maxtext, import_megatron
from planner.planfile import PlanFile, load_plan, save_plan

PLANNER = str(Path(sys.executable).with_name("planner"))
KEYS_FILE = Path(__file__).parents[1] / "planner" / "maxtext_0_2_5_keys.txt"
MAXTEXT_KEYS = {ln.strip() for ln in KEYS_FILE.read_text().splitlines() if ln.strip() and not ln.startswith("#")}


def planner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PLANNER, *args], capture_output=True, text=True, timeout=120)


def pf(model: str, hw: str, chips: int, seq: int, gb: int, fw: str = "maxtext", prec: str = "bf16",
       remat: str = "full", **kw) -> PlanFile:
    return PlanFile(load_model(model), load_hardware(hw), chips, Job(seq, gb, prec, fw),
                    Plan(remat=parse_remat(remat), **kw), model, hw)


MAXTEXT_CASES = {
    "fsdp-tp": pf("llama3-8b", "tpu-v5p", 64, 4096, 256, fsdp=16, tp=4),
    "multislice-dp": pf("llama3-70b", "tpu-v5p", 512, 4096, 1024, dp=2, fsdp=64, tp=4, slices=2, remat="minimal"),
    "pp-vpp": pf("llama3-70b", "tpu-v5p", 256, 4096, 512, fsdp=16, tp=4, pp=4, vpp=2, micro_batch=2,
                 remat="save_qkv_proj"),
    "pp-over-dcn": pf("llama3-70b", "tpu-v5p", 128, 4096, 512, fsdp=64, pp=2, slices=2),
    "moe-ep-custom": pf("mixtral-8x7b", "tpu-v5p", 64, 4096, 256, fsdp=8, ep=8,
                        remat="custom:qkv_proj=offload,out_proj=device"),
    "mla-moe": pf("deepseek-v3-671b", "tpu-v5p", 256, 4096, 1024, fsdp=8, ep=32, remat="minimal"),
    "cp-zero1": pf("llama2-7b", "tpu-v5p", 64, 16384, 64, dp=16, tp=2, cp=2, zero=1),
    "plain-mlp-offload-input": pf("gpt3-175b", "tpu-v5p", 1024, 2048, 1024, fsdp=128, tp=8,
                                  remat="custom:layer_input=offload,mlp_out=device"),
    "gpu-nodes": pf("llama3-70b", "h100-sxm", 64, 4096, 256, dp=8, tp=8, remat="minimal_with_context"),
    "host-offload": pf("llama3-8b", "tpu-v6e", 256, 4096, 512, fsdp=256, remat="minimal_offloaded",
                       offload_optimizer=True, offload_params=True),
    "size-shorthand": pf("1T", "tpu-v5p", 2048, 4096, 2048, fsdp=256, tp=8),
    "bf16-weights-vocab-tiling": PlanFile(load_model("llama3-8b"), load_hardware("tpu-v6e"), 64,
                                          Job(8192, 128, weight_dtype="bfloat16"),
                                          Plan(fsdp=64, micro_batch=2, vocab_tiles=4), "llama3-8b", "tpu-v6e"),
    "unscanned-layers": PlanFile(load_model("llama3-8b"), load_hardware("tpu-v5p"), 64,
                                 Job(4096, 64, scan_layers=False), Plan(fsdp=64), "llama3-8b", "tpu-v5p"),
}
MEGATRON_CASES = {
    "tp-dp-distopt": pf("llama3-8b", "h100-sxm", 64, 4096, 256, "megatron", dp=16, tp=4, zero=1, remat="selective"),
    "pp-vpp": pf("llama3-70b", "h100-sxm", 256, 4096, 512, "megatron", dp=8, tp=8, pp=4, vpp=2),
    "gpt3-fp8": pf("gpt3-175b", "h100-sxm", 1024, 2048, 1536, "megatron", "fp8", dp=8, tp=8, pp=16, remat="none"),
    "moe-ep": pf("mixtral-8x7b", "h100-sxm", 64, 4096, 256, "megatron", dp=8, ep=8, zero=1),
    "mla-moe-dense-layers": pf("deepseek-v3-671b", "h100-sxm", 2048, 4096, 4096, "megatron", dp=4, ep=64, tp=8,
                               zero=1),
    "cp": pf("llama3-8b", "h100-sxm", 64, 32768, 64, "megatron", dp=2, tp=8, cp=4, remat="selective"),
    "fp16-cpu-adam": pf("llama3-8b", "a100-80gb", 32, 4096, 128, "megatron", "fp16", dp=8, tp=4, zero=1,
                        offload_optimizer=True),
    "dp-only-no-sp": pf("llama2-7b", "h100-sxm", 8, 4096, 64, "megatron", dp=8, sequence_parallel=False,
                        remat="none"),
    # Llama 3 405B's published layout: 126 layers over 16 stages, 7 on each end stage
    "uneven-pp": pf("llama3-405b", "h100-sxm", 1024, 8192, 128, "megatron", dp=8, tp=8, pp=16, zero=1,
                    remat="selective"),
    "uneven-pp-vpp": pf("llama3-405b", "h100-sxm", 1024, 8192, 128, "megatron", dp=8, tp=8, pp=16, vpp=2, zero=1,
                        remat="selective"),
}


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _same(back: PlanFile, want: PlanFile, res) -> None:
    assert back.model == want.model
    assert back.hardware == want.hardware
    assert back.chips == want.chips
    assert back.job == res.adapted.job
    assert back.plan == res.adapted.plan


# ---- round trips -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", MAXTEXT_CASES)
def test_maxtext_round_trip_is_exact(tmp_path, case):
    want = MAXTEXT_CASES[case]
    res = export_result(want, "maxtext")
    assert res.warnings == ()
    assert res.adapted.plan.remat.choices() == want.plan.remat.choices()
    back = import_maxtext(_write(tmp_path, "run.yml", res.text))
    assert back.notes == ()
    _same(back.planfile, want, res)


@pytest.mark.parametrize("case", MEGATRON_CASES)
def test_megatron_round_trip_is_exact(tmp_path, case):
    want = MEGATRON_CASES[case]
    res = export_result(want, "megatron")
    assert [w for w in res.warnings if "hardware" not in w] == []
    back = import_megatron(_write(tmp_path, "args.sh", res.text))
    assert back.notes == ()
    _same(back.planfile, want, res)
    assert back.planfile.plan == want.plan.with_(sequence_parallel=want.plan.sequence_parallel and want.plan.tp > 1)


def test_json_export_is_the_plan_file(tmp_path):
    want = MAXTEXT_CASES["pp-vpp"]
    back = load_plan(_write(tmp_path, "p.json", export(want, "json")))
    assert (back.model, back.hardware, back.chips, back.job, back.plan) == \
        (want.model, want.hardware, want.chips, want.job, want.plan)


# ---- MaxText key validity and mesh products ----------------------------------------------------------------

def _maxtext_keys(p: PlanFile) -> dict:
    return yaml.safe_load(export(p, "maxtext", warn=None))


@pytest.mark.parametrize("case", MAXTEXT_CASES)
def test_maxtext_keys_exist_in_base_yml(case):
    keys = _maxtext_keys(MAXTEXT_CASES[case])
    assert set(keys) - MAXTEXT_KEYS == set()


def test_every_preset_exports_valid_keys():
    hw = load_hardware("tpu-v5p")
    for name in preset_names():
        m = load_model(name)
        p = PlanFile(m, hw, 8, Job(4096, 64), Plan(fsdp=8, remat=parse_remat("custom:context=offload")), name,
                     "tpu-v5p")
        keys = _maxtext_keys(p)
        assert set(keys) - MAXTEXT_KEYS == set(), name
        assert keys["base_num_decoder_layers"] == m.n_layers
        args = shlex.split(export(p.with_plan(p.plan, p.job), "megatron", warn=None), comments=True)
        assert args[args.index("--num-layers") + 1] == str(m.n_layers)


@pytest.mark.parametrize("case", MAXTEXT_CASES)
def test_maxtext_mesh_products(case):
    p = MAXTEXT_CASES[case]
    k = _maxtext_keys(p)
    ici = math.prod(k[f"ici_{s}_parallelism"] for s in AXIS_KEYS.values())
    dcn = math.prod(k[f"dcn_{s}_parallelism"] for s in AXIS_KEYS.values())
    assert ici * k["num_slices"] == p.chips
    assert dcn == k["num_slices"]
    for ax, stem in AXIS_KEYS.items():
        assert k[f"ici_{stem}_parallelism"] * k[f"dcn_{stem}_parallelism"] == getattr(p.plan, ax)
    # MaxText's global batch: int(per_device_batch_size * devices) * gradient_accumulation_steps
    assert int(k["per_device_batch_size"] * p.chips) * k["gradient_accumulation_steps"] == p.job.global_batch
    if p.plan.pp > 1:
        assert k["gradient_accumulation_steps"] == 1
        assert k["num_pipeline_microbatches"] % p.plan.pp == 0
        assert k["num_layers_per_pipeline_stage"] * p.plan.pp * p.plan.vpp == p.model.n_layers


def test_fractional_per_device_batch_is_exact():
    p = pf("llama3-8b", "tpu-v5p", 96, 4095, 32, fsdp=32, cp=3)  # 1/3 sequence per device
    k = _maxtext_keys(p)
    assert int(k["per_device_batch_size"] * 96) == 32


# ---- Megatron rules ----------------------------------------------------------------------------------------

def _meg_args(text: str) -> dict[str, str | bool]:
    toks = shlex.split(text, comments=True)
    out: dict[str, str | bool] = {}
    for i, t in enumerate(toks):
        if t.startswith("--"):
            nxt = toks[i + 1] if i + 1 < len(toks) else ""
            out[t] = nxt if nxt and not nxt.startswith("--") and nxt != ")" else True
    return out


@pytest.mark.parametrize("case", MEGATRON_CASES)
def test_megatron_batch_divisibility(case):
    p = MEGATRON_CASES[case]
    a = _meg_args(export(p, "megatron", warn=None))
    tp, pp, cp = (int(a.get(f, 1)) for f in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                              "--context-parallel-size"))
    assert p.chips % (tp * pp * cp) == 0
    dp = p.chips // (tp * pp * cp)
    gbs, mbs = int(a["--global-batch-size"]), int(a["--micro-batch-size"])
    assert gbs % (mbs * dp) == 0
    assert gbs // (mbs * dp) == p.job.global_batch // (p.plan.batch_shards * p.plan.micro_batch)
    if "--overlap-param-gather" in a:
        assert "--use-distributed-optimizer" in a and "--overlap-grad-reduce" in a
    if "--optimizer-cpu-offload" in a:
        assert "--use-precision-aware-optimizer" in a
    if int(a.get("--expert-model-parallel-size", 1)) > 1:
        assert int(a["--num-experts"]) % int(a["--expert-model-parallel-size"]) == 0


def test_megatron_moe_layer_freq():
    a = _meg_args(export(MEGATRON_CASES["mla-moe-dense-layers"], "megatron", warn=None))
    assert a["--moe-layer-freq"] == "([0]*3+[1]*58)"
    assert a["--moe-shared-expert-intermediate-size"] == "2048"
    assert "--multi-latent-attention" in a and a["--qk-head-dim"] == "128" and a["--qk-pos-emb-head-dim"] == "64"


# ---- nearest plan ------------------------------------------------------------------------------------------

def test_megatron_nearest_plan_for_fsdp_and_custom_remat():
    p = MAXTEXT_CASES["moe-ep-custom"]  # fsdp 8, ep 8, custom remat with offload, maxtext framework
    res = export_result(p, "megatron")
    plan = res.adapted.plan
    assert (plan.dp, plan.fsdp, plan.zero, plan.ep) == (8, 1, 1, 8)
    assert plan.remat.name in ("none", "selective", "full")
    text = "\n".join(res.warnings)
    assert "fsdp=8" in text and "remat" in text and "framework maxtext" in text
    assert res.warnings[-1].count("s/step") == 2  # both predicted costs
    assert "plan file" in res.warnings[-1] and "exported" in res.warnings[-1]


def test_nearest_megatron_remat_keeps_hbm_set_close():
    base = MEGATRON_CASES["tp-dp-distopt"]
    for spec, want in (("minimal", "selective"), ("minimal_with_context", "none"), ("save_qkv_proj", "full"),
                       ("custom:qkv_proj=offload,out_proj=offload,mlp_in=offload,mlp_out=offload", "full")):
        p = base.with_plan(base.plan.with_(remat=parse_remat(spec)))
        assert export_result(p, "megatron").adapted.plan.remat == REMAT_POLICIES[want], spec


def test_megatron_param_offload_and_int8_are_dropped():
    p = MEGATRON_CASES["tp-dp-distopt"]
    p = p.with_plan(p.plan.with_(offload_params=True), Job(4096, 256, "int8", "megatron"))
    res = export_result(p, "megatron")
    assert not res.adapted.plan.offload_params and res.adapted.job.precision == "bf16"
    assert any("offload_params" in w for w in res.warnings) and any("int8" in w for w in res.warnings)


def test_maxtext_nearest_plan():
    p = pf("llama3-8b", "tpu-v5p", 64, 4096, 256, "maxtext", dp=4, fsdp=16, zero=3)
    res = export_result(p, "maxtext")
    assert (res.adapted.plan.dp, res.adapted.plan.fsdp, res.adapted.plan.zero) == (1, 64, 0)
    assert any("zero 3" in w for w in res.warnings)
    p = pf("llama3-8b", "tpu-v5p", 64, 4096, 256, "megatron", dp=4, fsdp=16, zero=1)  # MaxText refuses ZeRO-1 with fsdp
    res = export_result(p, "maxtext")
    assert res.adapted.plan.zero == 0 and "shard_optimizer_over_data" in res.warnings[0]
    p = pf("llama3-70b", "tpu-v5p", 64, 4096, 64, fsdp=16, pp=4, micro_batch=1)  # 4 micro-batches, fine
    assert export_result(p, "maxtext").warnings == ()
    p = pf("llama3-70b", "tpu-v5p", 64, 4096, 128, "megatron", fsdp=16, pp=4, micro_batch=4)  # 2 -> 4 of 2
    res = export_result(p, "maxtext")
    assert res.adapted.plan.micro_batch == 2 and "num_pipeline_microbatches" in res.warnings[0]
    p = pf("llama3-70b", "tpu-v5p", 64, 4096, 96, "megatron", fsdp=16, pp=4, micro_batch=2)  # 6 per shard: never 4k
    with pytest.raises(InputError, match="multiple of pp=4"):
        export_result(p, "maxtext")
    p = pf("llama3-8b", "tpu-v5p", 8, 4096, 64, tp=8, sequence_parallel=False)
    assert export_result(p, "maxtext").adapted.plan.sequence_parallel


def test_exact_exports_print_nothing(capsys):
    export(MAXTEXT_CASES["fsdp-tp"], "maxtext")
    assert capsys.readouterr().err == ""


# ---- importing users' configs ------------------------------------------------------------------------------

def test_import_maxtext_user_config_with_auto_axis(tmp_path):
    p = _write(tmp_path, "user.yml", "model_name: llama3.1-8b\nper_device_batch_size: 2\nmax_target_length: 8192\n"
                                     "remat_policy: custom\nquery_proj: offload\nkey_proj: offload\n"
                                     "value_proj: offload\nici_tensor_parallelism: 4\n")
    with pytest.raises(InputError, match="pass --hardware"):
        import_maxtext(p)
    with pytest.raises(InputError, match="pass --chips"):
        import_maxtext(p, hardware="tpu-v5p")
    got = import_maxtext(p, hardware="tpu-v5p", chips=128).planfile
    assert got.model == load_model("llama3-8b")
    assert (got.plan.fsdp, got.plan.tp, got.plan.dp) == (32, 4, 1)  # ici_fsdp -1 fills the slice
    assert got.job == Job(8192, 256, "bf16", "maxtext")
    assert got.plan.remat.qkv_proj == "offload" and got.plan.remat.name == "custom"


def test_import_maxtext_compile_topology(tmp_path):
    p = _write(tmp_path, "aot.yml", "base_emb_dim: 4096\nbase_num_query_heads: 32\nbase_num_kv_heads: 8\n"
                                    "base_mlp_dim: 14336\nbase_num_decoder_layers: 32\nvocab_size: 128256\n"
                                    "compile_topology: v5p-256\ncompile_topology_num_slices: 2\n"
                                    "per_device_batch_size: 1\nici_fsdp_parallelism: -1\n")
    got = import_maxtext(p).planfile
    assert got.hardware.name == "tpu-v5p" and got.chips == 256 and got.plan.slices == 2
    assert (got.plan.dp, got.plan.fsdp) == (2, 128)  # dcn_data -1 spans the slices


def test_import_maxtext_errors(tmp_path):
    p = _write(tmp_path, "bad.yml", "ici_tensor_parallelism: four\n")
    with pytest.raises(InputError, match="'ici_tensor_parallelism': expected an integer"):
        import_maxtext(p, hardware="tpu-v5p", chips=8)
    p = _write(tmp_path, "bad2.yml", "model_name: gemma2-27b\n")
    with pytest.raises(InputError, match="model_name"):
        import_maxtext(p, hardware="tpu-v5p", chips=8)
    p = _write(tmp_path, "bad3.yml", "remat_policy: fastest\nici_fsdp_parallelism: 8\n")
    with pytest.raises(InputError, match="remat_policy"):
        import_maxtext(p, hardware="tpu-v5p")
    p = _write(tmp_path, "bad4.yml", "ici_fsdp_parallelsim: 8\n")
    with pytest.raises(InputError, match="did you mean 'ici_fsdp_parallelism'"):
        import_maxtext(p, hardware="tpu-v5p")
    # counts that MaxText divides by: a positive integer (or -1, auto), named, not a ZeroDivisionError
    for i, (text, match) in enumerate((
            ("gradient_accumulation_steps: 0\n", "'gradient_accumulation_steps': expected a positive integer, got 0"),
            ("ici_fsdp_parallelism: 0\n", "'ici_fsdp_parallelism': expected a positive integer or -1 \\(auto\\)"),
            ("ici_pipeline_parallelism: 2\nnum_layers_per_pipeline_stage: 0\n",
             "'num_layers_per_pipeline_stage': expected a positive integer, got 0"),
            ("per_device_batch_size: .nan\n", "'per_device_batch_size': expected a finite number, got nan"))):
        with pytest.raises(InputError, match=match):
            import_maxtext(_write(tmp_path, f"count{i}.yml", text), hardware="tpu-v5p", chips=8)


def test_import_megatron_command_line(tmp_path):
    cmd = ("torchrun --nproc_per_node 8 --nnodes 4 pretrain_gpt.py --num-layers 32 --hidden-size 4096 "
           "--ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention --num-query-groups 8 "
           "--swiglu --untie-embeddings-and-output-weights --vocab-size 128256 --kv-channels 128 "
           "--seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 128 "
           "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 --recompute-activations "
           "--use-distributed-optimizer --sequence-parallel --bf16 --lr 3e-4 --data-path /x/y")
    got = import_megatron(_write(tmp_path, "run.sh", cmd), hardware="h100-sxm").planfile
    assert got.chips == 32 and got.model == load_model("llama3-8b").__class__(**{
        **load_model("llama3-8b").__dict__, "name": "run", "description": "", "source": got.model.source})
    assert (got.plan.dp, got.plan.tp, got.plan.pp, got.plan.zero) == (2, 8, 2, 1)
    assert got.plan.remat == REMAT_POLICIES["selective"] and got.job.global_batch == 128


def test_import_megatron_errors(tmp_path):
    p = _write(tmp_path, "a.txt", "--num-layers $LAYERS --hidden-size 4096 --num-attention-heads 32")
    with pytest.raises(InputError, match="shell variables"):
        import_megatron(p, hardware="h100-sxm", chips=8)
    p = _write(tmp_path, "b.txt", "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --vocab-size 32000 "
                                  "--seq-length 4096 --micro-batch-size 3 --global-batch-size 20")
    with pytest.raises(InputError, match="not divisible by --micro-batch-size"):
        import_megatron(p, hardware="h100-sxm", chips=8)
    with pytest.raises(InputError, match="pass --chips"):
        import_megatron(p, hardware="h100-sxm")
    for flag in ("--num-attention-heads", "--micro-batch-size"):
        p = _write(tmp_path, "c.txt", "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --vocab-size "
                                      "32000 --seq-length 4096 --micro-batch-size 1".replace(f"{flag} 32", f"{flag} 0")
                   .replace(f"{flag} 1", f"{flag} 0"))
        with pytest.raises(InputError, match=f"argument {flag}: expected a positive integer, got 0"):
            import_megatron(p, hardware="h100-sxm", chips=8)


# ---- CLI ---------------------------------------------------------------------------------------------------

def _plan_file(tmp_path: Path, case: PlanFile, name: str = "p.yaml") -> Path:
    return save_plan(tmp_path / name, case.model_ref, case.hardware_ref, case.chips, case.job, case.plan)


def test_cli_export_and_import(tmp_path):
    p = _plan_file(tmp_path, MAXTEXT_CASES["pp-vpp"])
    out = tmp_path / "run.yml"
    r = planner("export", "--plan", str(p), "--format", "maxtext", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert set(yaml.safe_load(out.read_text())) <= MAXTEXT_KEYS
    back = tmp_path / "back.yaml"
    r = planner("import", "--from-maxtext", str(out), "--out", str(back))
    assert r.returncode == 0, r.stderr
    a, b = load_plan(p), load_plan(back)
    assert (a.model, a.chips, a.job, a.plan) == (b.model, b.chips, b.job, b.plan)
    r1 = planner("estimate", "--plan", str(p), "--json")
    r2 = planner("estimate", "--from-maxtext", str(out), "--json")
    assert r1.returncode == r2.returncode == 0
    assert json.loads(r1.stdout)["step_time_s"] == pytest.approx(json.loads(r2.stdout)["step_time_s"])


def test_cli_export_megatron_warns_on_stderr(tmp_path):
    p = _plan_file(tmp_path, MAXTEXT_CASES["fsdp-tp"])
    r = planner("export", "--plan", str(p), "--format", "megatron")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("#!/usr/bin/env bash") and "MEGATRON_ARGS=(" in r.stdout
    assert "warning: megatron export: fsdp=16" in r.stderr
    assert "predicted: plan file" in r.stderr
    args = tmp_path / "args.sh"
    args.write_text(r.stdout)
    r = planner("estimate", "--from-megatron", str(args), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["plan"]["dp"] == 16


@pytest.mark.parametrize("argv,needle", [
    (["export", "--plan", "P", "--format", "maxtex"], "did you mean 'maxtext'"),
    (["export", "--plan", "P", "--format", "maxtext", "--out", "/nonexistent/dir/run.yml"], "does not exist"),
    (["export", "--plan", "BAD", "--format", "json"], "version"),
    (["export", "--plan", "MISSING", "--format", "megatron"], "not found"),
    (["import", "--out", "x.yaml"], "--from-maxtext"),
    (["import", "--from-maxtext", "P"], "'version' is not a MaxText 0.2.5 config key"),
])
def test_cli_bad_input_exit_2(tmp_path, argv, needle):
    good = _plan_file(tmp_path, MAXTEXT_CASES["fsdp-tp"])
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("version: 1", "version: 0"))
    repl = {"P": str(good), "BAD": str(bad), "MISSING": str(tmp_path / "missing.yaml")}
    r = planner(*[repl.get(a, a) for a in argv])
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_formats_listed():
    assert FORMATS == ("maxtext", "megatron", "json")


# ---- optional: MaxText's own config loader -----------------------------------------------------------------

MAXTEXT_PYTHON = os.environ.get("MAXTEXT_PYTHON", "/work/maxtext-env/bin/python")


def _maxtext_importable() -> bool:
    if not Path(MAXTEXT_PYTHON).is_file():
        return False
    r = subprocess.run([MAXTEXT_PYTHON, "-c", "import maxtext.configs.pyconfig"], capture_output=True, timeout=300)
    return r.returncode == 0


@pytest.mark.skipif(not _maxtext_importable(), reason="MaxText 0.2.5 not importable (set MAXTEXT_PYTHON)")
def test_exports_load_in_maxtext_pyconfig(tmp_path):
    from planner.export_maxtext import TOPOLOGY

    cases, want = [], {}
    for name in ("pp-vpp", "pp-over-dcn", "moe-ep-custom", "mla-moe", "gpu-nodes", "plain-mlp-offload-input"):
        p = MAXTEXT_CASES[name]
        k = _maxtext_keys(p)
        f = _write(tmp_path, f"{name}.yml", export(p, "maxtext", warn=None))
        if p.hardware.vendor == "gpu":
            topo = "a3"
        else:
            prefix, cores = TOPOLOGY[p.hardware_ref]
            topo = f"{prefix}-{cores * p.chips // k['num_slices']}"
        cases.append({"file": str(f), "topology": topo, "slices": k["num_slices"], "outdir": str(tmp_path / "out")})
        want[str(f)] = p
    spec = _write(tmp_path, "cases.json", json.dumps(cases))
    r = subprocess.run([MAXTEXT_PYTHON, str(Path(__file__).with_name("maxtext_pyconfig_check.py")), str(spec)],
                       capture_output=True, text=True, timeout=600)
    results = [json.loads(ln[7:]) for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(results) == len(cases), r.stderr[-3000:]
    for res in results:
        assert res["ok"], res
        p = want[res["file"]]
        assert res["devices"] == p.chips
        assert res["global_batch"] == p.job.global_batch
        assert res["pipeline_repeats"] == p.plan.vpp


def test_import_maxtext_pipeline_with_accumulation(tmp_path):
    p = _write(tmp_path, "pp.yml", "model_name: llama2-70b\nici_pipeline_parallelism: 4\nici_fsdp_parallelism: 16\n"
                                   "per_device_batch_size: 2\ngradient_accumulation_steps: 2\n"
                                   "num_pipeline_microbatches: 8\nremat_policy: none\nquantization: int8\n")
    res = import_maxtext(p, hardware="tpu-v5p")
    got = res.planfile
    # MaxText's defaults: one layer per stage -> 80 / 4 = 20 circular repeats; 'none' is its alias of 'full'
    assert (got.plan.pp, got.plan.vpp, got.plan.fsdp, got.plan.micro_batch) == (4, 20, 16, 1)
    assert got.job == Job(2048, 256, "int8", "maxtext") and got.plan.remat == REMAT_POLICIES["full"]
    assert any("drains the pipeline on each of the 2 accumulation steps" in n for n in res.notes)


def test_megatron_args_refuses_an_unsplittable_pipeline_in_one_line():
    """A plan built in Python (no plan-file check) whose layers cannot be split over pp x vpp: an InputError naming
    pp*vpp, not a traceback (61 layers, 2 stages x 2 virtual stages: 61 is odd, so no stage gets a multiple of 2)."""
    from planner.export_megatron import megatron_args

    m = load_model("deepseek-v3-671b")
    plan = Plan(dp=2, tp=8, pp=2, vpp=2, ep=8, sequence_parallel=True)
    pf = PlanFile(model=m, hardware=load_hardware("h100-sxm"), chips=plan.chips,
                  job=Job(4096, 64, framework="megatron"), plan=plan, model_ref="deepseek-v3-671b",
                  hardware_ref="h100-sxm")
    with pytest.raises(InputError, match=r"pp\*vpp: 61 layers cannot be split over pp=2 stages x vpp=2"):
        megatron_args(pf)


def test_maxtext_export_refits_the_batch_after_moving_stages_to_fsdp():
    """A Megatron plan with an uneven pipeline (61 layers over 3 stages) exports to MaxText with the stages moved
    to fsdp (2 -> 6 batch shards): 6 sequences of 3 per micro-batch no longer divide, so the micro-batch shrinks
    to 1 (noted); 4 sequences cannot split over 6 shards at all: a one-line error, not a ZeroDivisionError."""
    from planner.export_maxtext import maxtext_plan

    m, chip = load_model("deepseek-v3-671b"), load_hardware("h100-sxm")
    plan = Plan(fsdp=2, tp=16, pp=3, micro_batch=3)

    def pf(gb: int) -> PlanFile:
        return PlanFile(model=m, hardware=chip, chips=plan.chips, job=Job(4096, gb, framework="megatron"),
                        plan=plan, model_ref="deepseek-v3-671b", hardware_ref="h100-sxm")

    ad = maxtext_plan(pf(6))
    assert (ad.plan.pp, ad.plan.fsdp, ad.plan.micro_batch) == (1, 6, 1)
    assert any("micro_batch 3 -> 1" in n for n in ad.notes)
    with pytest.raises(InputError, match="global_batch: MaxText runs this plan as dp=1 fsdp=6 ep=1, 6 batch "
                                         "shards, which 4 sequences do not divide; expected a multiple of 6"):
        maxtext_plan(pf(4))


def test_export_refuses_a_plan_predicted_not_to_fit(tmp_path):
    """llama3-70b on 8 H100 without remat, fsdp 8: Megatron's nearest plan (dp 8, ZeRO-1) needs ~580 GiB per chip.
    export exits 1 with one error line and writes nothing; --force writes it (issue 29)."""
    from planner.export import ExportDoesNotFit, write_export

    big = pf("llama3-70b", "h100-sxm", 8, 4096, 64, remat="none", fsdp=8)
    with pytest.raises(ExportDoesNotFit, match="predicted not to fit.*GiB per chip"):
        write_export(big, "megatron", None, warn=None)
    assert "MEGATRON_ARGS" in write_export(big, "megatron", None, warn=None, force=True)
    plan = tmp_path / "big.yml"
    save_plan(plan, "llama3-70b", "h100-sxm", 8, big.job, big.plan)
    out = tmp_path / "args.sh"
    r = planner("export", "--plan", str(plan), "--format", "megatron", "-o", str(out))
    assert r.returncode == 1 and not out.exists()
    assert r.stderr.strip().splitlines()[-1].startswith("error: the exported plan is predicted not to fit")
    r = planner("export", "--plan", str(plan), "--format", "megatron", "-o", str(out), "--force")
    assert r.returncode == 0 and out.exists()
