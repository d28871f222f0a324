"""The one step context (costmodel.memory.StepShape): what every term counts over, computed once, by hand."""

from __future__ import annotations

import pytest

from costmodel.catalog import load_model
from costmodel.estimate import estimate, stage_times
from costmodel.job import Job
from costmodel.memory import memory_terms, step_shape
from costmodel.plan import Plan
from hardware.catalog import load_hardware

DSV3 = load_model("deepseek-v3-671b")
LLAMA7 = load_model("llama2-7b")
H100 = load_hardware("h100-sxm")
V5P = load_hardware("tpu-v5p")


def test_step_shape_by_hand():
    # DeepSeek-V3 (3 dense + 58 MoE layers) over 16 Megatron stages: 3 + 14 x 4 + 2 layers, the dense ones first
    job = Job(4096, 4096, framework="megatron")
    plan = Plan(dp=8, tp=2, pp=16, ep=8, cp=2, micro_batch=2)
    s = step_shape(DSV3, job, plan, accum=32)
    assert s.fw is job.fw and s.micro_steps == 32
    assert s.tokens == 2 * 4096 / 2 and s.sp == 2
    assert s.stage_kinds[0] == (3.0, 0.0, False) and s.stage_kinds[1] == (0.0, 4.0, False)
    assert s.stage_kinds[-1] == (0.0, 2.0, True) and len(s.stage_kinds) == 16
    assert s.kinds == (0.0, 4.0) and s.layers == 4.0 and s.layer_stages == 61 / 4
    assert s.layer_steps == 32 and s.head_stages == 1  # 1F1B: the logits on the last stage alone
    assert s.wdegrees == {"fsdp": 1}
    # MaxText's SPMD pipeline: every stage runs the bubble's iterations and shares the logits; cp and ep shard
    mt = step_shape(LLAMA7, Job(4096, 64), Plan(fsdp=2, cp=2, pp=2, ep=1), accum=8)
    assert mt.layer_steps == 8 + 1 and mt.head_stages == 2 and mt.inflight == 8 + 1
    assert mt.wdegrees == {"fsdp": 2, "cp": 2} and mt.kinds is None and mt.layers == 16


@pytest.mark.parametrize("case", [(DSV3, H100, Job(4096, 4096, framework="megatron"),
                                   Plan(dp=8, tp=2, pp=16, ep=8, cp=2, micro_batch=2)),
                                  (LLAMA7, V5P, Job(4096, 64), Plan(fsdp=2, cp=2, pp=2))])
def test_terms_given_the_shape_equal_the_terms_alone(case):
    m, chip, job, plan = case
    accum = estimate(m, chip, job, plan).grad_accum
    s = step_shape(m, job, plan, accum)
    assert memory_terms(m, chip, job, plan, accum, s) == memory_terms(m, chip, job, plan, accum)
    assert stage_times(m, chip, job, plan, s) == stage_times(m, chip, job, plan)
