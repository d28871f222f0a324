"""Property-based robustness tests: estimate() returns a sane Cost or raises InputError, never anything else.

Random models (dense, MoE, MLA, odd head counts, GQA ratios, tiny and huge vocabularies), every hardware preset,
1 to 200,000 chips, sequences of 128 to 1M tokens and random plans. The default budget is small (the suite runs
on a shared 2-core machine); HYPOTHESIS_PROFILE=fuzz multiplies it by 20 (`HYPOTHESIS_PROFILE=fuzz pytest
tests/test_properties.py tests/test_invariants.py`).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costmodel.estimate import estimate
from costmodel.job import FRAMEWORKS, PRECISIONS, Job
from costmodel.model import ModelSpec
from costmodel.plan import CHOICES, REMAT_POLICIES, TENSORS, Plan, Remat
from hardware.catalog import load_hardware, preset_names
from hardware.errors import InputError

FUZZ = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"


def budget(n: int) -> settings:
    return settings(max_examples=n * (20 if FUZZ else 1), deadline=None, derandomize=not FUZZ,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


PRESETS = preset_names()
CHIPS = {name: load_hardware(name) for name in PRESETS}
MAX_CHIPS = 200_000

# ---- strategies ------------------------------------------------------------------------------------------

HEAD_DIMS = st.sampled_from([1, 3, 16, 64, 80, 96, 128, 192, 256])


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def models(draw) -> ModelSpec:
    """A valid ModelSpec (mostly): dense or MoE, MHA/GQA/MQA or MLA, odd shapes and extreme vocabularies."""
    n_heads = draw(st.one_of(st.integers(1, 16), st.sampled_from([25, 40, 52, 64, 96, 128, 7, 13])))
    head_dim = draw(HEAD_DIMS)
    explicit_head_dim = draw(st.booleans())
    d_model = n_heads * head_dim if not explicit_head_dim else draw(st.integers(1, 32768))
    kv = draw(st.sampled_from(_divisors(n_heads)))
    kw: dict = dict(
        name="rand", n_layers=draw(st.integers(1, 160)), d_model=d_model, n_heads=n_heads,
        ffn_dim=draw(st.integers(1, 131072)),
        vocab_size=draw(st.one_of(st.integers(1, 300), st.integers(300, 300_000), st.just(10_000_000))),
        n_kv_heads=kv, head_dim=head_dim if explicit_head_dim else 0, gated_mlp=draw(st.booleans()),
        tied_embeddings=draw(st.booleans()),
    )
    if draw(st.booleans()):  # MoE
        n_exp = draw(st.sampled_from([1, 2, 3, 8, 16, 64, 160, 256]))
        kw.update(n_experts=n_exp, experts_per_token=draw(st.integers(1, n_exp)),
                  moe_ffn_dim=draw(st.integers(0, 16384)), n_dense_layers=draw(st.integers(0, kw["n_layers"])),
                  n_shared_experts=draw(st.integers(0, 2)),
                  capacity_factor=draw(st.sampled_from([0.0, 1.0, 1.25, 2.0])))
    if draw(st.integers(0, 4)) == 0:  # MLA
        hd = head_dim if explicit_head_dim else d_model // n_heads
        if hd > 1:
            kw.update(kv_lora_rank=draw(st.integers(1, 1024)), q_lora_rank=draw(st.integers(0, 2048)),
                      qk_rope_head_dim=draw(st.integers(0, hd - 1)), v_head_dim=draw(st.integers(0, 256)))
    if draw(st.booleans()):
        kw.update(sliding_window=draw(st.integers(0, 8192)), local_per_global=draw(st.integers(0, 6)))
    return ModelSpec(**kw)


@st.composite
def remats(draw) -> Remat:
    if draw(st.booleans()):
        return REMAT_POLICIES[draw(st.sampled_from(sorted(REMAT_POLICIES)))]
    return Remat(**{t: draw(st.sampled_from(CHOICES)) for t in TENSORS})


DEGREE = st.sampled_from([1, 1, 1, 2, 3, 4, 8, 16, 64, 256, 5, 7])


@st.composite
def cases(draw):
    """(model, chip, job, plan, chips) with degrees whose product is the chip count (mostly)."""
    m = draw(models())
    chip_name = draw(st.sampled_from(PRESETS))
    chip = CHIPS[chip_name]
    degrees = {a: draw(DEGREE) for a in ("dp", "fsdp", "tp", "cp", "pp", "ep")}
    if not m.is_moe:
        degrees["ep"] = 1 if draw(st.integers(0, 9)) else degrees["ep"]
    while math.prod(degrees.values()) > MAX_CHIPS:
        biggest = max(degrees, key=degrees.get)
        degrees[biggest] = 1
    chips = math.prod(degrees.values())
    micro = draw(st.sampled_from([1, 1, 2, 3, 4, 16]))
    shards = degrees["dp"] * degrees["fsdp"] * degrees["ep"] * micro
    gb = shards * draw(st.integers(1, 64)) if draw(st.integers(0, 9)) else draw(st.integers(1, 1 << 20))
    seq = draw(st.one_of(st.sampled_from([128, 2048, 4096, 8192, 32768, 131072, 1 << 20]),
                         st.integers(128, 1 << 20)))
    slices = 1
    if chip.scale_up.kind == "torus" and draw(st.booleans()):
        slices = draw(st.sampled_from([d for d in _divisors(chips) if d <= 256] or [1]))
    vpp = draw(st.sampled_from([1, 1, 2, 4]))
    plan = Plan(**degrees, vpp=vpp, micro_batch=micro, zero=draw(st.integers(0, 3)),
                sequence_parallel=draw(st.booleans()), remat=draw(remats()),
                offload_optimizer=draw(st.booleans()), offload_params=draw(st.booleans()), slices=slices)
    job = Job(seq_len=seq, global_batch=gb, precision=draw(st.sampled_from(PRECISIONS)),
              framework=draw(st.sampled_from(FRAMEWORKS)))
    if draw(st.integers(0, 19)) == 0:
        chips = chips + 1  # occasionally a mismatching chip count
    return m, chip, job, plan, chips


# ---- the property --------------------------------------------------------------------------------------

def finite_nonneg(x: float) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x >= 0


def check_cost(c, job: Job, plan: Plan) -> None:
    assert math.isfinite(c.step_time_s) and c.step_time_s > 0
    for k, v in c.time.items():
        assert finite_nonneg(v), (k, v)
    for k, v in c.memory.items():
        assert finite_nonneg(v), (k, v)
    assert math.isclose(c.step_time_s, sum(c.time.values()), rel_tol=1e-9)
    assert math.isclose(c.peak_memory_bytes, sum(c.memory.values()), rel_tol=1e-9, abs_tol=1e-6)
    assert c.peak_memory_bytes > 0
    assert 0 < c.mfu <= c.hfu * (1 + 1e-12), (c.mfu, c.hfu)
    assert c.mfu <= 1, c.mfu
    for x in (c.tokens_per_s, c.tflops_per_chip, c.model_flops_per_step, c.hardware_flops_per_step):
        assert math.isfinite(x) and x > 0
    assert c.hardware_flops_per_step >= c.model_flops_per_step * (1 - 1e-12)
    assert math.isclose(c.tokens_per_s, job.tokens / c.step_time_s, rel_tol=1e-9)
    assert finite_nonneg(c.host_memory_bytes) and finite_nonneg(c.hbm_usable_bytes)
    assert finite_nonneg(c.overflow_bytes)
    assert 0 < c.fit_memory_bytes <= c.peak_memory_bytes * (1 + 1e-12)  # the fit floor never exceeds the total
    assert (c.fit_memory_bytes == c.peak_memory_bytes) or job.framework == "maxtext"
    assert (c.overflow_bytes > 0) == (c.fit_memory_bytes > c.hbm_usable_bytes)
    assert c.fits == (c.overflow_bytes == 0 and c.host_fits)
    assert c.grad_accum >= 1
    assert c.grad_accum * plan.batch_shards * plan.micro_batch == job.global_batch
    by_axis: dict[str, list[float]] = {}
    for coll in c.collectives:
        assert finite_nonneg(coll.bytes_each) and finite_nonneg(coll.time_s) and finite_nonneg(coll.exposed_s)
        t = by_axis.setdefault(coll.axis, [0.0, 0.0])
        t[0] += coll.time_s
        t[1] += coll.exposed_s
    # Per axis (not per row: the fsdp reduce-scatter row books the backward all-gather's exposure too),
    # what is exposed never exceeds the collective time.
    for axis, (total, exposed) in by_axis.items():
        assert exposed <= total * (1 + 1e-9) + 1e-15, (axis, total, exposed)
    json.dumps(c.to_dict(), allow_nan=False)


@budget(60)
@given(cases())
def test_estimate_returns_sane_cost_or_input_error(case):
    m, chip, job, plan, chips = case
    try:
        c = estimate(m, chip, job, plan, chips)
    except InputError as e:
        assert str(e) and "\n" not in str(e)
        return
    check_cost(c, job, plan)


@st.composite
def valid_cases(draw):
    """Cases biased towards plans that pass check_plan, so the Cost checks run often: GPU presets, tp/pp/cp
    chosen to divide the model, batch a multiple of the shards."""
    m = draw(models())
    chip = CHIPS[draw(st.sampled_from(PRESETS))]
    tp = draw(st.sampled_from([d for d in _divisors(m.n_heads) if d <= 64 and (m.n_kv_heads % d == 0
                                                                              or d % m.n_kv_heads == 0)]))
    pp = draw(st.sampled_from([d for d in _divisors(m.n_layers) if d <= 64]))
    vpp = draw(st.sampled_from([d for d in _divisors(m.n_layers // pp) if d <= 8])) if pp > 1 else 1
    seq = draw(st.sampled_from([128, 1000, 4096, 8192, 65536, 1 << 20]))
    cp = draw(st.sampled_from([d for d in _divisors(seq) if d <= 32]))
    ep = draw(st.sampled_from([d for d in _divisors(m.n_experts) if d <= 64])) if m.is_moe else 1
    dp = draw(st.sampled_from([1, 2, 3, 16, 128]))
    fsdp = draw(st.sampled_from([1, 2, 8, 64, 512]))
    degrees = dict(dp=dp, fsdp=fsdp, tp=tp, cp=cp, pp=pp, ep=ep)
    chips = math.prod(degrees.values())
    if chip.scale_up.kind == "torus":
        # Fit one slice (4x4x4-cube multiples) or span slices over the data axis.
        degrees.update(dp=1, fsdp=draw(st.sampled_from([1, 4, 64])), tp=1 if tp not in (1, 2, 4) else tp, cp=1, pp=1,
                       ep=1 if ep not in (1, 2, 4) else ep)
        slices = draw(st.sampled_from([1, 2, 3]))
        degrees["dp"] = slices
        chips = math.prod(degrees.values())
    else:
        slices = 1
        if chips > min(chip.max_chips, MAX_CHIPS):
            degrees.update(dp=1, fsdp=1)
            chips = math.prod(degrees.values())
    micro = draw(st.sampled_from([1, 2, 4]))
    gb = degrees["dp"] * degrees["fsdp"] * degrees["ep"] * micro * draw(st.integers(1, 16))
    plan = Plan(**degrees, vpp=vpp if degrees["pp"] > 1 else 1, micro_batch=micro, zero=draw(st.integers(0, 3)),
                sequence_parallel=draw(st.booleans()), remat=draw(remats()),
                offload_optimizer=draw(st.booleans()), offload_params=draw(st.booleans()), slices=slices)
    job = Job(seq_len=seq, global_batch=gb, precision=draw(st.sampled_from(PRECISIONS)),
              framework=draw(st.sampled_from(FRAMEWORKS)))
    return m, chip, job, plan, chips


@budget(60)
@given(valid_cases())
def test_estimate_on_mostly_valid_plans(case):
    m, chip, job, plan, chips = case
    try:
        c = estimate(m, chip, job, plan, chips)
    except InputError as e:
        assert str(e) and "\n" not in str(e)
        return
    check_cost(c, job, plan)


@budget(40)
@given(st.dictionaries(st.sampled_from(["n_layers", "d_model", "n_heads", "ffn_dim", "vocab_size", "n_kv_heads",
                                        "head_dim", "n_experts", "experts_per_token", "moe_ffn_dim",
                                        "n_dense_layers", "n_shared_experts", "q_lora_rank", "kv_lora_rank",
                                        "qk_rope_head_dim", "v_head_dim", "sliding_window", "local_per_global"]),
                       st.integers(-3, 300), min_size=0, max_size=18))
def test_random_model_fields_are_valid_or_input_error(fields):
    """Any integer combination of ModelSpec fields is either accepted, with a costable model, or an InputError."""
    kw = dict(n_layers=2, d_model=64, n_heads=4, ffn_dim=128, vocab_size=100)
    kw.update(fields)
    try:
        m = ModelSpec("r", **kw)
    except InputError:
        return
    assert m.total_params() > 0 and m.active_params() > 0
    assert m.active_params() <= m.total_params()
    c = estimate(m, CHIPS["h100-sxm"], Job(seq_len=128, global_batch=1), Plan())
    check_cost(c, Job(seq_len=128, global_batch=1), Plan())


# ---- the CLI on random inputs ------------------------------------------------------------------------------

def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from cli.main import main; main()", *args],
                          capture_output=True, text=True, timeout=120)


CLI_MODELS = ["llama3-8b", "mixtral-8x7b", "deepseek-v2-236b", "gpt3-175b", "70B", "1T", "0.5B", "lama3-8b"]


@budget(6)
@given(model=st.sampled_from(CLI_MODELS), hw=st.sampled_from(PRESETS + ["h100"]),
       chips=st.sampled_from([1, 8, 64, 256, 1024, 200_000, 0]),
       axis=st.sampled_from(["dp", "fsdp", "tp", "cp", "pp", "ep"]),
       seq=st.sampled_from([128, 4096, 1 << 20, 100]), gb=st.sampled_from([1, 64, 1024, 0]),
       remat=st.sampled_from(["none", "selective", "full", "minimal_offloaded", "custom:mlp_in=offload", "bogus"]),
       extra=st.sampled_from([[], ["--offload", "optimizer"], ["--precision", "fp8"], ["--framework", "megatron"],
                              ["--slices", "2"], ["--micro-batch", "2"], ["--zero", "5"]]))
def test_cli_estimate_random_inputs(model, hw, chips, axis, seq, gb, remat, extra):
    r = run_cli("estimate", "--model", model, "--hardware", hw, "--chips", str(chips), f"--{axis}", str(chips),
                "--seq-len", str(seq), "--global-batch", str(gb), "--remat", remat, *extra, "--json")
    assert "Traceback" not in r.stderr, r.stderr
    if r.returncode == 0:
        out = json.loads(r.stdout)
        assert out["step_time_s"] > 0 and 0 < out["mfu"] <= out["hfu"]
        assert r.stderr == ""
    else:
        assert r.returncode == 2, (r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
