"""The validator: HLO parsing (no jax), bad input (no jax), and, in fresh processes with 8 CPU devices, the sharded
step against the one-device step and an end-to-end `planner validate` of three plans.

XLA_FLAGS must ask for the host devices before jax starts, hence the subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from costmodel.catalog import load_model
from costmodel.plan import Plan
from hardware.errors import InputError
from planner.validate import hlo
from planner.validate.scale import Scale, check_devices, scale_down

ROOT = Path(__file__).resolve().parents[1]
PLANNER = str(Path(sys.executable).with_name("planner"))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_flash_memory_adjustment():
    """The validator's attention score blocks added to the CPU memory prediction: 6 fp32 blocks of micro-batch x
    heads/tp x query block x key block (blocks of seq/4; a cp shard's queries in one block here), 7 where the
    policy recomputes the context among kept tensors (selective, minimal: the peak in the recomputed forward)."""
    code = (
        "from costmodel.catalog import load_model\n"
        "from costmodel.plan import Plan\n"
        "from planner.validate.compare import FLASH_SCORE_BLOCKS, flash_memory_adjustment\n"
        "from planner.validate.scale import Scale, scale_down\n"
        "from costmodel.plan import remat_policy\n"
        "cases = ((dict(dp=2, tp=4), 'full', 6), (dict(dp=2, cp=4), 'none', 6), (dict(dp=8), 'selective', 7),\n"
        "         (dict(dp=8), 'minimal', 7))\n"
        "assert FLASH_SCORE_BLOCKS == 6\n"
        "for deg, policy, blocks in cases:\n"
        "    plan = Plan(**deg, remat=remat_policy(policy))\n"
        "    m, job, _ = scale_down(load_model('llama3-8b'), plan, Scale(seq_len=512))\n"
        "    got = flash_memory_adjustment(m, job, plan, job.seq_len // 4)\n"
        "    want = blocks * plan.micro_batch * m.n_heads // plan.tp * 128 * 128 * 4\n"
        "    assert got == want, (deg, policy, got, want)\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_hlo_collective_parsing():
    mesh = {"dp": 2, "fsdp": 4, "ep": 1, "cp": 1, "tp": 1}
    text = "\n".join([
        "  %all-gather.3 = f32[128,8,16]{2,1,0} all-gather(%c), channel_id=8, replica_groups=mesh['axis_0'=4,"
        "'axis_1'=1,'axis_2'=1,'axis_3'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}",
        "  %all-reduce = (f32[64]{0}, f32[32,2]{1,0}) all-reduce(%a, %b), channel_id=2, "
        "replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add",
        "  %reduce-scatter.1 = bf16[16]{0} reduce-scatter(%x), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}",
        "  %collective-permute = f32[8]{0} collective-permute(%y), source_target_pairs={{0,4},{4,0}}",
    ])
    got = [(c.kind, c.bytes, c.group_size, c.axes) for c in hlo.collectives(text, mesh)]
    assert got == [("all-gather", 128 * 8 * 16 * 4, 4, "fsdp"), ("all-reduce", (64 + 64) * 4, 2, "dp"),
                   ("reduce-scatter", 16 * 2 * 4, 4, "fsdp"), ("collective-permute", 32, 2, "dp")]
    assert hlo.ring_traffic("all-reduce", 100, 4) == 150
    # a pipeline shift over pp runs on every dp replica at once: its axis is pp, not all the axes the pairs span
    pp_mesh = {"dp": 2, "pp": 2, "fsdp": 1, "ep": 1, "cp": 1, "tp": 1}
    line = "  %cp.1 = f32[1,64,64]{2,1,0} collective-permute(%x), channel_id=1, source_target_pairs={{0,1},{2,3}}"
    assert [(c.kind, c.bytes, c.axes) for c in hlo.collectives(line, pp_mesh)] == [("collective-permute", 16384, "pp")]
    # a ragged all-to-all (dropless MoE over ep): the balanced rows, the smaller of operand and worst-case buffer
    ep_mesh = {"dp": 1, "fsdp": 2, "ep": 4, "cp": 1, "tp": 1}
    ragged = "\n".join([
        "  %rows.2 = bf16[64,32]{1,0:T(8,128)(2,1)} fusion(%a), kind=kLoop, calls=%f",
        "  %buf = bf16[256,32]{1,0} broadcast(%z), dimensions={}",
        "  %r.1 = bf16[256,32]{1,0} ragged-all-to-all(%rows.2, %buf, %o, %s, /*index=5*/%q), channel_id=1, "
        "replica_groups={{0,1,2,3},{4,5,6,7}}",
        "  %r.2 = bf16[64,32]{1,0} ragged-all-to-all(%r.1, %rows.2, %o, %s, /*index=5*/%q), channel_id=2, "
        "replica_groups={{0,1,2,3},{4,5,6,7}}",
    ])
    got = [(c.kind, c.bytes, c.group_size, c.axes) for c in hlo.collectives(ragged, ep_mesh)]
    assert got == [("all-to-all", 64 * 32 * 2, 4, "ep")] * 2


def test_flash_attention_flops_by_hand():
    from planner.validate.flash import attention_flops

    # seq 64 in blocks of 32: the causal block pairs (0, 0), (1, 0), (1, 1); 2 heads, queries and keys 24 wide,
    # values 16 (MLA): QK^T 2 x 2 x 32 x 32 x 24 per pair, PV the same with 16
    qk, pv = 2 * 2 * 32 * 32 * 24, 2 * 2 * 32 * 32 * 16
    assert attention_flops(1, 1, 64, 64, 2, 24, 32, dv=16) == (3 * (qk + pv), 3 * (3 * qk + 2 * pv))
    assert attention_flops(1, 1, 64, 64, 2, 24, 32) == (3 * 2 * qk, 3 * 5 * qk)  # values as wide as keys


FLASH_CHECK = """
import jax, jax.numpy as jnp, numpy as np
from planner.validate.flash import causal_attention
r = np.random.default_rng(0)
q, k, v, w = (jnp.asarray(r.standard_normal(s), jnp.float32) for s in ((1, 1, 64, 2, 1, 24), (1, 64, 2, 24),
                                                                        (1, 64, 2, 16), (1, 1, 64, 2, 1, 16)))
pos = jnp.arange(64)
for window in (0, 20):
    def ref(q, k, v):
        sc = jnp.einsum("brqkgd,btkd->brkgqt", q, k) / jnp.sqrt(24.0)
        keep = (pos[None, :] <= pos[:, None]) & ((pos[None, :] > pos[:, None] - window) if window else True)
        p = jax.nn.softmax(jnp.where(keep, sc, -jnp.inf), axis=-1)
        return jnp.einsum("brkgqt,btkd->brqkgd", p, v)
    def flash(q, k, v):
        return causal_attention(q, k, v, 16, window)
    for f in (ref, flash):
        out = f(q, k, v)
        grads = jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(q, k, v)
        if f is ref:
            want = (out, grads)
    assert np.allclose(out, want[0], atol=1e-5), window
    assert all(np.allclose(g, h, atol=1e-4) for g, h in zip(grads, want[1])), window
print("ok")
"""


def test_flash_attention_equals_softmax_attention_with_window_and_narrow_values(has_jax):
    # the blockwise attention and its custom backward against plain masked softmax attention: causal and a
    # sliding window of 20 (blocks of 16, so edge blocks are partly masked and old ones skipped), values
    # narrower than the keys (MLA)
    r = subprocess.run([sys.executable, "-c", FLASH_CHECK], capture_output=True, text=True, env=_env(), cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_scale_down_keeps_divisibility_and_refuses_what_it_cannot_run():
    small, job, _ = scale_down(load_model("llama3-8b"), Plan(tp=4, cp=2))
    assert small.n_heads % 4 == 0 and small.n_kv_heads % 4 == 0 and small.vocab_size % 4 == 0
    assert job.seq_len % 2 == 0 and small.n_heads // small.n_kv_heads == 2
    moe, _, _ = scale_down(load_model("mixtral-8x7b"), Plan(ep=4, dp=2))
    assert moe.n_experts % 4 == 0 and moe.experts_per_token == 2
    # DeepSeek's layout: one leading dense layer, the shared expert and MLA kept (latents d/4 and d/8, qk heads
    # of 16 + 8 rope, values 16); under pp the stages stack alike layers, so the dense layer goes (noted)
    ds, _, notes = scale_down(load_model("deepseek-v3-671b"), Plan(ep=4, dp=2))
    assert (ds.n_dense_layers, ds.n_moe_layers, ds.n_shared_experts, ds.is_mla) == (1, 1, 1, True)
    assert (ds.q_lora_rank, ds.kv_lora_rank, ds.head_dim, ds.qk_rope_head_dim, ds.v_head_dim) == (32, 16, 24, 8, 16)
    assert notes == []
    ds, _, notes = scale_down(load_model("deepseek-v3-671b"), Plan(ep=2, pp=2))
    assert (ds.n_dense_layers, ds.n_shared_experts) == (0, 1) and "pipeline stages run alike" in notes[0]
    ds, _, notes = scale_down(load_model("deepseek-v3-671b"), Plan(ep=8), Scale(n_layers=1))
    assert ds.n_dense_layers == 0 and notes == ["leading dense layers dropped (the one scaled layer is a MoE layer)"]
    # a sliding window: a quarter of the scaled sequence; Gemma 3's 5:1 pattern keeps one global layer of two,
    # and under pp every layer is local (noted)
    from dataclasses import replace

    swa = replace(load_model("llama3-8b"), sliding_window=1024, local_per_global=5)
    small, _, notes = scale_down(swa, Plan(dp=8))
    assert (small.sliding_window, small.local_per_global, notes) == (32, 1, [])
    small, _, notes = scale_down(swa, Plan(pp=2, dp=4))
    assert (small.sliding_window, small.local_per_global) == (32, 0) and "every layer local" in notes[0]
    small, job, _ = scale_down(load_model("llama3-8b"), Plan(pp=2, dp=2))
    assert small.n_layers == 2 and job.global_batch == 2 * 2  # micro-batches per step: pp of them by default
    with pytest.raises(InputError, match="--layers 4"):
        scale_down(load_model("llama3-8b"), Plan(pp=4), Scale(n_layers=2))
    with pytest.raises(InputError, match="one weight-splitting axis"):
        scale_down(load_model("llama3-8b"), Plan(pp=2, tp=2, fsdp=2))
    # circular pipeline (vpp repeats): the layers split over pp * vpp chunks, exactly pp micro-batches per step
    small, job, _ = scale_down(load_model("llama3-8b"), Plan(pp=2, vpp=2, dp=2), Scale(n_layers=4))
    assert small.n_layers == 4 and job.global_batch == 2 * 2
    with pytest.raises(InputError, match=r"2 stages x 2 repeats; use --layers 4 \(a multiple of pp\*vpp\)"):
        scale_down(load_model("llama3-8b"), Plan(pp=2, vpp=2))
    with pytest.raises(InputError, match=r"circular pipeline \(vpp=2\) runs exactly pp=2 of them; use --grad-accum 2"):
        scale_down(load_model("llama3-8b"), Plan(pp=2, vpp=2), Scale(n_layers=4, micro_steps=4))
    with pytest.raises(InputError, match="only 8 exist"):
        check_devices(Plan(dp=4, tp=4), 8)
    # cp 3: d_model a multiple of the weight shards (was 128, not divisible by 3: XLA refused the sharding) and the
    # sequence of whole flash blocks per cp shard (was 129: one-token blocks, a compile that did not end)
    small, job, notes = scale_down(load_model("llama3-8b"), Plan(cp=3))
    assert (small.d_model, job.seq_len) == (144, 132) and any("d_model 128 -> 144" in n for n in notes)


def test_cli_bad_input_exits_2_with_one_line():
    for args, needle in ((["--dp", "4", "--tp", "4"], "only 8 exist"), (["--pp", "4"], "use --layers 4"),
                         (["--pp", "2", "--tp", "2", "--fsdp", "2"], "--pp 1"), (["--ep", "2"], "--ep 1"),
                         (["--coordinator", "nohost"], "HOST:PORT"),
                         (["--vpp", "2"], "vpp: virtual stages (2) need pp > 1"),  # was a per-plan failure, exit 1
                         (["--plan-timeout", "-1"], "--plan-timeout: expected 0 (no limit)")):
        r = subprocess.run([PLANNER, "validate", *args], capture_output=True, text=True, env=_env(), timeout=60)
        assert r.returncode == 2, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and needle in lines[0]


def test_calibrate_on_devices_bad_input_exits_2_with_one_line(tmp_path):
    out = str(tmp_path / "p.yaml")
    for args, needle in (([], "--file"), (["--out", out], "--hardware"),
                         (["--out", out, "-H", "cpu-host", "-f", "x.csv"], "leave out --file"),
                         (["--out", out, "-H", "cpu-host", "--set", "nope"], "quick, cpu8, single"),
                         (["--out", out, "-H", "cpu-host", "--devices", "4"], "only 4 exist"),
                         (["--out", out, "-H", "no-such-chip"], "hardware")):
        r = subprocess.run([PLANNER, "calibrate", *args], capture_output=True, text=True, env=_env(), timeout=60)
        assert r.returncode == 2, (args, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and needle in lines[0], (args, lines)
    assert not Path(out).exists()


def test_cli_plan_file_too_big_for_the_devices(tmp_path):
    plan = tmp_path / "p64.yaml"
    r = subprocess.run([PLANNER, "estimate", "--model", "llama3-8b", "--hardware", "tpu-v5p", "--chips", "64",
                        "--fsdp", "64", "--global-batch", "64", "--save-plan", str(plan)],
                       capture_output=True, text=True, env=_env(), timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([PLANNER, "validate", "--plan", str(plan)], capture_output=True, text=True, env=_env(),
                       timeout=60)
    assert r.returncode == 2 and "needs 64 devices" in r.stderr and "--devices" in r.stderr


@pytest.fixture(scope="module")
def has_jax():
    pytest.importorskip("jax")


def test_scanned_step_groups_blocks_of_a_local_global_pattern(has_jax):
    from dataclasses import replace

    from planner.validate.model import layer_groups, layer_stacks

    # 14 layers of five local then one global: two blocks of six, then two local layers (a shorter block)
    m = replace(load_model("llama3-8b"), n_layers=14, sliding_window=1024, local_per_global=5)
    loc, glob = (False, 1024), (False, 0)
    assert layer_groups(m) == [((loc,) * 5 + (glob,), 0, 2), ((loc, loc), 12, 1)]
    assert layer_stacks(m) == [[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11], [12], [13]]
    # every layer local (Mistral's 4096-token window; its preset, like MaxText, attends globally): one run
    mistral = replace(load_model("mistral-7b"), sliding_window=4096)
    assert layer_groups(mistral) == [(((False, 4096),), 0, 32)]
    # DeepSeek-V2-Lite: one dense layer, then 26 MoE layers
    ds = load_model("deepseek-v2-lite-16b")
    assert layer_groups(ds) == [(((False, 0),), 0, 1), (((True, 0),), 1, 26)]
    assert layer_stacks(ds) == [[0], list(range(1, 27))]


def test_sharded_step_equals_one_device_step(has_jax):
    r = subprocess.run([sys.executable, "-m", "planner.validate.equality", "--devices", "8", "--only",
                        "cp2-tp2-fsdp2-sp-selective,moe-ep2-tp2-dp2-full,pp2-dp2-fsdp2-selective,"
                        "pp2-dp2-full-scanned,pp4-vpp2-dp2-selective,pp2-vpp2-dp2-full-scanned,"
                        "moe-ep4-fsdp2-none-dropless,moe-shared-dense-ep2-tp2-fsdp2-selective,"
                        "swa-cp2-tp2-fsdp2-none,layer-scan-moe-shared-dense-ep2-tp2-fsdp2-full-dropless,"
                        "layer-scan-swa-cp2-tp2-fsdp2-full,moe-pp2-ep4-full-gathered,pp2-fsdp4-full-gathered"],
                       capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert len(rows) == 13  # the third: GPipe stages (shard_map over pp, ppermute) with dp and fsdp; the fourth
    # the same schedule as one lax.scan over the ticks; the fifth and sixth: MaxText's circular pipeline (vpp 2,
    # the micro-batches going round a ring of 4 and of 2 stages), unrolled and scanned; the seventh: MaxText's
    # dropless MoE (ragged all-to-all over ep 4, grouped matmuls), which on one device also equals the
    # capacity-routed step given room for every token; then DeepSeek's layout (MLA, a dense layer, then a MoE
    # layer with a shared expert); a sliding-window layer and a global one under cp; then two rows of the TPU
    # compile's step (one lax.scan per run of alike blocks: DeepSeek-V2-Lite's dense layer, then two MoE layers;
    # two blocks of a local and a global layer, then a local layer); the scanned ticks with each stage's weights
    # gathered for the whole loop (the TPU memory compile's, MaxText's layout) for MoE stages over ep 4 and for
    # dense stages over fsdp 4
    for row in rows:
        assert row["loss_diff"] < 1e-5, row
        assert row["max_grad_rel_err"] < 1e-4, row
    for dropless in (rows[6], rows[9]):
        assert dropless["capacity_loss_diff"] < 1e-5 and dropless["capacity_grad_rel_err"] < 1e-4, dropless


def test_validate_three_plans_end_to_end(has_jax):
    r = subprocess.run([PLANNER, "validate", "--set", "quick", "--steps", "1", "--d-model", "64", "--seq-len", "64",
                        "--fast-compile", "--json"], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert r.returncode in (0, 1), r.stderr[-2000:]  # 1: some check outside tolerance (reported, not a crash)
    out = json.loads(r.stdout)
    plans = {c["plan"] for c in out["checks"]}
    assert plans == {"fsdp4-dp2-full", "tp4-sp-dp2-selective", "cp2-fsdp4-none"}
    for c in out["checks"]:
        assert set(c) >= {"plan", "quantity", "predicted", "xla", "error_pct", "ok"}
        assert c["quantity"] != "compile", c  # every plan compiled
    by = {(c["plan"], c["quantity"]): c for c in out["checks"]}
    for p in plans:
        # model state (fp32 weights + Adam) is what the cost model gets exactly right
        assert by[(p, "state_bytes")]["ok"], by[(p, "state_bytes")]
        # FLOPs: matmuls are modelled; XLA also counts element-wise work (norms, softmax, Adam): within 15%
        assert abs(by[(p, "flops")]["error_pct"]) < 15, by[(p, "flops")]
        assert by[(p, "step_time_s")]["xla"] > 0
    assert r.returncode == (0 if all(c["ok"] for c in out["checks"]) else 1)


def test_device_script_runs_end_to_end_on_cpu(has_jax, tmp_path):
    """benchmarks/device_calibration.sh on the CPU devices: microbench, validate of three plans and planner calibrate
    --out, whose profile `--hardware` accepts, with only the efficiencies refitted."""
    from hardware.catalog import load_hardware

    r = subprocess.run(["bash", "benchmarks/device_calibration.sh", "--quick"], capture_output=True, text=True,
                       env={**_env(), "OUT": str(tmp_path), "PYTHON": sys.executable}, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    bench = json.loads((tmp_path / "microbench.json").read_text())
    assert bench["best_matmul_tflops"] > 0 and bench["hbm"]["GBps"] > 0
    checks = json.loads((tmp_path / "validate.json").read_text())["checks"]
    assert {c["plan"] for c in checks} == {"fsdp4-dp2-full", "tp4-sp-dp2-selective", "cp2-fsdp4-none"}
    cal = json.loads((tmp_path / "calibrate.json").read_text())["calibration"]
    assert cal["rows"] == 3 and cal["after"]["median_error_pct"] <= cal["before"]["median_error_pct"] + 1e-9
    fitted, base = load_hardware(str(tmp_path / "calibrated_cpu-host.yaml")), load_hardware("cpu-host")
    assert fitted.eff != base.eff and fitted.peak_bf16_flops == base.peak_bf16_flops
    assert fitted.eff.matmul_peak == pytest.approx(cal["eff"]["matmul_peak"], rel=1e-4)
    r = subprocess.run([PLANNER, "estimate", "-m", "llama3-8b", "-H", str(tmp_path / "calibrated_cpu-host.yaml"),
                        "-n", "1", "-b", "1", "-s", "128", "--json"], capture_output=True, text=True, env=_env(),
                       timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["step_time_s"] > 0, r.stderr


def test_cpu_calibration_recovers_synthetic_step_times():
    """fit_efficiency on step times made by the cost model itself with other efficiencies: ranks and times back."""
    from dataclasses import replace

    from costmodel.estimate import estimate
    from costmodel.published import Case
    from hardware.catalog import load_hardware
    from planner.validate.calibrate_cpu import fit_efficiency, predicted_times, summary
    from planner.validate.compare import activation_bytes
    from planner.validate.plans import PLAN_SETS

    chip = load_hardware("cpu-host")
    truth = chip.with_efficiency(matmul_peak=0.2, attention=0.4, step_overhead_s=0.01)
    cases = []
    for name, model, plan in PLAN_SETS["cpu8"][:6]:
        small, job, _ = scale_down(load_model(model), plan)
        with activation_bytes(4):
            t = estimate(small, truth, job, plan).step_time_s
        cases.append(Case(name, "synthetic", small, chip, job, plan, t))
    cal, stats = fit_efficiency(cases, chip)
    meas = [c.measured_step_time_s for c in cases]
    after = summary(predicted_times(cases, cal), meas)
    assert after["median_error_pct"] < 5 and after["spearman"] > 0.9, (after, cal.eff)
    assert replace(cal, eff=chip.eff) == chip  # only the efficiencies change


def test_validate_pipeline_plan_compare(has_jax):
    """pp=2 x dp=2, laid out as MaxText's pipeline: XLA's collective-permute bytes equal the cost model's (a stage
    shift per iteration but the last, and the last stage's outputs to the other stage's logits shard), the
    gradients are reduced once per step (dp, and dp x pp for the tables), and the FLOPs match once the bubble
    ticks' compute is added (compare.pipeline_flops_adjustment)."""
    r = subprocess.run([PLANNER, "validate", "--pp", "2", "--dp", "2", "--steps", "0", "--d-model", "64",
                        "--seq-len", "64", "--fast-compile", "--json"],
                       capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert r.returncode in (0, 1), r.stderr[-2000:]
    out = json.loads(r.stdout)
    by = {c["quantity"]: c for c in out["checks"]}
    assert "compile" not in by, by
    perm = by["collective_bytes:collective-permute"]
    assert perm["ok"] and perm["xla"] == perm["predicted"] > 0, perm
    assert by["matmul_flops"]["ok"] and by["state_bytes"]["ok"], (by["matmul_flops"], by["state_bytes"])
    assert by["flops"]["ok"], by["flops"]
    reduce = by["collective_bytes:all-reduce+reduce-scatter"]
    assert abs(reduce["error_pct"]) < 1, reduce
    assert out["plans"][0]["xla_collectives_by_axis"]["collective-permute@pp"] == perm["xla"]


def test_validate_circular_pipeline_plan_compare(has_jax):
    """pp=2 x vpp=2 x dp=4 (MaxText's circular pipeline: M * vpp + pp - 1 ticks of one L / (pp * vpp) chunk): the
    bubble is (pp - 1) / vpp stages, so the FLOPs are 5/6 of the vpp 1 step's and match the cost model's; the stage
    shifts (now round a ring) and the gradient reductions match byte for byte."""
    runs = {}
    for vpp in ("1", "2"):
        r = subprocess.run([PLANNER, "validate", "--pp", "2", "--vpp", vpp, "--dp", "4", "--layers", "4", "--steps",
                            "0", "--d-model", "64", "--seq-len", "64", "--fast-compile", "--json"],
                           capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
        assert r.returncode in (0, 1), r.stderr[-2000:]
        runs[vpp] = {c["quantity"]: c for c in json.loads(r.stdout)["checks"]}
    by = runs["2"]
    assert by["flops"]["ok"], by["flops"]  # within 3 %, and as close as the vpp 1 step's (the bubble is exact)
    assert abs(by["flops"]["error_pct"] - runs["1"]["flops"]["error_pct"]) < 0.5, (by["flops"], runs["1"]["flops"])
    perm = by["collective_bytes:collective-permute"]
    assert perm["xla"] == perm["predicted"] > 0, perm
    assert abs(by["collective_bytes:all-reduce+reduce-scatter"]["error_pct"]) < 1
    # 2 micro-batches: vpp 1 runs 3 ticks of 2 layers (6 layer passes), vpp 2 5 ticks of 1 (5): the layers' share
    # of the FLOPs drops by a sixth
    assert 0.80 < by["flops"]["xla"] / runs["1"]["flops"]["xla"] < 0.90


GATHERED_STAGE = """
import json
from dataclasses import replace
from planner.validate import set_host_devices
set_host_devices(8)
from costmodel.catalog import load_model
from costmodel.plan import Plan, remat_policy
from planner.validate import hlo
from planner.validate.model import Setup, build_step, make_mesh
from planner.validate.scale import Scale, scale_down
def temps(plan):  # (temp without, temp with gather_stage, one stage's parameters) of the scanned pipeline step
    small, job, _ = scale_down(load_model("llama3-8b"), plan, Scale(d_model=256, seq_len=64, n_layers=4))
    out = []
    for gather in (False, True):
        cfg = Setup(small, plan, job.seq_len, job.global_batch, "float32", scan_pipeline=True, gather_stage=gather)
        step = build_step(cfg, make_mesh(plan))
        out.append(hlo.memory(step.fn.lower(*step.abstract_inputs()).compile())["temp"])
    return *out, sum(v.size for lay in step.abstract_inputs()[0]["layers"] for v in lay.values()) // plan.pp
plan = Plan(pp=2, fsdp=4, remat=remat_policy("full"))
temp, temp_gathered, stage = temps(plan)
circular = temps(replace(plan, vpp=2))[:2]
print(json.dumps({"temp": temp, "temp_gathered": temp_gathered, "stage_params": stage, "circular": circular}))
"""


def test_gathered_stage_holds_the_stage_weights_and_gradient(has_jax):
    """Setup.gather_stage (the TPU memory compile of a pp plan, MaxText's layout): the scanned tick loop holds the
    stage's weights gathered over fsdp and their unsharded gradient, so XLA's temp grows by the gathered stage less
    its shard, once for the weights and once for the gradient (fp32 here: 4 B per parameter)."""
    r = subprocess.run([sys.executable, "-c", GATHERED_STAGE], capture_output=True, text=True, env=_env(), cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    x = json.loads(r.stdout.strip().splitlines()[-1])
    beyond_shard = 4 * x["stage_params"] * (1 - 1 / 4)  # fsdp 4: a gathered fp32 stage less the chip's quarter
    grown = x["temp_gathered"] - x["temp"]
    assert beyond_shard < grown <= 2 * beyond_shard, (grown, beyond_shard)
    # a circular pipeline (vpp 2) keeps its chunks sharded: the same program either way
    assert x["circular"][0] == x["circular"][1], x["circular"]


def test_validate_two_processes_jax_distributed(has_jax):
    """The multi-host path: two processes on localhost (4 CPU devices each, 8 in the mesh), gloo collectives."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = ["validate", "--dp", "2", "--fsdp", "4", "--steps", "1", "--d-model", "64", "--seq-len", "64",
            "--fast-compile", "--json", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    procs = [subprocess.Popen([PLANNER, *args, "--process-id", str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT) for i in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    if any(p.returncode not in (0, 1) for p in procs) and any("gloo" in err.lower() and "unavailable" in err.lower()
                                                             for _, err in outs):
        pytest.skip("gloo CPU collectives are unavailable in this jax build")
    results = []
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode in (0, 1), err[-2000:]
        d = json.loads(out)
        assert d["plans"][0]["error"] == "" and d["plans"][0]["loss"] is not None, d["plans"][0]
        results.append(d)
    assert results[0]["plans"][0]["loss"] == results[1]["plans"][0]["loss"]
    same = [{k: c[k] for k in ("quantity", "predicted", "xla")} for c in results[0]["checks"]
            if c["quantity"] != "step_time_s"]
    assert same == [{k: c[k] for k in ("quantity", "predicted", "xla")} for c in results[1]["checks"]
                    if c["quantity"] != "step_time_s"]


FAILING_COMPILES = """
import sys, time
from planner.validate import set_host_devices
set_host_devices(8)
import planner.validate.compare as c
real = c.lower_and_compile
def fake(step):
    if step.cfg.plan.tp == 4:
        raise RuntimeError("injected compile failure")
    if step.cfg.plan.cp == 2:
        time.sleep(600)
    return real(step)
c.lower_and_compile = fake
from cli.main import main
sys.argv = ["planner", "validate", "--set", "quick", "--steps", "0", "--d-model", "64", "--seq-len", "64",
            "--fast-compile", "--json", "--plan-timeout", "15"]
main()
"""


def test_compile_failure_and_timeout_are_reported_per_plan(has_jax):
    r = subprocess.run([sys.executable, "-c", FAILING_COMPILES], capture_output=True, text=True, env=_env(), cwd=ROOT,
                       timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    out = json.loads(r.stdout)
    info = {p["plan"]: p for p in out["plans"]}
    assert "injected compile failure" in info["tp4-sp-dp2-selective"]["error"]
    assert "within 15 s" in info["cp2-fsdp4-none"]["error"]
    assert info["fsdp4-dp2-full"]["error"] == ""  # the other plan's results are kept
    qs = {(c["plan"], c["quantity"]) for c in out["checks"]}
    assert ("fsdp4-dp2-full", "state_bytes") in qs
    assert {("tp4-sp-dp2-selective", "compile"), ("cp2-fsdp4-none", "compile")} <= qs


def test_validate_pipeline_micro_batches_must_divide_over_stages():
    """The logits' batch is split over the stages (MaxText's layout): M must be a multiple of pp."""
    from planner.validate.scale import Scale

    with pytest.raises(InputError, match=r"--grad-accum: 3 micro-batches; .*multiple of pp=2.*--grad-accum 4"):
        scale_down(load_model("llama3-8b"), Plan(pp=2, dp=2), Scale(micro_steps=3))


def test_grouped_matmul_flops_adjustment_by_hand():
    """The megablox kernels' declared excess under ep: (buffer - 1) x the routed experts' MLP FLOPs, each matmul
    counted forward, twice backward and once more recomputed under full remat; shared experts (a dense MLP)
    not scaled. Tiny MoE: d 64, expert ffn 32 (gated), top-2 of 8 plus 1 shared, ep 4 -> buffer min(4, 8/2) = 4."""
    from dataclasses import replace

    from costmodel.model import ModelSpec
    from costmodel.plan import parse_remat
    from planner.validate.compare import grouped_matmul_flops_adjustment
    from planner.validate.tpu import tpu_job

    m = ModelSpec(name="tiny-moe", n_layers=3, d_model=64, n_heads=4, n_kv_heads=4, head_dim=16, ffn_dim=128,
                  vocab_size=256, gated_mlp=True, tied_embeddings=False, n_experts=8, experts_per_token=2,
                  moe_ffn_dim=32, n_shared_experts=1)
    plan = Plan(ep=4, fsdp=2, remat=parse_remat("full"))
    job = tpu_job(plan, 128)
    mlp_in = 2 * 128 * 2 * 64 * (2 * 32)  # tokens x k x d x (gate + up) x ffn, 2 FLOPs per multiply-add
    mlp_out = 2 * 128 * 2 * 32 * 64
    want = 3 * (3 * (4 * mlp_in + 4 * mlp_out))  # 3 MoE layers x (buffer - 1) x 4 passes each
    assert grouped_matmul_flops_adjustment(m, job, plan) == pytest.approx(want)
    # no ep: the buffer is the balanced rows, nothing declared beyond the work
    assert grouped_matmul_flops_adjustment(m, job, plan.with_(ep=1, fsdp=8)) == 0.0
    # a dense first layer runs no grouped matmul
    assert grouped_matmul_flops_adjustment(replace(m, n_dense_layers=1), job, plan) == pytest.approx(want * 2 / 3)
