"""Model presets, costmodel.catalog (names, YAML files, size shorthands) and `planner models`."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from costmodel.catalog import describe_shorthand, load_model, preset_names, resolve_size
from costmodel.model import ModelSpec
from hardware.errors import InputError
from hardware.yamlio import to_dict

B = 1e9
SHAPE_ONLY = ("name", "description", "source")


def shape(spec: ModelSpec) -> dict:
    d = to_dict(spec)
    for k in SHAPE_ONLY:
        d.pop(k)
    return d


# ---- what the published counts include that ModelSpec has no field for ------------------------------------


def gpt_positions_and_biases(m: ModelSpec, seq: int = 2048) -> int:
    """GPT-2-style models (Megatron GPT, GPT-3) also have a learned seq x d position table and biases:
    per layer qkv 3d + attention-out d + fc1 4d + fc2 d + two LayerNorm biases 2d = 11d."""
    return seq * m.d_model + 11 * m.d_model * m.n_layers


def input_embedding_excluded(m: ModelSpec) -> int:
    """DeepSeek's 'activated' figures leave out the input-embedding lookup (a table read, not a matmul):
    with it removed the same shapes give V3 36.6B ('37B') and V2 20.9B ('21B'); with it, 37.6B and 21.4B."""
    return -m.vocab_size * m.d_model


def none(m: ModelSpec) -> int:
    return 0


@dataclass(frozen=True)
class Published:
    preset: str
    quantity: str  # total | active | embedding | non_embedding
    billions: float  # as the source states it
    decimals: int  # digits after the point in the statement
    source: str
    extra: Callable[[ModelSpec], int] = none  # what the stated figure counts beyond ModelSpec's fields

    def counted(self) -> int:
        m = load_model(self.preset)
        own = {"total": m.total_params(), "active": m.active_params(), "embedding": m.embedding_params(),
               "non_embedding": m.non_embedding_params()}[self.quantity]
        return own + self.extra(m)

    def tolerance(self) -> float:
        """0.5%, or half a unit of the last stated digit when the statement is coarser than that."""
        return max(0.005 * self.billions, 0.5 * 10 ** -self.decimals) * B


MEGATRON_TABLE1 = ("1.7", "3.6", "7.5", "18.4", "39.1", "76.1", "145.6", "310.1", "529.6", "1008.0")

PUBLISHED = [
    # Released checkpoints (sum of the tensor sizes of the weights the authors published).
    Published("llama2-7b", "total", 6.74, 2, "Llama-2-7b checkpoint"),
    Published("llama2-13b", "total", 13.02, 2, "Llama-2-13b checkpoint"),
    Published("llama2-70b", "total", 68.98, 2, "Llama-2-70b checkpoint"),
    Published("llama3-8b", "total", 8.03, 2, "Llama-3.1-8B checkpoint"),
    Published("llama3-70b", "total", 70.55, 2, "Llama-3.1-70B checkpoint"),
    Published("llama3-405b", "total", 405.85, 2, "Llama-3.1-405B checkpoint"),
    # Mistral's announcement says "7.3B", which its own checkpoint (7,241,732,096) does not reproduce.
    Published("mistral-7b", "total", 7.24, 2, "Mistral-7B-v0.1 checkpoint"),
    Published("mixtral-8x7b", "total", 46.7, 1, "Mistral AI, Mixtral of experts (2023): 46.7B total"),
    Published("mixtral-8x7b", "active", 12.9, 1, "Mistral AI, Mixtral of experts (2023): 12.9B per token"),
    Published("mixtral-8x22b", "total", 141, 0, "Mistral AI, Mixtral 8x22B announcement (2024): 141B"),
    Published("mixtral-8x22b", "active", 39, 0, "Mistral AI, Mixtral 8x22B announcement (2024): 39B active"),
    # Base checkpoint (vocab 32000; the preset's 32768 adds 9.4M = 0.007%).
    Published("mixtral-8x22b", "total", 140.62, 2, "Mixtral-8x22B-v0.1 checkpoint"),
    Published("mixtral-8x22b", "active", 39.15, 2, "Mixtral-8x22B-v0.1 checkpoint, 2 of 8 experts"),
    Published("deepseek-v3-671b", "total", 671, 0, "DeepSeek-V3 Technical Report: 671B total"),
    Published("deepseek-v3-671b", "active", 37, 0, "DeepSeek-V3 Technical Report: 37B activated",
              input_embedding_excluded),
    Published("deepseek-v2-236b", "total", 236, 0, "DeepSeek-V2 paper: 236B total"),
    Published("deepseek-v2-236b", "active", 21, 0, "DeepSeek-V2 paper: 21B activated", input_embedding_excluded),
    # Gemma 3 report, Table 1: 10,759M non-embedding (the norms it adds beyond the fields: 0.4M, 0.004%)
    Published("gemma3-12b", "non_embedding", 10.759, 3, "Gemma 3 Technical Report Table 1: 10,759M non-embedding"),
    Published("deepseek-v2-lite-16b", "total", 15.7, 1, "DeepSeek-V2 paper, Appendix B: DeepSeek-V2-Lite 15.7B total"),
    # (its "2.4B activated" is not reproduced to 0.1B: 2.451B counted without the input embedding, as for V2/V3)
    Published("gpt3-175b", "total", 175.0, 1, "Brown et al. 2020 Table 2.1: 175.0B", gpt_positions_and_biases),
    # The same shape with the vocabulary padded to 51200 (0.01% more parameters).
    Published("gpt3-175b", "total", 174.6, 1, "Narayanan et al. 2021 Table 2: GPT 174.6B", gpt_positions_and_biases),
    Published("palm-540b", "total", 540.35, 2, "Chowdhery et al. 2022 Table 1: 540.35B"),
    # Nemotron-4 15B report: "3.2B embedding and 12.5B non-embedding parameters" (V*d*2 = 3.146B embedding).
    Published("nemotron4-15b", "non_embedding", 12.5, 1, "Parmar et al. 2024: 12.5B non-embedding"),
    Published("nemotron4-15b", "total", 15.7, 1, "Parmar et al. 2024: 3.2B + 12.5B"),
    Published("nemotron4-340b", "embedding", 9.4, 1, "Nemotron-4 340B report: 9.4B embedding"),
    Published("nemotron4-340b", "non_embedding", 331.6, 1, "Nemotron-4 340B report: 331.6B non-embedding"),
    # Megatron table figures are rounded to 0.1B: "1.7" is Eq. 2's 1.652B (see test_megatron_eq2_exact).
    *(Published(f"megatron-gpt-{size}b", "total", float(size), 1, "Narayanan et al. 2021 Table 1",
                gpt_positions_and_biases) for size in MEGATRON_TABLE1),
]

# llm-foundry's NumParams (benchmark table, normalised in shared/reference/runs_dev.csv notes) for MPTConfig
# defaults: learned positions of max_seq_len x d, biases (11d per layer as for GPT) and a final LayerNorm bias.
MPT_NUMPARAMS = {  # preset: (NumParams, max_seq_len of that benchmark row)
    "mpt-7b": (6_918_905_856, 65536),
    "mpt-13b": (13_011_240_960, 32768),
    "mpt-30b": (30_019_254_272, 8192),
    "mpt-70b": (64_862_437_376, 2048),
}


@pytest.mark.parametrize("pub", PUBLISHED, ids=lambda p: f"{p.preset}-{p.quantity}-{p.billions}")
def test_published_counts(pub: Published) -> None:
    counted = pub.counted()
    assert abs(counted - pub.billions * B) <= pub.tolerance(), (
        f"{pub.preset} {pub.quantity}: computed {counted / B:.3f}B vs {pub.billions}B ({pub.source})")


@pytest.mark.parametrize("size", MEGATRON_TABLE1)
def test_megatron_table_rounding_and_eq2_exact(size: str) -> None:
    """Narayanan et al. 2021 Eq. 2, P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)), which counts positions,
    biases and LayerNorms but no final LayerNorm, is reproduced exactly; the table shows it to 0.1B."""
    m = load_model(f"megatron-gpt-{size}b")
    l_, h, v, s = m.n_layers, m.d_model, m.vocab_size, 2048
    eq2 = 12 * l_ * h * h + 13 * l_ * h + (v + s) * h
    assert m.total_params() + gpt_positions_and_biases(m, s) - m.d_model == eq2
    assert f"{eq2 / B:.1f}" == size


@pytest.mark.parametrize("name", sorted(MPT_NUMPARAMS))
def test_mpt_llm_foundry_numparams_exact(name: str) -> None:
    m = load_model(name)
    numparams, seq = MPT_NUMPARAMS[name]
    assert m.total_params() + gpt_positions_and_biases(m, seq) + m.d_model == numparams


def test_every_preset_has_a_published_check() -> None:
    checked = {p.preset for p in PUBLISHED} | set(MPT_NUMPARAMS)
    assert set(preset_names()) == checked


def test_moe_active_counts_by_hand() -> None:
    m = load_model("mixtral-8x7b")
    attn = 4096 * 4096 * 2 + 2 * 4096 * 1024
    expert = 3 * 4096 * 14336
    per_layer = attn + 2 * 4096 + 4096 * 8  # + norms + router
    emb = 2 * 32000 * 4096 + 4096
    assert m.total_params() == 32 * (per_layer + 8 * expert) + emb
    assert m.active_params() == 32 * (per_layer + 2 * expert) + emb


def test_mla_attention_by_tensor_shapes() -> None:
    """DeepSeek-V3 attention, from the checkpoint's tensor shapes: q_a_proj [1536, 7168], q_a_layernorm [1536],
    q_b_proj [128*192, 1536], kv_a_proj_with_mqa [512+64, 7168], kv_a_layernorm [512],
    kv_b_proj [128*(128+128), 512], o_proj [7168, 128*128]."""
    m = load_model("deepseek-v3-671b")
    assert m.attn_params() == (1536 * 7168 + 1536 + 128 * 192 * 1536 + 576 * 7168 + 512
                               + 128 * 256 * 512 + 7168 * 128 * 128)
    # Without query compression (DeepSeek-V2-Lite: 16 heads, d 2048): q_proj [16*192, 2048].
    lite = ModelSpec(name="v2-lite", n_layers=27, d_model=2048, n_heads=16, head_dim=192, ffn_dim=10944,
                     vocab_size=102400, n_experts=64, experts_per_token=6, moe_ffn_dim=1408, n_dense_layers=1,
                     n_shared_experts=2, kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128)
    assert lite.attn_params() == 16 * 192 * 2048 + 576 * 2048 + 512 + 16 * 256 * 512 + 2048 * 16 * 128
    assert round(lite.total_params() / B, 1) == 15.7  # DeepSeek-V2 paper: 15.7B total
    # Tensor parallelism splits the up-projections and o_proj by head; the down-projections and their norms are
    # replicated (MaxText's q_lora_up_proj / kv_lora_up_proj axes, Megatron-Core's duplicated down-projections).
    replicated = 1536 * 7168 + 1536 + 576 * 7168 + 512
    assert m.attn_tp_replicated_params() == replicated
    assert lite.attn_tp_replicated_params() == 576 * 2048 + 512
    assert load_model("llama3-8b").attn_tp_replicated_params() == 0
    # kept when nothing is recomputed: both latents, their normalised copies, the shared rope key
    assert m.mla_latent_elems() == 2 * 1536 + 2 * 512 + 64


# ---- presets and YAML files -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", preset_names())
def test_preset_files(name: str) -> None:
    m = load_model(name)
    assert m.name == name
    for text in (m.description, m.source):
        assert text and "\n" not in text


@pytest.mark.parametrize("name", [*preset_names(), "1T", "70B"])
def test_yaml_round_trip(name: str, tmp_path: Path) -> None:
    m = load_model(name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(to_dict(m), sort_keys=False))
    assert load_model(str(path)) == m


def test_names_are_case_insensitive_and_cached() -> None:
    assert load_model("Llama3-8B") == load_model("llama3-8b")
    assert load_model("llama3-8b") is load_model("llama3-8b")


def _write(tmp_path: Path, data: dict, name: str = "m.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


GOOD = {"name": "tiny", "n_layers": 2, "d_model": 256, "n_heads": 4, "ffn_dim": 1024, "vocab_size": 1000}


def raises(text: str, *fragments: str) -> str:
    with pytest.raises(InputError) as e:
        load_model(text)
    msg = str(e.value)
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, msg
    return msg


def test_user_yaml_minimal(tmp_path: Path) -> None:
    m = load_model(_write(tmp_path, GOOD))
    assert (m.n_kv_heads, m.head_dim, m.gated_mlp, m.tied_embeddings) == (4, 64, True, False)


def test_unknown_preset_did_you_mean() -> None:
    raises("llama3-8", "unknown model 'llama3-8'", "did you mean 'llama3-8b'")
    raises("mixtral-8x7", "did you mean 'mixtral-8x7b'")


def test_missing_field(tmp_path: Path) -> None:
    data = {k: v for k, v in GOOD.items() if k != "d_model"}
    raises(_write(tmp_path, data), "m.yaml", "missing field 'd_model'")


def test_misspelled_field(tmp_path: Path) -> None:
    data = {**{k: v for k, v in GOOD.items() if k != "n_layers"}, "n_layer": 2}
    raises(_write(tmp_path, data), "unknown field 'n_layer'", "did you mean 'n_layers'")


@pytest.mark.parametrize("field,value", [("n_layers", 0), ("d_model", -256), ("vocab_size", 0)])
def test_non_positive_field(tmp_path: Path, field: str, value: int) -> None:
    raises(_write(tmp_path, {**GOOD, field: value}), "m.yaml", f"'{field}'", "positive")


def test_wrong_type(tmp_path: Path) -> None:
    raises(_write(tmp_path, {**GOOD, "gated_mlp": "yes"}), "gated_mlp", "true or false")
    raises(_write(tmp_path, {**GOOD, "n_heads": 4.5}), "n_heads", "integer")


def test_heads_must_divide_d_model_without_head_dim(tmp_path: Path) -> None:
    raises(_write(tmp_path, {**GOOD, "n_heads": 3}), "m.yaml", "'n_heads'", "d_model")
    assert load_model(_write(tmp_path, {**GOOD, "n_heads": 3, "head_dim": 64}, "ok.yaml")).q_dim == 192


def test_kv_heads_must_divide_heads(tmp_path: Path) -> None:
    raises(_write(tmp_path, {**GOOD, "n_kv_heads": 3}), "m.yaml", "'n_kv_heads'")


def test_moe_and_mla_fields(tmp_path: Path) -> None:
    raises(_write(tmp_path, {**GOOD, "n_experts": 4, "experts_per_token": 5}), "'experts_per_token'")
    raises(_write(tmp_path, {**GOOD, "n_shared_experts": 1}), "n_experts")
    raises(_write(tmp_path, {**GOOD, "q_lora_rank": 64}), "'q_lora_rank'", "kv_lora_rank")
    raises(_write(tmp_path, {**GOOD, "kv_lora_rank": 32, "qk_rope_head_dim": 64}), "'qk_rope_head_dim'")


BUILD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelSpec)
                  if f.name in ("norm", "norm_eps", "activation", "linear_bias", "qk_norm", "dropout",
                                "position_embedding", "rope_theta", "rope_local_theta", "rope_fraction", "rope_scaling",
                                "rope_scaling_factor", "rope_original_context", "rope_beta_fast", "rope_beta_slow",
                                "rope_mscale", "rope_mscale_all_dim", "router_score", "router_norm_topk",
                                "router_topk_scale", "router_expert_bias", "router_groups", "router_group_topk",
                                "router_bias_update_rate", "maxtext_name")}


@pytest.mark.parametrize("name", preset_names())
def test_build_fields_change_no_count(name: str) -> None:
    """The fields that build the model (norm, RoPE, router, ...) leave every parameter count as it was."""
    m = load_model(name)
    plain = ModelSpec(**{**to_dict(m), **BUILD_DEFAULTS})
    assert (plain.total_params(), plain.active_params(), plain.embedding_params(), plain.attn_params()) == \
        (m.total_params(), m.active_params(), m.embedding_params(), m.attn_params())


def test_build_field_values_from_the_sources() -> None:
    l3, v3, mx = load_model("llama3-405b"), load_model("deepseek-v3-671b"), load_model("mixtral-8x7b")
    assert (l3.rope_theta, l3.rope_scaling, l3.rope_scaling_factor, l3.rope_original_context, l3.norm_eps) == \
        (500000.0, "llama3", 8.0, 8192, 1e-5)
    assert (mx.rope_theta, load_model("llama2-70b").rope_theta) == (1e6, 10000.0)
    assert (v3.norm_eps, v3.router_score, v3.router_topk_scale, v3.router_expert_bias, v3.router_groups,
            v3.router_group_topk, v3.rope_scaling, v3.rope_scaling_factor, v3.qk_norm) == \
        (1e-6, "sigmoid", 2.5, True, 8, 4, "yarn", 40.0, True)
    assert load_model("gpt3-175b").activation == "gelu" and load_model("llama2-7b").activation == "silu"


@pytest.mark.parametrize("extra,fragments", [
    ({"norm": "batchnorm"}, ("'norm'", "'rmsnorm'")),
    ({"activation": "tanh"}, ("'activation'", "'relu2'")),
    ({"norm_eps": 0}, ("'norm_eps'", "(0, 1)")),
    ({"rope_fraction": 1.5}, ("'rope_fraction'",)),
    ({"rope_scaling": "llama3"}, ("'rope_original_context'", "positive")),
    ({"dropout": 1.0}, ("'dropout'", "[0, 1)")),
    ({"router_score": "sigmoid"}, ("router field 'router_score'", "n_experts")),
    ({"n_experts": 8, "experts_per_token": 2, "router_groups": 3, "router_group_topk": 1}, ("'router_groups'",)),
    ({"n_experts": 8, "experts_per_token": 2, "router_groups": 4}, ("'router_group_topk'", "both")),
    ({"n_experts": 8, "experts_per_token": 2, "router_bias_update_rate": 0.001}, ("router_expert_bias",)),
])
def test_build_field_errors(tmp_path: Path, extra: dict, fragments: tuple[str, ...]) -> None:
    raises(_write(tmp_path, {**GOOD, **extra}), "m.yaml", *fragments)


def test_bad_files(tmp_path: Path) -> None:
    raises(str(tmp_path / "absent.yaml"), "file not found")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    raises(str(bad), "not valid YAML")
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    raises(str(listed), "mapping")


# ---- size shorthands ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,preset", [("8B", "llama3-8b"), ("70B", "llama3-70b"), ("405B", "llama3-405b"),
                                         ("70b", "llama3-70b"), ("0.405T", "llama3-405b")])
def test_shorthand_anchors_are_llama3(text: str, preset: str) -> None:
    m = load_model(text)
    assert shape(m) == shape(load_model(preset))
    assert m.name == f"dense-{text.upper()}"


def test_shorthand_1t() -> None:
    m = load_model("1T")
    assert m.name == "dense-1T"
    assert abs(m.total_params() / 1e12 - 1) < 0.03
    assert f"{m.n_layers} layers, d_model {m.d_model}" in m.description
    assert describe_shorthand("1t") == m.description
    assert load_model("1.5T").total_params() > m.total_params()


@pytest.mark.parametrize("target", [0.5e9, 1e9, 3e9, 13e9, 34e9, 69.9e9, 100e9, 175e9, 250e9, 1e12, 1.5e12,
                                    2e12, 10e12, 100e12])
def test_shorthand_family_rule(target: float) -> None:
    text = f"{target / B:g}B"
    m = resolve_size(text)
    assert abs(m.total_params() / target - 1) < 0.03
    assert m.d_model % 1024 == 0 and m.n_heads * 128 == m.d_model and m.head_dim == 128
    assert (m.n_kv_heads, m.vocab_size, m.gated_mlp, m.tied_embeddings, m.is_moe) == (8, 128256, True, False,
                                                                                         False)
    assert m.ffn_dim % 256 == 0 and 3.2 <= m.ffn_dim / m.d_model <= 3.55


def test_shorthand_widths_grow_with_size() -> None:
    widths = [resolve_size(f"{s}B").d_model for s in (1, 3, 8, 20, 70, 150, 405, 1000, 3000)]
    assert widths == sorted(widths)


@pytest.mark.parametrize("text", ["0B", "-5B", "0.0T", "-1t"])
def test_non_positive_size(text: str) -> None:
    raises(text, "'model'", "must be positive", "70B")


def test_too_small_and_too_large_sizes() -> None:
    raises("100M", "'model'", "too small")
    raises("5000T", "'model'", "1000T")


# ---- CLI ---------------------------------------------------------------------------------------------------

_PLANNER = Path(sys.executable).with_name("planner")
PLANNER = [str(_PLANNER)] if _PLANNER.exists() else [sys.executable, "-c", "from cli.main import main; main()"]
REPO = Path(__file__).resolve().parents[1]


def planner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PLANNER, *args], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_cli_list() -> None:
    r = planner("models", "list")
    assert r.returncode == 0, r.stderr
    for text in ("llama3-70b", "70.55", "deepseek-v3-671b", "256+1 top-8", "37.55"):
        assert text in r.stdout


def test_cli_list_json() -> None:
    r = planner("models", "list", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert sorted(rows) == preset_names()
    assert rows["mixtral-8x7b"]["active_params"] == load_model("mixtral-8x7b").active_params()


def test_cli_show() -> None:
    r = planner("models", "show", "deepseek-v3-671b")
    assert r.returncode == 0, r.stderr
    assert "kv_lora_rank" in r.stdout and "671,026,404,352" in r.stdout


def test_cli_show_shorthand_and_json(tmp_path: Path) -> None:
    r = planner("models", "show", "1T")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("1T -> ") and "151 layers" in r.stdout
    r = planner("models", "show", "70B", "--json")
    data = json.loads(r.stdout)
    assert (data["name"], data["n_layers"], data["derived"]["total_params"]) == ("dense-70B", 80, 70553706496)
    r = planner("models", "show", _write(tmp_path, GOOD), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["name"] == "tiny"


@pytest.mark.parametrize("args,fragment", [(("show", "llama3-8"), "error: unknown model 'llama3-8'"),
                                           (("show", "0B"), "error: field 'model'"),
                                           (("show", "/nonexistent/m.yaml"), "error: ")])
def test_cli_bad_input_exit_2(args: tuple[str, ...], fragment: str) -> None:
    r = planner("models", *args)
    assert r.returncode == 2
    assert r.stderr.startswith(fragment) and r.stderr.count("\n") == 1
    assert "Traceback" not in r.stderr + r.stdout


def test_an_edited_model_file_is_read_again(tmp_path: Path) -> None:
    """load_model caches a user's YAML per version of the file, so an edit in a notebook takes effect."""
    import os

    path = _write(tmp_path, GOOD)
    assert load_model(path).n_layers == 2
    Path(path).write_text(yaml.safe_dump({**GOOD, "n_layers": 3}))
    os.utime(path, ns=(1, 2_000_000_000))  # a different mtime even on a coarse-grained file system
    assert load_model(path).n_layers == 3
