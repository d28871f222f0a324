"""Rendering a Cost as rich tables or JSON. No logic beyond formatting.

Text read from files (names, descriptions, sources, level names) goes through `shown` before rich sees it: rich
reads `[...]` in a table cell or title as markup and passes ESC through to the terminal (issue 31)."""

from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from costmodel.cost import NEAR_LIMIT, Cost
from costmodel.plan import MEGATRON_SWITCHES, Plan
from hardware.errors import escape as escape_controls

GIB = 2**30


def shown(text: str) -> str:
    """`text` from a file for a rich table or markup string: line breaks, ESC and other control characters
    written as escapes (hardware.errors.escape) and markup such as [red] or [link=...] escaped
    (rich.markup.escape), so it prints as written and changes nothing on the terminal."""
    return escape(escape_controls(text))


def plan_summary(plan: Plan) -> str:
    d = plan.degrees()
    deg = " ".join(f"{a}={v}" for a, v in d.items() if v > 1) or "single chip"
    extra = [f"mb={plan.micro_batch}", f"remat={plan.remat.summary()}"]
    if plan.vpp > 1:
        extra.append(f"vpp={plan.vpp}")
    if plan.zero:
        extra.append(f"zero={plan.zero}")
    if plan.offload_optimizer:
        extra.append("offload=optimizer")
    if plan.offload_params:
        extra.append("offload=params")
    if plan.slices > 1:
        extra.append(f"slices={plan.slices}")
    accounted = [n for n, on in zip(("embedding", "loss"), plan.split_accounting, strict=True) if on]
    if accounted:  # Megatron-Core's --account-for-...-in-pipeline-split
        extra.append(f"split-counts={'+'.join(accounted)}")
    if plan.overlap_moe_expert_parallel_comm:  # Megatron-Core's --overlap-moe-expert-parallel-comm
        extra.append("ep-a2a-overlap")
    if plan.recompute_num_layers:  # Megatron-Core's --recompute-method block --recompute-num-layers
        extra.append(f"recompute-layers={plan.recompute_num_layers}")
    if plan.cpu_offload_layers:  # Megatron-Core's --cpu-offloading-num-layers
        extra.append(f"cpu-offload-layers={plan.cpu_offload_layers}")
    if plan.fp8_param_gather:  # Megatron-Core's --fp8-param-gather
        extra.append("fp8-params")
    if plan.grad_reduce_in_bf16:  # Megatron-Core's --grad-reduce-in-bf16
        extra.append("bf16-grads")
    return deg + "  " + " ".join(extra)


def plan_dict(plan: Plan) -> dict:
    return {**plan.degrees(), "vpp": plan.vpp, "micro_batch": plan.micro_batch, "zero": plan.zero,
            "sequence_parallel": plan.sequence_parallel, "remat": plan.remat.name,
            "remat_tensors": plan.remat.choices(), "offload_optimizer": plan.offload_optimizer,
            "offload_params": plan.offload_params, "slices": plan.slices,
            # Megatron-Core's flags, when set
            **{f: True for f in MEGATRON_SWITCHES if getattr(plan, f)},
            **({"recompute_num_layers": plan.recompute_num_layers} if plan.recompute_num_layers else {}),
            **({"cpu_offload_layers": plan.cpu_offload_layers} if plan.cpu_offload_layers else {})}


def print_json(obj: dict) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


def stage_layers_text(split: tuple[int, ...]) -> str:
    """'8 each' for an even pipeline split, else 'first / middle / last' (Megatron's uneven split)."""
    first, mid, last = split
    return f"{mid} each" if first == mid == last else f"{first} / {mid} / {last} (first / middle / last)"


def interval_text(iv) -> str:
    """'2.91 .. 4.02 s (80 %)' for a costmodel.interval.Interval."""
    from costmodel.interval import LEVEL

    return f"{iv.low_s:.3f} .. {iv.high_s:.3f} s ({LEVEL * 100:.0f} % likely)"


def print_interval_notes(iv, console: Console) -> None:
    """The interval's basis and the plan's extrapolations, one line each."""
    console.print(f"range from {escape(iv.basis)}")
    for note in iv.extrapolations:
        console.print(f"  extrapolation: {escape(note)}")


def print_cost(cost: Cost, title: str, console: Console | None = None, interval=None) -> None:
    console = console or Console()
    head = Table(title=shown(title), show_header=False)
    head.add_column("metric", style="bold")
    head.add_column("value", justify="right")
    fit = "yes" if cost.fits else f"NO (over by {cost.overflow_bytes / GIB:.1f} GiB)"
    notes = []
    if cost.fits and cost.peak_memory_bytes > cost.hbm_usable_bytes:
        notes.append("by the least memory XLA needs")
    if cost.near_limit:
        notes.append(f"within {NEAR_LIMIT:.0%} of the HBM: compile first")
    if notes:
        fit = f"yes ({'; '.join(notes)})"
    rng = (("step time range", interval_text(interval)),) if interval is not None else ()
    for k, v in (("step time", f"{cost.step_time_s:.3f} s"), *rng, ("MFU", f"{cost.mfu * 100:.1f} %"),
                 ("HFU", f"{cost.hfu * 100:.1f} %"), ("tokens/s", f"{cost.tokens_per_s:,.0f}"),
                 ("TFLOP/s per chip", f"{cost.tflops_per_chip:.1f}"),
                 ("memory per chip", f"{cost.peak_memory_bytes / GIB:.2f} / {cost.hbm_usable_bytes / GIB:.1f} GiB"),
                 *((("least memory XLA needs", f"{cost.fit_memory_bytes / GIB:.2f} GiB (the fit check)"),)
                   if cost.fit_below_total else ()),
                 ("fits", fit), *((("layers per stage", stage_layers_text(cost.stage_layers)),)
                                  if cost.stage_layers else ()),
                 ("gradient accumulation", str(cost.grad_accum)),
                 ("state convention", cost.convention)):
        head.add_row(k, v)
    if cost.host_memory_bytes:
        head.add_row("host memory per chip", f"{cost.host_memory_bytes / GIB:.2f} GiB")
    console.print(head)
    if interval is not None:
        print_interval_notes(interval, console)
    t = Table(title="step time breakdown")
    t.add_column("part")
    t.add_column("seconds", justify="right")
    t.add_column("share", justify="right")
    for k, v in cost.time.items():
        if v > 0:
            t.add_row(k, f"{v:.3f}", f"{v / cost.step_time_s * 100:.1f} %")
    m = Table(title="memory per chip")
    m.add_column("part")
    m.add_column("GiB", justify="right")
    for k, v in cost.memory.items():
        if v > 0:
            m.add_row(k, f"{v / GIB:.2f}")
    console.print(t)
    console.print(m)
