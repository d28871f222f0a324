"""XLA:TPU ahead-of-time compile of the validator's step (planner.validate.tpu); skipped without libtpu.

Run it where libtpu is installed, e.g. `PYTHONPATH=. /work/maxtext-env/bin/python -m pytest tests/test_validate_tpu.py`.
The parsing and the bad-input paths are tested everywhere.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest

from costmodel.model import ModelSpec
from costmodel.plan import Plan, parse_remat
from hardware.errors import InputError
from planner.validate.tpu import TOLERANCE_PCT, check_tpu_plan, parse_target

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None and importlib.util.find_spec("jax") is not None

SMALL = ModelSpec(name="small-llama", n_layers=8, d_model=1024, n_heads=8, n_kv_heads=8, head_dim=128, ffn_dim=4096,
                  vocab_size=32000, gated_mlp=True, tied_embeddings=False)


def test_parse_target():
    t = parse_target("tpu-v5p:2x2x2")
    assert (t.generation, t.dims, t.chips, t.hardware) == ("v5p", (2, 2, 2), 8, "tpu-v5p")
    assert parse_target("v6e:2x4").chips == 8
    for bad in ("tpu-v5p:2x2", "tpu-v7:2x2", "v6e:2x2x2", "gpu"):
        with pytest.raises(InputError):
            parse_target(bad)


def test_fit_check_is_one_sided():
    """The fit floor against XLA's peak: above it is safe (ok), more than 1 % below it is not (a plan said to fit
    that XLA refuses), no peak reported is no verdict (runs without libtpu)."""
    from planner.validate.tpu import fit_check

    assert fit_check("p", 30e9, 20e9).ok and fit_check("p", 30e9, 20e9).error_pct == pytest.approx(50.0)
    assert fit_check("p", 29.8e9, 30e9).ok and not fit_check("p", 29.6e9, 30e9).ok
    none = fit_check("p", 30e9, None)
    assert none.error_pct is None and not none.ok and none.quantity == "fit_memory_bytes"


def test_bad_plan_for_target():
    with pytest.raises(InputError, match="has 8 chips"):
        check_tpu_plan(SMALL, Plan(fsdp=4), 1024, parse_target("tpu-v5p:2x2x2"))
    with pytest.raises(InputError, match="not divisible by cp"):
        check_tpu_plan(SMALL, Plan(fsdp=2, cp=2), 1023, parse_target("tpu-v5p:2x2x1"))
    moe = replace(SMALL, n_experts=8, experts_per_token=2, moe_ffn_dim=4096)
    check_tpu_plan(moe, Plan(fsdp=2, ep=4), 1024, parse_target("tpu-v5p:2x2x2"))  # MoE layers all alike: runs
    # DeepSeek's layout (MLA, a leading dense layer, shared experts): one stack per run of alike layers
    ds = replace(moe, n_shared_experts=1, n_dense_layers=1, head_dim=96, kv_lora_rank=256, qk_rope_head_dim=32,
                 v_head_dim=64)
    check_tpu_plan(ds, Plan(fsdp=2, ep=4), 1024, parse_target("tpu-v5p:2x2x2"))
    # sliding windows: scanned one period of the local/global pattern at a time; pipeline stages run alike layers
    gemma_like = replace(SMALL, sliding_window=256, local_per_global=3)
    check_tpu_plan(gemma_like, Plan(fsdp=8), 1024, parse_target("tpu-v5p:2x2x2"))
    check_tpu_plan(replace(SMALL, sliding_window=256), Plan(pp=2, fsdp=4), 1024, parse_target("tpu-v5p:2x2x2"))
    with pytest.raises(InputError, match="local/global attention pattern is not supported there"):
        check_tpu_plan(gemma_like, Plan(pp=2, fsdp=4), 1024, parse_target("tpu-v5p:2x2x2"))
    # pipeline stages compile for dense models whose layers split evenly over the stages
    check_tpu_plan(SMALL, Plan(pp=2, fsdp=4), 1024, parse_target("tpu-v5p:2x2x2"))
    with pytest.raises(InputError, match=r"small-llama's 8 layers do not split evenly over pp=16 chunks; use a pp "
                                         r"that divides 8"):
        check_tpu_plan(SMALL, Plan(pp=16), 1024, parse_target("tpu-v5p:2x4x2"))
    # MoE stages (routed by capacity there), but not DeepSeek's dense layers before the MoE ones
    check_tpu_plan(moe, Plan(pp=2, ep=4), 1024, parse_target("tpu-v5p:2x2x2"))
    with pytest.raises(InputError, match="small-ds's leading dense layers before its MoE layers are not supported"):
        check_tpu_plan(replace(ds, name="small-ds"), Plan(pp=2, ep=4), 1024, parse_target("tpu-v5p:2x2x2"))
    with pytest.raises(InputError, match="one weight-splitting axis"):
        check_tpu_plan(SMALL, Plan(pp=2, fsdp=2, tp=2), 1024, parse_target("tpu-v5p:2x2x2"))


def compiled_checks(name: str, m: ModelSpec, plan: Plan, target: str) -> dict:
    """Compile `plan` for `target` (seq 1024) and return its checks by quantity, having asserted that it compiled
    and that model state and FLOPs are within tolerance (every plan the TPU compile runs gets those right)."""
    from planner.validate.tpu import validate_tpu

    r = validate_tpu(name, m, plan, 1024, target)
    assert not r.error, r.error
    checks = {c.quantity: c for c in r.checks}
    for q in ("state_bytes", "flops"):
        assert abs(checks[q].error_pct) <= TOLERANCE_PCT[q], checks[q]
    return checks


@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu not installed (pip install 'jax[tpu]')")
def test_small_plan_on_v5p_matches_compiler():
    checks = compiled_checks("small", SMALL, Plan(fsdp=4, remat=parse_remat("full")), "tpu-v5p:2x2x1")
    mem = checks["memory_bytes"]
    assert mem.xla > 0 and abs(mem.error_pct) <= MEMORY_TOLERANCE_PCT, mem
    fit = checks["fit_memory_bytes"]  # the fit floor is not below XLA's own peak: the fit check errs safe
    assert fit.ok and fit.xla <= mem.xla and fit.predicted <= mem.predicted, fit


@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu not installed (pip install 'jax[tpu]')")
def test_small_dropless_moe_on_v5p_compiles():
    """MaxText's dropless MoE (megablox grouped matmuls, ragged all-to-all over ep) compiles for the TPU; FLOPs and
    state as the cost model counts them."""
    moe = replace(SMALL, name="small-moe", n_experts=8, experts_per_token=2, moe_ffn_dim=2048)
    checks = compiled_checks("small-moe", moe, Plan(fsdp=2, ep=4, remat=parse_remat("full")), "tpu-v5p:2x2x2")
    a2a = checks["collective_bytes:all-to-all"]  # the ragged all-to-alls: the balanced rows, as predicted
    assert a2a.xla > 0 and abs(a2a.error_pct) <= TOLERANCE_PCT["collective_bytes"], a2a


@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu not installed (pip install 'jax[tpu]')")
def test_small_deepseek_layout_on_v5p_compiles():
    """DeepSeek's layout (MLA without a query latent, a dense first layer, routed experts beside a shared one),
    each run of alike layers scanned as a stack of its own: FLOPs (the megablox excess of the routed experts only)
    and state as the cost model counts them."""
    ds = replace(SMALL, name="small-deepseek", n_layers=5, n_experts=8, experts_per_token=2, moe_ffn_dim=1024,
                 n_shared_experts=1, n_dense_layers=1, head_dim=192, kv_lora_rank=256, qk_rope_head_dim=64,
                 v_head_dim=128)
    compiled_checks("small-deepseek", ds, Plan(fsdp=2, ep=4, remat=parse_remat("full")), "tpu-v5p:2x2x2")


@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu not installed (pip install 'jax[tpu]')")
def test_small_local_global_pattern_on_v5p_compiles():
    """A local/global attention pattern (three sliding-window layers, then a global one) scanned one period at a
    time: FLOPs (the flash attention skipping the blocks outside each window) and state as the cost model counts
    them."""
    swa = replace(SMALL, name="small-swa", sliding_window=256, local_per_global=3)
    compiled_checks("small-swa", swa, Plan(fsdp=8, remat=parse_remat("full")), "tpu-v5p:2x2x2")


@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu not installed (pip install 'jax[tpu]')")
def test_small_pipeline_on_v5p_compiles():
    """GPipe stages (shard_map over pp, ppermute) compile for the TPU; FLOPs (with the bubble ticks), state and the
    stage-to-stage shifts as the cost model counts them."""
    checks = compiled_checks("small-pp", SMALL, Plan(pp=2, fsdp=2, remat=parse_remat("full")), "tpu-v5p:2x2x1")
    shift = checks["collective_bytes:collective-permute"]
    assert abs(shift.error_pct) <= TOLERANCE_PCT["collective_bytes"], shift
    _assert_stage_memory(checks)


def _assert_stage_memory(checks: dict) -> None:
    """A pp plan's memory compile holds each stage gathered, as MaxText's pipeline does (planner.validate.pipeline
    .gathered_stage), so the cost model's MaxText stage buffers apply: within MEMORY_TOLERANCE_PCT (below), and the
    fit floor not under XLA's own peak (the fit check errs safe)."""
    mem, fit = checks["memory_bytes"], checks["fit_memory_bytes"]
    assert abs(mem.error_pct) <= MEMORY_TOLERANCE_PCT, mem
    assert fit.ok and fit.xla <= mem.xla, fit


@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu not installed (pip install 'jax[tpu]')")
def test_small_moe_pipeline_on_v5p_compiles():
    """MoE layers in GPipe stages (routed by capacity inside the stage's manual region): FLOPs, state and the stage
    shifts as the cost model counts them."""
    moe = replace(SMALL, name="small-moe", n_layers=4, n_experts=8, experts_per_token=2, moe_ffn_dim=2048)
    checks = compiled_checks("small-pp-moe", moe, Plan(pp=2, ep=2, remat=parse_remat("full")), "tpu-v5p:2x2x1")
    shift = checks["collective_bytes:collective-permute"]
    assert abs(shift.error_pct) <= TOLERANCE_PCT["collective_bytes"], shift
    _assert_stage_memory(checks)  # (predicted for the capacity routing compiled there: tpu.as_compiled)


# The target (5%) is for full-width plans: benchmarks/validate_tpu_report.txt, with the gaps that remain and
# why. This 1 GB-per-chip model is at +10.8%: the cost model's layer-count-independent terms (one layer's working
# set and gathered weights, the second checkpoint stack of MaxText's scanned loop) weigh more next to its small state.
MEMORY_TOLERANCE_PCT = 15.0


@pytest.mark.parametrize("rows", [1, 2])
def test_flash_attention_matches_dense(rows):
    """The flash-style attention the TPU compile uses: same output and gradients as dense causal attention."""
    import math

    import jax
    import jax.numpy as jnp
    import numpy as np

    from planner.validate.flash import causal_attention

    b, s, kv, g, d = 2, 64, 2, 3, 8
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, rows, s // rows, kv, g, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, s, kv, d)), jnp.float32) for _ in range(2))
    w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def dense(q, k, v):
        sc = jnp.einsum("bskgd,btkd->bkgst", q.reshape(b, s, kv, g, d), k) / math.sqrt(d)
        p = jax.nn.softmax(jnp.where(jnp.arange(s)[None, :] <= jnp.arange(s)[:, None], sc, -1e30), -1)
        return jnp.einsum("bkgst,btkd->bskgd", p, v).reshape(q.shape)

    f1 = jax.value_and_grad(lambda *a: jnp.sum(causal_attention(*a, 8) * w), argnums=(0, 1, 2))
    f2 = jax.value_and_grad(lambda *a: jnp.sum(dense(*a) * w), argnums=(0, 1, 2))
    (l1, g1), (l2, g2) = f1(q, k, v), f2(q, k, v)
    np.testing.assert_allclose(l1, l2, rtol=1e-5, atol=1e-4)
    for a, c in zip(g1, g2, strict=True):
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-5)
