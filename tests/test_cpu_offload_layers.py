"""Megatron-Core's layer CPU offload (Plan.cpu_offload_layers, --cpu-offloading-num-layers N): device and host
activations and the host transfers by hand on a small model, N = 0 is today, Megatron's refusals as one-line
errors with exit 2, the plan file and the export/import round trip."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.estimate import estimate
from costmodel.job import Job
from costmodel.memory import BF16
from costmodel.model import ModelSpec
from costmodel.plan import CPU_OFFLOAD_LAYERS, Plan, cpu_offload_windows, parse_remat
from hardware.catalog import load_hardware
from hardware.errors import InputError
from planner.export import export_result
from planner.import_configs import import_megatron
from planner.planfile import PlanFile, load_plan, planfile_text
from tests.cli_in_process import planner_in_process as _cli

# 8 layers, d 1024, 8 heads of 128 (no GQA), gated MLP 4096, a small vocabulary
SMALL = ModelSpec("small", n_layers=8, d_model=1024, n_heads=8, n_kv_heads=8, ffn_dim=4096, vocab_size=256)
H100 = load_hardware("h100-sxm")
JOB = Job(4096, 8, "bf16", "megatron")  # 8 micro-steps of one 4096-token sequence on one chip
NONE = Plan(remat=parse_remat("none"))  # one chip, pp 1: one micro-batch in flight
# Remat none keeps per token: the input 1024, q/k/v 3 x 1024, the context 1024, the out projection 1024, the two
# MLP input projections 2 x 4096, two norm outputs 2 x 1024 and the MLP activation 4096 = 20,480 elements
LAYER = 4096 * 20480 * BF16  # bytes of one layer's saved activations per micro-batch: 167,772,160


def _est(n: int, chip=H100):
    return estimate(SMALL, chip, JOB, NONE.with_(cpu_offload_layers=n))


def test_windows_follow_transformer_engine():
    # layer_window_map for L 8: N 2 -> [3, 7], N 4 -> [1, 3, 5, 7], N 3 -> [2, 5, 7]; the windows are the gaps
    assert cpu_offload_windows(2, 8) == [3, 4]
    assert cpu_offload_windows(4, 8) == [1, 2, 2, 2]
    assert cpu_offload_windows(3, 8) == [2, 3, 2]
    assert all(sum(cpu_offload_windows(n, 8)) == 7 for n in range(1, 8))  # the last window ends at layer 7


def test_device_and_host_memory_by_hand():
    assert _est(0).memory["activations"] == pytest.approx(8 * LAYER)
    for n in (1, 4, 7):
        c = _est(n)
        # the 8 - n kept layers and the last offloaded one, freed only after the last layer's forward
        assert c.memory["activations"] == pytest.approx((8 - n + 1) * LAYER)
        assert c.host_memory_bytes == pytest.approx(n * LAYER)


def test_transfer_time_by_hand():
    t = LAYER / H100.host_link_Bps  # one layer one way: 2.62 ms at 64 GB/s
    bare = replace(H100, eff=replace(H100.eff, host_overlap=0.0))  # nothing hidden
    c0, c4 = _est(0, bare), _est(4, bare)
    host = [x for x in c4.collectives if x.axis == "host"]
    assert len(host) == 1 and host[0].count == 2 * 4 * 8  # 4 layers down and back, 8 micro-steps
    assert host[0].exposed_s == pytest.approx(64 * t)
    assert c4.step_time_s - c0.step_time_s == pytest.approx(64 * t)
    # with overlap the copies hide behind their windows: never more exposed than with none, more for more layers
    exposed = [sum(x.exposed_s for x in _est(n).collectives if x.axis == "host") for n in (2, 4, 7)]
    assert 0 < exposed[0] < exposed[1] < exposed[2] <= 2 * 7 * 8 * t


def test_zero_is_today():
    a, b = _est(0), estimate(SMALL, H100, JOB, NONE)
    assert (a.step_time_s, a.memory, a.host_memory_bytes) == (b.step_time_s, b.memory, b.host_memory_bytes)


@pytest.mark.parametrize("job, plan, needle", [
    (Job(4096, 8, "bf16", "maxtext"), NONE.with_(cpu_offload_layers=2), "expected --framework megatron or nemo"),
    (JOB, NONE.with_(pp=2, cpu_offload_layers=2), "expected pp 1"),
    (JOB, NONE.with_(remat=parse_remat("full"), cpu_offload_layers=2), "expected --remat none"),
    (JOB, NONE.with_(remat=parse_remat("selective"), cpu_offload_layers=2), "expected --remat none"),
    (JOB, NONE.with_(cpu_offload_layers=8), "expected 1 to 7"),
])
def test_errors_name_the_flag(job, plan, needle):
    with pytest.raises(InputError, match="--cpu-offloading-num-layers") as e:
        estimate(SMALL, H100, job, plan)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_plan_field_refuses_a_negative_count():
    with pytest.raises(InputError, match=CPU_OFFLOAD_LAYERS):
        Plan(cpu_offload_layers=-1)




BASE = ("estimate", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--global-batch", "64",
        "--tp", "8", "--framework", "megatron")


@pytest.mark.parametrize("extra, needle", [
    (("--remat", "full", "--cpu-offloading-num-layers", "2"), "expected --remat none"),
    (("--remat", "none", "--cpu-offloading-num-layers", "32"), "expected 1 to 31"),
    (("--remat", "none", "--cpu-offloading-num-layers", "0"), "expected a positive integer"),
])
def test_cli_bad_input_one_line_exit_2(capsys, monkeypatch, extra, needle):
    code, _, err = _cli(capsys, monkeypatch, *BASE, *extra)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err and "--cpu-offloading-num-layers" in err


def test_cli_flag_sets_the_plan(capsys, monkeypatch):
    code, out, _ = _cli(capsys, monkeypatch, *BASE, "--remat", "none", "--cpu-offloading-num-layers", "3", "--json")
    assert code == 0 and f'"{CPU_OFFLOAD_LAYERS}": 3' in out


def _pf(n: int) -> PlanFile:
    plan = NONE.with_(cpu_offload_layers=n)
    return PlanFile(SMALL, H100, 1, JOB, plan, None, "h100-sxm")


def test_plan_file_round_trip(tmp_path: Path):
    p = tmp_path / "p.yaml"
    p.write_text(planfile_text(_pf(3)))
    assert f"{CPU_OFFLOAD_LAYERS}: 3" in p.read_text()
    assert load_plan(p).plan == NONE.with_(cpu_offload_layers=3)
    p.write_text(planfile_text(_pf(0)))
    assert CPU_OFFLOAD_LAYERS not in p.read_text()  # written only when set


def test_megatron_export_import_round_trip(tmp_path: Path):
    res = export_result(_pf(3), "megatron")
    assert "--cpu-offloading-num-layers 3" in res.text and "--recompute-granularity" not in res.text
    f = tmp_path / "args.sh"
    f.write_text(res.text)
    back = import_megatron(f, hardware="h100-sxm").planfile.plan
    assert (back.cpu_offload_layers, back.pp, back.remat.name) == (3, 1, "none")
    assert "--cpu-offloading" not in export_result(_pf(0), "megatron").text


def test_maxtext_export_drops_it_with_a_note():
    res = export_result(_pf(3), "maxtext")
    assert any("cpu_offload_layers 3" in w for w in res.warnings)
    assert res.adapted.plan.cpu_offload_layers == 0
