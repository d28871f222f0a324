"""The expert all-to-all overlap (Plan.overlap_moe_expert_parallel_comm, Megatron-Core's
--overlap-moe-expert-parallel-comm): its exposed time, default-off equality, its errors and its export/import."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.cost import Role
from costmodel.estimate import _stage_times, estimate, step_shape
from costmodel.job import Job
from costmodel.model import ModelSpec
from costmodel.plan import EP_OVERLAP, Plan, parse_remat
from hardware.catalog import load_hardware
from hardware.errors import InputError
from planner.export import export_result
from planner.import_configs import import_megatron
from planner.planfile import PlanFile, load_plan, planfile_text
from tests.cli_in_process import planner_in_process as _cli

SMALL_MOE = ModelSpec("small-moe", n_layers=8, d_model=2048, n_heads=16, n_kv_heads=4, ffn_dim=5632,
                      vocab_size=32000, n_experts=8, experts_per_token=2, moe_ffn_dim=1408)
H100 = load_hardware("h100-sxm")
JOB = Job(4096, 64, "bf16", "megatron")
PLAN = Plan(ep=8, remat=parse_remat("none"))  # 8 chips, 64 / 8 = 8 micro-batches of 1 sequence
ON = {EP_OVERLAP: True}


def _exchange(chip, plan: Plan):
    cost = estimate(SMALL_MOE, chip, JOB, plan)
    return cost, next(c for c in cost.collectives if c.role == Role.EXPERT_EXCHANGE)


def _by_hand(chip) -> tuple[float, float, float]:
    """(4 t, hideable compute, exposed seconds per step) worked out from the formula's parts: 8 MoE layers x 8
    micro-batches; the first forward and the last backward run alone (1 of 8), the rest hide 4 t behind
    overlap x one MoE layer's forward + backward."""
    _, plain = _exchange(chip, PLAN)
    t = plain.time_s / plain.count  # one all-to-all (count = 4 x 8 layers x 8 micro-batches)
    one = _stage_times(SMALL_MOE, chip, JOB, PLAN, (0.0, 1.0), False, step_shape(SMALL_MOE, JOB, PLAN, 8))
    hide = chip.eff.overlap * (one.fwd + one.bwd + one.recompute)
    share = 1 / 8
    return 4 * t, hide, 8 * 8 * (share * 4 * t + (1 - share) * max(0.0, 4 * t - hide))


def test_a2a_shorter_than_compute_hidden_but_the_lone_passes():
    four_t, hide, want = _by_hand(H100)
    assert four_t < hide  # NVLink all-to-all: fully hidden in the steady phase
    _, ex = _exchange(H100, PLAN.with_(**ON))
    assert ex.exposed_s == pytest.approx(want) and ex.exposed_s == pytest.approx(8 * four_t)
    _, plain = _exchange(H100, PLAN)
    assert plain.exposed_s == pytest.approx(8 * 8 * four_t) and ex.time_s == plain.time_s


def test_a2a_longer_than_compute_shows_the_rest():
    slow = replace(H100, eff=replace(H100.eff, overlap=0.1))  # a chip whose compute hides little
    four_t, hide, want = _by_hand(slow)
    assert four_t > hide
    _, ex = _exchange(slow, PLAN.with_(**ON))
    assert ex.exposed_s == pytest.approx(want)
    assert ex.exposed_s == pytest.approx(8 * (four_t + 7 * (four_t - hide)))


def test_default_off_is_the_plan_without_it():
    assert Plan() == Plan(**{EP_OVERLAP: False})
    a = estimate(SMALL_MOE, H100, JOB, PLAN)
    b = estimate(SMALL_MOE, H100, JOB, replace(PLAN, **{EP_OVERLAP: False}))
    assert a == b
    on = estimate(SMALL_MOE, H100, JOB, PLAN.with_(**ON))
    assert on.step_time_s < a.step_time_s and on.peak_memory_bytes > a.peak_memory_bytes  # one more in flight


@pytest.mark.parametrize("job, plan, needle", [
    (Job(4096, 64, "bf16", "maxtext"), PLAN.with_(**ON), "expected --framework megatron or nemo, got maxtext"),
    (JOB, Plan(dp=8, remat=parse_remat("none"), **ON), "expected ep > 1 on a MoE model, got ep 1"),
    (JOB, PLAN.with_(remat=parse_remat("full"), **ON), "expected remat none or selective"),
])
def test_errors_name_the_flag(job, plan, needle):
    with pytest.raises(InputError, match="--overlap-moe-expert-parallel-comm") as e:
        estimate(SMALL_MOE, H100, job, plan)
    assert needle in str(e.value) and "\n" not in str(e.value)




@pytest.mark.parametrize("extra, needle", [
    (("--framework", "maxtext", "--ep", "8"), "expected --framework megatron or nemo"),
    (("--framework", "megatron", "--dp", "8"), "expected ep > 1"),
    (("--framework", "megatron", "--ep", "8", "--remat", "full"), "expected remat none or selective"),
])
def test_cli_bad_input_one_line_exit_2(capsys, monkeypatch, extra, needle):
    code, _, err = _cli(capsys, monkeypatch, "estimate", "--model", "mixtral-8x7b", "--hardware", "h100-sxm",
                     "--chips", "8", "--seq-len", "4096", "--global-batch", "64",
                     "--overlap-moe-expert-parallel-comm", *extra)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


def test_cli_flag_sets_the_plan(capsys, monkeypatch):
    code, out, _ = _cli(capsys, monkeypatch, "estimate", "--model", "mixtral-8x7b", "--hardware", "h100-sxm",
                        "--chips", "8", "--seq-len", "4096", "--global-batch", "64", "--framework", "megatron",
                        "--ep", "8", "--remat", "selective", "--overlap-moe-expert-parallel-comm", "--json")
    assert code == 0 and f'"{EP_OVERLAP}": true' in out


def _pf(**kw) -> PlanFile:
    return PlanFile(SMALL_MOE, H100, 8 * kw.get("pp", 1), JOB, PLAN.with_(**ON, **kw), None, "h100-sxm")


def test_plan_file_round_trip(tmp_path: Path):
    p = tmp_path / "p.yaml"
    p.write_text(planfile_text(_pf()))
    assert f"{EP_OVERLAP}: true" in p.read_text()
    assert load_plan(p).plan == PLAN.with_(**ON)
    p.write_text(planfile_text(PlanFile(SMALL_MOE, H100, 8, JOB, PLAN, None, "h100-sxm")))
    assert EP_OVERLAP not in p.read_text()  # written only when set


def test_megatron_export_import_round_trip(tmp_path: Path):
    res = export_result(_pf(pp=2, vpp=2), "megatron")
    assert "--overlap-moe-expert-parallel-comm" in res.text and "--delay-wgrad-compute" in res.text
    f = tmp_path / "args.sh"
    f.write_text(res.text)
    back = import_megatron(f, hardware="h100-sxm").planfile.plan
    assert back.overlap_moe_expert_parallel_comm and (back.pp, back.vpp, back.ep) == (2, 2, 8)


def test_megatron_export_drops_it_without_virtual_stages():
    res = export_result(_pf(pp=2), "megatron")
    assert "--overlap-moe-expert-parallel-comm" not in res.text
    assert any("expected vpp > 1, got vpp 1" in w and w.endswith("-> false") for w in res.warnings)


def test_megatron_import_refuses_what_megatron_refuses(tmp_path: Path):
    text = export_result(_pf(pp=2, vpp=2), "megatron").text
    f = tmp_path / "args.sh"
    f.write_text(text.replace("--num-virtual-stages-per-pipeline-rank 2", "").replace(
        "--num-layers-per-virtual-pipeline-stage 2", ""))
    with pytest.raises(InputError, match="needs virtual stages"):
        import_megatron(f, hardware="h100-sxm")
    f.write_text(text.replace("--overlap-moe-expert-parallel-comm", ""))
    with pytest.raises(InputError, match="--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm"):
        import_megatron(f, hardware="h100-sxm")


def test_maxtext_export_drops_it_with_a_note():
    res = export_result(_pf(), "maxtext")
    assert any("overlap_moe_expert_parallel_comm: MaxText has no expert all-to-all overlap" in w
               for w in res.warnings)
    assert not res.adapted.plan.overlap_moe_expert_parallel_comm


def test_one_more_micro_batch_of_activations_in_flight():
    """Combined 1F1B keeps one more forward pass's checkpoints (costmodel.memory.pipeline_inflight). By hand: pp 1,
    8 micro-batches: plain gradient accumulation holds 1 micro-batch, the overlap 2 (1 when there is only one);
    interleaved pp 2 vpp 2 (8 micro-batches): min(16, 2 x 2 + 1) = 5 chunk passes of half a stage, 6 with it."""
    def acts(job: Job, plan: Plan) -> float:
        return estimate(SMALL_MOE, H100, job, plan).memory["activations"]

    assert acts(JOB, PLAN.with_(**ON)) == pytest.approx(2 * acts(JOB, PLAN))
    one = Job(4096, 8, "bf16", "megatron")  # 8 chips, one micro-batch: nothing to pair, nothing more held
    assert acts(one, PLAN.with_(**ON)) == pytest.approx(acts(one, PLAN))
    inter = Plan(pp=2, vpp=2, ep=4, remat=parse_remat("none"))
    assert acts(JOB, inter.with_(**ON)) == pytest.approx(6 / 5 * acts(JOB, inter))


def _best(fw: str, fix: str):
    from planner.candidates import parse_fix
    from planner.solve import search

    return search(SMALL_MOE, H100, Job(4096, 64, "bf16", fw), 16, cons=parse_fix(fix), explain=False).plans[0]


def test_search_turns_it_on_where_the_all_to_all_dominates():
    """ep 8 and micro-batch 1 pinned on 16 H100s (4 micro-batches a step to pair): suggest turns the overlap on under
    Megatron-Core (faster, and it fits); MaxText has no such overlap, so never there."""
    on = _best("megatron", "ep=8,micro_batch=1")
    assert on.plan.overlap_moe_expert_parallel_comm and (on.plan.pp == 1 or on.plan.vpp > 1)
    assert on.plan.remat.choices()["mlp_in"] != "remat"
    off = estimate(SMALL_MOE, H100, Job(4096, 64, "bf16", "megatron"), on.plan.with_(**{EP_OVERLAP: False}))
    assert on.cost.step_time_s < off.step_time_s and on.cost.fits
    assert not _best("maxtext", "ep=8,micro_batch=1").plan.overlap_moe_expert_parallel_comm
