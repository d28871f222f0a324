#!/usr/bin/env python3
"""Where XLA:TPU's memory_analysis() temp exceeds its own buffer assignment: small programs, compiled ahead of time.

On MaxText's compiles memory_analysis() reports 1.2-13.3 GB more temp than the buffer assignment it dumps (the
total MaxText prints minus XLA's peak_memory_in_bytes, NOTES.md); this compiles small JAX programs for a v5p 2x2x1
topology and prints, for each, argument / output / temp, the preallocated temp of the dumped buffer assignment
(--xla_dump_to, color 0) and their difference. Run in the MaxText environment (libtpu):

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 /work/maxtext-env/bin/python benchmarks/maxtext_memory/excess_probe.py
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.topologies import get_topology_desc  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

N = 8192
BF, F32 = jnp.bfloat16, jnp.float32
GB = 1e9


def mesh() -> Mesh:
    desc = get_topology_desc(platform="tpu", topology_name="v5p:2x2x1", chip_config_name="megacore",
                             chips_per_host_bounds=(2, 2, 1), num_slices=1, wrap=(False, False, False))
    return Mesh(np.array(desc.devices).reshape(4), ("x",))


def prealloc_temp(dump: str) -> int:
    """The color-0 (HBM) preallocated temp allocation of the dumped buffer assignment."""
    total = 0
    for fn in glob.glob(dump + "/*after_optimizations-buffer-assignment.txt"):
        total += sum(int(m.group(1)) for m in re.finditer(r"allocation \d+: size (\d+), page 0, preallocated-temp",
                                                           open(fn).read()))
    return total


def report(msh: Mesh, name: str, f, *specs) -> None:
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(msh, P())) for s, d in specs]
    dump = tempfile.mkdtemp(prefix="excess_")
    try:
        ma = jax.jit(f).lower(*args).compile(compiler_options={"xla_dump_to": dump}).memory_analysis()
        pre = prealloc_temp(dump)
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    print(f"{name:34s} {ma.argument_size_in_bytes / GB:7.3f} {ma.output_size_in_bytes / GB:7.3f} "
          f"{ma.temp_size_in_bytes / GB:7.3f} {pre / GB:9.3f} {(ma.temp_size_in_bytes - pre) / GB:7.3f}", flush=True)


def chain(h, w):
    return jnp.tanh(h @ w)


def two(h, w, v):
    return jnp.tanh(jnp.tanh(h @ w) @ v)


def scan_loss(step, remat: bool = False):
    body = jax.checkpoint(step) if remat else step

    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (body(h, *w) if isinstance(w, tuple) else body(h, w), None), x, ws)
        return jnp.sum(h.astype(F32))
    return loss


def unrolled_loss(ws, x):
    h = x
    for i in range(ws.shape[0]):
        h = chain(h, ws[i])
    return jnp.sum(h.astype(F32))


def residual_layer(h, w, v):
    return h + jnp.tanh(h @ w) @ v


def grouped_loss(k: int, block: bool):
    """12 layers scanned k per iteration, each layer under its own jax.checkpoint (the validator's step) or one
    jax.checkpoint around the k layers (MaxText's Gemma 3 block)."""
    def loss(ws, vs, x):
        def body(h, wv):
            w, v = wv
            if block:
                def blk(h, w, v):
                    for i in range(k):
                        h = residual_layer(h, w[i], v[i])
                    return h
                return jax.checkpoint(blk)(h, w, v), None
            for i in range(k):
                h = jax.checkpoint(residual_layer)(h, w[i], v[i])
            return h, None
        def split(a):
            return a.reshape(a.shape[0] // k, k, *a.shape[1:])
        h, _ = jax.lax.scan(body, x, (split(ws), split(vs)))
        return jnp.sum(h.astype(F32))
    return jax.grad(loss, argnums=(0, 1))


def stacked_forward(width: int, stack_out: bool):
    """A forward scan (no gradient) whose body makes a [N, width*N] intermediate and stacks its [N, N] result:
    the stack returned (a program output) or summed after the loop (a temporary)."""
    def f(ws, vs, x):
        def body(h, wv):
            t = jnp.tanh(jnp.tanh(h @ wv[0]) @ wv[1])
            return t, t
        h, ys = jax.lax.scan(body, x, (ws, vs))
        return (h, ys) if stack_out else (h, jnp.sum(ys, axis=0))
    return f


def temp_across_forward(rows: int):
    """A forward scan (2 matmuls, width 4N, no stacked output) with a [rows, N] temporary made before the loop
    and used after it."""
    def f(ws, vs, x):
        z = jnp.tanh(jnp.concatenate([x] * (rows // N)) * 2)
        h, _ = jax.lax.scan(lambda h, wv: (jnp.tanh(jnp.tanh(h @ wv[0]) @ wv[1]), None), x, (ws, vs))
        return h + jnp.sum(z.reshape(-1, N, N), axis=0)
    return f


def layers_vjp(k: int, block: bool):
    """One scan iteration's backward with no loop: the VJP of k residual layers (each its own jax.checkpoint, or
    one around them) at h with cotangent g."""
    def fwd(w, v, h):
        if block:
            def blk(h, w, v):
                for i in range(k):
                    h = residual_layer(h, w[i], v[i])
                return h
            return jax.checkpoint(blk)(h, w, v)
        for i in range(k):
            h = jax.checkpoint(residual_layer)(h, w[i], v[i])
        return h

    def f(w, v, h, g):
        return jax.vjp(fwd, w, v, h)[1](g)
    return f


def main() -> None:
    msh = mesh()
    print(f"{'program (N = 8192, bf16, 4 layers)':34s} {'arg GB':>7s} {'out GB':>7s} {'temp GB':>7s} "
          f"{'prealloc GB':>9s} {'excess':>7s}")
    w4, x1, x2 = ((4, N, N), BF), ((N, N), BF), ((2 * N, N), BF)
    report(msh, "forward scan", scan_loss(chain), w4, x1)
    report(msh, "grad, unrolled layers", jax.grad(unrolled_loss), w4, x1)
    report(msh, "grad, scanned layers", jax.grad(scan_loss(chain)), w4, x1)
    report(msh, "grad, scanned, 2x tokens", jax.grad(scan_loss(chain)), w4, x2)
    report(msh, "grad, scanned, fp32", jax.grad(scan_loss(chain)), ((4, N, N), F32), ((N, N), F32))
    for k, x in ((2, x1), (2, x2), (4, x1)):
        ws = (((4, N, k * N), BF), ((4, k * N, N), BF))
        loss = scan_loss(two)
        report(msh, f"grad, 2 matmuls, width {k}N, {x[0][0] // N}x tok",
               jax.grad(lambda w, v, h, loss=loss: loss((w, v), h), argnums=(0, 1)), *ws, x)
        loss = scan_loss(two, remat=True)
        report(msh, "  the same under jax.checkpoint",
               jax.grad(lambda w, v, h, loss=loss: loss((w, v), h), argnums=(0, 1)), *ws, x)
    w12, v12 = ((12, N, 2 * N), BF), ((12, 2 * N, N), BF)
    for k, block in ((1, False), (2, False), (3, False), (6, False), (2, True), (3, True), (6, True)):
        report(msh, f"12 layers, {k} per iteration, " + ("block remat" if block else "layer remat"),
               grouped_loss(k, block), w12, v12, x1)
    for width in (1, 2, 4):  # no gradient: a forward loop whose stacked outputs are, or are not, temporaries
        wv = (((4, N, width * N), BF), ((4, width * N, N), BF))
        report(msh, f"fwd scan, {width}N-wide, stack summed", stacked_forward(width, False), *wv, x1)
        report(msh, f"fwd scan, {width}N-wide, stack returned", stacked_forward(width, True), *wv, x1)
    for width in (2, 4):
        wv = (((4, N, width * N), BF), ((4, width * N, N), BF))
        for rows in (N, 4 * N):
            report(msh, f"fwd scan, {width}N-wide, [{rows // N}N, N] temp across", temp_across_forward(rows), *wv, x1)
    for k, block in ((1, False), (2, False), (6, False), (2, True), (3, True), (6, True)):  # no loop
        report(msh, f"vjp of {k} layers, no loop, " + ("block remat" if block else "layer remat"),
               layers_vjp(k, block), ((k, N, 2 * N), BF), ((k, 2 * N, N), BF), x1, x1)


if __name__ == "__main__":
    main()
