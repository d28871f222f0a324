"""Megatron-LM's uneven pipeline split (costmodel.plan.pipeline_split): the busiest stage sets time and memory."""

from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.catalog import load_model
from costmodel.estimate import _stage_times, estimate, stage_times
from costmodel.job import Job
from costmodel.memory import busiest_kinds, memory_terms, stage_kinds
from costmodel.model import ModelSpec
from costmodel.plan import REMAT_POLICIES, Plan, busiest_stage_layers, pipeline_split
from hardware.catalog import load_hardware
from hardware.errors import InputError
from planner.candidates import axis_options
from planner.export import export_result
from planner.import_configs import import_megatron
from planner.planfile import PlanFile

H100 = load_hardware("h100-sxm")
M32 = ModelSpec("m32", n_layers=32, d_model=1024, n_heads=16, n_kv_heads=4, ffn_dim=4096, vocab_size=32000)
M31 = replace(M32, name="m31", n_layers=31)
MEG = Job(seq_len=2048, global_batch=64, framework="megatron")
PP4 = Plan(dp=2, pp=4, remat=REMAT_POLICIES["full"])


@pytest.mark.parametrize("layers, pp, vpp, want", [
    (32, 4, 1, (8, 8, 8)),  # even: unchanged
    (126, 16, 1, (7, 8, 7)),  # Llama 3 405B (one layer fewer on each end stage)
    (61, 16, 1, (3, 4, 2)),  # DeepSeek-V3: 14 x 4 in the middle, 5 left for the ends
    (61, 2, 1, (31, 31, 30)),  # no middle stage
    (126, 16, 2, (8, 8, 6)),  # with 2 virtual stages every count is even
    (61, 8, 2, None),  # 61 is odd: no split into multiples of 2
    (61, 12, 1, (6, 5, 5)),  # 10 x 6 in the middle would leave 1 layer for two ends: 5 in the middle instead
    (17, 16, 1, (2, 1, 1)),
    (9, 6, 1, None),  # equal middle stages cannot keep every stage at 2 (3 + 4 x 1 + 2 would be the best)
    (28, 16, 1, None),  # 7 + 14 x 1 + 7: the ends would hold 7 layers where an even-ish split holds 2
    (10, 16, 1, None),  # more stages than layers
])
def test_pipeline_split_by_hand(layers, pp, vpp, want):
    assert pipeline_split(layers, pp, vpp) == want
    if want:
        first, mid, last = want
        assert first + (pp - 2) * mid + last == layers if pp > 2 else first + last == layers
        assert all(n % vpp == 0 and n >= vpp for n in want) and last <= first
        assert max(want) == vpp * -(-layers // (pp * vpp))  # the busiest stage as small as any split's


def test_the_busiest_stage_of_an_uneven_split():
    # 31 layers over 4 stages: (8, 8, 7). With a large vocabulary the last stage (7 layers + the logits) is the
    # busiest: the 32-layer model's last stage less one layer.
    big31, big32 = replace(M31, vocab_size=256_000), replace(M32, vocab_size=256_000)
    st31, st32 = stage_times(big31, H100, MEG, PP4), stage_times(big32, H100, MEG, PP4)
    assert st31.stages == pytest.approx(31 / 7) and st31.head == st32.head > 0
    assert st31.fwd == pytest.approx(st32.fwd - st32.layer_fwd)
    assert st31.per_micro > st32.per_micro - st32.head  # more than a middle stage's 8 layers without logits
    # With a small one a middle stage (8 layers, no logits) is: the 32-layer model's stage less the logits.
    s31, s32 = stage_times(replace(M31, vocab_size=256), H100, MEG, PP4), stage_times(
        replace(M32, vocab_size=256), H100, MEG, PP4)
    assert s31.stages == pytest.approx(31 / 8) and s31.head == 0.0
    assert s31.fwd == pytest.approx(s32.fwd - s32.head / 3)
    assert s31.per_micro == pytest.approx(s32.per_micro - s32.head)
    # 61 layers over 12 stages: (6, 5, 5); the first stage, with the most layers, is the busiest without logits.
    s61 = stage_times(replace(M32, n_layers=61, vocab_size=256), H100, MEG, Plan(dp=2, pp=12))
    assert s61.stages == pytest.approx(61 / 6) and s61.head == 0.0


def test_uneven_memory_counts_the_busiest_stage():
    # The busiest stage of 31 layers over 4 holds 8 layers, as every stage of the 32-layer model does.
    t31 = memory_terms(M31, H100, MEG, PP4, accum=8)
    t32 = memory_terms(M32, H100, MEG, PP4, accum=8)
    assert t31.param_elems == pytest.approx(t32.param_elems)
    assert t31.peak_bytes == pytest.approx(t32.peak_bytes)


def test_uneven_split_only_where_the_framework_can_and_must_exist():
    for fw in ("maxtext", "pytorch-fsdp"):
        with pytest.raises(InputError, match=rf"pp\*vpp: n_layers 31 is not divisible by pp\*vpp = 4 \({fw} splits"):
            estimate(M31, H100, replace(MEG, framework=fw), PP4)
    assert estimate(M31, H100, replace(MEG, framework="deepspeed"), PP4).step_time_s > 0
    with pytest.raises(InputError, match="vpp: DeepSpeed's pipeline engine has no interleaved schedule"):
        estimate(M32, H100, replace(MEG, framework="deepspeed"), PP4.with_(vpp=2))
    m10 = replace(M32, n_layers=10)
    with pytest.raises(InputError, match=r"pp\*vpp: n_layers 10 cannot be split over pp=16"):
        estimate(m10, H100, replace(MEG, global_batch=16), Plan(pp=16))  # more stages than layers
    with pytest.raises(InputError, match="n_layers 10"):
        busiest_stage_layers(10, Plan(pp=16))
    cost = estimate(M31, H100, MEG, PP4)
    assert cost.step_time_s > 0 and cost.stage_layers == (8, 8, 7) and cost.to_dict()["stage_layers"] == [8, 8, 7]
    assert estimate(M32, H100, MEG, Plan(dp=8)).stage_layers == ()


def test_candidates_offer_uneven_pp_under_megatron_only():
    m = load_model("llama3-405b")  # 126 layers
    meg = Job(seq_len=8192, global_batch=2048, framework="megatron")
    assert 16 in axis_options(m, H100, meg, 16384, _cons())["pp"]
    assert 16 not in axis_options(m, H100, replace(meg, framework="maxtext"), 16384, _cons())["pp"]


def _cons():
    from planner.candidates import Constraints
    return Constraints()


def test_megatron_export_names_the_end_stages_and_imports_back(tmp_path):
    m = load_model("llama3-405b")
    pf = PlanFile(m, H100, 1024, Job(8192, 128, framework="megatron"),
                  Plan(dp=8, tp=8, pp=16, zero=1, remat=REMAT_POLICIES["selective"]), "llama3-405b", "h100-sxm")
    text = export_result(pf, "megatron").text
    assert "--decoder-first-pipeline-num-layers 7" in text and "--decoder-last-pipeline-num-layers 7" in text
    p = tmp_path / "args.sh"
    p.write_text(text.replace("--decoder-first-pipeline-num-layers 7", "--decoder-first-pipeline-num-layers 8")
                 .replace("--decoder-last-pipeline-num-layers 7", "--decoder-last-pipeline-num-layers 6"))
    back = import_megatron(p)
    assert back.planfile.plan.pp == 16
    assert any("stages of 8 / 8 / 6 layers (first / middle / last) are modelled as 7 / 8 / 7" in n
               for n in back.notes)
    # Megatron's own rule: an end stage without its flag takes the middle stages' share, (126 - 6) / 15 = 8
    p.write_text(text.replace("--decoder-first-pipeline-num-layers 7", "")
                 .replace("--decoder-last-pipeline-num-layers 7", "--decoder-last-pipeline-num-layers 6"))
    assert any("stages of 8 / 8 / 6 layers" in n for n in import_megatron(p).notes)
    # without either flag Megatron refuses 126 layers over 16 stages; a share that does not divide too
    p.write_text(text.replace("--decoder-first-pipeline-num-layers 7", "")
                 .replace("--decoder-last-pipeline-num-layers 7", ""))
    with pytest.raises(InputError, match="--num-layers 126 is not divisible by --pipeline-model-parallel-size 16"):
        import_megatron(p)
    p.write_text(text.replace("--decoder-first-pipeline-num-layers 7", "--decoder-first-pipeline-num-layers 5"))
    with pytest.raises(InputError, match="leave 114 of 126 layers for 14 stages; expected a positive multiple of 14"):
        import_megatron(p)
    for bad in ("0", "-2"):
        flag = "--decoder-first-pipeline-num-layers"
        p.write_text(text.replace(f"{flag} 7", f"{flag} {bad}"))
        with pytest.raises(InputError, match=f"--decoder-first-pipeline-num-layers: expected a positive multiple of "
                                             f"the 1 virtual stages, got {bad}"):
            import_megatron(p)
    p.write_text(text + "\n--num-virtual-stages-per-pipeline-rank 0\n")
    with pytest.raises(InputError, match="--num-virtual-stages-per-pipeline-rank: expected a positive integer, got 0"):
        import_megatron(p)


def test_maxtext_export_of_an_uneven_plan_uses_an_even_pp():
    m = load_model("llama3-405b")
    pf = PlanFile(m, H100, 1024, Job(8192, 256, framework="megatron"), Plan(dp=8, tp=8, pp=16, micro_batch=1),
                  "llama3-405b", "h100-sxm")
    res = export_result(pf, "maxtext")
    # gcd(16, 126) = 2; the rest of the stage axis goes to fsdp, which shards the weights pp no longer splits
    assert res.adapted.plan.pp == 2 and res.adapted.plan.fsdp == 8 and res.adapted.plan.dp == 8
    assert any("pp 16 -> 2, fsdp 1 -> 8" in w for w in res.warnings)


def test_a_moe_models_leading_dense_layers_sit_on_the_first_stage():
    # 8 layers, the first 2 dense (DeepSeek's first_k_dense_replace), over 4 stages: stage 0 holds the 2 dense
    # layers, the others 2 MoE layers each. The busiest stage is then exactly the all-MoE model's (not an average
    # 1.5 MoE + 0.5 dense layers).
    moe = ModelSpec("moe8", n_layers=8, d_model=256, n_heads=8, n_kv_heads=4, ffn_dim=1024, vocab_size=1000,
                    n_experts=8, experts_per_token=2, moe_ffn_dim=256)
    mixed = replace(moe, name="moe8-dense2", n_dense_layers=2)
    plan = Plan(dp=2, pp=4, ep=2, remat=REMAT_POLICIES["full"])
    assert stage_kinds(mixed, plan) == [(2.0, 0.0, False), (0.0, 2.0, False), (0.0, 2.0, False), (0.0, 2.0, True)]
    assert busiest_kinds(mixed, plan) == (0.0, 2.0)
    a, b = memory_terms(mixed, H100, MEG, plan, accum=8), memory_terms(moe, H100, MEG, plan, accum=8)
    assert a.param_elems == pytest.approx(b.param_elems) and a.peak_bytes == pytest.approx(b.peak_bytes)
    # Time: the slower of stage 0 (2 dense layers, whose MLP of 1024 outweighs top-2 experts of 256) and the
    # last (2 MoE layers and the logits); here the dense stage.
    st = stage_times(mixed, H100, MEG, plan)
    dense0, last = _stage_times(mixed, H100, MEG, plan, (2.0, 0.0), False), stage_times(moe, H100, MEG, plan)
    assert st.kinds == (2.0, 0.0) and st.per_micro == pytest.approx(dense0.per_micro)
    assert dense0.per_micro > last.per_micro
    # models with one kind of layer keep the average (exact) mix
    assert busiest_kinds(moe, plan) is None and stage_kinds(moe, plan)[0] == (0.0, 2.0, False)


def test_1f1b_in_flight_over_an_uneven_split():
    # 126 layers over 16 stages (7 + 14 x 8 + 7): stage 0 keeps 16 micro-batches of 7 layers, stage 1 15 of 8: the
    # most is 120 layer-micro-batches, 15 per layer of the busiest (8-layer) stage; an even split keeps 16.
    from costmodel.memory import pipeline_inflight

    meg = Job(seq_len=2048, global_batch=256, framework="megatron")
    assert pipeline_inflight(meg, Plan(pp=16), 16, 126) == 15.0
    assert pipeline_inflight(meg, Plan(pp=16), 4, 126) == 4.0  # few micro-batches: every stage keeps all 4
    assert pipeline_inflight(meg, Plan(pp=16), 16, 128) == 16.0


def test_interleaved_in_flight_is_capped_by_the_chunk_passes():
    # Megatron's interleaved schedule: rank 0 warms up with 2 (pp - 1) + (vpp - 1) pp chunk passes plus one, at most
    # all M * vpp; a chunk is half the stage's layers at vpp 2. pp 16, vpp 2: 2*15 + 16 + 1 = 47 chunk passes, 23.5
    # stage micro-batches with M = 64; with M = 16 (Llama 3 405B: 16 sequences per DP rank) all 32 -> 16.
    from costmodel.memory import pipeline_inflight

    meg = Job(seq_len=8192, global_batch=2048, framework="megatron")
    assert pipeline_inflight(meg, Plan(pp=16, vpp=2), 64, 128) == 23.5
    assert pipeline_inflight(meg, Plan(pp=16, vpp=2), 16, 128) == 16.0
    assert pipeline_inflight(meg, Plan(pp=4, vpp=4), 8, 128) == (4 * 4 + 4 - 1) / 4  # 19 of 32 chunk passes


def test_the_memory_stage_is_the_one_with_the_most_weights_not_the_most_layers():
    # 9 layers, the first 3 dense, over 8 stages: (2, 1, 1) -> stage 0 holds 2 dense layers, stage 1 one dense,
    # the rest one MoE layer each. A MoE layer's 8 experts outweigh two dense layers, so memory is a MoE stage's:
    # the same weights per chip as an all-MoE 8-layer model over 8 stages.
    moe8 = ModelSpec("moe8", n_layers=8, d_model=256, n_heads=8, n_kv_heads=4, ffn_dim=1024, vocab_size=1000,
                     n_experts=8, experts_per_token=2, moe_ffn_dim=512)
    mixed = replace(moe8, name="moe9-dense3", n_layers=9, n_dense_layers=3)
    plan = Plan(dp=2, pp=8, remat=REMAT_POLICIES["full"])
    assert busiest_kinds(mixed, plan) == (0.0, 1.0)
    a, b = memory_terms(mixed, H100, MEG, plan, accum=8), memory_terms(moe8, H100, MEG, plan, accum=8)
    assert a.param_elems == pytest.approx(b.param_elems)
