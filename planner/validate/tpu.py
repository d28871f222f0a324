"""Compile the validator's training step for a real TPU topology on a CPU host, and hold the cost model against it.

With `libtpu` installed, `jax.experimental.topologies.get_topology_desc` describes a TPU slice whose devices
`jit(...).lower(...).compile()` accepts with no TPU attached (MaxText's `train_compile` uses the same mechanism):
XLA:TPU reports per chip its buffer assignment (`memory_analysis()`), FLOPs and the optimized HLO.

What is compiled: the validator's step at full width and the real sequence length, bf16 compute with fp32
parameters and Adam moments (the cost model's `maxtext` convention), donated state, flash-style attention. By
default (scan=True) the layers run under `jax.lax.scan` as MaxText does, so the full depth compiles and nothing is
extrapolated; XLA counts a while body once, so FLOPs = F1 + (L - 1) * (F2 - F1) from a second compile with two
layers per iteration, and collectives in the loop are weighted by its trip count. scan=False compiles the
unrolled step at two layer counts and extrapolates linearly.
(why scanned, and results: docs/validator.md)
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import time
from dataclasses import dataclass, field, replace

from costmodel.job import Job
from costmodel.model import ModelSpec
from costmodel.plan import Plan
from hardware.errors import InputError, excerpt
from planner.validate.compare import (
    Check,
    _check,
    error_pct,
    flash_flops_adjustment,
    grouped_matmul_flops_adjustment,
    pipeline_flops_adjustment,
    predicted_collectives,
)
from planner.validate.hlo import split_computations

# generation: (libtpu topology prefix, chip_config_name, hardware profile)
GENERATIONS = {
    "v5p": ("v5", "megacore", "tpu-v5p"),
    "v5e": ("v5e", "default", "tpu-v5e"),
    "v6e": ("v6e", "default", "tpu-v6e"),
}
TOLERANCE_PCT = {"memory_bytes": 5.0, "state_bytes": 1.0, "flops": 5.0, "collective_bytes": 10.0}
FIT_BELOW_PCT = 1.0  # how far the fit floor may sit below XLA's peak (above it, the fit check errs safe)
LIBTPU_HINT = ('the TPU compiler (libtpu) is not installed in this Python; install it with '
               '`pip install -U "jax[tpu]"` (jax, jaxlib and libtpu of one release; no TPU is needed)')


@dataclass(frozen=True)
class Target:
    generation: str  # v5p | v5e | v6e
    dims: tuple[int, ...]

    @property
    def chips(self) -> int:
        return math.prod(self.dims)

    @property
    def hardware(self) -> str:
        return GENERATIONS[self.generation][2]

    @property
    def name(self) -> str:
        return f"tpu-{self.generation}:{'x'.join(map(str, self.dims))}"


def parse_target(text: str) -> Target:
    """'tpu-v5p:2x2x2' (or 'v5p:2x2x2') -> Target. v5p topologies are 3-D, v5e and v6e 2-D (chips per side)."""
    m = re.fullmatch(r"(?:tpu-)?(v5p|v5e|v6e):(\d{1,4}(?:x\d{1,4})*)", text.strip())
    if not m:
        raise InputError(f"--target: expected tpu-GEN:TOPOLOGY with GEN one of {', '.join(GENERATIONS)} and at most "
                         f"4 digits a side (e.g. tpu-v5p:2x2x2, tpu-v6e:2x4), got {excerpt(text)}")
    gen, dims = m.group(1), tuple(int(x) for x in m.group(2).split("x"))
    want = 3 if gen == "v5p" else 2
    if len(dims) != want or min(dims) < 1:
        raise InputError(f"--target: a {gen} topology has {want} dimensions (e.g. "
                         f"{'2x2x2' if want == 3 else '2x4'}), got {m.group(2)!r}")
    return Target(gen, dims)


def have_libtpu() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def require_libtpu() -> None:
    if not have_libtpu():
        raise InputError(f"--target: {LIBTPU_HINT}")


def topology_devices(t: Target) -> list:
    """The devices of TPU topology `t` (ahead-of-time compilation only; nothing runs on them)."""
    require_libtpu()
    # Compiling needs no TPU; don't wait on (or fail at) the lock that guards a real TPU's device files.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # XLA:TPU may turn an FSDP matmul into a "windowed einsum" loop (a ring of collective-permutes of weight slices,
    # no gathered layer) nested in the layer loop, whose FLOPs its cost analysis counts once per loop body (seen on
    # llama3-8b, v6e 2x4, fsdp 8, seq 8192: FLOPs -40%). Off, so that the compile does what the cost model
    # assumes (whole-layer all-gathers and reduce-scatters) and every FLOP is counted. On that plan the windowed
    # version needed 3.0 GB less per chip (29.47 vs 32.49 GB): no whole gathered layer and no unreduced gradient
    # of one. Set LIBTPU_INIT_ARGS with any windowed_einsum flag to choose otherwise. Must precede libtpu's init.
    if "windowed_einsum" not in os.environ.get("LIBTPU_INIT_ARGS", ""):
        os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") +
                                          " --xla_tpu_enable_windowed_einsum_for_all_gather=false"
                                          " --xla_tpu_enable_windowed_einsum_for_reduce_scatter=false").strip()
    from jax.experimental.topologies import get_topology_desc

    prefix, chip_config, _ = GENERATIONS[t.generation]
    dims3 = (*t.dims, 1) if len(t.dims) == 2 else t.dims
    host = (2, 2, 1) if t.chips >= 4 else (*dims3[:2], 1)
    wrap = tuple(d >= (4 if t.generation == "v5p" else 16) for d in dims3)  # full torus rings (MaxText's table)
    desc = get_topology_desc(platform="tpu", topology_name=f"{prefix}:{'x'.join(map(str, t.dims))}",
                             chip_config_name=chip_config, chips_per_host_bounds=host, num_slices=1, wrap=wrap)
    return list(desc.devices)


def tpu_mesh(plan: Plan, devices: list):
    """The plan's mesh over the topology's devices, laid out by mesh_utils (ICI-aware) when it can."""
    import numpy as np
    from jax.experimental import mesh_utils
    from jax.sharding import Mesh

    from planner.validate.model import mesh_axes

    axes = mesh_axes(plan)
    sizes = [getattr(plan, a) for a in axes]
    try:
        arr = mesh_utils.create_device_mesh(sizes, devices)
    except Exception:  # an odd shape mesh_utils cannot place: row-major order
        arr = np.array(devices).reshape(sizes)
    return Mesh(arr, axes)


@dataclass
class Compiled:
    """What XLA:TPU reports for one compile (per chip)."""

    layers: int
    compile_s: float
    memory: dict[str, float]
    flops: float
    collectives: dict[str, float]  # bytes per HLO collective kind (a loop body counted per iteration)
    unroll: int = 0  # layers per scan iteration (0: unrolled layers)


@dataclass
class TpuResult:
    name: str
    target: Target
    plan: Plan
    model: ModelSpec | None = None
    job: Job | None = None
    compiles: list[Compiled] = field(default_factory=list)
    full: dict = field(default_factory=dict)  # extrapolated to the model's layer count
    per_layer: dict = field(default_factory=dict)  # slope per layer
    predicted: dict = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    error: str = ""

    @property
    def compile_s(self) -> float:
        return sum(c.compile_s for c in self.compiles)


def compile_step(m: ModelSpec, plan: Plan, job: Job, devices: list, block: int = 512, scan: bool = True,
                 unroll: int = 1, scan_ticks: bool = False) -> Compiled:
    """Compile the validator's step for `m` (all its layers) on the topology's devices; scan: layers under
    lax.scan (MaxText's layout, compile time independent of depth), else unrolled (planner.validate.model);
    scan_ticks: a pp plan's pipeline ticks as one lax.scan (planner.validate.pipeline)."""
    from planner.validate import hlo
    from planner.validate.model import Setup, build_scanned_step, build_step

    mesh = tpu_mesh(plan, devices)
    # MoE routes dropless as MaxText does (a shard_map over the whole mesh), but inside a pipeline stage, a region
    # already manual over pp and dp, by capacity (planner.validate.model.moe_mlp)
    # The memory compile of a GPipe plan holds each stage's weights gathered through the tick loop, as MaxText's
    # pipeline does (planner.validate.pipeline.gathered_stage); the unrolled FLOPs/collectives compiles gather
    # them layer by layer in every tick, as MaxText's collectives run
    cfg = Setup(m, plan, job.seq_len, job.global_batch, "bfloat16", flash_block=block, grad_clip=1.0,
                dropless=plan.pp == 1, scan_pipeline=scan_ticks, gather_stage=scan_ticks)
    step = build_scanned_step(cfg, mesh, unroll) if scan else build_step(cfg, mesh)
    fn, args = step.fn, step.abstract_inputs()
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    dt = time.perf_counter() - t0
    text = compiled.as_text()
    if os.environ.get("PLANNER_VALIDATE_DUMP"):  # debugging: keep the optimized HLO
        with open(os.path.join(os.environ["PLANNER_VALIDATE_DUMP"], f"tpu-{m.n_layers}l.hlo.txt"), "w") as f:
            f.write(text)
    coll: dict[str, float] = {}
    rs = _reduce_scatter_names(text)
    comps, mult = _call_multipliers(text)
    for name, lines in comps.items():
        for c in hlo.collectives("\n".join(lines), dict(mesh.shape)):
            kind = "reduce-scatter" if c.kind == "all-reduce" and _instr_name(c.line) in rs else c.kind
            # an all-reduce-scatter's input is its reduce-scatter bytes; a loop body counts once per iteration
            coll[kind] = coll.get(kind, 0.0) + c.bytes * mult.get(name, 0.0)
    return Compiled(m.n_layers, dt, hlo.memory(compiled), hlo.flops(compiled), coll, unroll)




def _call_multipliers(text: str) -> tuple[dict[str, list[str]], dict[str, float]]:
    """(computation -> its instruction lines, computation -> times it runs per step): a while body runs its
    known_trip_count times (a scanned layer loop: once per layer), fusions and calls inherit their caller's count."""
    comps, entry = split_computations(text)
    def trips(line: str) -> float:
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        if known:
            return float(known.group(1))
        # XLA:TPU drops the annotation: read `i < N` off the condition (the loop counter starts at 0)
        cond = re.search(r"condition=%([\w.-]+)", line)
        text = "\n".join(comps.get(cond.group(1), [])) if cond else ""
        n = re.findall(r"constant\((\d+)\)", text)
        return float(n[0]) if len(n) == 1 and "direction=LT" in text else 1.0

    calls: dict[str, list[tuple[str, float]]] = {}
    for name, lines in comps.items():
        for line in lines:
            for key, callee in re.findall(r"(calls|to_apply|body|condition|branch_computations)=\{?%([\w.-]+)", line):
                factor = trips(line) if key == "body" else 1.0
                calls.setdefault(name, []).append((callee, factor))
    mult: dict[str, float] = {}

    def visit(name: str, k: float, depth: int = 0) -> None:
        mult[name] = mult.get(name, 0.0) + k
        if depth < 50:
            for callee, f in calls.get(name, []):
                visit(callee, k * f, depth + 1)

    if entry:
        visit(entry, 1.0)
    return comps, mult


def _instr_name(line: str) -> str:
    m = re.match(r"(?:ROOT\s+)?%?([\w.-]+)\s*=", line)
    return m.group(1) if m else ""


def _reduce_scatter_names(text: str) -> set[str]:
    """Collectives inside XLA:TPU's `all-reduce-scatter` fusions: a reduce-scatter, printed as an all-reduce."""
    names, inside = set(), False
    for line in text.splitlines():
        if line and not line[0].isspace():
            inside = bool(re.match(r"%all-reduce-scatter[\w.-]*\s", line))
        elif inside and re.search(r"\sall-reduce(?:-start)?\(", line):
            names.add(_instr_name(line.strip()))
    return names


def _flat(c: Compiled) -> dict[str, float]:
    d = {f"mem:{k}": v for k, v in c.memory.items()}
    d["flops"] = c.flops
    d.update({f"coll:{k}": v for k, v in c.collectives.items()})
    return d


def _extrapolate(a: Compiled, b: Compiled, layers: int) -> tuple[dict, dict]:
    fa, fb = _flat(a), _flat(b)
    keys = sorted(set(fa) | set(fb))
    slope = {k: (fb.get(k, 0.0) - fa.get(k, 0.0)) / (b.layers - a.layers) for k in keys}
    full = {k: fa.get(k, 0.0) + (layers - a.layers) * slope[k] for k in keys}
    return full, slope


def tpu_check(name: str, quantity: str, pred: float, xla: float | None, note: str = "") -> Check:
    c = _check(name, quantity, pred, xla, note)
    tol = TOLERANCE_PCT.get(quantity.split(":")[0])
    if tol is not None and c.error_pct is not None:
        c.ok = abs(c.error_pct) <= tol
    return c


def fit_check(name: str, fit_bytes: float, xla_peak: float | None) -> Check:
    """The fit check's figure (Cost.fit_memory_bytes: costmodel.memory.fit_floor_bytes under MaxText) against XLA's
    peak_memory_in_bytes, the figure XLA:TPU's capacity check reads: one-sided, ok unless the floor is more than
    FIT_BELOW_PCT below it (a plan the planner says fits would then not compile)."""
    err = error_pct(fit_bytes, xla_peak) if xla_peak else None
    return Check(name, "fit_memory_bytes", float(fit_bytes), float(xla_peak) if xla_peak else None, err,
                 err is not None and err >= -FIT_BELOW_PCT,
                 "XLA:TPU peak_memory_in_bytes (what its capacity check reads); ok unless below it by more than "
                 f"{FIT_BELOW_PCT:g} %")


def validate_tpu(name: str, m_full: ModelSpec, plan: Plan, seq_len: int, target: Target | str,
                 layers: tuple[int, int] = (2, 4), block: int = 512, devices: list | None = None,
                 scan: bool = True) -> TpuResult:
    """Compile `plan` for `target` at full width with layers[0] and layers[1] layers, extrapolate to the model's
    depth, and put each figure next to the cost model's prediction. Errors land in `result.error`."""
    t = parse_target(target) if isinstance(target, str) else target
    res = TpuResult(name, t, plan)
    try:
        _validate(res, m_full, plan, seq_len, t, layers, block, devices, scan)
    except InputError:
        raise
    except Exception as e:  # a compile failure is reported per plan
        res.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return res


def check_tpu_plan(m: ModelSpec, plan: Plan, seq_len: int, t: Target) -> None:
    """Bad input, said before anything compiles."""
    from planner.validate.scale import unsupported

    if plan.chips != t.chips:
        d = " * ".join(f"{a}={v}" for a, v in plan.degrees().items() if v > 1) or "1"
        raise InputError(f"--target: {t.name} has {t.chips} chips but the plan uses {plan.chips} ({d}); "
                         f"make the degrees multiply to {t.chips}")
    why = unsupported(plan)
    if why:
        raise InputError(why)
    if plan.pp > 1:  # (pp micro-batches, tpu_job: the pipeline's micro-batch rules hold)
        if m.is_moe and m.n_dense_layers:
            raise InputError(f"--pp: the TPU compile's pipeline stages run alike layers; {m.name}'s leading dense "
                             "layers before its MoE layers are not supported there (use --pp 1)")
        if m.sliding_window and m.local_per_global:
            raise InputError(f"--pp: the TPU compile's pipeline stages run alike layers; {m.name}'s local/global "
                             "attention pattern is not supported there (use --pp 1, or validate it on the CPU "
                             "devices: drop --target)")
        if m.n_layers % (plan.pp * plan.vpp):
            what = f"pp={plan.pp}" + (f" x vpp={plan.vpp}" if plan.vpp > 1 else "")
            raise InputError(f"--pp: {m.name}'s {m.n_layers} layers do not split evenly over {what} chunks; use "
                             f"a pp{' x vpp' if plan.vpp > 1 else ''} that divides {m.n_layers}")
    if seq_len % plan.cp:
        raise InputError(f"--seq-len: {seq_len} is not divisible by cp={plan.cp}")
    if m.n_kv_heads % plan.tp:
        raise InputError(f"--tp: {m.name}'s {m.n_kv_heads} KV heads are not divisible by tp={plan.tp}")


def tpu_job(plan: Plan, seq_len: int, scan: bool = True) -> Job:
    """The job the TPU compile runs and the cost model is asked about: one micro-batch per batch shard (pp plans:
    pp of them, MaxText's default num_pipeline_microbatches), bf16, MaxText's convention."""
    return Job(seq_len=seq_len, global_batch=plan.batch_shards * plan.micro_batch * plan.pp, precision="bf16",
               framework="maxtext", scan_layers=scan)


def _compile_figures(res: TpuResult, m_full: ModelSpec, plan: Plan, job: Job, devices: list,
                     layers: tuple[int, int], block: int, scan: bool) -> str:
    """Compile the step (as many times as the layout needs), fill res.compiles, res.full (the full model's
    figures) and res.per_layer; returns how the figures were obtained."""
    if plan.pp > 1:
        # Memory: the full model with the pipeline ticks as one lax.scan, as MaxText iterates (planner.validate
        # .compare does the same; memory is not linear in the depth here). FLOPs and collectives: the ticks
        # unrolled, which XLA counts tick by tick, with one and two chunks of layers per stage, extrapolated.
        chunks = plan.pp * plan.vpp
        res.compiles = [compile_step(replace(m_full, n_layers=n * chunks), plan, job, devices, block, False)
                        for n in (1, 2)]
        res.full, res.per_layer = _extrapolate(*res.compiles, m_full.n_layers)
        res.compiles.append(compile_step(m_full, plan, job, devices, block, False, scan_ticks=True))
        res.full.update({k: v for k, v in _flat(res.compiles[-1]).items() if k.startswith("mem:")})
        how = (f"the full {m_full.n_layers} layers, pipeline ticks under lax.scan (FLOPs and collectives: ticks "
               f"unrolled, extrapolated from {chunks} and {2 * chunks} layers)")
    elif scan:  # full depth, twice: one block per scan iteration, then two (FLOPs: the body's share)
        for u in (1, 2):
            res.compiles.append(compile_step(m_full, plan, job, devices, block, True, u))
        a, b = res.compiles
        res.full, res.per_layer = _flat(a), {}
        # XLA's cost analysis counts a while body once: F2 - F1 is one more block of layers (one layer, or one
        # period of a local/global pattern; with an odd count, scan's unroll=2 adds a one-block remainder outside
        # the loop: two more); only the longest run of alike blocks is scanned (planner.validate.model.scanned_loss)
        from planner.validate.model import layer_groups

        n = max(count for _, _, count in layer_groups(m_full))
        body = (b.flops - a.flops) / (2 if n % 2 else 1)
        res.full["flops"] = a.flops + (n - 1) * body
        res.per_layer["flops"] = body
        how = f"the full {m_full.n_layers} layers under lax.scan"
    else:
        for n in layers:
            res.compiles.append(compile_step(replace(m_full, n_layers=n), plan, job, devices, block, False))
        a, b = res.compiles
        res.full, res.per_layer = _extrapolate(a, b, m_full.n_layers)
        how = f"unrolled, extrapolated from {a.layers} and {b.layers} layers to {m_full.n_layers}"
    return how


def predicted_flops(m: ModelSpec, job: Job, plan: Plan, hardware_flops_per_step: float,
                    block: int = 512) -> tuple[float, float]:
    """FLOPs per chip XLA:TPU's cost analysis should count for the validator's step: the cost model's hardware
    FLOPs plus what the step's kernels declare beyond them (flash-attention blocks and recompute, megablox
    worst-case rows of the dropless MoE, the pipeline bubble); returns (total, that adjustment)."""
    extra = flash_flops_adjustment(m, job, plan, block)
    if plan.pp == 1:  # (pipeline stages route by capacity: no grouped matmuls; compile_step)
        extra += grouped_matmul_flops_adjustment(m, job, plan)
    extra += pipeline_flops_adjustment(m, job, plan, hardware_flops_per_step / plan.chips + extra)
    return hardware_flops_per_step / plan.chips + extra, extra


def as_compiled(m: ModelSpec, plan: Plan) -> ModelSpec:
    """The model as the validator's TPU step runs it, for the cost model to be asked about: a dropless MoE routes
    dropless (as MaxText) except inside pipeline stages, where it routes by capacity 1 (compile_step)."""
    if plan.pp > 1 and m.is_moe and m.capacity_factor == 0:
        return replace(m, capacity_factor=1.0)
    return m


def _validate(res: TpuResult, m_full: ModelSpec, plan: Plan, seq_len: int, t: Target,
              layers: tuple[int, int], block: int, devices: list | None, scan: bool) -> None:
    from costmodel.estimate import estimate
    from hardware.catalog import load_hardware

    check_tpu_plan(m_full, plan, seq_len, t)
    devices = devices if devices is not None else topology_devices(t)
    job = tpu_job(plan, seq_len, scan)
    res.model, res.job = m_full, job
    how = _compile_figures(res, m_full, plan, job, devices, layers, block, scan)
    chip = load_hardware(t.hardware)
    cost = estimate(as_compiled(m_full, plan), chip, job, plan, t.chips)
    flops, extra = predicted_flops(m_full, job, plan, cost.hardware_flops_per_step, block)
    res.predicted = {"memory_bytes": cost.peak_memory_bytes, "breakdown": dict(cost.memory),
                     "flops": flops, "flops_adjustment": extra}
    full, name = res.full, res.name
    peak = full["mem:argument"] + full["mem:output"] + full["mem:temp"] - full["mem:alias"]
    res.checks.append(tpu_check(name, "memory_bytes", cost.peak_memory_bytes, peak,
                                f"{t.name}, XLA:TPU argument + output - alias + temp; {how}"))
    if full.get("mem:xla_peak"):  # (jax versions without peak_memory_in_bytes: no verdict)
        res.checks.append(fit_check(name, cost.fit_memory_bytes, full["mem:xla_peak"]))
    batch_bytes = 2 * job.global_batch * job.seq_len * 4 / (plan.batch_shards * plan.cp)
    state_pred = cost.memory["optimizer"] + cost.memory["weights"] * 4 / 6  # fp32 weights, without the bf16 copy
    res.checks.append(tpu_check(name, "state_bytes", state_pred, full["mem:argument"] - batch_bytes - 4,
                                "fp32 weights + Adam moments (XLA: arguments less tokens, targets, step counter)"))
    res.checks.append(tpu_check(name, "flops", res.predicted["flops"], full["flops"],
                                f"cost model + {extra:.4g} (flash-attention blocks and recompute, megablox worst-case "
                                "rows, pipeline bubble)"))
    pred_coll = predicted_collectives(cost, plan, merge_rs=False)
    xla_coll = {k.split(":", 1)[1]: v for k, v in full.items() if k.startswith("coll:")}
    for kind in sorted(set(pred_coll) | set(xla_coll)):
        pv, why = pred_coll.get(kind, (0.0, "not predicted"))
        res.checks.append(tpu_check(name, f"collective_bytes:{kind}", pv, xla_coll.get(kind, 0.0),
                                    f"predicted from: {why}" if kind in pred_coll else "not in the cost model"))


def result_dict(r: TpuResult) -> dict:
    """JSON-friendly summary of one TPU validation (the checks go separately)."""
    return {"plan": r.name, "target": r.target.name, "error": r.error, "compile_s": r.compile_s,
            "compiles": [{"layers": c.layers, "unroll": c.unroll, "compile_s": c.compile_s, "memory": c.memory,
                          "flops": c.flops,
                          "collectives": c.collectives} for c in r.compiles],
            "extrapolated": r.full, "per_layer": r.per_layer, "predicted": r.predicted}
