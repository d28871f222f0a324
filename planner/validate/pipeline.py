"""Pipeline parallelism for the validator: GPipe stages with `jax.shard_map` over the 'pp' mesh axis, laid out as
MaxText's pipeline (maxtext/layers/pipeline.py) runs them.

Layers split evenly: stage s holds layers [s*L/pp, (s+1)*L/pp), stacked per stage and sharded over 'pp'; the
embedding tables and final norm are replicated over 'pp'. The step runs in a shard_map manual over 'pp' and 'dp'
(the other axes stay automatic, so planner.validate.model's layer code is reused); each gradient is reduced once
per step. GPipe: at tick t stage s runs micro-batch t - s, M + pp - 1 ticks, `ppermute` between stages, the bubble
computed too; the logits' batch is split over the stages. Circular (vpp = R > 1, MaxText's num_pipeline_repeats,
M = pp): stage s holds R chunks of L/(pp*R) layers, M*R + pp - 1 ticks. The tick loop is unrolled (FLOPs and
collectives) or one lax.scan (Setup.scan_pipeline, the memory figure); Setup.gather_stage gathers a stage's bf16
weights once for the whole loop, as MaxText's pipeline holds them.
(details: docs/validator.md)
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from planner.validate.axis_rules import embed_axes
from planner.validate.model import (
    BATCH,
    Setup,
    Sharder,
    Step,
    init_params,
    jit_step,
    layer_fn,
    param_specs,
    rmsnorm,
)


def micro_steps(cfg: Setup) -> int:
    """M: micro-batches per step = global batch / (micro_batch * dp * fsdp * ep)."""
    plan = cfg.plan
    return max(1, cfg.global_batch // (plan.batch_shards * plan.micro_batch))


# ---- parameter layout ------------------------------------------------------------------------------------

def _stack(*xs):
    if isinstance(xs[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)
    return np.stack(xs) if isinstance(xs[0], np.ndarray) else jnp.stack(xs)


def to_stages(params: dict, pp: int, vpp: int = 1) -> dict:
    """Flat per-layer list -> L/(pp*vpp) layer dicts whose leaves are stacked over the pp stages ([pp, ...]), and
    with vpp > 1 over each stage's repeats ([pp, vpp, ...]). Stage s's j-th layer of repeat r is global layer
    (r*pp + s) * L/(pp*vpp) + j, MaxText's circular layout (layers_per_stage chunks dealt round the ring)."""
    layers = params["layers"]
    per = len(layers) // (pp * vpp)

    def layer(s: int, r: int, j: int) -> dict:
        return layers[(r * pp + s) * per + j]

    if vpp == 1:
        stacked = [jax.tree.map(_stack, *[layer(s, 0, j) for s in range(pp)]) for j in range(per)]
    else:
        stacked = [jax.tree.map(_stack, *[jax.tree.map(_stack, *[layer(s, r, j) for r in range(vpp)])
                                          for s in range(pp)]) for j in range(per)]
    return {**params, "layers": stacked}


def from_stages(params: dict, vpp: int = 1) -> dict:
    """Inverse of to_stages (e.g. to compare gradients with the one-device step's)."""
    stacked = params["layers"]
    pp = jax.tree.leaves(stacked[0])[0].shape[0]
    if vpp == 1:
        layers = [jax.tree.map(lambda a, s=s: a[s], lay) for s in range(pp) for lay in stacked]
    else:
        layers = [jax.tree.map(lambda a, s=s, r=r: a[s, r], lay)
                  for r in range(vpp) for s in range(pp) for lay in stacked]
    return {**params, "layers": layers}


def stage_param_specs(cfg: Setup, moments: bool = False) -> dict:
    specs = param_specs(cfg, moments)
    plan = cfg.plan
    per = cfg.model.n_layers // (plan.pp * plan.vpp)
    lead = ("pp",) if plan.vpp == 1 else ("pp", None)
    specs["layers"] = [{k: P(*lead, *s) for k, s in lay.items()} for lay in specs["layers"][:per]]
    return specs


# ---- the pipelined loss ----------------------------------------------------------------------------------

MANUAL = ("pp", "dp")  # the shard_map's manual axes


def _auto(entry):
    """A PartitionSpec entry without the manual axes."""
    if entry is None or isinstance(entry, str):
        return None if entry in MANUAL else entry
    kept = tuple(a for a in entry if a not in MANUAL)
    return kept or None


class StageSharder(Sharder):
    """Sharding constraints inside the shard_map (manual over 'pp' and 'dp'): bare PartitionSpecs over the
    automatic axes."""

    def __call__(self, x, *spec):
        return jax.lax.with_sharding_constraint(x, P(*(_auto(e) for e in spec)))


def _shape(cfg: Setup) -> tuple[int, int, int, list[tuple[int, int]]]:
    """(stages S, micro-batches M, repeats R, the shift's pairs): a chain for GPipe, a ring when the micro-batches
    go round the stages R = vpp times (MaxText's circular pipeline; with M = S a micro-batch leaving the last stage
    reaches the first just when its next repeat starts there)."""
    S, M, R = cfg.plan.pp, micro_steps(cfg), cfg.plan.vpp
    return S, M, R, [(i, i + 1) for i in range(S - 1)] if R == 1 else [(i, (i + 1) % S) for i in range(S)]


def _chunk(layers, R: int, M: int, t, stage):
    """The stage's layers for tick t: with repeats, chunk r = (t - stage) // M of its [vpp, ...] stacks."""
    if R == 1:
        return layers
    r = jnp.clip((t - stage) // M, 0, R - 1)
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, 0, keepdims=False), layers)


def unrolled_ticks(cfg: Setup, sh: Sharder, f, layers, table, tokens, stage) -> list:
    """The GPipe forward, unrolled (XLA's cost analysis counts every tick; XLA:CPU's scheduler, though, defers
    each tick's weight-gradient products to the end of the backward pass and keeps their inputs): at tick t
    stage s runs micro-batch (t - s) mod M of repeat (t - s) // M; returns the last stage's M outputs of the
    last repeat."""
    S, M, R, pairs = _shape(cfg)
    state, outs = None, []
    for t in range(M * R + S - 1):
        if t < M:
            x0 = sh.resid(jnp.take(table, tokens[t], axis=0))
            state = x0 if state is None else sh.resid(jnp.where(stage == 0, x0, state))
        for lp in _chunk(layers, R, M, t, stage):
            state = f(lp, state)
        if t >= M * (R - 1) + S - 1:
            outs.append(state)  # the last stage's output of micro-batch t - (S - 1) - M * (R - 1)
        if t < M * R + S - 2:
            state = sh.resid(jax.lax.ppermute(state, "pp", pairs))
    return outs


def scanned_ticks(cfg: Setup, sh: Sharder, f, layers, table, tokens, stage) -> list:
    """The same schedule as one lax.scan over the ticks, as MaxText's pipeline iterates (each tick's weight
    gradients are accumulated in the backward loop's carry); for the memory figure only: XLA counts a loop body's
    FLOPs and collectives once."""
    S, M, R, pairs = _shape(cfg)

    # The micro-batches are embedded before the loop (MaxText embeds outside its pipeline module); like MaxText's
    # state_io, one [M, ...] buffer holds the inputs and takes the last stage's outputs as they come.
    io = sh(jnp.take(table, tokens, axis=0), None, BATCH, sh.seq, None)

    def tick(carry, t):
        state, io = carry
        x0 = jax.lax.dynamic_index_in_dim(io, jnp.minimum(t, M - 1), 0, False)
        state = sh.resid(jnp.where((stage == 0) & (t < M), x0, state))
        for lp in _chunk(layers, R, M, t, stage):
            state = f(lp, state)
        first = M * (R - 1) + S - 1  # the tick the last repeat's first micro-batch leaves the last stage
        k = jnp.maximum(t - first, 0)
        out = jnp.where(t >= first, state, jax.lax.dynamic_index_in_dim(io, k, 0, False))
        io = jax.lax.dynamic_update_index_in_dim(io, out, k, 0)
        return (sh.resid(jax.lax.ppermute(state, "pp", pairs)), io), None

    (_, io), _ = jax.lax.scan(tick, (jnp.zeros_like(io[0]), io), jnp.arange(M * R + S - 1))
    return [io[k] for k in range(M)]


def gathered_stage(cfg: Setup, sh: Sharder, layers: list) -> list:
    """The stage's bf16 layer weights gathered over the axes that shard their d_model (fsdp; ep for the weights
    outside the experts, which stay split over ep by expert), once, for the whole tick loop: MaxText's pipeline
    holds the whole stage's gathered bf16 weights through its iteration loop and carries their unsharded bf16
    gradient, reduce-scattered after it (benchmarks/maxtext_memory/NOTES.md, "Pipeline parallelism";
    costmodel.memory.maxtext_stage_buffers). GPipe stages only: with repeats (vpp) MaxText gathers one chunk per
    iteration, and gathering every chunk for the whole loop made XLA:TPU hold 46 GB where MaxText holds 28
    (llama2-7b pp 2 x vpp 2 x fsdp 4; each tick's dynamic chunk index copies the gathered stack), so a circular
    pipeline keeps its chunks sharded (29.6 GB there)."""
    if cfg.plan.vpp > 1:
        return layers
    W = set(embed_axes(cfg.plan))  # MaxText's `embed` split (planner.validate.axis_rules)

    def gathered(entry):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        return entry if entry == "ep" or not (set(names) & W) else None

    specs = param_specs(cfg)["layers"]
    return [{k: sh(v, *(gathered(e) for e in specs[j][k])) for k, v in lay.items()}
            for j, lay in enumerate(layers)]


def pipeline_loss(cfg: Setup, mesh, params: dict, tokens, targets):
    m, plan = cfg.model, cfg.plan
    S, M = plan.pp, micro_steps(cfg)
    sh = StageSharder(mesh, plan)
    f = layer_fn(cfg, sh)
    layers, rest = params["layers"], {k: v for k, v in params.items() if k != "layers"}

    def stage_program(layers, rest, tokens, targets):
        cdt = cfg.cdt
        # Every parameter turns varying over the manual axes once, here: its gradient is summed over 'dp' (the
        # pp-replicated ones over 'dp' x 'pp', one all-reduce) once per step, after the last micro-batch, as
        # MaxText and Megatron reduce gradients (left to GSPMD, each tick's partial sums were all-reduced).
        layers = jax.tree.map(lambda a: jax.lax.pcast(a[0].astype(cdt), "dp", to="varying"), layers)
        if cfg.gather_stage:
            layers = gathered_stage(cfg, sh, layers)
        p = jax.tree.map(lambda a: jax.lax.pcast(a.astype(cdt), MANUAL, to="varying"), rest)
        stage = jax.lax.axis_index("pp")
        outs = (scanned_ticks if cfg.scan_pipeline else unrolled_ticks)(cfg, sh, f, layers, p["embed"], tokens, stage)
        # MaxText computes the logits outside the pipeline with the batch split over the stages too
        # (activation_embed_and_logits_batch: data, stage, fsdp): stage j takes micro-batches [j*M/S, (j+1)*M/S)
        # of the last stage's outputs (one shift from the last stage per other stage).
        n = M // S
        mine = jnp.stack(outs[(S - 1) * n:])
        for j in range(S - 1):
            got = jax.lax.ppermute(jnp.stack(outs[j * n:(j + 1) * n]), "pp", [(S - 1, j)])
            mine = jnp.where(stage == j, got, mine)
        tgt = jax.lax.dynamic_slice_in_dim(targets, stage * n, n, axis=0)
        w_out = p["embed"].T if m.tied_embeddings else p["unembed"]
        x = sh(rmsnorm(mine, p["final_norm"]), None, BATCH, "cp", None)
        logits = sh(jnp.einsum("nbsd,dv->nbsv", x, w_out), None, BATCH, "cp", "tp").astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        target_logit = jnp.sum(logits * jax.nn.one_hot(tgt, m.vocab_size, dtype=logits.dtype), axis=-1)
        loss = jnp.mean(lse - target_logit) / S  # the mean of this stage's share; summed over the stages
        return jax.lax.pmean(jax.lax.psum(loss, "pp"), "dp")

    # Micro-batches [M, b, s] outside the shard_map: micro-batch k holds rows k, M + k, 2M + k, ... of the batch,
    # so that every device keeps its own rows (a local reshape of the batch-sharded tokens).
    B, s = tokens.shape
    split = NamedSharding(mesh, P(None, BATCH, "cp"))
    tokens, targets = (jax.lax.with_sharding_constraint(a.reshape(B // M, M, s).transpose(1, 0, 2), split)
                       for a in (tokens, targets))
    rest_specs = jax.tree.map(lambda _: P(), rest)
    layer_specs = jax.tree.map(lambda _: P("pp"), layers)
    prog = jax.shard_map(stage_program, mesh=mesh, in_specs=(layer_specs, rest_specs, P(None, "dp"), P(None, "dp")),
                         out_specs=P(), axis_names=frozenset(MANUAL))
    return prog(layers, rest, tokens, targets)


# ---- the step --------------------------------------------------------------------------------------------

class PipelineStep(Step):
    """A Step whose parameters (and Adam moments) are stacked per stage (see to_stages)."""

    def host_params(self, seed: int = 0) -> dict:
        return to_stages(init_params(self.cfg, seed), self.cfg.plan.pp, self.cfg.plan.vpp)

    def unstack(self, tree: dict) -> dict:
        return from_stages(tree, self.cfg.plan.vpp)

    def param_shapes(self) -> dict:
        return to_stages(init_params(self.cfg, shapes_only=True), self.cfg.plan.pp, self.cfg.plan.vpp)


def build_pipeline_step(cfg: Setup, mesh, donate: bool = True) -> PipelineStep:
    from hardware.errors import InputError
    from planner.validate.scale import pipeline_unsupported

    why = pipeline_unsupported(cfg.plan, cfg.model.n_layers, micro_steps(cfg))
    if why:
        raise InputError(why)
    if "pp" not in mesh.axis_names:
        raise InputError("pp: the mesh has no 'pp' axis; build it with planner.validate.model.make_mesh(plan)")

    return jit_step(PipelineStep, cfg, mesh, partial(pipeline_loss, cfg, mesh), stage_param_specs(cfg),
                    stage_param_specs(cfg, moments=True), donate)
