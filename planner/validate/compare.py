"""Hold the cost model against XLA: compile a plan's step ahead of time, read XLA's figures, time real steps.

For each plan: scale the model down (planner.validate.scale), build the sharded JAX step (planner.validate.model),
`jit(...).lower(...).compile()`, read memory_analysis(), cost_analysis() FLOPs and the collectives of the
optimized HLO, and run a few steps. The cost model costs the same scaled-down job with 4-byte activations and
gathered weights and no separate bf16 weight copy, since the validator computes in fp32 (XLA:CPU upcasts bf16).

Adjustments (each check's `note` says which apply): flops add the flash attention's whole diagonal blocks and
backward QK^T recompute (`flash_flops_adjustment`; CPU block = FLASH_BLOCK_FRACTION of the sequence); memory
runs with XLA:CPU's end-of-step all-reduce combiner off (planner.validate.CPU_FLAGS), as accelerators reduce
layer by layer, and on CPU adds the score blocks the attention keeps in memory (`flash_memory_adjustment`);
on CPU a reduce-scatter is an all-reduce + slice, so the two kinds are compared as one.
(details and results: docs/validator.md)
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from costmodel.cost import Cost
from costmodel.estimate import estimate
from costmodel.flops import layer_ops
from costmodel.job import Job
from costmodel.model import ModelSpec
from costmodel.plan import Plan
from hardware.chip import Chip
from planner.validate.scale import FLASH_BLOCK_FRACTION, Scale, check_devices, scale_down

if TYPE_CHECKING:  # (jax is imported only when a plan runs)
    from planner.validate.model import Setup

TOLERANCE_PCT = {"flops": 3.0, "matmul_flops": 3.0, "memory_bytes": 10.0, "state_bytes": 10.0, "temp_bytes": 10.0,
                 "collective_bytes": 10.0, "step_time_s": 15.0}


@dataclass
class Check:
    plan: str
    quantity: str
    predicted: float
    xla: float | None
    error_pct: float | None
    ok: bool
    note: str = ""

    def to_dict(self) -> dict:
        return {"plan": self.plan, "quantity": self.quantity, "predicted": self.predicted, "xla": self.xla,
                "error_pct": self.error_pct, "ok": self.ok, **({"note": self.note} if self.note else {})}


@dataclass
class PlanResult:
    name: str
    plan: Plan
    checks: list[Check] = field(default_factory=list)
    error: str = ""
    notes: list[str] = field(default_factory=list)
    compile_s: float = 0.0
    step_times_s: list[float] = field(default_factory=list)
    predicted_step_s: float = 0.0
    model: ModelSpec | None = None
    job: Job | None = None
    xla: dict = field(default_factory=dict)
    runner: object = None  # StepRunner when run_plan(keep_runner=True)
    loss: float | None = None  # loss of the last step run

    @property
    def measured_step_s(self) -> float:
        return statistics.median(self.step_times_s) if self.step_times_s else float("nan")


@contextlib.contextmanager
def activation_bytes(n: int):
    """Cost the job with `n`-byte activations and gathered weights (the cost model's BF16 constants)."""
    import costmodel.estimate as ce
    import costmodel.memory as cm

    old = ce.BF16, cm.BF16
    ce.BF16 = cm.BF16 = n
    try:
        yield
    finally:
        ce.BF16, cm.BF16 = old


def predict(m: ModelSpec, chip: Chip, job: Job, plan: Plan, act_bytes: int = 4) -> Cost:
    with activation_bytes(act_bytes):
        return estimate(m, chip, job, plan)


def flash_flops_adjustment(m: ModelSpec, job: Job, plan: Plan, block: int = 512) -> float:
    """Per-chip attention FLOPs per step the flash-style attention computes beyond the cost model's count (every
    micro-batch; under pp a chip runs its stage's share of the layers).

    The cost model counts causal attention at s/2 keys per query (a sliding window: ModelSpec.mean_attended_keys):
    A per layer forward, 2A backward, A more when the context is recomputed. planner.validate.flash computes whole
    blocks on the diagonal ((B+1)/2B of the s x s square, B blocks; with cp nearly every block; a window's edge
    blocks whole too), recomputes QK^T in its backward (2.5x the forward's matmuls), and under any remat policy
    its forward is recomputed (its output and log-sum-exp are not named checkpoints)."""
    from collections import Counter

    from planner.validate.flash import attention_flops
    from planner.validate.model import layer_window

    tokens = plan.micro_batch * job.seq_len / plan.cp
    a = sum(op.flops for op in layer_ops(m, tokens, job.seq_len, plan.tp, plan.cp, False) if op.is_attention)
    r_model = 1 if plan.remat.context == "remat" and plan.remat.count("remat") else 0
    r_flash = 1 if plan.remat.count("remat") else 0
    computed = 0.0
    windows = Counter(layer_window(m, i) for i in range(m.n_layers))  # a window skips the blocks outside it
    for window, n in windows.items():
        fwd, bwd = attention_flops(plan.micro_batch, plan.cp, job.seq_len // plan.cp, job.seq_len,
                                   m.n_heads // plan.tp, m.head_dim, block, m.v_head_dim if m.is_mla else 0, window)
        computed += n * ((1 + r_flash) * fwd + bwd) / plan.cp  # the cp rows are split over the chips
    accum = job.global_batch // (plan.batch_shards * plan.micro_batch)  # micro-batches per step
    return (computed - m.n_layers * (3 + r_model) * a) * accum / plan.pp


# Score-sized buffers at the peak of XLA:CPU's step when it falls in the validator's attention: the backward of one
# block pair holds 3 probability blocks (exp), 2 dP-sized products and dS (buffer assignments and live ranges of 9
# plans at 12 shapes outside the random set: dp8 none/full/selective d128-256 s512-1024, tp2/tp4 with and without
# sequence parallelism, dp2-fsdp2-tp2 d256 s1024; docs/validator_random_shapes.md, "Score blocks at the peak").
FLASH_SCORE_BLOCKS = 6
# Under a policy that recomputes the attention but keeps other tensors (selective, minimal) the peak falls in the
# attention's recomputed forward instead: 4 probability blocks (rematted_computation/exp) and 3 dot outputs (live
# ranges at dp8-selective d128 s512 and d256 s1024, fsdp8-selective d256 s768, fsdp4-dp2-selective d320 s768, none
# of them in the random set; docs/validator_random_shapes.md).
FLASH_SCORE_BLOCKS_SELECTIVE = 7


def score_blocks_at_peak(plan: Plan) -> int:
    """Score-sized blocks live at XLA:CPU's peak: FLASH_SCORE_BLOCKS_SELECTIVE where the context alone is
    recomputed among kept tensors, else FLASH_SCORE_BLOCKS (the backward's)."""
    kept = plan.remat.count("device") - (plan.remat.layer_input == "device")
    return FLASH_SCORE_BLOCKS_SELECTIVE if plan.remat.context == "remat" and kept > 0 else FLASH_SCORE_BLOCKS


def flash_memory_adjustment(m: ModelSpec, job: Job, plan: Plan, block: int) -> float:
    """Per-device bytes of the score blocks the validator's blockwise attention (planner.validate.flash) keeps in
    memory at its backward's peak on XLA:CPU, where a flash kernel keeps them on chip and the cost model counts
    none: score_blocks_at_peak fp32 blocks of micro-batch x (heads / tp) x query block x key block."""
    from planner.validate.flash import block_size

    sq = job.seq_len // plan.cp  # each cp shard's queries
    score = plan.micro_batch * (m.n_heads // plan.tp) * block_size(sq, block) * block_size(job.seq_len, block) * 4
    return score_blocks_at_peak(plan) * score


def grouped_matmul_flops_adjustment(m: ModelSpec, job: Job, plan: Plan) -> float:
    """Per-chip FLOPs XLA's cost analysis counts for the dropless MoE's grouped matmuls beyond the work done.

    Each megablox kernel (forward, input gradient, weight gradient) declares 2 m k n FLOPs over its whole operand,
    and under ep that is the worst-case receive buffer, routed_buffer_factor times the balanced rows (the kernel
    skips the empty tiles; the cost model counts the balanced rows). Per expert matmul: forward, two backward
    kernels, and the forward again when its output is recomputed (the gate gradient needs the experts' outputs).
    Only the routed experts' share of the MLP ops (k of k + shared): shared experts run as a dense MLP."""
    from costmodel.memory import routed_buffer_factor

    buf = routed_buffer_factor(m, job, plan)
    if buf == 1 or not m.is_moe:
        return 0.0
    tokens = plan.micro_batch * job.seq_len / plan.cp
    remat = plan.remat.count("remat") > 0
    ch = plan.remat.choices()
    ops = {op.name: op.flops for op in layer_ops(m, tokens, job.seq_len, plan.tp, plan.cp, True)}
    passes = {t: 3 + (remat and ch[t] != "device") for t in ("mlp_in", "mlp_out")}
    routed = m.experts_per_token / (m.experts_per_token + m.n_shared_experts)
    return m.n_moe_layers * (buf - 1) * routed * sum(ops[t] * passes[t] for t in passes)


def pipeline_flops_adjustment(m: ModelSpec, job: Job, plan: Plan, per_device_flops: float) -> float:
    """Per-device FLOPs the validator's GPipe step (planner.validate.pipeline) computes beyond `per_device_flops`,
    the cost model's per-chip average (with the attention adjustment); 0 without pp. Every stage runs one chunk of
    L / (pp * vpp) layers, forward and backward, on M * vpp + pp - 1 ticks, not M * vpp (SPMD stages compute
    through the bubble, as MaxText's pipeline iterations do): the layer FLOPs x (pp - 1) / (M * vpp) more. The
    logits are not rerun: every stage computes them once, for its M / pp micro-batches, as the per-chip average
    says."""
    if plan.pp == 1:
        return 0.0
    from costmodel.flops import logits_op

    accum = job.global_batch // (plan.batch_shards * plan.micro_batch)
    head = 3 * logits_op(m, plan.micro_batch * job.seq_len / plan.cp, plan.tp).flops * accum / plan.pp
    return (per_device_flops - head) * (plan.pp - 1) / (accum * plan.vpp)


def error_pct(pred: float, xla: float) -> float | None:
    if xla == 0:
        return 0.0 if pred == 0 else None
    return (pred - xla) / xla * 100


def _check(name: str, quantity: str, pred: float, xla: float | None, note: str = "") -> Check:
    tol = TOLERANCE_PCT[quantity.split(":")[0]]
    err = None if xla is None else error_pct(pred, xla)
    if xla is not None and xla == 0 and pred == 0:
        err = 0.0
    ok = err is not None and abs(err) <= tol
    return Check(name, quantity, float(pred), None if xla is None else float(xla), err, ok, note)


def predicted_collectives(cost: Cost, plan: Plan, merge_rs: bool) -> dict[str, tuple[float, str]]:
    """Bytes per step per HLO collective kind, from the cost model's collectives (host traffic excluded)."""
    out: dict[str, float] = {}
    notes: dict[str, set[str]] = {}

    def add(kind: str, nbytes: float, why: str) -> None:
        if merge_rs and kind in ("all-reduce", "reduce-scatter"):
            kind = "all-reduce+reduce-scatter"
        out[kind] = out.get(kind, 0.0) + nbytes
        notes.setdefault(kind, set()).add(why)

    for c in cost.collectives:
        if c.axis == "host":
            continue
        total = c.count * c.bytes_each
        kind = {"p2p": "collective-permute"}.get(c.kind, c.kind)
        split = (c.axis == "tp" and plan.sequence_parallel) or (c.axis == "dp" and plan.zero in (1, 2))
        if kind == "all-reduce" and split:
            # the cost model counts RS+AG as one all-reduce of the same ring traffic
            add("reduce-scatter", total, f"{c.axis} {c.purpose}")
            add("all-gather", total, f"{c.axis} {c.purpose}")
        else:
            add(kind, total, f"{c.axis} {c.purpose}")
    return {k: (v, ", ".join(sorted(notes[k]))) for k, v in out.items()}


def run_plan(name: str, m_full: ModelSpec, plan: Plan, chip: Chip, devices: int = 8, steps: int = 3,
             scale: Scale = Scale(), time_steps: bool = True, compute_dtype: str = "float32",
             keep_runner: bool = False, timeout_s: float = 0.0) -> PlanResult:
    """Validate one plan; errors (bad input, compile failures) land in `result.error`, not as exceptions.

    keep_runner (with time_steps False): keep the compiled step in `result.runner` to time it later, e.g. in
    rounds interleaved with other plans so that a shared machine's load drift hits every plan alike.
    timeout_s > 0: a compile that takes longer is reported as this plan's error (see compile_with_timeout)."""
    res = PlanResult(name, plan)
    try:
        check_devices(plan, devices)
        small, job, notes = scale_down(m_full, plan, scale)
        res.model, res.job, res.notes = small, job, notes
        _run(res, small, job, plan, chip, steps, time_steps, compute_dtype, keep_runner, timeout_s)
    except Exception as e:  # reported per plan; the other plans still run
        res.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return res


class CompileTimeout(TimeoutError):
    pass


ABANDONED_COMPILES: list = []  # threads of compiles given up on (the caller may want to exit without them)


def lower_and_compile(step):
    return step.fn.lower(*step.abstract_inputs()).compile()


def compile_with_timeout(step, timeout_s: float = 0.0):
    """step.fn lowered and compiled ahead of time; with timeout_s > 0 the compile runs in a daemon thread and a
    CompileTimeout is raised after timeout_s (XLA cannot be interrupted: the thread is left to finish in the
    background and recorded in ABANDONED_COMPILES)."""
    if timeout_s <= 0:
        return lower_and_compile(step)
    import threading

    box: dict = {}

    def work():
        try:
            box["out"] = lower_and_compile(step)
        except BaseException as e:  # handed to the caller
            box["err"] = e

    th = threading.Thread(target=work, name="planner-validate-compile", daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        ABANDONED_COMPILES.append(th)
        raise CompileTimeout(f"compile did not finish within {timeout_s:g} s (--plan-timeout)")
    if "err" in box:
        raise box["err"]
    return box["out"]


def _compile(res: PlanResult, cfg: Setup, timeout_s: float) -> tuple:
    """Compile the plan's step; returns (compiled step, step, memory figures). Under pp the memory comes from the
    same step with the pipeline ticks as one lax.scan, as MaxText's pipeline iterates: in the unrolled step
    XLA:CPU's scheduler defers every tick's weight-gradient products to the end of the backward pass, keeping
    their inputs (FLOPs and collectives come from the unrolled step, which XLA counts tick by tick)."""
    from planner.validate import hlo
    from planner.validate.model import build_step, make_mesh

    step = build_step(cfg, make_mesh(cfg.plan))
    t0 = time.perf_counter()
    compiled = compile_with_timeout(step, timeout_s)
    mem = hlo.memory(compiled)
    if cfg.plan.pp > 1:
        scanned = build_step(replace(cfg, scan_pipeline=True), step.mesh)
        mem = hlo.memory(compile_with_timeout(scanned, timeout_s))
    res.compile_s = time.perf_counter() - t0
    return compiled, step, mem


def _xla_collectives(text: str, mesh_shape: dict[str, int], merge: bool) -> tuple[dict[str, float], dict[str, float]]:
    """Collective bytes per device in the compiled HLO: (by kind, by kind@axes). merge: all-reduce and
    reduce-scatter as one kind (XLA:CPU emits a reduce-scatter as an all-reduce and a slice)."""
    from planner.validate import hlo

    by_kind: dict[str, float] = {}
    by_axis: dict[str, float] = {}
    for c in hlo.collectives(text, mesh_shape):
        kind = "all-reduce+reduce-scatter" if merge and c.kind in ("all-reduce", "reduce-scatter") else c.kind
        by_kind[kind] = by_kind.get(kind, 0.0) + c.bytes
        by_axis[f"{c.kind}@{c.axes or '?'}"] = by_axis.get(f"{c.kind}@{c.axes or '?'}", 0.0) + c.bytes
    return by_kind, by_axis


def _flops_checks(name: str, cost: Cost, small: ModelSpec, job: Job, plan: Plan, block: int, flops: float,
                  matmul_flops: float) -> list[Check]:
    """FLOPs per device: the cost model's hardware FLOPs plus what the validator's flash attention and pipeline
    ticks compute beyond them (and the element-wise ops, which XLA's cost analysis counts)."""
    extra = flash_flops_adjustment(small, job, plan, block)
    pred_flops = cost.hardware_flops_per_step / plan.chips + extra
    why = f"cost model {cost.hardware_flops_per_step / plan.chips:.4g} + flash-attention blocks {extra:.4g}"
    if plan.pp > 1:
        pipe = pipeline_flops_adjustment(small, job, plan, pred_flops)
        pred_flops += pipe
        why += f" + pipeline bubble ticks {pipe:.4g}"
    vec = cost.vector_flops_per_step / plan.chips
    return [_check(name, "flops", pred_flops + vec, flops,
                   f"{why} + element-wise {vec:.4g}; XLA cost_analysis incl. element-wise ops"),
            _check(name, "matmul_flops", pred_flops, matmul_flops, why + "; XLA: the dots of the optimized HLO")]


def _memory_checks(name: str, cost: Cost, small: ModelSpec, chip: Chip, job: Job, plan: Plan, mem: dict,
                   compute_dtype: str, act_bytes: int, scores: float = 0.0) -> list[Check]:
    """Memory per device: the whole, the model state and the rest (temporaries), each against XLA's figures;
    scores: the validator's attention score blocks (flash_memory_adjustment), added to the prediction."""
    b = cost.memory
    working_copy = 0.0
    if compute_dtype == "float32":  # no bf16 compute copy of the weights in an fp32 step
        working_copy = b["weights"] - _param_bytes(small, chip, job, plan, act_bytes)
    batch_bytes = 2 * job.global_batch * job.seq_len * 4 / (plan.batch_shards * plan.cp)
    state_pred = b["weights"] - working_copy + b["optimizer"]
    state_xla = mem["argument"] - batch_bytes - 4  # minus tokens, targets and the step counter
    peak_pred = cost.peak_memory_bytes - working_copy + scores
    note = "XLA: argument + output + temp - alias" + ("; prediction without the bf16 compute copy"
                                                      if working_copy else "")
    if scores:
        note += f"; + the validator's attention score blocks {scores:.4g} B"
    return [_check(name, "memory_bytes", peak_pred, mem["peak"], note),
            _check(name, "state_bytes", state_pred, state_xla, "fp32 weights + Adam moments"),
            _check(name, "temp_bytes", peak_pred - state_pred, mem["temp"] + mem["output"] - mem["alias"],
                   "gradients, activations, logits, gathered weights (XLA temp + unaliased output)")]


def _collective_checks(name: str, cost: Cost, plan: Plan, xla_coll: dict[str, float], merge: bool) -> list[Check]:
    """Collective bytes per kind: every kind either side lists."""
    pred_coll = predicted_collectives(cost, plan, merge)
    out = []
    for kind in sorted(set(pred_coll) | set(xla_coll)):
        pv, why = pred_coll.get(kind, (0.0, "not predicted"))
        note = f"predicted from: {why}" if kind in pred_coll else "not in the cost model"
        if merge and kind == "all-reduce+reduce-scatter":
            note += "; XLA:CPU emits reduce-scatter as all-reduce + slice"
        out.append(_check(name, f"collective_bytes:{kind}", pv, xla_coll.get(kind, 0.0), note))
    return out


def _run(res: PlanResult, small: ModelSpec, job: Job, plan: Plan, chip: Chip, steps: int, time_steps: bool,
         compute_dtype: str, keep_runner: bool, timeout_s: float = 0.0) -> None:
    import jax

    from planner.validate import hlo
    from planner.validate.model import Setup

    block = max(1, job.seq_len // FLASH_BLOCK_FRACTION)
    cfg = Setup(small, plan, job.seq_len, job.global_batch, compute_dtype, flash_block=block)
    compiled, step, mem = _compile(res, cfg, timeout_s)
    flops = hlo.flops(compiled)
    platform = jax.devices()[0].platform
    text = compiled.as_text()
    if os.environ.get("PLANNER_VALIDATE_DUMP"):  # debugging: keep the optimized HLO of every plan
        Path(os.environ["PLANNER_VALIDATE_DUMP"], f"{Path(res.name).name}.hlo.txt").write_text(text)
    merge = platform == "cpu"
    xla_coll, by_axis = _xla_collectives(text, dict(step.mesh.shape), merge)
    matmul = hlo.matmul_flops(text)
    res.xla = {"memory": mem, "flops": flops, "matmul_flops": matmul, "collectives_by_axis": by_axis,
               "platform": platform}

    act_bytes = 4 if compute_dtype == "float32" else 2
    cost = predict(small, chip, job, plan, act_bytes)
    res.predicted_step_s = cost.step_time_s
    res.checks += _flops_checks(res.name, cost, small, job, plan, block, flops, matmul)
    scores = flash_memory_adjustment(small, job, plan, block) if platform == "cpu" else 0.0
    res.checks += _memory_checks(res.name, cost, small, chip, job, plan, mem, compute_dtype, act_bytes, scores)
    res.checks += _collective_checks(res.name, cost, plan, xla_coll, merge)
    if time_steps and steps > 0:
        runner = StepRunner(compiled, step.inputs())
        res.step_times_s = runner.run(steps)
        res.loss = runner.last_loss
        res.checks.append(step_time_check(res, cost.step_time_s, chip))
    elif keep_runner:
        res.runner = StepRunner(compiled, step.inputs())
        res.predicted_step_s = cost.step_time_s


class StepRunner:
    """Runs a compiled step on its own buffers; one warm-up step before the first timed one."""

    def __init__(self, compiled, inputs):
        self.compiled, self.state, self.warm = compiled, list(inputs), False
        self.last_loss: float | None = None

    def _step(self) -> float:
        import jax

        params, opt, tokens, targets = self.state
        t = time.perf_counter()
        params, opt, loss = self.compiled(params, opt, tokens, targets)
        jax.block_until_ready(loss)
        dt = time.perf_counter() - t
        self.state = [params, opt, tokens, targets]
        self.last_loss = float(loss)  # replicated: readable on every process of a multi-process run
        return dt

    def run(self, steps: int) -> list[float]:
        if not self.warm:
            self._step()
            self.warm = True
        return [self._step() for _ in range(steps)]


def step_time_check(res: PlanResult, predicted_s: float, chip: Chip) -> Check:
    return _check(res.name, "step_time_s", predicted_s, res.measured_step_s,
                  f"{chip.name} profile, median of {len(res.step_times_s)} steps after warm-up")


def _param_bytes(m: ModelSpec, chip: Chip, job: Job, plan: Plan, act_bytes: int) -> float:
    """Stored weight bytes on this chip (the `weights` memory term less any compute copy), from the cost model's
    own memory terms."""
    from costmodel.memory import memory_terms

    accum = job.global_batch // (plan.batch_shards * plan.micro_batch)
    with activation_bytes(act_bytes):
        mt = memory_terms(m, chip, job, plan, accum)
    return 0.0 if plan.offload_params else mt.param_elems * mt.param_bytes
