"""Pins that `suggest --fix` must honour when the framework runs them (issue 29: `--fix zero=2` found nothing although
`estimate` costs that plan)."""

from __future__ import annotations

from costmodel.catalog import load_model
from costmodel.job import Job
from hardware.catalog import load_hardware
from planner.candidates import parse_fix
from planner.solve import search


def test_zero_2_is_searched_when_pinned():
    s = search(load_model("llama2-7b"), load_hardware("h100-sxm"), Job(4096, 64, framework="deepspeed"), 16,
               parse_fix("zero=2"), top=1)
    assert s.plans and s.plans[0].plan.zero == 2 and s.plans[0].plan.dp > 1


def test_zero_2_is_not_searched_unless_pinned():
    s = search(load_model("llama2-7b"), load_hardware("h100-sxm"), Job(4096, 64, framework="deepspeed"), 16, top=3)
    assert all(r.plan.zero in (0, 1) for r in s.plans)
