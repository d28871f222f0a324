"""Megatron-Core's --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split
(costmodel.plan.split_accounted): the split Megatron builds, its costs, the CLI, plan files, export and import."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest

from cli.main import main
from costmodel.catalog import load_model
from costmodel.estimate import estimate, stage_times
from costmodel.job import Job
from costmodel.memory import memory_terms, pipeline_inflight
from costmodel.model import ModelSpec
from costmodel.plan import (
    REMAT_POLICIES,
    Plan,
    busiest_stage_layers,
    chunk_layer_counts,
    pipeline_split,
    split_accounted,
)
from hardware.catalog import load_hardware
from hardware.errors import InputError
from planner.export import export_result
from planner.import_configs import import_megatron
from planner.planfile import PlanFile, load_plan, save_plan

H100 = load_hardware("h100-sxm")
M31 = ModelSpec("m31", n_layers=31, d_model=1024, n_heads=16, n_kv_heads=4, ffn_dim=4096, vocab_size=32000)
MEG = Job(seq_len=2048, global_batch=64, framework="megatron")
BOTH = dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
EMB = dict(account_for_embedding_in_pipeline_split=True)
LOSS = dict(account_for_loss_in_pipeline_split=True)
# MLPerf v5.0 Llama 3.1 405B (NVIDIA, 512 H100): TP 8, PP 8, CP 2, INTERLEAVED_PIPELINE=8, ASYM_PP_EMBED/LOSS
MLPERF = Plan(dp=4, tp=8, pp=8, cp=2, vpp=8, zero=1, remat=REMAT_POLICIES["none"], **BOTH)


def megatron_num_layers_to_build(n: int, pp: int, vpp: int, emb: bool, loss: bool, rank: int, chunk: int) -> int:
    """Megatron-LM megatron/core/transformer/transformer_block.py get_num_layers_to_build, transcribed (the branch
    without --decoder-first/last-pipeline-num-layers; vp_size None when vpp is 1)."""
    num_layers = n + emb + loss
    assert num_layers % pp == 0
    per_rank = num_layers // pp
    if vpp > 1:
        assert per_rank % vpp == 0
        build = per_rank // vpp
    else:
        build = per_rank
    if emb and chunk == 0 and rank == 0:
        build -= 1
    if loss and chunk == vpp - 1 and rank == pp - 1:
        build -= 1
    return build


@pytest.mark.parametrize("layers, pp, vpp, emb, loss, want", [
    (126, 8, 8, 1, 1, (15, 16, 15)),  # MLPerf 405B: 128 / 8 = 16 per rank, 2 per chunk, the end chunks 1
    (126, 16, 2, 1, 1, (7, 8, 7)),  # Meta's 405B layout with 2 virtual stages (7 / 8 / 7)
    (126, 16, 1, 1, 1, (7, 8, 7)),
    (31, 4, 1, 1, 0, (7, 8, 8)),  # embedding only: the first stage builds one layer fewer
    (31, 4, 1, 0, 1, (8, 8, 7)),  # loss only: the last
    (30, 4, 1, 1, 1, (7, 8, 7)),
    (63, 2, 2, 1, 0, (31, 31, 32)),  # no middle stage
    (6, 2, 1, 1, 1, (3, 3, 3)),
])
def test_split_by_hand(layers, pp, vpp, emb, loss, want):
    assert split_accounted(layers, pp, vpp, emb, loss) == want == pipeline_split(layers, pp, vpp, emb, loss)
    plan = Plan(pp=pp, vpp=vpp, account_for_embedding_in_pipeline_split=bool(emb),
                account_for_loss_in_pipeline_split=bool(loss))
    chunks = chunk_layer_counts(layers, plan)
    assert sum(map(sum, chunks)) == layers
    middle = chunks[1] if pp > 2 else chunks[0]  # pipeline_split's (first, first, last) without a middle stage
    assert [sum(c) for c in (chunks[0], middle, chunks[-1])] == list(want)
    assert busiest_stage_layers(layers, plan) == max(want)


def test_chunks_are_megatrons_for_every_valid_split():
    for layers in range(1, 70):
        for pp in (2, 3, 4, 8):
            for vpp in (1, 2, 4):
                for emb, loss in ((1, 0), (0, 1), (1, 1)):
                    plan = Plan(pp=pp, vpp=vpp, account_for_embedding_in_pipeline_split=bool(emb),
                                account_for_loss_in_pipeline_split=bool(loss))
                    try:
                        chunks = chunk_layer_counts(layers, plan)
                    except InputError:
                        with pytest.raises(AssertionError):  # Megatron refuses it too, or a stage holds nothing
                            want = [[megatron_num_layers_to_build(layers, pp, vpp, emb, loss, r, c)
                                     for c in range(vpp)] for r in range(pp)]
                            assert min(sum(want[0]), sum(want[-1])) > 0
                        continue
                    assert chunks == [[megatron_num_layers_to_build(layers, pp, vpp, emb, loss, r, c)
                                       for c in range(vpp)] for r in range(pp)]


def test_mlperf_405b_chunks():
    chunks = chunk_layer_counts(126, MLPERF)
    assert chunks[0] == [1] + [2] * 7 and chunks[-1] == [2] * 7 + [1]
    assert all(c == [2] * 8 for c in chunks[1:-1])


@pytest.mark.parametrize("layers, pp, vpp, emb, loss, message", [
    (32, 4, 1, 1, 0, "pp: num_layers 33 (after account_for_embedding_in_pipeline_split) must be divisible by "
                     "pipeline_model_parallel_size 4"),
    (126, 8, 3, 1, 1, "vpp: number of layers on each pipeline rank 16 (after account_for_embedding_in_pipeline_split"
                      " and account_for_loss_in_pipeline_split) must be divisible by "
                      "virtual_pipeline_model_parallel_size 3"),
    (1, 3, 1, 1, 1, "leave an end stage with no layer"),
])
def test_megatrons_checks(layers, pp, vpp, emb, loss, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        split_accounted(layers, pp, vpp, emb, loss)
    assert pipeline_split(layers, pp, vpp, emb, loss) is None


def test_off_by_default_and_the_uneven_split_unchanged():
    assert Plan().split_accounting == (0, 0)
    assert pipeline_split(126, 16, 2) == (8, 8, 6)  # without the flags 7 / 8 / 7 with vpp 2 cannot be built
    with pytest.raises(InputError, match="expected true or false"):
        Plan(pp=2, account_for_loss_in_pipeline_split=1)


# ---- costs ---------------------------------------------------------------------------------------------------

def test_the_last_stage_time_moves_with_the_loss_flag():
    # 31 layers over 4 stages with a large vocabulary (the logits outweigh a layer): the embedding flag leaves 8
    # layers and the logits on the last stage, as the 32-layer model's last stage; the loss flag leaves 7.
    big31 = replace(M31, vocab_size=256_000)
    big32 = replace(big31, n_layers=32)
    pp4 = Plan(dp=2, pp=4)
    emb, loss = (stage_times(big31, H100, MEG, pp4.with_(**f)) for f in (EMB, LOSS))
    st32, uneven = stage_times(big32, H100, MEG, pp4), stage_times(big31, H100, MEG, pp4)
    assert emb.per_micro == pytest.approx(st32.per_micro) and emb.head > 0
    assert loss.per_micro == pytest.approx(uneven.per_micro) and loss.per_micro < emb.per_micro
    assert estimate(big31, H100, MEG, pp4.with_(**EMB)).stage_layers == (7, 8, 8)


def test_the_first_stage_memory_moves_with_the_embedding_flag():
    # 1F1B: stage s keeps min(M, pp - s) micro-batches. Embedding flag (7, 8, 8, 8): max(7 x 4, 8 x 3) = 28 layer
    # micro-batches; loss flag (8, 8, 8, 7): 8 x 4 = 32; per layer of the busiest stage (8): 3.5 and 4.
    pp4 = Plan(dp=2, pp=4)
    assert pipeline_inflight(MEG, pp4.with_(**EMB), 8, 31) == 3.5
    assert pipeline_inflight(MEG, pp4.with_(**LOSS), 8, 31) == 4.0
    small = replace(M31, vocab_size=256)  # the first stage's checkpoints, not the last stage's logits, peak
    a_emb, a_loss = (memory_terms(small, H100, MEG, pp4.with_(**f), accum=8).breakdown["activations"]
                     for f in (EMB, LOSS))
    assert a_emb == pytest.approx(a_loss * 3.5 / 4)


def test_interleaved_in_flight_counts_the_short_chunks():
    # MLPerf 405B, M = 288: rank 0 runs 2 x 7 + 7 x 8 + 1 = 71 chunk passes, 15 of them through its 1-layer chunk
    # 0 (micro-batches 0-7 and 8-14): 15 + 56 x 2 = 127 layers; rank 1 69 passes x 2 = 138, the most: 138 / 16
    # per layer of the busiest stage (the even-chunk formula's rank 0: 71 / 8).
    job = Job(seq_len=8192, global_batch=1152, framework="nemo")
    assert pipeline_inflight(job, MLPERF, 288, 126) == 138 / 16
    # 127 layers, loss flag only: rank 0's chunks all hold 2 layers, so its 71 passes keep 142 (the even-chunk
    # formula's count)
    assert pipeline_inflight(job, MLPERF.with_(account_for_embedding_in_pipeline_split=False), 288, 127) == 142 / 16


def test_end_stage_tables_replace_a_layer():
    # Both flags, pp > 2: the middle stages (16 layers, no table) hold the most weights; the tables are not added
    # on top. The 128-layer model's even split (16 layers + a table per end stage) differs by exactly the table.
    m = load_model("llama3-405b")
    m128 = replace(m, n_layers=128)
    job = Job(seq_len=8192, global_batch=1152, framework="nemo")
    flagged = memory_terms(m, H100, job, MLPERF, accum=288)
    even = memory_terms(m128, H100, job, MLPERF.with_(account_for_embedding_in_pipeline_split=False,
                                                      account_for_loss_in_pipeline_split=False), accum=288)
    assert even.param_elems - flagged.param_elems == pytest.approx(m.vocab_size * m.d_model / 8)
    # a table larger than a layer: the end stage (15 layers and its table) holds the most
    wide = replace(M31, n_layers=30, vocab_size=2_000_000)
    p = Plan(pp=4, **BOTH)
    t = memory_terms(wide, H100, MEG, p, accum=8)
    layer = memory_terms(wide, H100, MEG, p, accum=8).layer_weight_elems
    assert t.param_elems == pytest.approx(7 * layer + wide.vocab_size * wide.d_model)


def test_mlperf_405b_is_costed():
    m = replace(load_model("llama3-405b"), vocab_size=32768)  # the MLPerf row's model
    cost = estimate(m, H100, Job(seq_len=8192, global_batch=1152, precision="fp8", framework="nemo"), MLPERF)
    assert cost.stage_layers == (15, 16, 15) and cost.grad_accum == 288
    assert cost.to_dict()["stage_layers"] == [15, 16, 15]


# ---- bad input -------------------------------------------------------------------------------------------------

def test_only_under_megatron_core_and_with_pp():
    p = Plan(dp=2, pp=4, **EMB)
    m = replace(M31, n_layers=31)
    for fw in ("maxtext", "pytorch-fsdp", "deepspeed"):
        with pytest.raises(InputError, match=r"account_for_embedding_in_pipeline_split "
                                             r"\(--account-for-embedding-in-pipeline-split\): a Megatron-Core option; "
                                             rf"expected --framework megatron or nemo, got {fw}"):
            estimate(m, H100, replace(MEG, framework=fw), p)
    with pytest.raises(InputError, match=r"\(--account-for-loss-in-pipeline-split\): counts a layer of the "
                                         r"pipeline split; expected pp > 1, got pp 1"):
        estimate(m, H100, MEG, Plan(dp=8, **LOSS))
    with pytest.raises(InputError, match="num_layers 33"):
        estimate(replace(M31, n_layers=32), H100, MEG, p)  # 32 layers are even, but 33 do not split over 4


def planner(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["planner", *args])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out = capsys.readouterr()
    return code, out.out, out.err


CLI = ("estimate", "--model", "llama3-405b", "--hardware", "h100-sxm", "--chips", "512", "--dp", "4", "--tp", "8",
       "--pp", "8", "--cp", "2", "--vpp", "8", "--zero", "1", "--remat", "none", "--global-batch", "1152",
       "--seq-len", "8192")
FLAGS = ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")


def test_cli(capsys, monkeypatch):
    code, out, _ = planner(capsys, monkeypatch, *CLI, "--framework", "nemo", *FLAGS, "--json")
    d = json.loads(out)
    assert code == 0 and d["stage_layers"] == [15, 16, 15]
    assert d["plan"]["account_for_embedding_in_pipeline_split"] is True
    code, out, _ = planner(capsys, monkeypatch, *CLI, "--framework", "nemo", *FLAGS)
    assert code == 0 and "15 / 16 / 15 (first / middle / last)" in out and "split-counts=embedding+loss" in out
    code, out, _ = planner(capsys, monkeypatch, *CLI, "--framework", "nemo", "--json")  # without: refused
    assert code == 2


@pytest.mark.parametrize("extra, needles", [
    (("--framework", "maxtext", FLAGS[1]), ("--account-for-loss-in-pipeline-split", "expected --framework megatron "
                                                                                    "or nemo, got maxtext")),
    (("--framework", "nemo", FLAGS[1]), ("num_layers 127", "must be divisible by pipeline_model_parallel_size 8")),
    (("--framework", "nemo", FLAGS[0], FLAGS[1], "--vpp", "3"), ("rank 16", "virtual_pipeline_model_parallel_size 3")),
])
def test_cli_errors(capsys, monkeypatch, extra, needles):
    args = [a for a in CLI]
    if "--vpp" in extra:
        i = args.index("--vpp")
        del args[i:i + 2]
    code, _, err = planner(capsys, monkeypatch, *args, *extra)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
    assert all(n in lines[0] for n in needles), lines[0]


def test_cli_pp_1(capsys, monkeypatch):
    code, _, err = planner(capsys, monkeypatch, "estimate", "--model", "llama3-8b", "--hardware", "h100-sxm",
                           "--chips", "8", "--dp", "8", "--global-batch", "8", "--framework", "megatron", FLAGS[0])
    assert code == 2 and err.strip().splitlines() == [
        "error: account_for_embedding_in_pipeline_split (--account-for-embedding-in-pipeline-split): counts a layer "
        "of the pipeline split; expected pp > 1, got pp 1"]


# ---- plan files, export and import -----------------------------------------------------------------------------

def _pf(plan: Plan = MLPERF) -> PlanFile:
    job = Job(seq_len=8192, global_batch=1152, precision="fp8", framework="megatron")
    return PlanFile(load_model("llama3-405b"), H100, plan.chips, job, plan, "llama3-405b", "h100-sxm")


def test_plan_file_round_trip(tmp_path):
    pf = _pf()
    p = save_plan(tmp_path / "p.yaml", "llama3-405b", "h100-sxm", pf.chips, pf.job, pf.plan)
    assert "account_for_embedding_in_pipeline_split: true" in p.read_text()
    assert load_plan(p).plan == pf.plan
    plain = save_plan(tmp_path / "q.yaml", "llama3-8b", "h100-sxm", 8, MEG, Plan(dp=8))
    assert "account_for" not in plain.read_text()  # written only when set
    p.write_text(p.read_text().replace("account_for_loss_in_pipeline_split: true",
                                       "account_for_loss_in_pipeline_split: 1"))
    with pytest.raises(InputError, match="field 'plan.account_for_loss_in_pipeline_split': expected true or false"):
        load_plan(p)
    p.write_text(p.read_text().replace("account_for_loss_in_pipeline_split: 1", "account_for_loss_in_pipeline_split: "
                                       "true").replace("framework: megatron", "framework: maxtext"))
    with pytest.raises(InputError, match="a Megatron-Core option"):
        load_plan(p)


def test_megatron_export_and_import_round_trip(tmp_path):
    pf = _pf()
    res = export_result(pf, "megatron")
    assert all(f in res.text for f in FLAGS) and "--num-virtual-stages-per-pipeline-rank 8" in res.text
    assert "--decoder-first-pipeline-num-layers" not in res.text  # Megatron refuses the two ways together
    p = tmp_path / "args.sh"
    p.write_text(res.text)
    back = import_megatron(p)
    assert back.notes == () and back.planfile.plan == res.adapted.plan == pf.plan
    # --num-layers-per-virtual-pipeline-stage counts the embedding and the loss too (arguments.py): 128 / 8 / 2 = 8
    p.write_text(res.text.replace("--num-virtual-stages-per-pipeline-rank 8",
                                  "--num-layers-per-virtual-pipeline-stage 2"))
    assert import_megatron(p).planfile.plan.vpp == 8
    # only the flags that are set are exported, and come back
    emb_only = _pf(Plan(dp=2, tp=8, pp=7, zero=1, remat=REMAT_POLICIES["selective"], **EMB))  # 127 / 7 is not whole
    with pytest.raises(InputError, match="num_layers 127"):
        export_result(emb_only, "megatron")
    one = _pf(Plan(dp=16, tp=8, pp=16, vpp=2, zero=1, remat=REMAT_POLICIES["selective"], **BOTH))
    text = export_result(one, "megatron").text
    p.write_text(text.replace(FLAGS[1], ""))
    with pytest.raises(InputError, match="num_layers 127"):
        import_megatron(p)


def test_import_refuses_both_ways_to_split(tmp_path):
    text = export_result(_pf(), "megatron").text
    p = tmp_path / "args.sh"
    p.write_text(text + "\n--decoder-first-pipeline-num-layers 14\n")
    with pytest.raises(InputError, match="--decoder-first-pipeline-num-layers cannot be set together with "
                                         "--account-for-embedding-in-pipeline-split and "
                                         "--account-for-loss-in-pipeline-split"):
        import_megatron(p)


def test_seven_eight_seven_with_two_virtual_stages(tmp_path):
    # Meta's 405B layout with vpp 2: --decoder-first/last-pipeline-num-layers 7 is refused (Megatron too: 7 is
    # not a multiple of 2; the message points at the flags); the flags build 7 / 8 / 7 (4-layer chunks, 3 at the
    # ends), which the planner's own uneven split (8 / 8 / 6) could not.
    plan = Plan(dp=128, tp=8, pp=16, vpp=2, zero=1, remat=REMAT_POLICIES["selective"])
    text = export_result(_pf(plan), "megatron").text
    p = tmp_path / "args.sh"
    p.write_text(text.replace("--decoder-first-pipeline-num-layers 8", "--decoder-first-pipeline-num-layers 7")
                 .replace("--decoder-last-pipeline-num-layers 6", "--decoder-last-pipeline-num-layers 7"))
    with pytest.raises(InputError, match="expected a positive multiple of the 2 virtual stages, got 7 .Megatron-Core "
                                         "refuses it too; .*--account-for-embedding-in-pipeline-split"):
        import_megatron(p)
    job = Job(seq_len=8192, global_batch=2048, framework="megatron")
    m = load_model("llama3-405b")
    assert estimate(m, H100, job, plan).stage_layers == (8, 8, 6)
    assert estimate(m, H100, job, plan.with_(**BOTH)).stage_layers == (7, 8, 7)


def test_end_stage_table_counted_beside_its_own_layers():
    """The stage with the most weights: max(busiest stage's layers, an end stage's layers + its table). 6 layers
    over pp 4 split 1 / 2 / 1 (Megatron's uneven split): the end stages hold 1 layer and a table, so beyond the
    2-layer stage's weights only table - layer is counted; an even split counts the whole table."""
    from costmodel.memory import param_counts_per_chip
    from costmodel.model import ModelSpec
    from costmodel.plan import Plan, plan_split

    m = ModelSpec("six", n_layers=6, d_model=512, n_heads=8, n_kv_heads=8, ffn_dim=2048, vocab_size=32000)
    uneven = Plan(tp=2, pp=4, dp=1)
    assert plan_split(m.n_layers, uneven) == (1, 2, 1)
    body, layer, emb = param_counts_per_chip(m, uneven)
    table = 32000 * 512 / 2
    assert body == pytest.approx(2 * layer) and table > layer
    assert emb == pytest.approx(table - layer)
    even = Plan(tp=2, pp=3, dp=1)  # 2 / 2 / 2: every end stage holds 2 layers and its table
    assert param_counts_per_chip(m, even)[2] == pytest.approx(table)
