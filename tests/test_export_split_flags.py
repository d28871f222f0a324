"""MaxText export of a plan with Megatron-Core's account_for_embedding/loss_in_pipeline_split: the flags are
dropped with a note (MaxText has no such split) and the exported plan costs."""

from __future__ import annotations

import yaml

from costmodel.catalog import load_model
from costmodel.job import Job
from costmodel.plan import SPLIT_FLAGS, Plan, parse_remat
from hardware.catalog import load_hardware
from planner.export import export_result
from planner.planfile import PlanFile

BOTH = dict.fromkeys(SPLIT_FLAGS, True)


def _pf(model: str, chips: int, gb: int, **kw) -> PlanFile:
    return PlanFile(load_model(model), load_hardware("h100-sxm"), chips, Job(8192, gb, "bf16", "megatron"),
                    Plan(remat=parse_remat("selective"), **kw), model, "h100-sxm")


def _split_note(warnings: tuple[str, ...]) -> str:
    notes = [w for w in warnings if w.startswith("maxtext export: account_for_")]
    assert len(notes) == 1, warnings
    return notes[0]


def test_flags_dropped_with_a_note_and_the_export_costs():
    # 80 layers over pp 2 with both flags: 82 / 2 = 41 per rank, 40 / 40 layers; MaxText: 40 / 40, no flags
    res = export_result(_pf("llama3-70b", 64, 128, dp=4, tp=8, pp=2, **BOTH), "maxtext")
    note = _split_note(res.warnings)
    assert ("account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split: MaxText has no such "
            "split" in note and "outside its pipeline, on every stage" in note and note.endswith("both -> false"))
    assert not any(getattr(res.adapted.plan, f) for f in SPLIT_FLAGS)
    assert (res.adapted.plan.pp, res.adapted.plan.vpp) == (2, 1)
    assert yaml.safe_load(res.text)["num_layers_per_pipeline_stage"] == 40
    assert res.cost is not None and not any("cannot be costed" in w for w in res.warnings)


def test_mlperf_405b_layout_exports_costed():
    # MLPerf Llama 3.1 405B: 126 layers over pp 8 x vpp 8 only with both flags; MaxText needs an even split
    res = export_result(_pf("llama3-405b", 512, 1152, dp=8, tp=8, pp=8, vpp=8, zero=1, **BOTH), "maxtext")
    _split_note(res.warnings)
    assert any("splits the 126 layers evenly" in w for w in res.warnings)
    assert res.cost is not None and not any("cannot be costed" in w for w in res.warnings)
    assert "exported" in res.warnings[-1] and "s/step" in res.warnings[-1].split("exported")[1]


def test_no_flags_no_note():
    res = export_result(_pf("llama3-70b", 64, 128, dp=4, tp=8, pp=2), "maxtext")
    assert not any("account_for_" in w for w in res.warnings)
