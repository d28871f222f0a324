"""Sharded step == one-device step: loss and gradients of the same parameters and batch, fp32.

Run as `python -m planner.validate.equality [--devices 8]`: prints one JSON line per plan with the loss difference
and the largest gradient error relative to that tensor's largest magnitude (run in a fresh process: XLA_FLAGS
must ask for the host devices before jax starts).
"""

from __future__ import annotations

import json
import sys

from costmodel.plan import Plan, remat_policy

PLANS = [  # together they cover every mesh axis the validator supports, SP, and the three remat kinds
    ("cp2-tp2-fsdp2-sp-selective", "llama3-8b", Plan(cp=2, tp=2, fsdp=2, remat=remat_policy("selective"))),
    ("moe-ep2-tp2-dp2-full", "mixtral-8x7b", Plan(ep=2, tp=2, dp=2, zero=1, remat=remat_policy("full"))),
    ("dp2-fsdp4-none-zero3", "llama3-8b", Plan(dp=2, fsdp=4, zero=3, remat=remat_policy("none"))),
    ("pp2-full", "llama3-8b", Plan(pp=2, remat=remat_policy("full"))),
    ("pp2-dp2-fsdp2-selective", "llama3-8b", Plan(pp=2, dp=2, fsdp=2, remat=remat_policy("selective"))),
    # the pipeline ticks as one lax.scan (the step whose memory the validator reports for pp plans)
    ("pp2-dp2-full-scanned", "llama3-8b", Plan(pp=2, dp=2, remat=remat_policy("full"))),
    # MaxText's circular pipeline: the micro-batches go round the ring of stages vpp times
    ("pp4-vpp2-dp2-selective", "llama3-8b", Plan(pp=4, vpp=2, dp=2, remat=remat_policy("selective"))),
    ("pp2-vpp2-dp2-full-scanned", "llama3-8b", Plan(pp=2, vpp=2, dp=2, remat=remat_policy("full"))),
    # MaxText's dropless MoE (ragged all-to-all over ep, grouped matmuls), as the TPU compile runs it
    ("moe-ep2-tp2-dp2-full-dropless", "mixtral-8x7b", Plan(ep=2, tp=2, dp=2, zero=1, remat=remat_policy("full"))),
    ("moe-ep4-fsdp2-none-dropless", "mixtral-8x7b", Plan(ep=4, fsdp=2, remat=remat_policy("none"))),
    # DeepSeek's layout: a leading dense layer, then a MoE layer with a shared expert beside the routed ones
    ("moe-shared-dense-ep2-tp2-fsdp2-selective", "deepseek-v3-671b",
     Plan(ep=2, tp=2, fsdp=2, remat=remat_policy("selective"))),
    # sliding-window attention, one local and one global layer (a window of a quarter of the sequence), with cp
    ("swa-cp2-tp2-fsdp2-none", "llama3-8b+swa", Plan(cp=2, tp=2, fsdp=2, remat=remat_policy("none"))),
    # the TPU compile's step (planner.validate.model.build_scanned_step): DeepSeek-V2-Lite's layout (MLA without a query
    # latent, a dense layer, then two MoE layers with shared experts), one lax.scan per run of alike layers, dropless
    ("layer-scan-moe-shared-dense-ep2-tp2-fsdp2-full-dropless", "deepseek-v2-lite-16b",
     Plan(ep=2, fsdp=2, tp=2, remat=remat_policy("full"))),
    # the same scanned step over a local/global attention pattern: one block per period (a local and a global
    # layer), five layers: two blocks scanned, then a last local layer of its own
    ("layer-scan-swa-cp2-tp2-fsdp2-full", "llama3-8b+swa", Plan(cp=2, tp=2, fsdp=2, remat=remat_policy("full"))),
    # the scanned ticks with each stage's weights gathered for the whole loop (MaxText's layout, the TPU memory
    # compile's): ep gathered around experts that stay split over it; fsdp
    ("moe-pp2-ep4-full-gathered", "mixtral-8x7b", Plan(pp=2, ep=4, remat=remat_policy("full"))),
    ("pp2-fsdp4-full-gathered", "llama3-8b", Plan(pp=2, fsdp=4, remat=remat_policy("full"))),
]
LAYERS = {"moe-shared-dense-ep2-tp2-fsdp2-selective": 2, "swa-cp2-tp2-fsdp2-none": 2,  # more than one layer
          "layer-scan-moe-shared-dense-ep2-tp2-fsdp2-full-dropless": 3, "layer-scan-swa-cp2-tp2-fsdp2-full": 5}


def scanned_grads(cfg, mesh, params: dict, tokens, targets) -> tuple[float, dict]:
    """Loss and gradients of the TPU compile's step (planner.validate.model.build_scanned_step: stacks per run of
    alike blocks of layers) for the unrolled step's parameters, read back as the unrolled layer list."""
    import jax
    import numpy as np

    from planner.validate.model import build_scanned_step, layer_stacks

    step = build_scanned_step(cfg, mesh, donate=False)
    stacks = layer_stacks(cfg.model)
    host = jax.tree.map(np.asarray, params)
    stacked = dict(host, layers=[jax.tree.map(lambda *a: np.stack(a), *[host["layers"][i] for i in idx])
                                 for idx in stacks])
    loss, g = step.grad_fn(stacked, tokens, targets)
    g = jax.tree.map(np.asarray, g)
    layers: list = [None] * len(host["layers"])
    for stack, idx in zip(g["layers"], stacks, strict=True):
        for b, i in enumerate(idx):
            layers[i] = {k: v[b] for k, v in stack.items()}
    g["layers"] = layers
    return float(loss), g


def compare(model_name: str, plan: Plan, d_model: int = 64, seq_len: int = 64, layers: int = 1,
            scan_pipeline: bool = False, dropless: bool = False, layer_scan: bool = False,
            gather_stage: bool = False) -> dict:
    from dataclasses import replace

    import jax
    import numpy as np

    from costmodel.catalog import load_model
    from planner.validate.model import Setup, build_step, make_mesh, single_device_plan
    from planner.validate.scale import Scale, scale_down

    layers *= plan.pp * plan.vpp  # pipeline plans: `layers` per stage and repeat
    m = load_model(model_name.removesuffix("+swa"))
    if model_name.endswith("+swa"):  # a preset with a 1:1 local/global sliding window
        m = replace(m, sliding_window=4096, local_per_global=1)
    small, job, _ = scale_down(m, plan, Scale(d_model=d_model, seq_len=seq_len, n_layers=layers))
    if dropless:
        small = replace(small, capacity_factor=0.0)
    runs = [(small, plan, dropless), (small, single_device_plan(plan), dropless)]
    if dropless:  # and the capacity-routed step with room for every token (capacity factor experts / top_k)
        no_drop = replace(small, capacity_factor=small.n_experts / small.experts_per_token)
        runs.append((no_drop, single_device_plan(plan), False))
    out = []
    for m, pl, dl in runs:
        cfg = Setup(m, pl, job.seq_len, job.global_batch, "float32", scan_pipeline=scan_pipeline or gather_stage,
                    dropless=dl, gather_stage=gather_stage and pl is plan)
        step = build_step(cfg, make_mesh(pl), donate=False)
        params, _, tokens, targets = step.inputs(seed=1)
        if layer_scan and pl is plan:  # the sharded run: the TPU compile's scanned step
            out.append(scanned_grads(cfg, step.mesh, params, tokens, targets))
            continue
        loss, grads = step.grad_fn(params, tokens, targets)
        if hasattr(step, "unstack"):  # pipeline plans stack the layers per stage: back to the flat layer list
            grads = step.unstack(grads)
        out.append((float(loss), jax.tree.map(np.asarray, grads)))

    def rel_err(g, ref):
        return max(jax.tree.leaves(jax.tree.map(
            lambda a, b: float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30)), g, ref)))

    (l1, g1), (l0, g0) = out[:2]
    row = {"loss_sharded": l1, "loss_single": l0, "loss_diff": abs(l1 - l0), "max_grad_rel_err": rel_err(g1, g0)}
    if dropless:
        row.update(capacity_loss_diff=abs(out[2][0] - l0), capacity_grad_rel_err=rel_err(out[2][1], g0))
    return row


def main(argv: list[str]) -> None:
    from planner.validate import set_host_devices

    devices = int(argv[argv.index("--devices") + 1]) if "--devices" in argv else 8
    set_host_devices(devices)
    import os

    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
    only = argv[argv.index("--only") + 1].split(",") if "--only" in argv else None
    for name, model, plan in PLANS:
        if only and name not in only:
            continue
        print(json.dumps({"plan": name, **compare(model, plan, layers=LAYERS.get(name, 1),
                                                        scan_pipeline=name.endswith("-scanned"),
                                                        dropless=name.endswith("-dropless"),
                                                        gather_stage=name.endswith("-gathered"),
                                                        layer_scan=name.startswith("layer-scan"))}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
