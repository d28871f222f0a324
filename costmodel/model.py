"""Model description: a decoder-only transformer (dense or MoE, MHA/GQA/MQA or MLA) and its parameter counts.

Field names are the model YAML's (users and other tools write them). Zero means "not set / default" for
the optional integer fields, so that a YAML file only lists what differs from a plain decoder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hardware.errors import InputError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    ffn_dim: int
    vocab_size: int
    n_kv_heads: int = 0  # 0 -> n_heads (MHA); 1 = MQA; otherwise GQA groups
    head_dim: int = 0  # 0 -> d_model / n_heads (must divide)
    gated_mlp: bool = True  # SwiGLU/GeGLU 3-matrix MLP; false = 2-matrix GeLU/ReLU
    tied_embeddings: bool = False
    n_experts: int = 0  # 0 = dense
    experts_per_token: int = 0
    moe_ffn_dim: int = 0  # 0 -> ffn_dim
    n_dense_layers: int = 0  # leading dense layers of a MoE model
    n_shared_experts: int = 0
    sliding_window: int = 0  # local attention window in tokens (0 = every layer attends to the whole prefix)
    local_per_global: int = 0  # with a window: local layers per global layer (Gemma 3: 5); 0 = all local
    capacity_factor: float = 0.0  # token-dropping MoE: experts compute on cf x their fair share; 0 = dropless
    # Multi-head latent attention (DeepSeek-V2/V3); all 0 = ordinary attention.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # What builds the model but changes no count the cost model makes (the exporters write it; defaults are a
    # Llama-2-style decoder). Values as in the model's Hugging Face config.json or its framework's config.
    norm: str = "rmsnorm"  # rmsnorm | layernorm | layernorm1p (LayerNorm with zero-centred gamma, Nemotron-4)
    norm_eps: float = 1e-5
    activation: str = ""  # MLP nonlinearity: silu | gelu | relu2 (squared ReLU); "" -> silu if gated_mlp else gelu
    linear_bias: bool = False  # biases in the attention and MLP projections (GPT-2/3)
    qk_norm: bool = False  # norms on queries and keys; with MLA, on the query and key/value latents
    dropout: float = 0.0  # attention and hidden dropout probability in training
    position_embedding: str = "rope"  # rope | learned (absolute, GPT-3) | alibi (MPT)
    rope_theta: float = 10000.0  # RoPE base (Llama 3: 500,000; Mixtral: 1e6)
    rope_local_theta: float = 0.0  # RoPE base of the sliding-window layers (Gemma 3); 0 = rope_theta
    rope_fraction: float = 1.0  # share of each head's dimensions rotated (Nemotron-4: 0.5)
    # RoPE scaling: "" none | llama3 (Llama 3.1's, low/high frequency factors 1 and 4 as MaxText and Megatron-LM
    # hard-code them) | yarn (DeepSeek's YaRN: correction range rounded outwards, rotated pairs interleaved) |
    # linear (positions divided by the factor, Gemma 3's global layers)
    rope_scaling: str = ""
    rope_scaling_factor: float = 1.0
    rope_original_context: int = 0  # context before scaling (llama3, yarn): Llama 3.1 8192, DeepSeek 4096
    rope_beta_fast: float = 32.0  # yarn: the correction range's fast and slow betas
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0  # yarn: attention temperature terms, as DeepSeek's config.json names them
    rope_mscale_all_dim: float = 0.0
    # MoE router: scores, which experts a token may use, and how their weights are formed.
    router_score: str = "softmax"  # softmax | sigmoid (DeepSeek-V3)
    router_norm_topk: bool = True  # the chosen experts' weights renormalised to sum to 1 (DeepSeek-V2: false)
    router_topk_scale: float = 1.0  # the weights' scaling factor (DeepSeek-V3 routed_scaling_factor 2.5)
    router_expert_bias: bool = False  # a balancing bias added to the scores for selection only (DeepSeek-V3)
    router_groups: int = 0  # node-limited routing: expert groups, scored by their top-(k/group_topk) sum; 0 none
    router_group_topk: int = 0  # groups a token may route to
    router_bias_update_rate: float = 0.0  # step of the balancing bias per batch (DeepSeek-V3: 0.001); needs the bias
    maxtext_name: str = ""  # MaxText's configs/models/<name>.yml holding this model; MaxText selects some code
    # paths by it (DeepSeek-V3's routing: layers/moe.py) and merges that file over the exported keys
    description: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        where = f"model {self.name!r}"
        for f in ("n_layers", "d_model", "n_heads", "ffn_dim", "vocab_size"):
            if getattr(self, f) <= 0:
                raise InputError(f"{where}: field {f!r} must be a positive integer, got {getattr(self, f)}")
        for f in ("n_kv_heads", "head_dim", "n_experts", "experts_per_token", "moe_ffn_dim", "n_dense_layers",
                  "n_shared_experts", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, f) < 0:
                raise InputError(f"{where}: field {f!r} must be >= 0, got {getattr(self, f)}")
        if self.n_kv_heads == 0:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim == 0:
            if self.d_model % self.n_heads:
                raise InputError(f"{where}: field 'n_heads' ({self.n_heads}) must divide d_model "
                                 f"({self.d_model}) when head_dim is not given")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise InputError(f"{where}: field 'n_kv_heads' ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        if self.n_experts:
            if not 1 <= self.experts_per_token <= self.n_experts:
                raise InputError(f"{where}: field 'experts_per_token' must be in 1..n_experts ({self.n_experts}), "
                                 f"got {self.experts_per_token}")
            if self.moe_ffn_dim == 0:
                object.__setattr__(self, "moe_ffn_dim", self.ffn_dim)
            if self.n_dense_layers > self.n_layers:
                raise InputError(f"{where}: field 'n_dense_layers' must be <= n_layers ({self.n_layers})")
        elif self.experts_per_token or self.n_shared_experts or self.n_dense_layers:
            raise InputError(f"{where}: MoE fields (experts_per_token, n_shared_experts, n_dense_layers) "
                             "need n_experts > 0")
        for f in ("q_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, f) and not self.is_mla:
                raise InputError(f"{where}: field {f!r} is a multi-head latent attention field and needs "
                                 "kv_lora_rank > 0")
        if self.is_mla and self.qk_rope_head_dim >= self.head_dim:
            raise InputError(f"{where}: field 'qk_rope_head_dim' ({self.qk_rope_head_dim}) must be smaller "
                             f"than head_dim ({self.head_dim}, the no-RoPE + RoPE query/key head size)")
        if not (math.isfinite(self.capacity_factor) and (self.capacity_factor == 0 or self.capacity_factor >= 1)):
            raise InputError(f"{where}: field 'capacity_factor' must be 0 (dropless) or >= 1, "
                             f"got {self.capacity_factor}")
        for f in ("sliding_window", "local_per_global", "rope_original_context"):
            if getattr(self, f) < 0:
                raise InputError(f"{where}: field {f!r} must be >= 0, got {getattr(self, f)}")
        if self.is_mla and self.v_head_dim == 0:
            object.__setattr__(self, "v_head_dim", self.head_dim - self.qk_rope_head_dim)
        self._check_build_fields(where)
        self._check_router(where)
        if self.activation == "":
            object.__setattr__(self, "activation", "silu" if self.gated_mlp else "gelu")

    def _check_build_fields(self, where: str) -> None:
        """The norm, activation, position and RoPE fields: a known kind and a value in range."""
        for f, kinds in BUILD_KINDS.items():
            if getattr(self, f) not in kinds:
                raise InputError(f"{where}: field {f!r} must be one of {', '.join(repr(k) for k in kinds)}, "
                                 f"got {getattr(self, f)!r}")
        for f, lo, hi, text in RANGES:
            v = getattr(self, f)
            if not (math.isfinite(v) and lo(v) and hi(v)):
                raise InputError(f"{where}: field {f!r} must be {text}, got {v}")
        if self.rope_scaling in ("llama3", "yarn") and self.rope_original_context <= 0:
            raise InputError(f"{where}: field 'rope_original_context' must be a positive integer with "
                             f"rope_scaling {self.rope_scaling!r}, got {self.rope_original_context}")

    def _check_router(self, where: str) -> None:
        """Router fields need experts; node-limited groups must split the experts and the top-k evenly."""
        if not self.is_moe:
            set_ = [f for f, v in ROUTER_DEFAULTS.items() if getattr(self, f) != v]
            if set_:
                raise InputError(f"{where}: router field {set_[0]!r} needs n_experts > 0")
            return
        if self.router_bias_update_rate and not self.router_expert_bias:
            raise InputError(f"{where}: field 'router_bias_update_rate' needs router_expert_bias true")
        g, k = self.router_groups, self.router_group_topk
        if (g == 0) != (k == 0) or g < 0 or k < 0:
            raise InputError(f"{where}: fields 'router_groups' and 'router_group_topk' must both be 0 (no "
                             f"node-limited routing) or both positive, got {g} and {k}")
        if g and (self.n_experts % g or k > g or self.experts_per_token % k):
            raise InputError(f"{where}: field 'router_groups' ({g}) must divide n_experts ({self.n_experts}) and "
                             f"'router_group_topk' ({k}) be at most {g} and divide experts_per_token "
                             f"({self.experts_per_token})")

    # ---- shape helpers -------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers if self.is_moe else 0

    @property
    def n_dense_mlp_layers(self) -> int:
        return self.n_layers - self.n_moe_layers

    @property
    def effective_capacity_factor(self) -> float:
        """Expert capacity factor; 0 (no token dropping) counts as 1: every routed token is computed once."""
        return self.capacity_factor if self.capacity_factor > 0 else 1.0

    @property
    def routed_rows_per_token(self) -> float:
        """Expert-input rows a MoE layer computes per token: top-k x capacity factor, plus the shared experts."""
        return self.experts_per_token * self.effective_capacity_factor + self.n_shared_experts

    @property
    def q_dim(self) -> int:
        """Width of all query heads (n_heads * head_dim)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key heads (= value heads for non-MLA)."""
        return self.n_kv_heads * self.head_dim

    @property
    def attn_out_dim(self) -> int:
        """Width of the attention context fed to the output projection."""
        return self.n_heads * (self.v_head_dim if self.is_mla else self.head_dim)

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices per MLP: 3 for gated (SwiGLU), 2 for plain."""
        return 3 if self.gated_mlp else 2

    def mean_attended_keys(self, seq_len: int) -> float:
        """Keys one query attends to, averaged over positions and layers, under a causal mask.

        Full causal attention: s/2 on average. A causal sliding window w < s: w - w^2/(2s).
        """
        full = seq_len / 2
        if self.sliding_window <= 0 or self.sliding_window >= seq_len:
            return full
        w = self.sliding_window
        local = w - w * w / (2 * seq_len)
        if self.local_per_global <= 0:
            return local
        k = self.local_per_global
        return (k * local + full) / (k + 1)

    # ---- parameter counts -------------------------------------------------------------------------
    def attn_params(self) -> int:
        """Attention weights of one layer (no biases)."""
        d, h = self.d_model, self.n_heads
        if not self.is_mla:
            return d * self.q_dim + 2 * d * self.kv_dim + self.q_dim * d
        qk_head = self.head_dim  # nope + rope part
        q = (d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * qk_head) if self.q_lora_rank \
            else d * h * qk_head
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank \
            + self.kv_lora_rank * h * (qk_head - self.qk_rope_head_dim + self.v_head_dim)
        return q + kv + h * self.v_head_dim * d

    def attn_tp_replicated_params(self) -> int:
        """Attention weights of one layer that tensor parallelism does not split: MLA's down-projections and their
        norms. MaxText shards wq_a / wkv_a by d_model only (their `q_lora_up_proj` / `kv_lora_up_proj` axes map to
        no mesh axis, layers/attention_mla.py); Megatron-Core builds linear_q_down_proj / linear_kv_down_proj
        duplicated over the tensor-parallel group."""
        if not self.is_mla:
            return 0
        q = self.d_model * self.q_lora_rank + self.q_lora_rank if self.q_lora_rank else 0
        return q + self.d_model * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank

    def mla_latent_elems(self) -> int:
        """Per token, the MLA latents a layer keeps when nothing is recomputed (not split over tp): the query and
        key/value down-projections' outputs (with the shared rope key) and their normalised copies."""
        if not self.is_mla:
            return 0
        return 2 * self.q_lora_rank + 2 * self.kv_lora_rank + self.qk_rope_head_dim

    def dense_mlp_params(self) -> int:
        return self.mlp_matrices * self.d_model * self.ffn_dim

    def expert_params(self) -> int:
        """One routed (or shared) expert's weights."""
        return self.mlp_matrices * self.d_model * self.moe_ffn_dim

    def moe_layer_params(self, active: bool = False) -> int:
        """Router + experts of one MoE layer; `active` counts only the experts one token uses."""
        routed = self.experts_per_token if active else self.n_experts
        return self.d_model * self.n_experts + (routed + self.n_shared_experts) * self.expert_params()

    def layer_norm_params(self) -> int:
        return 2 * self.d_model

    def embedding_params(self) -> int:
        """Input embedding plus a separate output projection unless tied."""
        return self.vocab_size * self.d_model * (1 if self.tied_embeddings else 2)

    def total_params(self) -> int:
        return self._params(active=False)

    def active_params(self) -> int:
        """Parameters one token touches (equals total_params for dense models)."""
        return self._params(active=True)

    def _params(self, active: bool) -> int:
        per_layer = self.attn_params() + self.layer_norm_params()
        body = self.n_layers * per_layer + self.n_dense_mlp_layers * self.dense_mlp_params()
        if self.is_moe:
            body += self.n_moe_layers * self.moe_layer_params(active)
        return body + self.embedding_params() + self.d_model  # + final norm

    def non_embedding_params(self) -> int:
        return self.total_params() - self.embedding_params()

    def with_layers(self, n_layers: int) -> ModelSpec:
        """The model with another depth: no longer the one MaxText's maxtext_name file holds."""
        return replace(self, n_layers=n_layers, maxtext_name="")


# Allowed kinds of the string fields that build the model (exported as the frameworks name them).
BUILD_KINDS = {"norm": ("rmsnorm", "layernorm", "layernorm1p"), "activation": ("", "silu", "gelu", "relu2"),
               "position_embedding": ("rope", "learned", "alibi"), "rope_scaling": ("", "llama3", "yarn", "linear"),
               "router_score": ("softmax", "sigmoid")}
# (field, lower check, upper check, expected) for the float fields that build the model.
RANGES = (("norm_eps", lambda v: v > 0, lambda v: v < 1, "a number in (0, 1)"),
          ("dropout", lambda v: v >= 0, lambda v: v < 1, "a probability in [0, 1)"),
          ("rope_theta", lambda v: v > 0, lambda v: True, "a positive number"),
          ("rope_local_theta", lambda v: v >= 0, lambda v: True, "0 (as rope_theta) or a positive number"),
          ("rope_fraction", lambda v: v > 0, lambda v: v <= 1, "a fraction in (0, 1]"),
          ("rope_scaling_factor", lambda v: v >= 1, lambda v: True, "a number >= 1"),
          ("rope_beta_fast", lambda v: v > 0, lambda v: True, "a positive number"),
          ("rope_beta_slow", lambda v: v > 0, lambda v: True, "a positive number"),
          ("rope_mscale", lambda v: v >= 0, lambda v: True, "a number >= 0"),
          ("rope_mscale_all_dim", lambda v: v >= 0, lambda v: True, "a number >= 0"),
          ("router_topk_scale", lambda v: v > 0, lambda v: True, "a positive number"),
          ("router_bias_update_rate", lambda v: v >= 0, lambda v: True, "a number >= 0"))
# The router fields of a plain softmax top-k router; a dense model keeps them.
ROUTER_DEFAULTS = {"router_score": "softmax", "router_norm_topk": True, "router_topk_scale": 1.0,
                   "router_expert_bias": False, "router_groups": 0, "router_group_topk": 0,
                   "router_bias_update_rate": 0.0}
