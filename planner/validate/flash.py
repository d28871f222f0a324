"""Blockwise causal attention with a flash-style backward, in plain JAX (CPU, GPU and TPU, compiles ahead of time).

As flash attention does, block by block: the forward runs an online softmax over the key blocks each query block
can see and keeps only the output and the fp32 log-sum-exp; the backward (`jax.custom_vjp`) recomputes each
block's probabilities from q, k and the log-sum-exp and accumulates dq, dk, dv (dS = P * (dP - rowsum(dO * O))).
So the residuals are q, k, v, the output and the log-sum-exp, as the cost model assumes; a score block exists only
transiently. The loops are unrolled Python loops (XLA's cost analysis counts every block), chained with
optimization barriers so that one block's scores are live at a time (XLA:CPU drops them:
docs/validator_random_shapes.md).

Context parallelism: queries arrive as [b, R, sq, ...] (R = cp, query position r*sq + i) with all keys; a key
block is skipped only if it is above the diagonal for every r, and `attention_flops` counts what is computed.
(details: docs/validator.md)
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

NEG = -1e30


def block_size(sq: int, target: int = 512) -> int:
    """The largest divisor of sq that is at most `target` (the query and key block size)."""
    for b in range(min(sq, target), 0, -1):
        if sq % b == 0:
            return b
    return sq


def _pairs(rows: int, sq: int, s: int, bq: int, bk: int, window: int = 0) -> list[tuple[int, int]]:
    """(query block, key block) pairs with at least one unmasked entry for some row r (window > 0: a query at
    position q sees the keys q - window < k <= q)."""
    out = []
    for i in range(sq // bq):
        for j in range(s // bk):
            firsts = (r * sq + i * bq for r in range(rows))  # each row's first query position in block i
            if any(j * bk <= q + bq - 1 and (not window or j * bk + bk - 1 > q - window) for q in firsts):
                out.append((i, j))
    return out


def attention_flops(b: int, rows: int, sq: int, s: int, heads: int, hd: int, target: int = 512,
                    dv: int = 0, window: int = 0) -> tuple[float, float]:
    """(forward, backward) matmul FLOPs of `causal_attention` for these shapes (heads = query heads; hd the query
    and key width, dv the value width, default hd; window: a sliding window's width, 0 for none)."""
    bq = block_size(sq, target)
    bk = block_size(s, target)
    n = len(_pairs(rows, sq, s, bq, bk, window))
    qk = 2.0 * b * rows * heads * bq * bk * hd  # one [bq, hd] x [hd, bk] product
    pv = qk * (dv or hd) / hd  # one [bq, bk] x [bk, dv] product
    return n * (qk + pv), n * (3 * qk + 2 * pv)  # fwd: QK^T, PV; bwd: QK^T again, dQ, dK; dV, dP


def _mask(rows: int, sq: int, i: int, j: int, bq: int, bk: int, window: int = 0):
    """[rows, bq, bk] causal (and sliding-window) mask of block pair (i, j), or None when the block is unmasked
    for every row."""
    if not window and j * bk + bk - 1 <= i * bq:  # its last key precedes its first query (row 0, so every row)
        return None
    qpos = (jnp.arange(rows) * sq)[:, None] + i * bq + jnp.arange(bq)[None, :]
    kpos = j * bk + jnp.arange(bk)
    keep = kpos[None, None, :] <= qpos[:, :, None]
    return keep & (kpos[None, None, :] > qpos[:, :, None] - window) if window else keep


def _after(x, prev):
    """x, made to wait for `prev` (an optimization barrier): without it XLA's scheduler runs independent blocks
    side by side, and dozens of score blocks are live at once (1.6 GB at seq 4096 on llama3-8b)."""
    if prev is None:
        return x
    return jax.lax.optimization_barrier((x, prev))[0]


def _scores(qi, kj, scale):
    # qi [b, R, bq, kv, g, d], kj [b, bk, kv, d] -> [b, R, kv, g, bq, bk] in fp32
    return jnp.einsum("brqkgd,btkd->brkgqt", qi, kj, preferred_element_type=jnp.float32) * scale


def _fwd(q, k, v, target, window):
    b, rows, sq, kv, g, d = q.shape
    s, dv = k.shape[1], v.shape[-1]
    bq, bk = block_size(sq, target), block_size(s, target)
    scale = 1.0 / math.sqrt(d)
    pairs = _pairs(rows, sq, s, bq, bk, window)
    outs, lses = [], []
    prev = None
    for i in range(sq // bq):
        qi = _after(q[:, :, i * bq:(i + 1) * bq], prev)
        m = jnp.full((b, rows, kv, g, bq), NEG, jnp.float32)
        lsum = jnp.zeros((b, rows, kv, g, bq), jnp.float32)
        acc = jnp.zeros((b, rows, kv, g, bq, dv), jnp.float32)
        for _, j in (p for p in pairs if p[0] == i):
            sc = _scores(qi, k[:, j * bk:(j + 1) * bk], scale)
            mask = _mask(rows, sq, i, j, bq, bk, window)
            if mask is not None:
                sc = jnp.where(mask[None, :, None, None], sc, NEG)
            m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
            p = jnp.exp(sc - m_new[..., None])
            corr = jnp.exp(m - m_new)
            lsum = lsum * corr + jnp.sum(p, axis=-1)
            vj = v[:, j * bk:(j + 1) * bk]
            acc = acc * corr[..., None] + jnp.einsum("brkgqt,btkd->brkgqd", p.astype(v.dtype), vj,
                                                     preferred_element_type=jnp.float32)
            m = m_new
        outs.append((acc / lsum[..., None]).astype(q.dtype))
        prev = outs[-1]
        lses.append(m + jnp.log(lsum))
    out = jnp.concatenate(outs, axis=-2) if len(outs) > 1 else outs[0]  # [b, R, kv, g, sq, dv]
    lse = jnp.concatenate(lses, axis=-1) if len(lses) > 1 else lses[0]  # [b, R, kv, g, sq]
    return jnp.transpose(out, (0, 1, 4, 2, 3, 5)), lse


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def causal_attention(q, k, v, target: int = 512, window: int = 0):
    """q [b, R, sq, kv_heads, groups, d], k [b, s, kv_heads, d], v [b, s, kv_heads, dv]
    -> [b, R, sq, kv_heads, groups, dv] (dv = d but for MLA); window > 0: each query sees its last `window`
    keys (itself included), as a sliding-window layer does."""
    return _fwd(q, k, v, target, window)[0]


def _vjp_fwd(q, k, v, target, window):
    out, lse = _fwd(q, k, v, target, window)
    return out, (q, k, v, out, lse)


def _vjp_bwd(target, window, res, dout):
    q, k, v, out, lse = res
    b, rows, sq, kv, g, d = q.shape
    s, dvw = k.shape[1], v.shape[-1]
    bq, bk = block_size(sq, target), block_size(s, target)
    scale = 1.0 / math.sqrt(d)
    # D = rowsum(dO * O), [b, R, kv, g, sq]
    delta = jnp.einsum("brqkgd,brqkgd->brkgq", dout.astype(jnp.float32), out.astype(jnp.float32))
    prev = None
    dq = [jnp.zeros((b, rows, bq, kv, g, d), jnp.float32) for _ in range(sq // bq)]
    dk = [jnp.zeros((b, bk, kv, d), jnp.float32) for _ in range(s // bk)]
    dv = [jnp.zeros((b, bk, kv, dvw), jnp.float32) for _ in range(s // bk)]
    for i, j in _pairs(rows, sq, s, bq, bk, window):
        qs, ks = slice(i * bq, (i + 1) * bq), slice(j * bk, (j + 1) * bk)
        # one block pair at a time: its inputs wait for the previous pair's results
        qi, kj, vj, doi = _after((q[:, :, qs], k[:, ks], v[:, ks], dout[:, :, qs]), prev)
        p = jnp.exp(_scores(qi, kj, scale) - lse[..., qs][..., None])
        mask = _mask(rows, sq, i, j, bq, bk, window)
        if mask is not None:
            p = jnp.where(mask[None, :, None, None], p, 0.0)
        pl = p.astype(v.dtype)
        dv[j] = dv[j] + jnp.einsum("brkgqt,brqkgd->btkd", pl, doi, preferred_element_type=jnp.float32)
        dp = jnp.einsum("brqkgd,btkd->brkgqt", doi, vj, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta[..., qs][..., None]) * scale).astype(q.dtype)
        dq[i] = dq[i] + jnp.einsum("brkgqt,btkd->brqkgd", ds, kj, preferred_element_type=jnp.float32)
        dk[j] = dk[j] + jnp.einsum("brkgqt,brqkgd->btkd", ds, qi, preferred_element_type=jnp.float32)
        prev = (dq[i], dk[j], dv[j])

    def cat(parts, axis):
        return jnp.concatenate(parts, axis=axis) if len(parts) > 1 else parts[0]

    return (cat(dq, 2).astype(q.dtype), cat(dk, 1).astype(k.dtype), cat(dv, 1).astype(v.dtype))


causal_attention.defvjp(_vjp_fwd, _vjp_bwd)
