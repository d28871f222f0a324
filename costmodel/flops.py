"""FLOPs of one transformer layer, the embedding/logits and the loss, per op, forward pass.

A matmul of (m x k) by (k x n) costs 2*m*k*n FLOPs. The backward pass of a matmul costs twice its forward
(gradients w.r.t. input and weight); attention backward likewise counts 2x for model FLOPs.
Causal attention counts half of the s^2 score/context work (the masked half is skipped by flash attention).
Ops carry their per-chip matmul shape after tensor sharding so that efficiency can depend on it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from costmodel.model import ModelSpec


@dataclass(frozen=True)
class Op:
    """One forward op for `tokens` tokens on one chip: FLOPs, the smallest matmul dim, and its remat tensor."""

    name: str
    flops: float
    min_dim: float  # smallest per-chip matmul dim (attention: head_dim, its inner contraction)
    produces: str  # the remat tensor this op's output is ("" if none)
    is_attention: bool = False


def layer_ops(m: ModelSpec, tokens: float, seq_len: int, tp: int, cp: int, moe: bool,
              attention: str = "flash") -> list[Op]:
    """Forward ops of one layer on one chip processing `tokens` tokens (already divided by cp).

    Weights are split `tp` ways (heads and MLP columns); attention keys span the whole sequence (`seq_len`).
    attention 'dot_product' (Job.attention): the scores are two plain batched matmuls over every query-key pair.
    A pure function of its arguments, memoized (a search asks for the same layer thousands of times).
    """
    return list(_layer_ops(m, tokens, seq_len, tp, cp, moe, attention))


@functools.lru_cache(maxsize=4096)
def _layer_ops(m: ModelSpec, tokens: float, seq_len: int, tp: int, cp: int, moe: bool,
               attention: str) -> tuple[Op, ...]:
    d = m.d_model
    out: list[Op] = []
    if m.is_mla:
        # MLA (DeepSeek-V2/V3): low-rank q and kv projections, then per-head up-projections.
        q = m.d_model * m.q_lora_rank + m.q_lora_rank * m.n_heads * m.head_dim if m.q_lora_rank \
            else d * m.n_heads * m.head_dim
        kv = d * (m.kv_lora_rank + m.qk_rope_head_dim) \
            + m.kv_lora_rank * m.n_heads * (m.head_dim - m.qk_rope_head_dim + m.v_head_dim)
        qkv_params, qk_width, v_width = q + kv, m.n_heads * m.head_dim, m.n_heads * m.v_head_dim
        # The down-projections to the latents are an op of their own: not split over tp (every rank runs them,
        # ModelSpec.attn_tp_replicated_params), and rerun on their own under MaxText (estimate.rerun_once_ops).
        latents = m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim
        out.append(Op("mla_down", 2 * tokens * d * latents, min(d, latents, tokens), "qkv_proj"))
        qkv_params -= d * latents
    else:
        qkv_params, qk_width, v_width = d * (m.q_dim + 2 * m.kv_dim), m.q_dim, m.q_dim
    out.append(Op("qkv_proj", 2 * tokens * qkv_params / tp, min(d, (m.q_dim + 2 * m.kv_dim) / tp, tokens),
                  "qkv_proj"))
    # Scores Q K^T (2*width per query-key pair) and context P V (2*v_width per pair); causal masking (and any
    # sliding window) sets the pairs per query: s/2 for full causal attention (ModelSpec.mean_attended_keys).
    # Dot-product attention computes the whole s x s square before masking (Dao et al. 2022, FlashAttention,
    # Algorithm 0) as plain matmuls, at the matmul efficiency, not the fused kernel's.
    flash = attention == "flash"
    keys = m.mean_attended_keys(seq_len) if flash else seq_len
    attn = 2 * tokens * keys * (qk_width + v_width) / tp
    out.append(Op("attention", attn, m.head_dim, "context", is_attention=flash))
    out.append(Op("out_proj", 2 * tokens * v_width * d / tp, min(d, v_width / tp, tokens), "out_proj"))
    if moe:
        out.append(Op("router", 2 * tokens * d * m.n_experts, min(d, m.n_experts, tokens), ""))
        # Token-dropping MoE pads each expert's batch to capacity: cf x the routed tokens are computed.
        ffn, width = m.moe_ffn_dim, m.routed_rows_per_token
    else:
        ffn, width = m.ffn_dim, 1
    n_in = 2 if m.gated_mlp else 1
    out.append(Op("mlp_in", 2 * tokens * width * d * n_in * ffn / tp, min(d, ffn / tp, tokens), "mlp_in"))
    out.append(Op("mlp_out", 2 * tokens * width * ffn * d / tp, min(d, ffn / tp, tokens), "mlp_out"))
    return tuple(out)


# HBM accesses of each s x s score element (per query, key and head) by dot-product attention, in bf16: the forward
# writes S, reads it, writes P and reads it (4; Dao et al. 2022, FlashAttention, arXiv:2205.14135, Algorithm 0);
# the backward writes dP, reads P for dV, reads P and dP and writes dS, reads dS for dQ and for dK (7; Algorithm 3).
# The scores are no checkpoint, so a layer that recomputes anything reruns the forward's 4. Flash attention: none.
SCORE_FWD_ACCESSES, SCORE_BWD_ACCESSES = 4, 7


def score_accesses(attention: str, recomputed: float) -> float:
    """HBM accesses per score element per step of one layer (recomputed: the share of layers that rerun)."""
    if attention == "flash":
        return 0.0
    return SCORE_FWD_ACCESSES * (1 + recomputed) + SCORE_BWD_ACCESSES


# The ops a low-precision (fp8 / int8) run quantizes: the linear layers' GEMMs only. Attention and the logits stay
# bf16 (Transformer Engine: fp8 covers TE Linear/LayerNormLinear/LayerNormMLP, DotProductAttention only with
# fp8_dpa, default False; Megatron-Core's output layer is no TE module; torchao's Float8Linear skips the 'output'
# projection; MaxText AQT int8 (layers/quantizations.py) wraps the DenseGeneral dot_generals, its attention
# quantizes only a KV cache (inference) and decoders.py: "We do not quantize the logits matmul"); the MoE router
# stays bf16/fp32 (Megatron's TopKRouter is a plain linear outside TE).
QUANTIZED_OPS = ("qkv_proj", "out_proj", "mlp_in", "mlp_out", "mla_down")
TP_REPLICATED_OPS = ("mla_down", "router")  # ops layer_ops counts unsplit over tp: every tp rank runs them whole


def tp_replicated_flops_per_token(m: ModelSpec, moe: bool) -> float:
    """Forward FLOPs per token of one layer that every tensor-parallel rank repeats: MLA's down-projections
    (ModelSpec.attn_tp_replicated_params) and a MoE layer's router."""
    return sum(op.flops for op in layer_ops(m, 1, 1, 1, 1, moe) if op.name in TP_REPLICATED_OPS)


def logits_op(m: ModelSpec, tokens: float, tp: int) -> Op:
    """Output projection to the (tensor-sharded) vocabulary."""
    return Op("logits", 2 * tokens * m.d_model * m.vocab_size / tp, min(m.d_model, m.vocab_size / tp, tokens), "")


def model_flops_per_token(m: ModelSpec, seq_len: int) -> float:
    """Training model FLOPs per token: 3x forward (6 per matmul weight), causal attention halved, no recompute.

    Matmul weights: every active weight except the input embedding lookup; the logits matmul counts once
    (tied or not). This is the MFU numerator (PaLM App. B, with causal halving as in MaxText since 2025).
    """
    matmul_params = m.active_params() - m.vocab_size * m.d_model * (0 if m.tied_embeddings else 1)
    matmul_params -= m.n_layers * m.layer_norm_params() + m.d_model
    v_width = m.n_heads * (m.v_head_dim if m.is_mla else m.head_dim)
    attn = m.n_layers * 2 * m.mean_attended_keys(seq_len) * (m.q_dim + v_width)
    return 6 * matmul_params + 3 * attn


# Element-wise FLOPs, counted as XLA's cost analysis counts them: one per element per arithmetic op, compare or
# select; exp, log, rsqrt, sqrt and the logistic are transcendentals, not FLOPs. Small beside the matmuls at
# scale (about 1 %), a few % on narrow models; they run memory-bound (elementwise_bytes_per_token times them).
NORM_OPS = 4  # RMSNorm per element: square, sum, scale by the rsqrt, gain
ACT_OPS = {True: 2, False: 7}  # SiLU gate: x * sigmoid(x), * up; GeLU (tanh form): 7 arithmetic ops
SCORE_OPS = 5  # per query-key pair and head, online softmax: scale, mask select, running max, subtract, sum
SCORE_BWD_OPS = 6  # flash backward per pair: scale, subtract the log-sum-exp, mask, dP - delta, * P, scale
LOSS_FWD_OPS, LOSS_BWD_OPS = 6, 3  # per logit: max, subtract, sum, one-hot compare, multiply, sum; softmax - 1hot
ADAM_OPS = 13  # per parameter: mu (3), nu (4), two bias corrections, + eps, divide, * lr, subtract


def layer_vector_flops(m: ModelSpec, tokens: float, seq_len: int, tp: int, sp: int, moe: bool) -> tuple[float, float]:
    """(forward, backward) element-wise FLOPs of one layer on one chip for `tokens` tokens: two norms and two
    residual adds on the residual stream (split by tp only under sequence parallelism, sp = tp), the MLP
    activation, the attention softmax over the attended key pairs. Backward: twice the forward's per-element
    ops (each op's input gradient takes one or two), the softmax's per-pair flash backward."""
    ffn, k = (m.moe_ffn_dim, m.experts_per_token + m.n_shared_experts) if moe else (m.ffn_dim, 1)
    stream = (2 * NORM_OPS + 2) * m.d_model / sp
    act = ACT_OPS[m.gated_mlp] * ffn * k / tp
    pairs = m.mean_attended_keys(seq_len) * m.n_heads / tp
    fwd = tokens * (stream + act + SCORE_OPS * pairs)
    bwd = tokens * (2 * (stream + act) + SCORE_BWD_OPS * pairs)
    return fwd, bwd


def loss_vector_flops(m: ModelSpec, tokens: float, tp: int) -> float:
    """Element-wise FLOPs of the softmax cross-entropy and its gradient over the tp-sharded vocabulary."""
    return tokens * (LOSS_FWD_OPS + LOSS_BWD_OPS) * m.vocab_size / tp
