"""Megatron-Core's block recompute (Plan.recompute_num_layers, --recompute-num-layers N under
--recompute-method block): activations and recompute by hand on a small model, the limits (N = 0 and N = every
layer of a chunk are remat full), its errors, the plan file, the exports and the search."""

from __future__ import annotations

from pathlib import Path

import pytest

from costmodel.estimate import estimate
from costmodel.job import Job
from costmodel.memory import BF16
from costmodel.model import ModelSpec
from costmodel.plan import RECOMPUTE_LAYERS, Plan, parse_remat
from hardware.catalog import load_hardware
from hardware.errors import InputError
from planner.candidates import Mesh
from planner.export import export_result
from planner.import_configs import import_megatron
from planner.planfile import PlanFile, load_plan, planfile_text
from planner.remat import Choice, block_recompute, brute_force, evaluate
from planner.solve import with_headroom
from tests.cli_in_process import planner_in_process as _cli

# 8 layers, d 1024, 8 heads of 128 (no GQA), gated MLP 4096, a small vocabulary (so the first stage's checkpoints,
# not the last stage's logits, are the peak)
SMALL = ModelSpec("small", n_layers=8, d_model=1024, n_heads=8, n_kv_heads=8, ffn_dim=4096, vocab_size=256)
H100 = load_hardware("h100-sxm")
JOB = Job(4096, 8, "bf16", "megatron")  # 8 micro-batches of one 4096-token sequence
FULL = Plan(pp=2, remat=parse_remat("full"))  # 2 chips, 4 layers per stage
TOKENS = 4096


def _est(**kw):
    return estimate(SMALL, H100, JOB, FULL.with_(**kw))


def test_activation_memory_by_hand():
    # Elements per token of one layer (tp 1): remat full keeps the layer input, d = 1024. Remat none keeps the
    # input 1024, q/k/v 3 x 1024, the attention context 1024, the out projection 1024, the gated MLP's two input
    # projections 2 x 4096, two norm outputs 2 x 1024 and the MLP activation 4096 (the MLP output is the next
    # layer's input): 20,480.
    full_el, none_el = 1024, 1024 + 3 * 1024 + 1024 + 1024 + 2 * 4096 + 2 * 1024 + 4096
    inflight = 2  # 1F1B: the first of 2 stages keeps min(M = 8, pp = 2) micro-batches
    per_mb = TOKENS * BF16
    want = {0: 4 * full_el, 1: 1 * full_el + 3 * none_el, 4: 4 * full_el}  # N = 1: 3 of 4 layers keep everything
    for n, elems in want.items():
        assert _est(recompute_num_layers=n).memory["activations"] == pytest.approx(inflight * per_mb * elems)
    assert estimate(SMALL, H100, JOB, FULL.with_(remat=parse_remat("none"))).memory["activations"] == \
        pytest.approx(inflight * per_mb * 4 * none_el)


def test_recompute_scales_with_the_recomputed_layers():
    full, one, two = _est(), _est(recompute_num_layers=1), _est(recompute_num_layers=2)
    # tp 1: hardware FLOPs = model FLOPs + the recomputed forward; 1 (2) of 4 layers per stage recomputed
    rec = full.hardware_flops_per_step - full.model_flops_per_step
    assert rec > 0
    assert one.hardware_flops_per_step - one.model_flops_per_step == pytest.approx(rec / 4)
    assert two.hardware_flops_per_step - two.model_flops_per_step == pytest.approx(rec / 2)
    assert one.time["recompute"] == pytest.approx(full.time["recompute"] / 4)
    assert one.step_time_s < two.step_time_s < full.step_time_s
    assert one.peak_memory_bytes > two.peak_memory_bytes > full.peak_memory_bytes


def test_every_layer_of_a_chunk_is_remat_full_and_zero_is_today():
    assert Plan() == Plan(recompute_num_layers=0)
    full = _est()
    for n, kw in ((4, {}), (2, {"vpp": 2})):  # N = the layers of a chunk: 4 per stage, or 2 per chunk of 2
        same = _est(recompute_num_layers=n, **kw)
        ref = _est(**kw)
        assert (same.step_time_s, same.peak_memory_bytes, same.hardware_flops_per_step) == \
            (ref.step_time_s, ref.peak_memory_bytes, ref.hardware_flops_per_step)
    assert full == _est(recompute_num_layers=0)


def test_interleaved_chunks_share_per_chunk():
    # vpp 2: chunks of 2 layers; N = 1 recomputes 1 of each chunk's 2 layers: half the recompute
    full, half = _est(vpp=2), _est(vpp=2, recompute_num_layers=1)
    assert half.time["recompute"] == pytest.approx(full.time["recompute"] / 2)


@pytest.mark.parametrize("job, plan, needle", [
    (Job(4096, 8, "bf16", "maxtext"), FULL.with_(recompute_num_layers=1), "expected --framework megatron or nemo"),
    (JOB, FULL.with_(remat=parse_remat("selective"), recompute_num_layers=1), "expected --remat full, got selective"),
    (JOB, FULL.with_(recompute_num_layers=5), "expected 1 to 4"),
    (JOB, FULL.with_(vpp=2, recompute_num_layers=3), "expected 1 to 2"),
])
def test_errors_name_the_flag(job, plan, needle):
    with pytest.raises(InputError, match="--recompute-num-layers") as e:
        estimate(SMALL, H100, job, plan)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_plan_field_refuses_a_negative_count():
    with pytest.raises(InputError, match="recompute_num_layers"):
        Plan(recompute_num_layers=-1)




BASE = ("estimate", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--global-batch", "64",
        "--tp", "2", "--pp", "4")


@pytest.mark.parametrize("extra, needle", [
    (("--framework", "maxtext", "--remat", "full", "--recompute-num-layers", "2"), "expected --framework megatron"),
    (("--framework", "megatron", "--remat", "selective", "--recompute-num-layers", "2"), "expected --remat full"),
    (("--framework", "megatron", "--remat", "full", "--recompute-num-layers", "9"), "expected 1 to 8"),
    (("--framework", "megatron", "--remat", "full", "--recompute-num-layers", "0"), "expected a positive integer"),
])
def test_cli_bad_input_one_line_exit_2(capsys, monkeypatch, extra, needle):
    code, _, err = _cli(capsys, monkeypatch, *BASE, *extra)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err and "--recompute-num-layers" in err, err


def test_cli_flag_sets_the_plan(capsys, monkeypatch):
    code, out, _ = _cli(capsys, monkeypatch, *BASE, "--framework", "megatron", "--remat", "full",
                        "--recompute-num-layers", "3", "--json")
    assert code == 0 and f'"{RECOMPUTE_LAYERS}": 3' in out


def _pf(n: int = 1, **kw) -> PlanFile:
    plan = FULL.with_(recompute_num_layers=n, **kw)
    return PlanFile(SMALL, H100, plan.chips, JOB, plan, None, "h100-sxm")


def test_plan_file_round_trip(tmp_path: Path):
    p = tmp_path / "p.yaml"
    p.write_text(planfile_text(_pf(3)))
    assert f"{RECOMPUTE_LAYERS}: 3" in p.read_text()
    assert load_plan(p).plan == FULL.with_(recompute_num_layers=3)
    p.write_text(planfile_text(PlanFile(SMALL, H100, 2, JOB, FULL, None, "h100-sxm")))
    assert RECOMPUTE_LAYERS not in p.read_text()  # written only when set


def test_megatron_export_import_round_trip(tmp_path: Path):
    res = export_result(_pf(1, vpp=2), "megatron")
    assert "--recompute-method block" in res.text and "--recompute-num-layers 1" in res.text
    f = tmp_path / "args.sh"
    f.write_text(res.text)
    back = import_megatron(f, hardware="h100-sxm").planfile.plan
    assert (back.recompute_num_layers, back.pp, back.vpp, back.remat.name) == (1, 2, 2, "full")
    plain = export_result(PlanFile(SMALL, H100, 2, JOB, FULL, None, "h100-sxm"), "megatron").text
    assert "--recompute-method uniform" in plain and "--recompute-num-layers 1" in plain
    # block N covering every layer of a chunk imports as remat full of every layer (N 0)
    f.write_text(res.text.replace("--recompute-num-layers 1", "--recompute-num-layers 2"))
    assert import_megatron(f, hardware="h100-sxm").planfile.plan.recompute_num_layers == 0


def test_maxtext_export_drops_it_with_a_note():
    res = export_result(_pf(1), "maxtext")
    assert any("recompute_num_layers 1: MaxText applies one remat_policy" in w for w in res.warnings)
    assert res.adapted.plan.recompute_num_layers == 0


def test_search_takes_the_fewest_layers_that_fit():
    mesh = Mesh(dp=1, fsdp=1, tp=1, cp=1, pp=2, ep=1, vpp=1, micro_batch=1, zero=0, slices=1)
    full = Choice(parse_remat("full"), False, False)
    found, calls = block_recompute(SMALL, H100, JOB, mesh, full)
    assert calls == 2 and [ch.recompute_num_layers for ch, _ in found] == [1]  # everything fits: N = 1
    tight = (evaluate(SMALL, H100, JOB, mesh, Choice(full.remat, False, False, 2)).fit_memory_bytes
             + evaluate(SMALL, H100, JOB, mesh, Choice(full.remat, False, False, 1)).fit_memory_bytes) / 2
    small = with_headroom(H100, 1 - tight / H100.usable_hbm_bytes)  # N = 1 no longer fits, N = 2 does
    found, _ = block_recompute(SMALL, small, JOB, mesh, full)
    assert [ch.recompute_num_layers for ch, _ in found] == [2]


def test_search_prefers_none_when_it_fits():
    from planner.candidates import Constraints
    from planner.export_megatron import megatron_constraints

    mesh = Mesh(dp=1, fsdp=1, tp=1, cp=1, pp=2, ep=1, vpp=1, micro_batch=1, zero=0, slices=1)
    r = brute_force(SMALL, H100, JOB, mesh, megatron_constraints(Constraints()))
    assert r.choice.remat.name == "none" and r.choice.recompute_num_layers == 0
