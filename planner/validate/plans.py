"""Named plan sets for `planner validate --set` and benchmarks/validate_cpu.py (8 CPU devices)."""

from __future__ import annotations

from costmodel.plan import Plan, remat_policy

R = remat_policy


def _p(**kw) -> Plan:
    remat = kw.pop("remat", "full")
    return Plan(remat=R(remat), **kw)


# (name, model preset, plan). Dense plans use llama3-8b's shape family (GQA, SwiGLU); MoE plans mixtral-8x7b's and
# deepseek-v3's.
PLAN_SETS: dict[str, list[tuple[str, str, Plan]]] = {
    "quick": [
        ("fsdp4-dp2-full", "llama3-8b", _p(dp=2, fsdp=4)),
        ("tp4-sp-dp2-selective", "llama3-8b", _p(dp=2, tp=4, remat="selective")),
        ("cp2-fsdp4-none", "llama3-8b", _p(fsdp=4, cp=2, remat="none")),
    ],
    "cpu8": [
        ("dp8-full", "llama3-8b", _p(dp=8)),
        ("fsdp8-none", "llama3-8b", _p(fsdp=8, remat="none")),
        ("fsdp8-full", "llama3-8b", _p(fsdp=8)),
        ("fsdp4-dp2-selective", "llama3-8b", _p(dp=2, fsdp=4, remat="selective")),
        ("tp4-nosp-dp2-full", "llama3-8b", _p(dp=2, tp=4, sequence_parallel=False)),
        ("tp4-sp-fsdp2-selective", "llama3-8b", _p(fsdp=2, tp=4, remat="selective")),
        ("cp4-dp2-full", "llama3-8b", _p(dp=2, cp=4)),
        ("cp2-fsdp4-none", "llama3-8b", _p(fsdp=4, cp=2, remat="none")),
        ("moe-ep4-dp2-full", "mixtral-8x7b", _p(dp=2, ep=4)),
        ("moe-ep2-fsdp2-tp2-none", "mixtral-8x7b", _p(fsdp=2, ep=2, tp=2, remat="none")),
        # DeepSeek's layout (a leading dense layer, a shared expert beside the routed ones; GQA for MLA)
        ("deepseek-ep4-dp2-selective", "deepseek-v3-671b", _p(dp=2, ep=4, remat="selective")),
        ("pp2-dp4-full", "llama3-8b", _p(pp=2, dp=4)),
        ("pp2-tp2-dp2-selective", "llama3-8b", _p(pp=2, tp=2, dp=2, remat="selective")),
        ("pp2-fsdp2-dp2-full", "llama3-8b", _p(pp=2, fsdp=2, dp=2)),
    ],
    # One device (a single GPU): remat and micro-batch vary the compute, memory-traffic and overhead shares.
    "single": [
        ("dense-full-mb1", "llama3-8b", _p()),
        ("dense-selective-mb1", "llama3-8b", _p(remat="selective")),
        ("dense-none-mb1", "llama3-8b", _p(remat="none")),
        ("dense-full-mb4", "llama3-8b", _p(micro_batch=4)),
        ("dense-none-mb2", "llama3-8b", _p(micro_batch=2, remat="none")),
        ("moe-full-mb2", "mixtral-8x7b", _p(micro_batch=2)),
    ],
}
