"""Hand-computed FLOPs, bytes and memory for small cases, plus invariants of the cost model."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest

from costmodel.estimate import dcn_split, estimate
from costmodel.flops import layer_ops, model_flops_per_token
from costmodel.job import Job
from costmodel.memory import memory_terms, tensor_elems_per_token
from costmodel.model import ModelSpec
from costmodel.plan import REMAT_POLICIES, Plan, parse_remat
from hardware.catalog import load_hardware
from hardware.errors import InputError
from hardware.topology import AxisLink, collective_time, slice_shape

# A tiny GQA model: d=64, 4 query heads of 16, 2 kv heads, gated MLP 128, vocab 100, 2 layers.
TINY = ModelSpec("tiny", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100)
TINY_MOE = ModelSpec("tiny-moe", n_layers=2, d_model=64, n_heads=4, ffn_dim=128, vocab_size=100,
                     n_experts=4, experts_per_token=2, moe_ffn_dim=32)
V5P = load_hardware("tpu-v5p")
H100 = load_hardware("h100-sxm")


def test_gqa_param_count_by_hand():
    # q 64*64 + k,v 2*64*32 + o 64*64 = 12288 per layer; MLP 3*64*128 = 24576; norms 2*64.
    per_layer = 12288 + 24576 + 128
    assert TINY.total_params() == 2 * per_layer + 2 * 100 * 64 + 64


def test_layer_flops_by_hand_gqa():
    ops = {op.name: op for op in layer_ops(TINY, tokens=10, seq_len=10, tp=1, cp=1, moe=False)}
    assert ops["qkv_proj"].flops == 2 * 10 * 64 * (64 + 2 * 32)
    assert ops["out_proj"].flops == 2 * 10 * 64 * 64
    assert ops["mlp_in"].flops == 2 * 10 * 64 * 2 * 128
    assert ops["mlp_out"].flops == 2 * 10 * 128 * 64
    # Causal attention: QK^T and PV, 2*s*s*64 each, half of the pairs.
    assert ops["attention"].flops == 2 * 10 * 10 * (64 + 64) * 0.5
    split = {op.name: op for op in layer_ops(TINY, tokens=10, seq_len=10, tp=2, cp=1, moe=False)}
    assert split["mlp_in"].flops == ops["mlp_in"].flops / 2


def test_model_flops_per_token_by_hand():
    # 6 x (matmul weights: 2 layers x (12288 + 24576) + logits 100*64) + 3 x causal attention (2*s*(64+64)/2 per layer)
    s = 16
    expected = 6 * (2 * (12288 + 24576) + 6400) + 3 * 2 * (2 * s * 128 * 0.5)
    assert model_flops_per_token(TINY, s) == pytest.approx(expected)


def test_moe_flops_by_hand():
    ops = {op.name: op for op in layer_ops(TINY_MOE, tokens=8, seq_len=8, tp=1, cp=1, moe=True)}
    assert ops["router"].flops == 2 * 8 * 64 * 4
    # Two experts per token, each 3 matrices of 64x32: mlp_in has the two input matrices.
    assert ops["mlp_in"].flops == 2 * 8 * 2 * 64 * 2 * 32
    assert ops["mlp_out"].flops == 2 * 8 * 2 * 32 * 64
    assert TINY_MOE.active_params() < TINY_MOE.total_params()


def test_memory_by_hand_fsdp_maxtext():
    m = ModelSpec("m", n_layers=4, d_model=256, n_heads=4, ffn_dim=1024, vocab_size=1000)
    job = Job(seq_len=128, global_batch=8, framework="maxtext")
    plan = Plan(fsdp=8, micro_batch=1, zero=3, remat=REMAT_POLICIES["full"])
    mem = memory_terms(m, V5P, job, plan, accum=1)
    params = m.total_params() - m.d_model  # final norm is not in the per-layer/embedding split
    assert mem.param_elems == pytest.approx((params) / 8, rel=1e-3)
    # fp32 weights + their bf16 compute copy + fp32 grads + fp32 Adam moments = 18 bytes per parameter,
    # no accumulator at accum=1.
    b = mem.breakdown
    assert b["weights"] + b["gradients"] + b["optimizer"] == pytest.approx(18 * mem.param_elems)
    # Full remat keeps the layer input (d bf16 values per token per layer), and XLA's scanned loop a second copy
    # of that stack beside it (MaxText convention, its own breakdown entry).
    assert b["activations"] == pytest.approx(4 * 128 * 256 * 2)
    assert b["loop_buffers"] == pytest.approx(4 * 128 * 256 * 2)
    assert b["logits"] == pytest.approx(128 * 1000 * 4)


def test_logits_bytes_per_framework():
    """Logits and their gradient per token and vocab entry (tp 2 splits the vocab): MaxText and llm-foundry
    (flash-attn's fused cross-entropy) keep bf16 logits and a bf16 gradient, 4 B; Megatron and DeepSpeed add the
    fp32 upcast of the vocab-parallel cross-entropy, 6 B."""
    m = ModelSpec("m", n_layers=2, d_model=256, n_heads=4, ffn_dim=1024, vocab_size=1000)
    plan = Plan(dp=4, tp=2, micro_batch=2, remat=REMAT_POLICIES["full"])
    tokens_vocab = 2 * 128 * 1000 / 2
    for framework, per_elem in (("maxtext", 4), ("pytorch-fsdp", 4), ("megatron", 6), ("deepspeed", 6)):
        job = Job(seq_len=128, global_batch=8, framework=framework)
        b = memory_terms(m, H100, job, plan, accum=1).breakdown
        assert b["logits"] == pytest.approx(per_elem * tokens_vocab), framework


def test_maxtext_bf16_weight_dtype_and_grad_accumulation_state():
    m = ModelSpec("m", n_layers=4, d_model=256, n_heads=4, ffn_dim=1024, vocab_size=1000)
    plan = Plan(fsdp=8, micro_batch=1, zero=3, remat=REMAT_POLICIES["full"])
    bf16 = memory_terms(m, V5P, Job(seq_len=128, global_batch=8, weight_dtype="bfloat16"), plan, accum=1)
    b = bf16.breakdown
    # bf16 weights (no separate compute copy) + fp32 grads + bf16 mu and nu = 2 + 4 + 4 bytes per parameter.
    assert (b["weights"], b["gradients"], b["optimizer"]) == pytest.approx(
        (2 * bf16.param_elems, 4 * bf16.param_elems, 4 * bf16.param_elems))
    # Accumulating over 2 micro-steps: the scan carry adds an fp32 accumulator and an fp32 copy of the weights.
    ga = memory_terms(m, V5P, Job(seq_len=128, global_batch=16), plan, accum=2)
    assert ga.breakdown["gradients"] == pytest.approx((4 + 4 + 4) * ga.param_elems)
    with pytest.raises(InputError, match="weight_dtype"):
        Job(seq_len=128, global_batch=8, framework="megatron", weight_dtype="bfloat16")


def test_xla_loop_extra_buffer_rule():
    from costmodel.memory import xla_loop_extra_bytes

    assert xla_loop_extra_bytes(5.0, 3.0, only_layer_input=True, tp=1) == 5.0  # full remat: stack copied
    assert xla_loop_extra_bytes(5.0, 3.0, only_layer_input=False, tp=1) == 3.0  # the cheaper copy
    assert xla_loop_extra_bytes(2.0, 3.0, only_layer_input=False, tp=1) == 2.0
    # tp: one more buffer, again the cheaper of the stack and the gradient stack
    assert xla_loop_extra_bytes(5.0, 3.0, only_layer_input=True, tp=2) == 8.0
    assert xla_loop_extra_bytes(1.0, 3.0, only_layer_input=True, tp=2) == 2.0
    # In memory_terms: `minimal` on a tiny model, where the stack (by hand) is smaller than the layer gradients.
    m = ModelSpec("m", n_layers=4, d_model=256, n_heads=4, ffn_dim=1024, vocab_size=1000)
    job = Job(seq_len=128, global_batch=8)
    mem = memory_terms(m, V5P, job, Plan(fsdp=8, micro_batch=1, zero=3, remat=REMAT_POLICIES["minimal"]), accum=1)
    # Saved per token and layer: input 256 + q,k,v 768 + out_proj 256 + gated MLP inputs 2048 (the MLP output is
    # dropped by XLA), bf16, 4 layers x 128 tokens = 3.41 MB; the fp32 gradients of the layers' weights
    # (4 B x 4 layers x (4*256^2 + 3*256*1024 + 2*256) / 8 chips = 2.10 MB) are the cheaper extra buffer.
    stack = 4 * 128 * (256 + 768 + 256 + 2048) * 2
    grads = 4 * 4 * (4 * 256**2 + 3 * 256 * 1024 + 2 * 256) / 8
    assert mem.breakdown["activations"] == pytest.approx(stack)
    assert mem.breakdown["loop_buffers"] == pytest.approx(grads) == mem.loop_grad_bytes
    # Layers unrolled (MaxText scan_layers=false): no loop, no extra buffer.
    unrolled = replace(job, scan_layers=False)
    mem = memory_terms(m, V5P, unrolled, Plan(fsdp=8, micro_batch=1, zero=3, remat=REMAT_POLICIES["minimal"]), 1)
    assert mem.breakdown["activations"] == pytest.approx(stack)
    assert mem.breakdown["loop_buffers"] == 0 == mem.loop_grad_bytes


def test_fit_floor_by_hand():
    from costmodel.memory import fit_floor_bytes

    b = {"weights": 10.0, "gradients": 8.0, "optimizer": 16.0, "activations": 5.0, "loop_buffers": 5.0,
         "activation_working": 2.0, "logits": 4.0, "collective_buffers": 1.0}
    # state 34 + checkpoints 5 + the larger phase: logits 4 vs layer loop 2 + 1; the loop copy is not counted
    assert fit_floor_bytes(b) == 34 + 5 + 4
    assert fit_floor_bytes({**b, "logits": 1.0}) == 34 + 5 + 3
    assert fit_floor_bytes(b, loop_tp=2.0) == 34 + 5 + 2 + 4  # the tp loop buffer XLA's peak holds
    assert fit_floor_bytes(b, head=3.0) == 34 + 5 + 4 + 3  # the gathered output table joins the loss phase


def test_total_never_below_fit_floor_with_a_table_larger_than_the_layers():
    """A 10M-token vocabulary over d_model 2 (fsdp 2): the loss phase's gathered output table and its gradient
    (bf16, 20M elements each) outweigh the layer loop's working set, so the floor's loss phase is above the
    sum of terms; the total (XLA's memory_analysis holds every buffer its peak holds) is the floor there."""
    m = ModelSpec("wide-vocab", n_layers=1, d_model=2, n_heads=1, ffn_dim=4, vocab_size=10_000_000)
    job = Job(seq_len=8, global_batch=2)
    plan = Plan(fsdp=2, remat=REMAT_POLICIES["none"], sequence_parallel=False)
    mem = memory_terms(m, load_hardware("a100-40gb"), job, plan, accum=1)
    assert mem.fit_bytes > sum(mem.breakdown.values())  # the case the invariant had failed on
    assert mem.peak_bytes == mem.fit_bytes
    c = estimate(m, load_hardware("a100-40gb"), job, plan, 2)
    assert c.fit_memory_bytes <= c.peak_memory_bytes


def test_gathered_output_table_by_hand():
    """The loss phase under FSDP: the gathered bf16 table (V x d) and its bf16 gradient, which replaces the logits
    once they die, so only its excess over them counts."""
    from costmodel.memory import head_table_bytes

    # table 1000 x 100 = 100,000 elements, logits 50 tokens x 1000 = 50,000: 2 B x 100,000 + 2 B x 50,000
    assert head_table_bytes(50_000, 100_000, gathered=True) == 300_000
    # logits larger than the table: only the table itself
    assert head_table_bytes(4_000_000, 100_000, gathered=True) == 200_000
    # weights not sharded: the table is the weights, its gradient the gradients (counted as state)
    assert head_table_bytes(50_000, 100_000, gathered=False) == 0
    # Gemma 3 12B, fsdp 8, one 4096-token sequence per chip: the loss phase outweighs the layer loop, so the fit
    # floor carries the table (262144 x 3840) and its gradient's excess over the logits (4096 x 262144)
    from costmodel.catalog import load_model

    g = load_model("gemma3-12b")
    mem = memory_terms(g, V5P, Job(4096, 8, precision="bf16", framework="maxtext"),
                       Plan(fsdp=8, micro_batch=1, remat=REMAT_POLICIES["full"]), 1)
    b = mem.breakdown
    table, logits = 262144 * 3840, 4096 * 262144
    assert b["logits"] == pytest.approx(4 * logits)  # bf16 logits and their bf16 gradient
    state = b["weights"] + b["gradients"] + b["optimizer"]
    assert mem.fit_bytes == pytest.approx(state + b["activations"] + 4 * logits + 2 * table)  # table < logits here


def test_fit_check_reads_the_floor_under_maxtext():
    """Two MaxText compiles of llama2-70b / llama3-70b on v6e-64 (benchmarks/maxtext_memory/results.csv): XLA
    accepted fsdp 32 x tp 2 at 8k tokens per replica although its memory_analysis total (34.2 GB) is over the
    usable HBM, and refused llama3-70b fsdp 16 x tp 4 at 8k x 4 tokens (OOM). The fit check is on the floor
    (costmodel.memory.fit_floor_bytes); PyTorch stacks keep the peak."""
    from costmodel.catalog import load_model

    v6e = load_hardware("tpu-v6e")
    ok = estimate(load_model("llama2-70b"), v6e, Job(4096, 64),
                  Plan(fsdp=32, tp=2, micro_batch=2, zero=3, remat=REMAT_POLICIES["full"]))
    assert ok.peak_memory_bytes > ok.hbm_usable_bytes > ok.fit_memory_bytes and ok.fits and ok.overflow_bytes == 0
    b = ok.memory
    loop_tp = b["loop_buffers"] - b["activations"]  # full remat: the stack copy, plus min(stack, gradients) (tp)
    assert ok.fit_memory_bytes == pytest.approx(ok.peak_memory_bytes - b["loop_buffers"] + loop_tp
                                                - min(b["logits"], b["activation_working"] + b["collective_buffers"]))
    oom = estimate(load_model("llama3-70b"), v6e, Job(8192, 64),
                   Plan(fsdp=16, tp=4, micro_batch=4, zero=3, remat=REMAT_POLICIES["full"]))
    assert not oom.fits and oom.overflow_bytes == pytest.approx(oom.fit_memory_bytes - oom.hbm_usable_bytes)
    mega = estimate(load_model("llama2-70b"), H100, Job(4096, 64, framework="megatron"),
                    Plan(dp=8, tp=8, micro_batch=1, zero=1, remat=REMAT_POLICIES["full"]))
    assert mega.fit_memory_bytes == mega.peak_memory_bytes


def test_near_limit_flags_plans_within_five_percent_of_the_hbm():
    """The fit check's figure within 5 % of the usable HBM flags a fitting plan (Cost.near_limit): llama2-7b at
    5 x 8192 tokens per chip on v6e-8, whose floor is 96.7 % of the HBM and which XLA refused; not at 1 x 8192,
    and never for a plan that does not fit. estimate prints it in the fits row and --json carries it."""
    from costmodel.catalog import load_model

    v6e, m = load_hardware("tpu-v6e"), load_model("llama2-7b")
    near = estimate(m, v6e, Job(8192, 40), Plan(fsdp=8, micro_batch=5, remat=REMAT_POLICIES["full"]))
    assert near.fits and 0.95 < near.fit_memory_bytes / near.hbm_usable_bytes <= 1 and near.near_limit
    roomy = estimate(m, v6e, Job(8192, 8), Plan(fsdp=8, remat=REMAT_POLICIES["full"]))
    assert roomy.fits and roomy.fit_memory_bytes < 0.95 * roomy.hbm_usable_bytes and not roomy.near_limit
    over = estimate(m, v6e, Job(8192, 48), Plan(fsdp=8, micro_batch=6, remat=REMAT_POLICIES["full"]))
    assert not over.fits and not over.near_limit
    args = ("estimate", "--model", "llama2-7b", "--hardware", "tpu-v6e", "--chips", "8", "--fsdp", "8",
            "--global-batch", "40", "--micro-batch", "5", "--seq-len", "8192", "--remat", "full")
    r = run_cli(*args)
    assert r.returncode == 0 and "compile first" in r.stdout, r.stderr
    assert json.loads(run_cli(*args, "--json").stdout)["near_limit"] is True


def test_megatron_convention_and_zero1():
    m = ModelSpec("m", n_layers=4, d_model=256, n_heads=4, ffn_dim=1024, vocab_size=1000)
    job = Job(seq_len=128, global_batch=16, framework="megatron")
    plan = Plan(dp=4, micro_batch=1, zero=1)
    mem = memory_terms(m, H100, job, plan, accum=4)
    assert mem.breakdown["weights"] == pytest.approx(2 * mem.param_elems)
    assert mem.breakdown["optimizer"] == pytest.approx(12 * mem.param_elems / 4)


def test_activation_none_matches_korthikanti_without_dropout():
    # GPT layer (h, 4h plain MLP, MHA): Korthikanti's 34*s*b*h minus two dropout masks (2 sbh) = 32 sbh bytes.
    m = ModelSpec("gpt", n_layers=1, d_model=1024, n_heads=16, ffn_dim=4096, vocab_size=1000, gated_mlp=False)
    job = Job(seq_len=512, global_batch=1, framework="megatron")
    mem = memory_terms(m, H100, job, Plan(remat=REMAT_POLICIES["none"]), accum=1)
    assert mem.breakdown["activations"] == pytest.approx(32 * 512 * 1024)


def test_sequence_parallel_shards_layer_input():
    plan = Plan(tp=4, sequence_parallel=True)
    el = tensor_elems_per_token(TINY, plan, moe=False)
    assert el["layer_input"] == 16 and el["qkv_proj"] == (64 + 64) / 4


def test_pipeline_bubble_and_inflight():
    m = ModelSpec("m", n_layers=8, d_model=512, n_heads=8, ffn_dim=2048, vocab_size=1000)
    job = Job(seq_len=256, global_batch=32, framework="megatron")
    c1 = estimate(m, H100, job, Plan(dp=2, pp=4, micro_batch=1))
    c2 = estimate(m, H100, job, Plan(dp=2, pp=4, vpp=2, micro_batch=1))
    assert c1.grad_accum == 16
    assert c2.time["bubble"] == pytest.approx(c1.time["bubble"] / 2, rel=1e-6)
    per_micro = (c1.time["compute"] + c1.time["recompute"] + c1.time["memory_bound"]) / 16
    assert c1.time["bubble"] == pytest.approx(3 * per_micro)
    # MaxText: the logits run outside the pipeline, 1 / pp of them per micro-step on every stage, none in the
    # bubble iterations.
    from costmodel.estimate import op_time, stage_times
    from costmodel.flops import logits_op

    mt = replace(job, framework="maxtext")
    plan = Plan(dp=2, pp=4, micro_batch=1)
    st = stage_times(m, H100, mt, plan)
    t_lg = op_time(logits_op(m, 256, 1), H100, H100.effective_peak_flops(mt.precision))
    assert st.head == pytest.approx(3 * t_lg / 4)
    c3 = estimate(m, H100, mt, plan)
    per_micro = (c3.time["compute"] + c3.time["recompute"] + c3.time["memory_bound"]) / 16
    assert c3.time["bubble"] == pytest.approx(3 * (per_micro - st.head))


def test_ring_collective_time_by_hand():
    link = AxisLink("fsdp", 4, 4, 1, 100e9, 10e9, 1e-6, 1e-5)
    # all-gather of 1 GB over 4: 3/4 GB at 100 GB/s + 3 latency steps
    assert collective_time(link, "all-gather", 1e9) == pytest.approx(0.75e9 / 100e9 + 3e-6)
    assert collective_time(link, "all-reduce", 1e9) == pytest.approx(2 * (0.75e9 / 100e9 + 3e-6))
    hier = AxisLink("fsdp", 16, 4, 4, 100e9, 10e9, 0.0, 0.0)
    # inner phase on the full buffer, network phase on a quarter of it
    assert collective_time(hier, "all-gather", 1e9) == pytest.approx(0.75e9 / 100e9 + 0.75 * 0.25e9 / 10e9)


def test_tpu_slice_shapes_and_errors():
    assert slice_shape(V5P, 64) == (4, 4, 4)
    assert math.prod(slice_shape(V5P, 6144)) == 6144
    with pytest.raises(InputError, match="nearest valid"):
        slice_shape(V5P, 7000)


def test_dcn_split_data_first():
    assert dcn_split(Plan(dp=2, fsdp=64, slices=2)) == {"dp": 2, "pp": 1, "fsdp": 1}
    assert dcn_split(Plan(fsdp=512, slices=2)) == {"dp": 1, "pp": 1, "fsdp": 2}
    with pytest.raises(InputError, match="slices"):
        dcn_split(Plan(tp=4, slices=4))


@pytest.mark.parametrize("plan, match", [
    (Plan(fsdp=4), "product"),
    (Plan(tp=8), "n_heads"),
    (Plan(pp=3), "n_layers"),
    (Plan(ep=2), "MoE"),
    (Plan(dp=4, micro_batch=4), "global_batch"),
])
def test_constraint_errors(plan, match):
    chips = 8 if match == "product" else None
    with pytest.raises(InputError, match=match):
        estimate(TINY, H100, Job(seq_len=64, global_batch=8), plan, chips)


def test_cp_must_divide_seq():
    with pytest.raises(InputError, match="cp"):
        estimate(TINY, H100, Job(seq_len=30, global_batch=8), Plan(cp=4))


LLAMA = ModelSpec("l", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256)
JOB = Job(seq_len=4096, global_batch=64)


def test_invariants_flops_and_recompute():
    a = estimate(LLAMA, V5P, JOB, Plan(fsdp=64, remat=REMAT_POLICIES["none"]))
    b = estimate(LLAMA, V5P, JOB, Plan(fsdp=16, tp=4, remat=REMAT_POLICIES["full"]))
    sel = estimate(LLAMA, V5P, JOB, Plan(fsdp=64, remat=REMAT_POLICIES["selective"]))
    full = estimate(LLAMA, V5P, JOB, Plan(fsdp=64, remat=REMAT_POLICIES["full"]))
    assert a.model_flops_per_step == b.model_flops_per_step
    assert a.time["recompute"] == 0 and a.hardware_flops_per_step == a.model_flops_per_step
    assert 0 < sel.time["recompute"] < full.time["recompute"]
    for c in (a, b, sel, full):
        assert 0 < c.mfu <= c.hfu <= 1
        assert c.step_time_s == pytest.approx(sum(c.time.values()))
        assert c.peak_memory_bytes == pytest.approx(sum(c.memory.values()))


def test_invariants_memory_monotone():
    weights = [estimate(LLAMA, V5P, JOB, Plan(fsdp=f, dp=64 // f)).memory["weights"] for f in (1, 2, 8, 64)]
    assert weights == sorted(weights, reverse=True)
    c = estimate(LLAMA, V5P, JOB, Plan(fsdp=64))
    bigger = replace(V5P, hbm_bytes=V5P.hbm_bytes * 2)
    assert c.fits <= estimate(LLAMA, bigger, JOB, Plan(fsdp=64)).fits


def test_doubling_batch_keeps_or_raises_throughput():
    c1 = estimate(LLAMA, V5P, JOB, Plan(fsdp=64))
    c2 = estimate(LLAMA, V5P, replace(JOB, global_batch=128), Plan(fsdp=64))
    assert c2.tokens_per_s >= c1.tokens_per_s * 0.999


def test_offload_moves_memory_to_host():
    base = estimate(LLAMA, V5P, JOB, Plan(fsdp=64, remat=REMAT_POLICIES["save_qkv_proj"]))
    off = estimate(LLAMA, V5P, JOB, Plan(fsdp=64, remat=parse_remat("custom:qkv_proj=offload"),
                                         offload_optimizer=True))
    assert off.peak_memory_bytes < base.peak_memory_bytes
    assert off.host_memory_bytes > 0 and base.host_memory_bytes == 0


def test_remat_policy_names():
    assert parse_remat("minimal").context == "remat"
    assert parse_remat("custom:query_proj=offload,mlpwo=device").qkv_proj == "offload"
    with pytest.raises(InputError, match="did you mean"):
        parse_remat("ful")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from cli.main import main; main()", *args],
                          capture_output=True, text=True, timeout=120)


def test_estimate_cli_json():
    r = run_cli("estimate", "--model", "llama3-8b", "--hardware", "tpu-v5p", "--chips", "64", "--fsdp", "64",
                "--global-batch", "64", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("step_time_s", "mfu", "hfu", "tokens_per_s", "tflops_per_chip", "peak_memory_bytes", "fits",
                "breakdown"):
        assert key in out
    assert out["breakdown"]["time_s"]["compute"] > 0


@pytest.mark.parametrize("args, match", [
    (("--fsdp", "32"), "product"),
    (("--fsdp", "16", "--tp", "4", "--remat", "bogus"), "remat"),
    (("--fsdp", "64", "--ep", "1", "--cp", "1", "--micro-batch", "0"), "micro-batch"),
])
def test_estimate_cli_bad_input(args, match):
    r = run_cli("estimate", "--model", "llama3-8b", "--chips", "64", "--global-batch", "64", *args)
    assert r.returncode == 2
    assert match in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_bench_published_json(tmp_path):
    csv = tmp_path / "runs.csv"
    csv.write_text(
        "id,source,model_name,n_layers,d_model,n_heads,n_kv_heads,head_dim,ffn_dim,vocab_size,gated_mlp,"
        "tied_embeddings,seq_len,hardware,chips,slices,tp,pp,vpp,cp,ep,dp,fsdp,zero,micro_batch,global_batch,"
        "remat,precision,framework,measured_step_time_s\n"
        "r1,s,x,32,4096,32,8,128,14336,128256,true,false,4096,tpu-v5p,64,1,1,1,1,1,1,1,64,3,1,64,full,bf16,"
        "maxtext,5.0\n"
        "r2,s,x,32,4096,32,8,128,14336,128256,true,false,4096,tpu-v3,64,1,1,1,1,1,1,1,64,3,1,64,full,bf16,"
        "maxtext,5.0\n")
    r = run_cli("bench", "published", "--file", str(csv), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    rows = {row["id"]: row for row in out["rows"]}
    assert rows["r1"]["predicted_step_time_s"] > 0 and "error_pct" in rows["r1"]
    assert "skipped" in rows["r2"]
    assert "overall" in out["mape_pct"]


def test_expert_parallel_collectives_by_hand():
    # TINY_MOE on dp2 x ep4: experts (4 of 3 x 64 x 32 per layer) are split over ep and reduced over dp. Megatron
    # replicates every other weight over dp and ep, so its gradient is reduced over dp x ep in one all-reduce;
    # MaxText shards those weights over ep like fsdp (its `embed` rule lists `expert`): gathered per layer over
    # ep, reduce-scattered there, and only their ep shard all-reduced over dp.
    job = Job(seq_len=16, global_batch=8)
    plan = Plan(dp=2, ep=4, micro_batch=1, remat=REMAT_POLICIES["full"])
    c = estimate(TINY_MOE, V5P, job, plan, 8)
    by = {(x.axis, x.kind, x.purpose): x for x in c.collectives}
    expert = 2 * 4 / 4 * 3 * 64 * 32  # layers x experts per rank x params per expert
    non_expert = TINY_MOE.total_params() - 2 * 4 * 3 * 64 * 32 - 64  # the final norm is not in the split
    layer_non_expert = 4 * 64 * 64 + 2 * 64 + 64 * 4  # q, k, v, o; two norms; the router
    # MaxText reduces the gradients of the bf16 compute copy: 2 bytes per parameter on the wire.
    assert by["dp", "all-reduce", "grads"].bytes_each == pytest.approx(2 * (expert + non_expert / 4))
    gather = by["fsdp", "all-gather", "weights fwd+bwd"]
    assert (gather.count, gather.bytes_each) == (2 * 2, 2 * layer_non_expert)  # the experts are not gathered
    assert not any("ep" in x.axis.split("+") and x.kind == "all-reduce" for x in c.collectives)
    assert memory_terms(TINY_MOE, V5P, job, plan, 1).param_elems == pytest.approx(expert + non_expert / 4)
    mega = {(x.axis, x.kind, x.purpose): x for x in estimate(TINY_MOE, V5P, replace(job, framework="megatron"),
                                                              plan, 8).collectives}
    assert mega["dp", "all-reduce", "expert grads"].bytes_each == pytest.approx(4 * expert)  # fp32 main grads
    assert mega["dp+ep", "all-reduce", "non-expert grads"].bytes_each == pytest.approx(4 * non_expert)
    assert not any(k[2] == "weights fwd+bwd" for k in mega)
    # Dispatch + combine forward and backward, rerun with the recomputed MoE block: 6 per MoE layer.
    a2a = by["ep", "all-to-all", "tokens"]
    assert a2a.count == 6 * 2
    assert a2a.bytes_each == pytest.approx(16 * 2 * 64 * 2)  # tokens x top-2 x d x bf16
    # Selective remat (the MLP kept): a JAX policy still recomputes the routed tokens (no named checkpoint), so
    # MaxText reruns dispatch and combine; Megatron keeps them (4 per MoE layer); nothing recomputed: 4 for both.
    for remat, fw, n in (("selective", "maxtext", 6), ("selective", "megatron", 4), ("none", "maxtext", 4)):
        sel = estimate(TINY_MOE, V5P, replace(job, framework=fw), replace(plan, remat=REMAT_POLICIES[remat]), 8)
        assert {(x.axis, x.purpose): x.count for x in sel.collectives}["ep", "tokens"] == n * 2, (remat, fw)


def test_tensor_parallel_collectives_by_hand():
    # TINY (2 layers, d 64) on tp 2 with sequence parallelism, seq 16, one sequence per replica; bf16 activations
    # of 16 tokens x 64 = 2048 B per collective.
    job = Job(seq_len=16, global_batch=4)
    plan = Plan(dp=4, tp=2, micro_batch=1, remat=REMAT_POLICIES["full"])
    by = {(x.axis, x.kind, x.purpose): x for x in estimate(TINY, V5P, job, plan, 8).collectives}
    act, mlp = by["tp", "all-reduce", "activations"], by["tp", "all-reduce", "MLP activations"]
    assert (act.count, act.bytes_each) == (3 * 2, 16 * 64 * 2)  # attention: fwd, bwd, the recomputed out_proj
    assert (mlp.count, mlp.bytes_each) == (2 * 2, 16 * 64 * 2)  # MLP: fwd, bwd (its output is not rerun)
    # A MoE layer's MLP pair carries the routed tokens: top-2 of TINY_MOE, twice the bytes.
    moe = {x.purpose: x for x in estimate(TINY_MOE, V5P, job, plan, 8).collectives}
    assert moe["MLP activations"].bytes_each == 2 * 16 * 64 * 2
    assert by["tp", "all-reduce", "embedding/logits"].count == 2  # vocab-parallel lookup, logits input gradient
    assert by["tp", "all-gather", "sequence-parallel re-gather"].count == 2 * 2  # attention and MLP inputs
    # Nothing recomputed under MaxText: the gathered norm outputs are kept, no re-gather; Megatron re-gathers.
    none = plan.with_(remat=REMAT_POLICIES["none"])
    kinds = {x.purpose for x in estimate(TINY, V5P, job, none, 8).collectives}
    assert "sequence-parallel re-gather" not in kinds
    mega = estimate(TINY, V5P, replace(job, framework="megatron"), none, 8).collectives
    assert "sequence-parallel re-gather" in {x.purpose for x in mega}


def test_fsdp_embedding_and_context_parallel_collectives_by_hand():
    # TINY on fsdp 4 x cp 2, seq 16, one sequence per batch shard: 8 tokens per chip, d 64, bf16.
    job = Job(seq_len=16, global_batch=4)
    plan = Plan(fsdp=4, cp=2, micro_batch=1, remat=REMAT_POLICIES["full"])
    colls = estimate(TINY, V5P, job, plan, 8).collectives
    by = {(x.axis, x.kind, x.purpose): x for x in colls}
    # Looked-up rows to their tokens' chips and their gradients back: one all-to-all per shard axis (fsdp, cp).
    rows = [x for x in colls if x.purpose == "embedding rows"]
    assert [(x.count, x.bytes_each) for x in rows] == [(2, 8 * 64 * 2)] * 2
    kv = 16 * 2 * 32 * 2  # the whole sequence's K and V (2 kv heads x 16) in bf16
    assert (by["cp", "all-gather", "keys/values"].count, by["cp", "all-gather", "keys/values"].bytes_each) == (4, kv)
    assert by["cp", "reduce-scatter", "key/value grads"].count == 2
    # Megatron: no embedding all-to-all (the rule is GSPMD's partitioning of the lookup).
    mega = estimate(TINY, V5P, replace(job, framework="megatron"), plan.with_(zero=0), 8).collectives
    assert "embedding rows" not in {x.purpose for x in mega}


def test_vector_flops_by_hand():
    from costmodel.flops import layer_vector_flops, loss_vector_flops

    # TINY, 16 tokens of a 16-token sequence, no tp: residual stream (2 norms x 4 + 2 adds) x 64 = 640, SiLU gate
    # 2 x 128 = 256, softmax 5 x (8 keys x 4 heads) = 160 per token forward; backward 2 x 896 + 6 x 32.
    assert layer_vector_flops(TINY, 16, 16, 1, 1, False) == (16 * 1056, 16 * 1984)
    # tp 2 without sequence parallelism splits the MLP and the heads, not the residual stream.
    assert layer_vector_flops(TINY, 16, 16, 2, 1, False) == (16 * (640 + 128 + 80), 16 * (2 * 768 + 96))
    assert loss_vector_flops(TINY, 16, 1) == 16 * 9 * 100
    # In a step: both layers forward, recomputed (full remat) and backward, the loss, Adam on every parameter.
    job = Job(seq_len=16, global_batch=1)
    plan = Plan(remat=REMAT_POLICIES["full"])
    c = estimate(TINY, V5P, job, plan, 1)
    updated = memory_terms(TINY, V5P, job, plan, 1).optimizer_param_elems  # the parameters Adam updates here
    assert updated == pytest.approx(TINY.total_params(), rel=1e-3)
    assert c.vector_flops_per_step == 2 * (2 * 16 * 1056 + 16 * 1984) + 16 * 900 + 13 * updated


def test_moe_layers_keep_routed_tokens_when_nothing_is_recomputed():
    from costmodel.memory import extra_saved_elems_per_token

    # Dense TINY: two norm outputs (2 x 64) and the MLP activation (128).
    assert extra_saved_elems_per_token(TINY, Plan(), False) == 2 * 64 + 128
    # TINY_MOE (top-2 of 4 experts, expert width 32): norms 128, activations 2 x 32, and the dispatched tokens
    # plus the expert outputs, 2 x top-2 x 64.
    assert extra_saved_elems_per_token(TINY_MOE, Plan(), True) == 128 + 64 + 2 * 2 * 64


def test_mla_down_projections_are_not_split_over_tp():
    """A small MLA model (d 64, 4 heads of 24 = 16 nope + 8 rope, values 16, latents 16 (q) and 8 (kv)) on tp 2:
    FLOPs, weights and the saved query/key/value by hand."""
    from costmodel.flops import tp_replicated_flops_per_token
    from costmodel.memory import param_counts_per_chip

    mla = replace(TINY, n_kv_heads=4, head_dim=24, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=8,
                  v_head_dim=16)
    down = 64 * 16 + 64 * (8 + 8)  # wq_a, wkv_a
    up = 16 * 4 * 24 + 8 * 4 * (16 + 16)  # wq_b, wkv_b
    ops = {o.name: o for o in layer_ops(mla, 10, 32, 2, 1, False)}
    # 10 tokens: the down-projections (an op of their own) on every tp rank, the up-projections split
    assert (ops["mla_down"].flops, ops["qkv_proj"].flops) == (2 * 10 * down, 2 * 10 * up / 2)
    assert ops["mla_down"].produces == "qkv_proj"
    # MaxText reruns them once anything is recomputed (its minimal policies keep q/k/v, not the latents);
    # Megatron only with the projections themselves
    from costmodel.estimate import rerun_once_ops

    sel, job_mt = REMAT_POLICIES["selective"], Job(seq_len=32, global_batch=4)
    assert [o.name for o in rerun_once_ops(list(ops.values()), Plan(tp=2, remat=sel), job_mt)] == ["mla_down"]
    assert rerun_once_ops(list(ops.values()), Plan(tp=2, remat=sel), replace(job_mt, framework="megatron")) == []
    assert rerun_once_ops(list(ops.values()), Plan(tp=2, remat=REMAT_POLICIES["none"]), job_mt) == []
    assert tp_replicated_flops_per_token(mla, False) == 2 * down
    # weights per chip: the replicated down-projections and their norms (16 + 8) whole, the rest halved
    body, layer, _ = param_counts_per_chip(mla, Plan(tp=2))
    rest = mla.attn_params() - (down + 16 + 8) + 2 * 64 + 3 * 64 * 128  # + layer norms, MLP
    assert layer == pytest.approx(rest / 2 + down + 16 + 8)
    # query_proj and key_proj 4 x 24, value_proj 4 x 16, split over tp 2
    assert tensor_elems_per_token(mla, Plan(tp=2), False)["qkv_proj"] == (96 + 96 + 64) / 2
    # hardware FLOPs: each of the other tp rank repeats the down-projections, forward and backward (3x), per token
    job = Job(seq_len=32, global_batch=4)
    c1 = estimate(mla, V5P, job, Plan(dp=2, remat=REMAT_POLICIES["none"]), 2)
    c2 = estimate(mla, V5P, job, Plan(tp=2, remat=REMAT_POLICIES["none"]), 2)
    assert c2.hardware_flops_per_step - c1.hardware_flops_per_step == pytest.approx(3 * 1 * 4 * 32 * 2 * 2 * down)


def test_shared_experts_keep_no_routed_copies():
    from costmodel.memory import extra_saved_elems_per_token

    shared = replace(TINY_MOE, n_shared_experts=1)
    # a shared expert adds its MLP activation (32 wide) but no dispatched copy or pre-combine output (it reads the
    # norm output and is added ungated): norms 128, activations (2 + 1) x 32, routed copies 2 x top-2 x 64
    assert extra_saved_elems_per_token(shared, Plan(), True) == 128 + 3 * 32 + 2 * 2 * 64


def test_maxtext_dropless_expert_buffers_are_sized_for_the_worst_case():
    from costmodel.memory import extra_saved_elems_per_token, routed_buffer_factor

    job = Job(seq_len=16, global_batch=8)
    # min(ep, experts / top_k): TINY_MOE has 4 experts, top-2, so at most 2x the balanced rows
    assert routed_buffer_factor(TINY_MOE, job, Plan(ep=4)) == 2
    assert routed_buffer_factor(TINY_MOE, job, Plan(ep=1)) == 1
    assert routed_buffer_factor(TINY_MOE, replace(job, framework="megatron"), Plan(ep=4)) == 1
    assert routed_buffer_factor(replace(TINY_MOE, capacity_factor=1.25), job, Plan(ep=4)) == 1  # token dropping
    # the experts' input (gated: 2 x 32 per routed row) and the routed copies grow with it: 2 x top-2 rows
    assert tensor_elems_per_token(TINY_MOE, Plan(), True, 2.0)["mlp_in"] == 2 * 32 * 2 * 2
    assert extra_saved_elems_per_token(TINY_MOE, Plan(), True, 2.0) == 128 + 32 * 4 + 2 * 4 * 64
    dense_part = memory_terms(TINY_MOE, V5P, job, Plan(dp=2, remat=REMAT_POLICIES["full"]), 1)
    ep_part = memory_terms(TINY_MOE, V5P, job, Plan(ep=2, remat=REMAT_POLICIES["full"]), 1)
    # one MoE layer's working set, 16 tokens, bf16: (2 x 32 + 32 + 2 x 64) more elements per routed row, 2 rows;
    # and the grouped matmuls' backward holds the gradients of the 4 rows' expert inputs and activation (2 x 32
    # + 32 per row) beside them
    grow = 16 * 2 * (2 * (2 * 32 + 32 + 2 * 64) + 4 * (2 * 32 + 32))
    assert ep_part.breakdown["activation_working"] - dense_part.breakdown["activation_working"] == grow


def test_maxtext_pipeline_memory_and_collectives_by_hand():
    """MaxText's pipeline (layers/pipeline.py): one scan over M * vpp + pp - 1 iterations on every stage, the
    embedding and logits outside it with the batch split over the stages too. TINY (2 layers, d 64, vocab 100) on
    pp 2 x dp 2 x tp 2, seq 16, micro-batch 1, M = 4 micro-batches per step, full remat, unscanned layers."""
    job = Job(seq_len=16, global_batch=8, framework="maxtext", scan_layers=False)
    plan = Plan(dp=2, tp=2, pp=2, micro_batch=1, remat=REMAT_POLICIES["full"])
    cost = estimate(TINY, V5P, job, plan, 8)
    assert cost.grad_accum == 4
    mem = memory_terms(TINY, V5P, job, plan, accum=4)
    b = mem.breakdown
    # every stage holds both tables (vocab over tp) and its layer; no gradient-accumulation carry under pp
    layer = (TINY.attn_params() + TINY.layer_norm_params() + TINY.dense_mlp_params()) / 2
    assert mem.param_elems == pytest.approx(layer + 2 * 100 * 64 / 2)
    assert b["gradients"] == pytest.approx(4 * mem.param_elems)
    # 1 layer x (M + pp - 1 = 5 iterations) x the saved layer input, bf16, sequence-parallel (16 / 2 tokens); no
    # scanned-layer loop extra (a stage's layers are unscanned); logits of M / pp = 2 micro-batches (bf16 + grad)
    assert b["activations"] == pytest.approx(1 * 5 * (16 / 2) * 64 * 2)
    assert b["logits"] == pytest.approx(2 * 16 * 100 / 2 * 4)
    # the stage's bf16 gradients stay live through the iteration loop, and the unreduced dp gradient is carried
    # as an fp32 accumulator beside the reduced one (no weight sharding: no gathered copy)
    assert b["collective_buffers"] == pytest.approx(2 * layer + 4 * layer)
    by = {(x.axis, x.kind, x.purpose): x for x in cost.collectives}
    # stage shifts every iteration but the last (4 forward, 4 backward), plus the last stage's outputs to the
    # other stage's logits shard: (pp - 1) shifts of M / pp micro-batches each way
    p2p = by["pp", "p2p", "activations"]
    assert (p2p.count, p2p.bytes_each) == (2 * (4 + 2 - 2), 16 * 64 * 2 / 2)
    out = by["pp", "p2p", "outputs to the logits' batch shards"]
    assert (out.count, out.bytes_each) == (2 * 1, 2 * 16 * 64 * 2 / 2)
    # the tables' gradients (bf16, 2 B) over dp x pp; the stage's layer over dp alone
    tables = by["dp+pp", "all-reduce", "embedding table grads"]
    assert tables.bytes_each == pytest.approx(2 * 100 * 64 / 2 * 2)
    assert by["dp", "all-reduce", "grads"].bytes_each == pytest.approx(layer * 2)
    # tp collectives run on every iteration, the bubble's too: 1 layer x (M + pp - 1) x (fwd + bwd + rerun)
    assert by["tp", "all-reduce", "activations"].count == 5 * 3
    assert by["tp", "all-reduce", "embedding/logits"].count == 2 * 4 / 2  # both on every stage, M / pp each
    # fsdp under the pipeline: the whole stage stays gathered (bf16 weights + bf16 gradient); no dp, no accumulator
    fplan = Plan(fsdp=2, tp=2, pp=2, micro_batch=1, remat=REMAT_POLICIES["full"])
    big = replace(TINY, n_layers=4)
    fmem = memory_terms(big, V5P, job, fplan, accum=4)
    assert fmem.breakdown["collective_buffers"] == pytest.approx((2 + 2) * fmem.layer_weight_elems * 2)
    # ... gathered on every iteration (M + pp - 1 = 5, forward and backward), reduced once after the loop
    fby = {(x.kind, x.purpose): x for x in estimate(big, V5P, job, fplan, 8).collectives if x.axis == "fsdp"}
    assert fby["all-gather", "weights fwd"].count == fby["all-gather", "weights bwd"].count == 2 * 5  # 2 layers/stage
    assert fby["reduce-scatter", "stage grads"].count == 2
    assert fby["all-gather", "output table"].count == 1  # the logits run once per step, outside the pipeline
    # the rule itself: bf16 stage gradients + one iteration's gathered chunk (circular: 1 / vpp of the stage)
    from costmodel.memory import maxtext_stage_buffers

    assert maxtext_stage_buffers(100.0, 25.0, weight_shards=4, dp_reduced=False, vpp=2) == 2 * 100 + 2 * 100 / 2
    assert maxtext_stage_buffers(100.0, 100.0, weight_shards=1, dp_reduced=True) == 2 * 100 + 4 * 100
    # Megatron keeps its 1F1B accounting: min(M, pp) micro-batches in flight, one table per end stage
    mega = memory_terms(TINY, V5P, replace(job, framework="megatron"), plan, accum=4)
    assert mega.param_elems == pytest.approx(layer + 100 * 64 / 2)


def test_layer_passes_count_maxtext_bubble_iterations():
    """MaxText's pipeline runs every stage through its M * vpp + pp - 1 iterations (in micro-batches of layers:
    M + (pp - 1) / vpp); Megatron's 1F1B runs each micro-batch once per stage."""
    from costmodel.memory import layer_passes

    plan = Plan(pp=4, vpp=2, dp=2)
    assert layer_passes(Job(4096, 32), plan, 8) == 8 + 3 / 2
    assert layer_passes(Job(4096, 32, framework="megatron"), plan, 8) == 8
    assert layer_passes(Job(4096, 32), Plan(dp=8), 4) == 4  # no pipeline: the micro-steps


def test_busiest_stage_activations_by_hand():
    """1F1B: the first stage keeps every in-flight micro-batch, the last one micro-batch and the logits; the
    larger is the peak. MaxText: every stage runs the same program, with 1 / pp of the step's logits."""
    from costmodel.memory import busiest_stage_activations

    meg = Job(4096, 32, framework="megatron")
    # first stage 12 (4 in flight x 3) vs last 3 + 5 = 8: the first, without logits
    assert busiest_stage_activations(meg, Plan(pp=4), 12.0, 4.0, 5.0, 16) == (12.0, 0.0)
    # first 12 vs last 3 + 10 = 13: the last, with its logits
    assert busiest_stage_activations(meg, Plan(pp=4), 12.0, 4.0, 10.0, 16) == (3.0, 10.0)
    assert busiest_stage_activations(meg, Plan(), 12.0, 1.0, 10.0, 1) == (12.0, 10.0)  # no pipeline
    assert busiest_stage_activations(Job(4096, 32), Plan(pp=4), 12.0, 4.0, 10.0, 16) == (12.0, 10.0 * 16 / 4)


def test_layer_activation_bytes_by_hand():
    """Full remat keeps one bf16 layer input per token (d_model = 64 values: 128 B); offloading it moves those
    bytes to the host; nothing kept under 'full' with the layer input offloaded."""
    from costmodel.memory import layer_activation_bytes

    job = Job(4096, 8, framework="megatron")
    saved, offl, working = layer_activation_bytes(TINY, job, Plan(), 10.0, None, 2.0)
    assert (saved, offl) == (10 * 64 * 2, 0.0) and working > saved
    plan = Plan(remat=parse_remat("custom:layer_input=offload"))
    saved, offl, _ = layer_activation_bytes(TINY, job, plan, 10.0, None, 2.0)
    assert (saved, offl) == (0.0, 10 * 64 * 2)


def test_job_bounds_are_named():
    for kw, match in ((dict(seq_len=0, global_batch=8), "seq_len must be a positive integer, got 0"),
                      (dict(seq_len=4096, global_batch=-1), "global_batch must be a positive integer, got -1"),
                      (dict(seq_len=4096, global_batch=2**29),  # 2^41 tokens: past the sanity bound
                       r"global_batch: 536870912 sequences x 4096 tokens is 2.2e\+12 tokens per step; expected at "
                       r"most 2\^40")):
        with pytest.raises(InputError, match=match):
            Job(**kw)
    assert Job(4096, 2**28).tokens == 2**40  # the bound itself is allowed


@pytest.mark.parametrize("pp", [16, 8])
def test_expert_exchange_counts_the_stage_with_the_most_moe_layers(pp):
    """DeepSeek-V3 (3 dense + 58 MoE layers) over pp 16 or 8 with ep 64 under Megatron: memory's busiest stage is
    the first (the dense layers outweigh 1/64 of the experts), but every MoE stage exchanges tokens and the
    slowest sets the pace, so the all-to-alls count the stage with the most MoE layers (issue 29: pp 16 had
    counted none, pp 8 half)."""
    from costmodel.catalog import load_model
    from costmodel.memory import stage_kinds

    m = load_model("deepseek-v3-671b")
    plan = Plan(dp=2048 // pp // 64, pp=pp, ep=64, zero=1, remat=REMAT_POLICIES["full"])
    job = Job(seq_len=4096, global_batch=4096, framework="megatron")
    c = estimate(m, load_hardware("h100-sxm"), job, plan, 2048)
    (ep,) = [x for x in c.collectives if x.axis == "ep"]
    most_moe = max(k[1] for k in stage_kinds(m, plan))
    accum = job.global_batch // (plan.dp * plan.ep * plan.micro_batch)
    assert most_moe == 4 if pp == 16 else most_moe == 8
    assert ep.count == (4 + 2) * most_moe * accum  # dispatch + combine, fwd + bwd, and the full-remat rerun
