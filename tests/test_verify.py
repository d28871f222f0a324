"""`planner verify` and `suggest --verify`: the train_compile log parser, the command built for a plan, the
environment lookup and its one-line error, the refusals (GPU, non-MaxText); one real compile, opt-in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from costmodel.catalog import load_model
from costmodel.job import Job
from costmodel.plan import Plan, parse_remat
from hardware.catalog import load_hardware
from hardware.errors import InputError
from planner.planfile import PlanFile, save_plan
from planner.verify import (
    TRAIN_COMPILE,
    check_verifiable,
    classify,
    command,
    find_env,
    parse_memory,
    topology,
    total_bytes,
)

PLANNER = str(Path(sys.executable).with_name("planner"))
# A CompiledMemoryStats line as MaxText 0.2.5's train_compile prints it (jax's repr), with the byte counts of
# results.csv's l2-7b_v5p8_b1_s2048_full row.
STATS = ("Memory analysis: CompiledMemoryStats("
         "generated_code_size_in_bytes=32458752, argument_size_in_bytes=20215300096, "
         "output_size_in_bytes=20215265024, alias_size_in_bytes=20215259136, temp_size_in_bytes=12291317888, "
         "host_generated_code_size_in_bytes=0, host_argument_size_in_bytes=0, host_output_size_in_bytes=0, "
         "host_alias_size_in_bytes=0, host_temp_size_in_bytes=0)\n")


def planner(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PLANNER, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def plan_file(model: str, hw: str, chips: int, seq: int, gb: int, fw: str = "maxtext", **kw) -> PlanFile:
    return PlanFile(load_model(model), load_hardware(hw), chips, Job(seq, gb, "bf16", fw),
                    Plan(remat=parse_remat(kw.pop("remat", "full")), **kw), model, hw)


def saved(tmp_path: Path, pf: PlanFile) -> str:
    path = tmp_path / "plan.yaml"
    save_plan(str(path), pf.model_ref, pf.hardware_ref, pf.chips, pf.job, pf.plan)
    return str(path)


def test_parser_reads_the_last_stats_line_and_totals_it():
    mem = parse_memory("Jitting and compiling train step...\n" + STATS)
    assert mem["argument_size_in_bytes"] == 20215300096 and mem["host_temp_size_in_bytes"] == 0
    # by hand: 20215300096 + 20215265024 - 20215259136 + 12291317888 = 32506623872 (results.csv's total)
    assert total_bytes(mem) == 32506623872
    assert parse_memory("no stats here") is None
    assert classify(STATS, 0)[0] == "ok"


def test_classify_oom_and_error():
    oom = ("E1206 ...] RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
           "Used 120.5G of 95.74G hbm. Exceeded hbm capacity by 24.76G. HLO module ...\n")
    status, mem, reason = classify(oom, 1)
    assert (status, mem) == ("oom", {}) and "Exceeded hbm capacity" in reason
    status, _, reason = classify("I1206 noise\nValueError: bad mesh\n", 1)
    assert status == "error" and "ValueError: bad mesh" in reason and "noise" not in reason


def test_command_for_a_two_slice_v5p_plan():
    pf = plan_file("llama3-70b", "tpu-v5p", 512, 4096, 1024, dp=2, fsdp=64, tp=4, slices=2, remat="minimal")
    topo, slices = topology(pf)
    assert (topo, slices) == ("v5p-512", 2)  # 256 chips per slice, two TensorCores each in MaxText's names
    cmd = command(Path("/env/bin/python"), Path("/t/plan.yml"), topo, slices, Path("/t/out"))
    assert cmd[:4] == ["/env/bin/python", "-m", TRAIN_COMPILE, "/t/plan.yml"]
    assert {"compile_topology=v5p-512", "compile_topology_num_slices=2", "dataset_type=synthetic",
            "enable_checkpointing=false", "base_output_directory=/t/out"} <= set(cmd)


def test_single_slice_v5p8():
    assert topology(plan_file("llama2-7b", "tpu-v5p", 4, 2048, 4, dp=4)) == ("v5p-8", 1)


def test_gpu_and_megatron_plans_are_refused():
    with pytest.raises(InputError, match="hardware: verify compiles TPU plans.*GPU"):
        check_verifiable(plan_file("llama3-8b", "h100-sxm", 8, 4096, 8, fw="megatron", dp=8))
    with pytest.raises(InputError, match="framework: verify compiles MaxText plans.*megatron"):
        check_verifiable(plan_file("llama2-7b", "tpu-v5p", 4, 2048, 4, fw="megatron", dp=4))


def test_find_env_order_and_messages(tmp_path, monkeypatch):
    monkeypatch.delenv("MAXTEXT_ENV", raising=False)
    monkeypatch.setattr("planner.verify.DEFAULT_ENV", str(tmp_path / "default"))
    with pytest.raises(InputError, match=r"default MaxText environment .*make maxtext-memory-env"):
        find_env(None)
    fake = tmp_path / "fake"
    (fake / "bin").mkdir(parents=True)
    (fake / "bin" / "python").symlink_to(sys.executable)  # a Python without maxtext
    monkeypatch.setenv("MAXTEXT_ENV", str(fake))
    with pytest.raises(InputError, match=r"\$MAXTEXT_ENV .*cannot import maxtext; .*make maxtext-memory-env"):
        find_env(None)
    with pytest.raises(InputError, match=r"--maxtext-env .*nowhere: no MaxText environment"):
        find_env(str(tmp_path / "nowhere"))  # the flag wins over the variable


def test_cli_without_env_is_one_line_exit_2(tmp_path):
    path = saved(tmp_path, plan_file("llama2-7b", "tpu-v5p", 4, 2048, 4, dp=4))
    r = planner("verify", "--plan", path, env={"MAXTEXT_ENV": str(tmp_path / "none")})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "make maxtext-memory-env" in lines[0] and "Traceback" not in r.stderr


def test_cli_refuses_gpu_plans(tmp_path):
    path = saved(tmp_path, plan_file("llama3-8b", "h100-sxm", 8, 4096, 8, fw="megatron", dp=8))
    r = planner("verify", "--plan", path)
    assert r.returncode == 2 and r.stderr.startswith("error: hardware: verify compiles TPU plans")
    r = planner("suggest", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--verify", "2")
    assert r.returncode == 2 and "--verify: verification compiles TPU plans under MaxText" in r.stderr


def _compile_env() -> str | None:
    """The MaxText environment for the real compile: only when PLANNER_COMPILE_TESTS=1 (minutes of CPU)."""
    if os.environ.get("PLANNER_COMPILE_TESTS") != "1":
        return None
    try:
        return str(find_env(None))
    except InputError:
        return None


@pytest.mark.skipif(_compile_env() is None, reason="set PLANNER_COMPILE_TESTS=1 and MAXTEXT_ENV (a MaxText env)")
def test_real_compile_llama2_7b_on_v5p8(tmp_path):
    """llama2-7b on 4 v5p chips (v5p-8), dp 4: compiles in 1-3 min; the prediction within 15 % of XLA's total."""
    path = saved(tmp_path, plan_file("llama2-7b", "tpu-v5p", 4, 2048, 4, dp=4))
    r = subprocess.run([PLANNER, "verify", "--plan", path, "--json"], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["status"] == "ok" and out["compile_topology"] == "v5p-8"
    assert abs(out["predicted_total_bytes"] / out["compiler_total_bytes"] - 1) < 0.15
