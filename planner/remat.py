"""The inner problem: for one mesh, choose each tensor's fate (device / remat / offload) and whether the optimizer
state and the master parameters live on the host, minimising step time subject to HBM and host memory.

Identical layers share one decision (6 tensors + 2 switches). The cost model is probed at ~15 plans (each
tensor alone recomputed or offloaded, 'none', 'full', the two offload switches); a surrogate with the cost
model's structure (linear terms, the weight traffic recompute hides, the offload traffic each layer hides, the
memory per kept tensor with and without anything recomputed) is read off them and checked against every probe,
else the mesh is brute-forced. CP-SAT (planner/cpsat.py) minimises the surrogate exactly; its pick is re-costed
with estimate() and excluded by a no-good cut until one verifies (at most MAX_RESOLVES times). Collectives are
found by role (costmodel.cost.Role), framework behaviour read off Job.fw (costmodel.framework).
The surrogate's equations and terms: docs/costmodel.md, "The remat/offload solver".

Ties on step time go to fewer offloads, then fewer tensors kept on device (cheaper memory for equal time).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from costmodel.cost import Cost, Role
from costmodel.estimate import estimate, stage_times
from costmodel.job import Job
from costmodel.memory import memory_terms, pipeline_inflight
from costmodel.model import ModelSpec
from costmodel.plan import CHOICES, REMAT_POLICIES, TENSORS, Plan, Remat, busiest_stage_layers
from hardware.chip import Chip
from planner.candidates import Constraints, Mesh
from planner.cpsat import Program

RECOMPUTABLE = TENSORS[1:]  # layer_input is the layer boundary: kept or offloaded, never recomputed
TENSOR_CHOICES = {t: (("device", "offload") if t == "layer_input" else CHOICES) for t in TENSORS}
NS = 1e9  # seconds -> integer nanoseconds in the program
TIE_WEIGHT = 32  # objective = TIE_WEIGHT * time_ns + tie-break penalty (< TIE_WEIGHT)
MAX_RESOLVES = 6
REL_TOL = 1e-9


@dataclass(frozen=True)
class Choice:
    """One assignment of the inner problem."""

    remat: Remat
    offload_optimizer: bool
    offload_params: bool
    recompute_num_layers: int = 0  # Megatron-Core block recompute under remat full (0: every layer)
    ep_overlap: bool = False  # Megatron-Core's expert all-to-all overlap (Plan.overlap_moe_expert_parallel_comm)

    def key(self) -> tuple:
        order = {c: i for i, c in enumerate(CHOICES)}
        return tuple(order[c] for c in self.remat.choices().values()) + (self.offload_optimizer, self.offload_params,
                                                                          self.recompute_num_layers, self.ep_overlap)

    def plan(self, mesh: Mesh) -> Plan:
        """The mesh's plan under this assignment."""
        return mesh.plan(self.remat, self.offload_optimizer, self.offload_params, self.recompute_num_layers,
                         self.ep_overlap)


def make_remat(choices: dict[str, str]) -> Remat:
    """A Remat for these choices, carrying the name of the first named policy with exactly these choices
    (costmodel.plan.REMAT_POLICIES order: none, selective, full, then MaxText's), else 'custom'."""
    for pol in REMAT_POLICIES.values():
        if pol.choices() == choices:
            return pol
    return Remat(**choices, name="custom")


def allowed_choices(cons: Constraints) -> dict[str, tuple[str, ...]]:
    if cons.remat is not None:
        return {t: (cons.remat.choices()[t],) for t in TENSORS}
    return dict(TENSOR_CHOICES)


def switch_values(fixed: bool | None) -> tuple[bool, ...]:
    return (False, True) if fixed is None else (fixed,)


def policy_set(cons: Constraints) -> tuple[Remat, ...] | None:
    """The whole-layer policies a framework limits the search to (None: any per-tensor assignment; a pinned
    policy overrides the set)."""
    return cons.policies if cons.remat is None else None


def allowed_remats(cons: Constraints) -> list[Remat]:
    """The per-tensor assignments the constraints allow: a pinned policy, a framework's policy set, or any."""
    if policy_set(cons) is not None:
        return list(cons.policies)
    allowed = allowed_choices(cons)
    return [make_remat(dict(zip(TENSORS, combo, strict=True)))
            for combo in itertools.product(*(allowed[t] for t in TENSORS))]


def all_choices(cons: Constraints) -> list[Choice]:
    """Every assignment the constraints allow (2 * 3^5 * 4 = 1944 when nothing is pinned)."""
    out = []
    for r in allowed_remats(cons):
        for o in switch_values(cons.offload_optimizer):
            for p in switch_values(cons.offload_params):
                out.append(Choice(r, o, p))
    return out


def min_memory_choice(cons: Constraints) -> Choice:
    """The assignment with the least HBM: layer input offloaded, the rest recomputed, optimizer and params on host."""
    o = True if cons.offload_optimizer is None else cons.offload_optimizer
    p = True if cons.offload_params is None else cons.offload_params
    if policy_set(cons) is not None:  # the policy keeping the fewest tensors in HBM
        return Choice(min(cons.policies, key=lambda r: r.count("device")), o, p)
    allowed = allowed_choices(cons)
    pick = {t: ("offload" if "offload" in allowed[t] and t == "layer_input" else
                "remat" if "remat" in allowed[t] else allowed[t][-1]) for t in TENSORS}
    return Choice(make_remat(pick), o, p)


def exposed(cost: Cost, role: Role) -> float:
    """The exposed seconds of the collectives of one role (found by role, never by their labels)."""
    return sum(c.exposed_s for c in cost.collectives if c.role is role)


def hideable(cost: Cost) -> float:
    """The exposed weight-sharding traffic that recomputation hides (costmodel.estimate: the layers' gradient
    reduce-scatters, or under a MaxText pipeline the backward's weight re-gathers), max(0, a - b * recompute)."""
    return exposed(cost, Role.LAYER_GRAD_REDUCE) + exposed(cost, Role.WEIGHT_REGATHER)


def _collective(cost: Cost, role: Role):
    return next((c for c in cost.collectives if c.role is role), None)


def _act(cost: Cost) -> float:
    return cost.memory.get("activations", 0.0) + cost.memory.get("logits", 0.0)


def _close(a: float, b: float, scale: float) -> bool:
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b), scale) + 1e-12


def _ns(v: float) -> int:
    """Seconds -> integer nanoseconds in the program."""
    return round(v * NS)


def _decision_vars(P: Program, cons: Constraints) -> tuple[dict[tuple[str, str], int], int, int]:
    """One boolean per (tensor, choice), exactly one choice per tensor, those the constraints forbid fixed to 0;
    and the optimizer and parameter offload switches (fixed where the constraints pin them)."""
    allowed = allowed_choices(cons)
    x: dict[tuple[str, str], int] = {}
    for t in TENSORS:
        for c in TENSOR_CHOICES[t]:
            x[t, c] = P.bool()
            if c not in allowed[t]:
                P.fix(x[t, c], 0)
        P.add([(x[t, c], 1) for c in TENSOR_CHOICES[t]], 1, 1)
    o, p = P.bool(), P.bool()
    if cons.offload_optimizer is not None:
        P.fix(o, int(cons.offload_optimizer))
    if cons.offload_params is not None:
        P.fix(p, int(cons.offload_params))
    return x, o, p


@dataclass
class Surrogate:
    """The cost model restricted to one mesh, as a function of the remat/offload choices (module docstring)."""

    mesh: Mesh
    usable_hbm: float
    host_cap: float
    # time, seconds
    L0: float = 0.0
    lam: dict[str, float] = field(default_factory=dict)
    eps: float = 0.0
    kappa: float = 0.0  # time that appears once anything is recomputed (the sequence-parallel re-gather; MaxText: the
    # ep all-to-alls' rerun too)
    rho_k: float = 0.0  # recompute that appears once anything is recomputed (MaxText: MLA's down-projections)
    mu: float = 0.0  # time when the MLP input and output are both recomputed, beyond each alone (a MoE layer's
    rho_mu: float = 0.0  # expert output matmul reruns only then), and its recompute share
    trig: tuple[str, ...] = ()
    k_o: float = 0.0
    k_p: float = 0.0
    g0: float = 0.0
    nu: float = 0.0
    rho: dict[str, float] = field(default_factory=dict)
    n_tau: dict[str, float] = field(default_factory=dict)
    n_c: tuple[float, float] = (0.0, 0.0)
    # memory, bytes
    R0: float = 0.0
    w_o: float = 0.0
    w_p: float = 0.0
    B: float = 0.0
    a: dict[str, float] = field(default_factory=dict)  # bytes per kept tensor when something is recomputed
    b: dict[str, float] = field(default_factory=dict)  # ... when nothing is
    xi: float = 0.0
    logits: float = 0.0
    inflight: float = 1.0
    same_stages: bool = False  # pp > 1 under MaxText: every stage runs the same program (no first/last stage)
    xla_floor: bool = False  # MaxText: hbm() models the fit floor (Cost.fit_memory_bytes), not the peak
    # The scanned loop's buffer the fit floor keeps under tp (costmodel.memory.xla_loop_tp_bytes), exact: with
    # something recomputed, min(S, G), S the kept tensors' stack (B + sum_t a_t*D_t), G the fp32 layer gradients
    # on this chip (set on MaxText's scanned meshes, 0 without a scanned loop; loop_tp: tp > 1).
    loop_G: float = 0.0
    loop_tp: bool = False
    eta: dict[str, float] = field(default_factory=dict)
    h_o: float = 0.0
    h_p: float = 0.0
    exact: bool = True
    mismatch: str = ""

    # ---- evaluation (floats) ------------------------------------------------------------------------------

    def time(self, ch: Choice) -> float:
        c = ch.remat.choices()
        rem = {t: c[t] == "remat" for t in TENSORS}
        lin = self.L0 + sum(self.lam.get(t, 0.0) for t in TENSORS if rem[t]) + self.k_o * ch.offload_optimizer \
            + self.k_p * ch.offload_params + (self.eps if any(rem[t] for t in self.trig) else 0.0)
        rec = sum(self.rho.get(t, 0.0) for t in TENSORS if rem[t])
        off = sum(self.n_tau.get(t, 0.0) for t in TENSORS if c[t] == "offload")
        if any(rem.values()):
            lin, rec = lin + self.kappa, rec + self.rho_k
        if rem["mlp_in"] and rem["mlp_out"]:
            lin, rec = lin + self.mu, rec + self.rho_mu
        return lin + max(0.0, self.g0 - self.nu * rec) + sum(max(0.0, off - nc) for nc in self.n_c)

    def ks(self, ch: Choice) -> float:
        c = ch.remat.choices()
        nr = not any(c[t] == "remat" for t in TENSORS)
        coef = self.b if nr else self.a
        return self.B + self.xi * nr + sum(coef[t] for t in TENSORS if c[t] == "device")

    def loop(self, ch: Choice) -> float:
        c = ch.remat.choices()
        if not (self.loop_G and self.loop_tp) or not any(c[t] == "remat" for t in TENSORS):
            return 0.0
        return min(self.B + sum(self.a[t] for t in TENSORS if c[t] == "device"), self.loop_G)

    def hbm(self, ch: Choice) -> float:
        rest = self.R0 + self.w_o * ch.offload_optimizer + self.w_p * ch.offload_params + self.loop(ch)
        ks = self.ks(ch)
        if self.xla_floor:  # costmodel.memory.fit_floor_bytes: the logits phase folded into R0
            return rest + self.inflight * ks
        if self.mesh.pp == 1:
            return rest + ks + self.logits
        return rest + max(self.inflight * ks, ks + self.logits)

    def host(self, ch: Choice) -> float:
        c = ch.remat.choices()
        return sum(self.eta[t] for t in TENSORS if c[t] == "offload") + self.h_o * ch.offload_optimizer \
            + self.h_p * ch.offload_params

    def check(self, ch: Choice, cost: Cost) -> None:
        """Compare with a probe; on a miss, mark the surrogate inexact (the mesh is then brute-forced)."""
        for what, mine, theirs, scale in (("time", self.time(ch), cost.step_time_s, cost.step_time_s),
                                          ("hbm", self.hbm(ch), cost.fit_memory_bytes, cost.peak_memory_bytes),
                                          ("host", self.host(ch), cost.host_memory_bytes, cost.peak_memory_bytes)):
            if not _close(mine, theirs, scale):
                self.exact = False
                self.mismatch = self.mismatch or f"{what} {mine!r} vs {theirs!r} at {ch.remat.summary()}"

    # ---- the CP-SAT program ---------------------------------------------------------------------------------

    def program(self, cons: Constraints) -> tuple[Program, dict[tuple[str, str], int], int, int]:
        """(program, var[(tensor, choice)], var offload_optimizer, var offload_params)."""
        P = Program()
        x, o, p = _decision_vars(P, cons)
        R = {t: x[t, "remat"] for t in RECOMPUTABLE}
        D = {t: x[t, "device"] for t in TENSORS}
        Off = {t: x[t, "offload"] for t in TENSORS}
        obj, nr = self._time_terms(P, R, Off, o, p)
        self._memory_constraints(P, D, Off, o, p, nr)
        penalty = [(Off[t], 2) for t in TENSORS] + [(D[t], 1) for t in TENSORS] + [(o, 2), (p, 2)]
        P.minimize([(v, TIE_WEIGHT * c) for v, c in obj] + penalty,
                   offset=TIE_WEIGHT * (_ns(self.L0) + _ns(self.kappa)))
        return P, x, o, p

    def _time_terms(self, P: Program, R: dict[str, int], Off: dict[str, int], o: int,
                    p: int) -> tuple[list[tuple[int, int]], int]:
        """The step time in integer nanoseconds as (var, coefficient) terms, and NR (no tensor recomputed), a
        variable the memory constraints use too (created here, after the time terms' own, so that the program's
        variables keep their order)."""
        obj: list[tuple[int, int]] = [(R[t], _ns(self.lam.get(t, 0.0))) for t in RECOMPUTABLE]
        obj += [(o, _ns(self.k_o)), (p, _ns(self.k_p))]
        if self.eps and self.trig:  # A = OR of the trigger tensors' remat (exact in both directions)
            a = P.bool()
            for t in self.trig:
                P.add([(a, 1), (R[t], -1)], lb=0)
            P.add([(a, 1)] + [(R[t], -1) for t in self.trig], ub=0)
            obj.append((a, _ns(self.eps)))
        pair: list[tuple[int, int]] = []
        if self.mu or self.rho_mu:  # Y = R[mlp_in] and R[mlp_out] (exact links)
            y = P.bool()
            P.add([(y, 1), (R["mlp_in"], -1)], ub=0)
            P.add([(y, 1), (R["mlp_out"], -1)], ub=0)
            P.add([(y, 1), (R["mlp_in"], -1), (R["mlp_out"], -1)], lb=-1)
            obj.append((y, _ns(self.mu)))
            pair = [(y, _ns(self.nu * self.rho_mu))]
        # NR = no tensor recomputed (exact links).
        nr = P.bool()
        for t in RECOMPUTABLE:
            P.add([(nr, 1), (R[t], 1)], ub=1)
        P.add([(nr, 1)] + [(R[t], 1) for t in RECOMPUTABLE], lb=1)
        if self.g0 > 0:  # g >= g0 - nu * recompute (rho_k: once anything is, i.e. 1 - NR)
            g = P.int(0, _ns(self.g0))
            once = _ns(self.nu * self.rho_k)
            P.add([(g, 1)] + [(R[t], _ns(self.nu * self.rho.get(t, 0.0))) for t in RECOMPUTABLE] + pair
                  + [(nr, -once)], lb=_ns(self.g0) - once)
            obj.append((g, 1))
        if any(self.n_tau.values()):
            top = _ns(sum(self.n_tau.values()))
            for nc in self.n_c:
                h = P.int(0, top)
                P.add([(h, 1)] + [(Off[t], -_ns(self.n_tau.get(t, 0.0))) for t in TENSORS], lb=-_ns(nc))
                obj.append((h, 1))
        if self.kappa:  # kappa * (1 - NR)
            obj.append((nr, -_ns(self.kappa)))
        return obj, nr

    def _memory_constraints(self, P: Program, D: dict[str, int], Off: dict[str, int], o: int, p: int,
                            nr: int) -> None:
        """HBM (the fit check's figure, per pipeline stage where the stages differ) and host memory caps."""
        ks = [(nr, round(self.xi))]
        for t in TENSORS:  # Y_t = NR and t kept on device (exact links)
            ks.append((D[t], round(self.a[t])))
            if round(self.b[t]) != round(self.a[t]):
                y = P.bool()
                P.add([(y, 1), (nr, -1)], ub=0)
                P.add([(y, 1), (D[t], -1)], ub=0)
                P.add([(y, 1), (nr, -1), (D[t], -1)], lb=-1)
                ks.append((y, round(self.b[t]) - round(self.a[t])))
        rest = [(o, round(self.w_o)), (p, round(self.w_p))] + self._loop_terms(P, D, nr)
        cap = math.floor(self.usable_hbm - self.R0 - self.B)
        if self.xla_floor:
            P.add(rest + [(v, round(c * self.inflight)) for v, c in ks],
                  ub=math.floor(self.usable_hbm - self.R0 - self.inflight * self.B))
        elif self.mesh.pp == 1:
            P.add(rest + ks, ub=math.floor(cap - self.logits))
        else:
            P.add(rest + [(v, round(c * self.inflight)) for v, c in ks],
                  ub=math.floor(self.usable_hbm - self.R0 - self.inflight * self.B))
            P.add(rest + ks, ub=math.floor(cap - self.logits))
        P.add([(Off[t], round(self.eta[t])) for t in TENSORS] + [(o, round(self.h_o)), (p, round(self.h_p))],
              ub=math.floor(self.host_cap))

    def _loop_terms(self, P: Program, D: dict[str, int], nr: int) -> list[tuple[int, int]]:
        """loop() in CP-SAT, exact through big-M links: E >= min(S, G) (w picks the smaller), 0 when nothing is
        recomputed (nr). The memory constraint only bounds E from above, so the solver never sets it higher."""
        if not (self.loop_G and self.loop_tp):
            return []
        S = [(D[t], round(self.a[t])) for t in TENSORS]  # S = B + sum(S)
        B, G = round(self.B), round(self.loop_G)
        M = B + sum(max(c, 0) for _, c in S) + G + 1
        e, w = P.int(0, M), P.bool()
        P.add([(e, 1)] + [(v, -c) for v, c in S] + [(w, M), (nr, M)], lb=B)  # E >= S unless w
        P.add([(e, 1), (w, -M), (nr, M)], lb=G - M)  # E >= G if w
        return [(e, 1)]


# ---- probing ----------------------------------------------------------------------------------------------

def _choice(base: dict[str, str], o: bool = False, p: bool = False, **changes: str) -> Choice:
    return Choice(make_remat({**base, **changes}), o, p)


NONE = dict.fromkeys(TENSORS, "device")


def evaluate(m: ModelSpec, chip: Chip, job: Job, mesh: Mesh, ch: Choice) -> Cost:
    return estimate(m, chip, job, ch.plan(mesh))


def group_key(mesh: Mesh) -> tuple:
    """Meshes that differ only in how the batch shards split between dp and fsdp, and in zero, share everything
    the remat/offload choices touch: tokens per chip, grad_accum, tensor-parallel links, the pipeline (its split
    flags included)."""
    return (mesh.tp, mesh.cp, mesh.pp, mesh.ep, mesh.vpp, mesh.micro_batch, mesh.slices, mesh.split)


class _Prober:
    """The estimates one probe() makes on a mesh, memoised by choice, and the views of a Cost the surrogate's
    terms are read through (relative to c0, the probe that recomputes and offloads nothing)."""

    def __init__(self, m: ModelSpec, chip: Chip, job: Job, mesh: Mesh, base: Cost | None,
                 low: tuple[Choice, Cost] | None) -> None:
        self.m, self.chip, self.job, self.mesh = m, chip, job, mesh
        self.ev: dict[Choice, Cost] = dict([low]) if low is not None else {}
        self.calls = 0
        self.xla_floor = job.fw.compiled_step
        # Time that appears once anything is recomputed: the sequence-parallel re-gather and, under MaxText (a JAX
        # remat policy recomputes the routed tokens), the second dispatch and combine of the ep all-to-alls.
        self.once_comm = [Role.SP_REGATHER] + ([Role.EXPERT_EXCHANGE] if job.fw.jax_remat else [])
        self.c0 = base if base is not None else self.run(_choice(NONE))
        self.ev.setdefault(_choice(NONE), self.c0)

    def run(self, ch: Choice) -> Cost:
        """The estimate for one choice, made once."""
        if ch not in self.ev:
            self.ev[ch] = evaluate(self.m, self.chip, self.job, self.mesh, ch)
            self.calls += 1
        return self.ev[ch]

    def once_time(self, c: Cost) -> float:
        """The exposed time of the once-terms in c beyond c0's."""
        return sum(exposed(c, role) - exposed(self.c0, role) for role in self.once_comm)

    def lin(self, c: Cost) -> float:
        """Step time less the terms the surrogate models apart (hideable traffic, offload, the once-terms)."""
        return c.step_time_s - hideable(c) - exposed(c, Role.ACTIVATION_OFFLOAD) - self.once_time(c)

    def rest(self, c: Cost) -> float:
        """The memory the fit check reads, less the activations the remat choices set."""
        if self.xla_floor:
            return c.fit_memory_bytes - c.memory.get("activations", 0.0)
        return c.peak_memory_bytes - _act(c)


def _nu(s: Surrogate, c_min_remat: Cost, t_min: str) -> float:
    """How fast recompute hides the gradient reduce-scatter, read off the smallest single-remat probe."""
    return (s.g0 - hideable(c_min_remat)) / (s.rho[t_min] + s.rho_k)


def _state_terms(s: Surrogate, pr: _Prober, c_o: Cost, c_p: Cost) -> None:
    """Per-mesh terms: communication and model state (optimizer and parameter offload), and what the memory
    constraints need of the mesh (the XLA fit floor or not, the loop's gradient stack, tp)."""
    c0 = pr.c0
    # (the probes rest() reads recompute nothing, so the fit floor's loop buffer is 0 in them)
    s.xla_floor = pr.xla_floor
    s.loop_G = memory_terms(pr.m, pr.chip, pr.job, pr.mesh.plan(), c0.grad_accum).loop_grad_bytes \
        if s.xla_floor else 0.0
    s.loop_tp = pr.mesh.tp > 1
    s.L0 = pr.lin(c0)
    s.g0 = hideable(c0)
    s.nu = pr.chip.eff.overlap
    s.k_o, s.k_p = pr.lin(c_o) - s.L0, pr.lin(c_p) - s.L0
    s.R0 = pr.rest(c0)
    s.w_o, s.w_p = pr.rest(c_o) - s.R0, pr.rest(c_p) - s.R0
    s.h_o, s.h_p = c_o.host_memory_bytes, c_p.host_memory_bytes


_SHARED_TERMS = ("lam", "eps", "kappa", "rho_k", "mu", "rho_mu", "trig", "rho", "n_tau", "n_c", "B", "a", "b", "xi",
                "logits", "inflight", "same_stages", "eta")  # the terms a template from the same group_key shares


def _from_template(s: Surrogate, pr: _Prober, template: Surrogate) -> None:
    """Take the shared terms from a surrogate of the same group and check them at two more probes ('full' and the
    largest tensor offloaded); the per-mesh nu is read again."""
    for name in _SHARED_TERMS:
        setattr(s, name, getattr(template, name))
    pr.run(_choice(NONE, **dict.fromkeys(RECOMPUTABLE, "remat")))
    pr.run(_choice(NONE, mlp_in="offload"))
    if s.g0 > 0 and s.trig:
        t_min = min(s.trig, key=lambda t: s.rho[t])
        s.nu = _nu(s, pr.run(_choice(NONE, **{t_min: "remat"})), t_min)


def _recompute_terms(s: Surrogate, pr: _Prober, remat_probes: dict[str, Cost], c_full: Cost) -> None:
    """What recompute costs: its time, the memory-bound passes and tp collectives it reruns (lam), the once-terms
    (eps, kappa, rho_k, the MoE pair's mu) and how fast it hides the gradient reduce-scatter (nu); from 'none',
    each tensor alone recomputed and 'full'."""
    m, c0 = pr.m, pr.c0
    s.kappa = pr.once_time(c_full)
    s.rho = {t: remat_probes[t].time.get("recompute", 0.0) for t in RECOMPUTABLE}
    s.trig = tuple(t for t in RECOMPUTABLE if s.rho[t] > 0)
    # what any remat reruns once (costmodel.estimate.rerun_once_ops), in every probe above: out of each rho_t
    some = _choice(NONE, context="remat").remat
    s.rho_k = c0.grad_accum * stage_times(m, pr.chip, pr.job, pr.mesh.plan(some)).recompute_once
    s.rho = {t: r - s.rho_k for t, r in s.rho.items()}
    dl = {t: pr.lin(remat_probes[t]) - s.L0 for t in RECOMPUTABLE}
    n = len(s.trig)
    if m.is_moe and s.rho["mlp_out"] <= 0:  # (of its own: beyond what any remat reruns)
        # mlp_out alone recomputes nothing of its own (MaxText), but a MoE layer reruns its expert output matmul
        # with the expert input (costmodel.estimate: recomputed ops): the pair's own term. With k of the pair
        # among the triggers, lin(pair) - L0 = dl_in + dl_out - (k - 1) eps + mu and lin(full) - L0 =
        # sum(dl) - (n - 1) eps + mu: two equations for eps and mu.
        c_pair = pr.run(_choice(NONE, mlp_in="remat", mlp_out="remat"))
        k = sum(t in s.trig for t in ("mlp_in", "mlp_out"))
        others = sum(d for t, d in dl.items() if t not in ("mlp_in", "mlp_out"))
        if n > k:
            s.eps = (others - (pr.lin(c_full) - pr.lin(c_pair))) / (n - k)
        s.mu = pr.lin(c_pair) - s.L0 - dl["mlp_in"] - dl["mlp_out"] + (k - 1) * s.eps
        s.rho_mu = c_pair.time.get("recompute", 0.0) - s.rho["mlp_in"] - s.rho["mlp_out"] - s.rho_k
    elif n >= 2:
        s.eps = (sum(dl.values()) - (pr.lin(c_full) - s.L0)) / (n - 1)
    s.lam = {t: dl[t] - (s.eps if t in s.trig else 0.0) for t in RECOMPUTABLE}
    if s.g0 > 0 and s.trig:
        t_min = min(s.trig, key=lambda t: s.rho[t])
        s.nu = _nu(s, remat_probes[t_min], t_min)


def _offload_terms(s: Surrogate, pr: _Prober, offload_probes: dict[str, Cost]) -> None:
    """Activation offload: its traffic per tensor, the compute that hides it, and the host memory it takes, from
    each tensor alone offloaded."""
    acts = {t: _collective(offload_probes[t], Role.ACTIVATION_OFFLOAD) for t in TENSORS}
    n = next((a.count / 2 for a in acts.values() if a is not None and a.count), 0.0)
    s.n_tau = {t: (a.time_s / 2 if a is not None else 0.0) for t, a in acts.items()}
    if n:
        everything = _choice(NONE, **dict.fromkeys(TENSORS, "offload"))
        s.n_c = _offload_thresholds(pr.m, pr.chip, pr.job, pr.mesh, n, acts, lambda: pr.run(everything))
    s.eta = {t: offload_probes[t].host_memory_bytes - pr.c0.host_memory_bytes for t in TENSORS}


def _activation_terms(s: Surrogate, pr: _Prober, c_min: Cost, remat_probes: dict[str, Cost],
                      offload_probes: dict[str, Cost], c_full: Cost) -> None:
    """The saved activations per tensor, with and without anything recomputed, and the logits and pipeline
    in-flight factor they sit beside."""
    mesh, job, c0 = pr.mesh, pr.job, pr.c0
    # logits: the probe with the least activations has the last stage's logits counted (or pp = 1).
    s.logits = c_min.memory.get("logits", 0.0)
    s.inflight = pipeline_inflight(job, mesh.plan(), c0.grad_accum, pr.m.n_layers)
    s.same_stages = job.fw.spmd_pipeline(mesh.pp)

    def ks(c: Cost) -> float:
        if mesh.pp == 1:
            return _act(c) - s.logits
        if s.same_stages:
            return c.memory.get("activations", 0.0) / s.inflight
        if c.memory.get("logits", 0.0) == 0.0:  # first stage is the peak: all in-flight micro-batches
            return c.memory.get("activations", 0.0) / s.inflight
        return c.memory.get("activations", 0.0)

    # Nothing recomputed (NR = 1): 'none' and each tensor alone offloaded give b_t, then xi.
    k0 = ks(c0)
    s.B = ks(c_min)  # layer input offloaded, the rest recomputed: no tensor kept
    s.b = {t: k0 - ks(offload_probes[t]) for t in TENSORS}
    s.xi = k0 - s.B - sum(s.b.values())
    # Something recomputed (NR = 0): 'full' keeps only the layer input; each single-remat probe keeps all but one.
    s.a = {"layer_input": ks(c_full) - s.B}
    kept = {t: ks(remat_probes[t]) - s.B for t in RECOMPUTABLE}  # = sum of a over the other five tensors
    total = (sum(kept.values()) - s.a["layer_input"]) / (len(RECOMPUTABLE) - 1)
    s.a.update({t: total - kept[t] for t in RECOMPUTABLE})


def probe(m: ModelSpec, chip: Chip, job: Job, mesh: Mesh, base: Cost | None = None,
          low: tuple[Choice, Cost] | None = None, template: Surrogate | None = None,
          cons: Constraints | None = None) -> tuple[Surrogate, int]:
    """Build and check the surrogate for one mesh; returns it and the number of estimate() calls made.

    From scratch: 15 calls (16 for MoE: the MLP pair), fewer when `base` (the 'none' probe) or `low` (layer input
    offloaded, the rest recomputed) are given. With a `template` from a mesh of the same group (group_key), only
    the per-mesh state terms are probed (optimizer and parameter offload) and the shared terms are checked at two
    more probes ('full' and the largest tensor offloaded); a miss falls back to probing from scratch."""
    cons = (cons or Constraints()).for_mesh(m, chip, job, mesh)
    pr = _Prober(m, chip, job, mesh, base, low)
    c0 = pr.c0
    least = _choice(NONE, layer_input="offload", **dict.fromkeys(RECOMPUTABLE, "remat"))
    same = low is not None and low[0].remat.choices() == least.remat.choices() and \
        (low[0].offload_optimizer, low[0].offload_params) == (least.offload_optimizer, least.offload_params)
    c_min = low[1] if same else pr.run(least)
    s = Surrogate(mesh, chip.usable_hbm_bytes, chip.host_mem_bytes)
    # A switch the constraints pin (or the framework forbids) is not probed: its terms stay 0, the program fixes it.
    c_o = pr.run(_choice(NONE, o=True)) if cons.offload_optimizer is not False else c0
    c_p = pr.run(_choice(NONE, p=True)) if cons.offload_params is not False else c0
    _state_terms(s, pr, c_o, c_p)

    if template is not None:
        _from_template(s, pr, template)
        for ch, cost in pr.ev.items():
            s.check(ch, cost)
        if s.exact:
            return s, pr.calls
        s2, more = probe(m, chip, job, mesh, c0, (least, c_min), cons=cons)
        return s2, pr.calls + more

    remat_probes = {t: pr.run(_choice(NONE, **{t: "remat"})) for t in RECOMPUTABLE}
    offload_probes = {t: pr.run(_choice(NONE, **{t: "offload"})) for t in TENSORS}
    c_full = pr.run(_choice(NONE, **dict.fromkeys(RECOMPUTABLE, "remat")))
    _recompute_terms(s, pr, remat_probes, c_full)
    _offload_terms(s, pr, offload_probes)
    _activation_terms(s, pr, c_min, remat_probes, offload_probes, c_full)
    for ch, cost in pr.ev.items():
        s.check(ch, cost)
    return s, pr.calls


def _offload_thresholds(m: ModelSpec, chip: Chip, job: Job, mesh: Mesh, n: float, acts: dict,
                        all_offloaded) -> tuple[float, float]:
    """n * (the forward and the backward time of one layer that hide offload traffic).

    The cost model exposes n * (max(0, tau - h*f) + max(0, tau - h*b)) for tau seconds of traffic per layer, f
    and b one layer's forward and backward (costmodel.estimate.stage_times) and h an overlap fraction. h is read
    off the probe with the most exposure (solving that piecewise-linear equation); when no single-tensor probe
    is exposed, off the probe with every tensor offloaded; when even that is hidden, nothing ever is."""
    st = stage_times(m, chip, job, mesh.plan())
    f, b = st.layer_fwd, st.layer_bwd
    pts = [(a.time_s / a.count, a.exposed_s / n) for a in acts.values() if a is not None and a.count]
    tau, e = max(pts, key=lambda p: (p[1], p[0]))
    if e <= 0:
        a = _collective(all_offloaded(), Role.ACTIVATION_OFFLOAD)
        tau, e = a.time_s / a.count, a.exposed_s / n
        if e <= 0:
            return (n * tau, n * tau)
    lo, hi = sorted((f, b))
    h = (2 * tau - e) / (lo + hi)  # both terms exposed
    if h * hi >= tau:  # only the shorter one is exposed
        h = (tau - e) / lo
    return (n * h * f, n * h * b)


# ---- solving one mesh ---------------------------------------------------------------------------------------

@dataclass
class MeshResult:
    mesh: Mesh
    choice: Choice | None
    cost: Cost | None
    min_hbm_bytes: float  # the least HBM any allowed assignment needs (for infeasibility explanations)
    estimates: int = 0
    brute_force: bool = False
    resolves: int = 0


def result_key(cost: Cost, mesh: Mesh, ch: Choice) -> tuple:
    """Deterministic order: step time, then memory, then the canonical mesh and choice tuples."""
    return (cost.step_time_s, cost.peak_memory_bytes, mesh, ch.key())


def brute_force(m: ModelSpec, chip: Chip, job: Job, mesh: Mesh, cons: Constraints) -> MeshResult:
    """Every allowed assignment costed with estimate(): the reference the CP-SAT path is checked against. Under a
    Megatron-Core policy set, where remat full fits and none does not, block recompute's fewest layers that fit
    too (block_recompute)."""
    cons = cons.for_mesh(m, chip, job, mesh)
    best = None
    min_hbm = math.inf
    choices = all_choices(cons)
    costs = [(ch, evaluate(m, chip, job, mesh, ch)) for ch in choices]
    n_est = len(costs)
    # Megatron-Core's block recompute, within its whole-layer policy set (planner.export_megatron.megatron_constraints;
    # the per-tensor search of solve_mesh has no layer counts)
    if job.fw.block_recompute and policy_set(cons) is not None and not any(c.fits and ch.remat.name == "none"
                                                                            for ch, c in costs):
        for ch, cost in list(costs):
            if cost.fits and ch.remat.name == "full":
                found, calls = block_recompute(m, chip, job, mesh, ch)
                costs += found
                n_est += calls
    for ch, cost in costs:
        min_hbm = min(min_hbm, cost.fit_memory_bytes)
        if cost.fits and (best is None or result_key(cost, mesh, ch) < result_key(best[1], mesh, best[0])):
            best = (ch, cost)
    best, calls = with_ep_overlap(m, chip, job, mesh, best)
    return MeshResult(mesh, best[0] if best else None, best[1] if best else None, min_hbm, n_est + calls, True)


def ep_overlap_applies(m: ModelSpec, job: Job, mesh: Mesh, ch: Choice) -> bool:
    """Whether the expert all-to-all overlap may go on this mesh's choice: a framework that runs it, a MoE model
    with ep > 1, the MoE layer's tensors kept (constraints.check_ep_overlap), and pp 1 or vpp > 1 (Megatron-Core
    refuses it on the plain 1F1B pipeline: planner.export_megatron drops it there)."""
    kept = all(ch.remat.choices()[t] != "remat" for t in ("mlp_in", "mlp_out"))
    return (job.fw.ep_overlap and m.n_moe_layers > 0 and mesh.ep > 1 and (mesh.pp == 1 or mesh.vpp > 1) and kept
            and not ch.recompute_num_layers)


def with_ep_overlap(m: ModelSpec, chip: Chip, job: Job, mesh: Mesh,
                    best: tuple[Choice, Cost] | None) -> tuple[tuple[Choice, Cost] | None, int]:
    """The mesh's best assignment with the expert all-to-all overlap on where it applies (ep_overlap_applies),
    fits (one more forward pass in flight: costmodel.memory.pipeline_inflight) and is faster; and the estimates
    it took (0 or 1). Tried on the best assignment only: the overlap only adds memory, so it fits nowhere the
    assignment did not, and it saves about the same time under each kept-MoE assignment."""
    if best is None or not ep_overlap_applies(m, job, mesh, best[0]):
        return best, 0
    ch = replace(best[0], ep_overlap=True)
    cost = evaluate(m, chip, job, mesh, ch)
    faster = cost.fits and result_key(cost, mesh, ch) < result_key(best[1], mesh, best[0])
    return ((ch, cost) if faster else best), 1


def block_recompute(m: ModelSpec, chip: Chip, job: Job, mesh: Mesh, full: Choice) -> tuple[list, int]:
    """Megatron-Core's block recompute for a mesh where remat full fits and none does not: the fewest layers per
    chunk N (1 .. chunk - 1) that still fit, found by bisection (memory falls and time rises with N:
    costmodel.memory.activation_terms, costmodel.plan.recomputed_share), as [(choice, cost)] (empty when even
    chunk - 1 does not fit), and the estimates it took (about log2 of the chunk's layers)."""
    chunk = -(-busiest_stage_layers(m.n_layers, full.plan(mesh)) // mesh.vpp)  # layers of the largest chunk
    lo, hi, calls, best = 1, chunk - 1, 0, []
    while lo <= hi:
        mid = (lo + hi) // 2
        ch = replace(full, recompute_num_layers=mid)
        cost = evaluate(m, chip, job, mesh, ch)
        calls += 1
        if cost.fits:
            best, hi = [(ch, cost)], mid - 1
        else:
            lo = mid + 1
    return best, calls


def solve_mesh(m: ModelSpec, chip: Chip, job: Job, mesh: Mesh, cons: Constraints, base: Cost | None = None,
               templates: dict | None = None) -> MeshResult:
    """The best remat/offload assignment for one mesh (CP-SAT over the probed surrogate, verified).

    templates: surrogates of already-solved meshes by group_key, shared across a search (probing reuses them)."""
    cons = cons.for_mesh(m, chip, job, mesh)
    ch_min = min_memory_choice(cons)
    c_min = evaluate(m, chip, job, mesh, ch_min)
    if c_min.fit_memory_bytes > chip.usable_hbm_bytes:
        return MeshResult(mesh, None, None, c_min.fit_memory_bytes, 1)
    # A handful of whole-layer policies: cost each. So too for steps so long (years) that the program's integer
    # nanoseconds could leave CP-SAT's int64 range.
    if policy_set(cons) is not None or c_min.step_time_s * NS * TIE_WEIGHT > 2**60:
        r = brute_force(m, chip, job, mesh, cons)
        r.estimates += 1
        return r
    key = group_key(mesh)
    s, calls = probe(m, chip, job, mesh, base, (ch_min, c_min), (templates or {}).get(key), cons)
    n_est = 1 + calls
    if not s.exact:
        r = brute_force(m, chip, job, mesh, cons)
        r.estimates += n_est
        return r
    if templates is not None and key not in templates:
        templates[key] = s
    prog, x, o, p = s.program(cons)
    best: tuple[Choice, Cost] | None = None
    resolves = 0
    for resolves in range(MAX_RESOLVES):  # noqa: B007
        vals = prog.solve()
        if vals is None:
            break
        ch = Choice(make_remat({t: next(c for c in TENSOR_CHOICES[t] if vals[x[t, c]]) for t in TENSORS}),
                    bool(vals[o]), bool(vals[p]))
        cost = evaluate(m, chip, job, mesh, ch)
        n_est += 1
        if cost.fits and (best is None or result_key(cost, mesh, ch) < result_key(best[1], mesh, best[0])):
            best = (ch, cost)
        if cost.fits and _close(cost.step_time_s, s.time(ch), cost.step_time_s):
            break  # verified: the surrogate optimum is the true optimum
        # Exclude this assignment and ask again.
        decision = [v for v in x.values()] + [o, p]
        ones = [v for v in decision if vals[v]]
        prog.add([(v, -1) for v in ones] + [(v, 1) for v in decision if not vals[v]], lb=1 - len(ones))
    if best is None and c_min.fits:
        # The least-memory assignment fits, so no fitting answer means the surrogate misled the solver on this
        # mesh: settle it by brute force rather than drop a feasible mesh.
        r = brute_force(m, chip, job, mesh, cons)
        r.estimates += n_est
        r.resolves = resolves
        return r
    best, calls = with_ep_overlap(m, chip, job, mesh, best)
    return MeshResult(mesh, best[0] if best else None, best[1] if best else None, c_min.fit_memory_bytes,
                      n_est + calls, False, resolves)
