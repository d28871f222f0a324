"""Model presets (YAML under models/), user model files by path, and size shorthands such as '70B' or '1T'.

`load_model(text)` accepts, in this order: a path to a user YAML file (ending in .yaml/.yml or containing '/')
with exactly ModelSpec's fields; a preset name (`preset_names()`, case-insensitive); a size shorthand (a positive
number with a K/M/B/T suffix, e.g. '8B', '1.5T').

Size shorthands resolve to one dense "Llama-3 style" family (SwiGLU MLP, GQA with 8 KV heads, head_dim 128,
vocabulary 128256, untied embeddings) by `resolve_size`: the Llama 3 sizes 8B/70B/405B return their published
shapes; otherwise d_model is log-log interpolated between those anchors (a multiple of 1024), ffn = m * d with m
from the Llama 3 ratios (3.5 up to 70B, 3.25 from 405B), and the layer count is the one whose parameter count is
closest to N. Sizes whose best shape is more than 5% off N, or above 1000T, are refused (field 'model').
(the rule step by step: docs/models.md)
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from functools import cache
from pathlib import Path

from costmodel.model import ModelSpec
from hardware.errors import InputError, check_name, excerpt, shown_path, unknown
from hardware.yamlio import build, cache_per_version, read_yaml

MODEL_DIR = Path(__file__).parent / "models"

SIZE_RE = re.compile(r"^\s*([+-]?\d+(?:\.\d*)?|[+-]?\.\d+)\s*([kmbt])\s*$", re.IGNORECASE)
SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
EXPECTED = ("expected a preset name (see `planner models list`), a path to a .yaml file, "
            "or a size such as 8B, 70B, 1T")

# The dense shorthand family (see the module docstring).
FAMILY_ANCHORS = ((8e9, "llama3-8b"), (70e9, "llama3-70b"), (405e9, "llama3-405b"))
FAMILY_VOCAB = 128256
FAMILY_KV_HEADS = 8
FAMILY_HEAD_DIM = 128
FAMILY_WIDTH_STEP = 1024  # = FAMILY_KV_HEADS * FAMILY_HEAD_DIM, so n_heads is a multiple of the KV heads
FAMILY_FFN_STEP = 256
FAMILY_FFN_RATIO = ((70e9, 3.5), (405e9, 3.25))
WIDTH_FALLBACK_ERROR = 0.03
MAX_SHORTHAND_ERROR = 0.05
MAX_SHORTHAND_PARAMS = 1e15


def preset_names() -> list[str]:
    return sorted(p.stem for p in MODEL_DIR.glob("*.yaml"))


def _build(data: dict, where: str) -> ModelSpec:
    try:
        return build(ModelSpec, data, where)
    except InputError as e:  # ModelSpec's own checks say "model 'x': ..."; add the file for context
        msg = str(e)
        raise InputError(msg if msg.startswith(where) else f"{where}: {msg}") from None


@cache_per_version
def _load_file(path: str) -> ModelSpec:
    """A model file, parsed (once per version of it)."""
    return _build(read_yaml(path), shown_path(Path(path).name))


def load_model(name_or_path: str) -> ModelSpec:
    """A preset by name, a user's model YAML by path, or a size shorthand ('70B', '1T'); see module doc."""
    text = str(name_or_path).strip()
    if _is_path(text):
        return _load_file(str(Path(text).resolve()))  # re-read when the file changes
    return _load_named(check_name(text, "field 'model'"))


def _is_path(text: str) -> bool:
    """A model file: a .yaml or .yml suffix (any case) or a '/'."""
    return text.lower().endswith((".yaml", ".yml")) or "/" in text


@cache
def _load_named(text: str) -> ModelSpec:
    names = preset_names()
    if text.lower() in names:
        return _load_file(str(MODEL_DIR / f"{text.lower()}.yaml"))
    size = parse_size(text)
    if size is not None:
        return resolve_size(text)
    raise unknown("model", text, names)


def parse_size(text: str) -> float | None:
    """The parameter count a size shorthand asks for ('1.5T' -> 1.5e12), or None if `text` is not one.

    A shorthand with a non-positive number ('0B', '-5B') raises InputError naming the field 'model'."""
    m = SIZE_RE.match(text)
    if not m:
        return None
    value = float(m.group(1)) * SUFFIX[m.group(2).lower()]
    if value <= 0:
        raise InputError(f"field 'model': size {excerpt(text.strip())} must be positive; {EXPECTED}")
    return value


def _canonical(text: str) -> str:
    m = SIZE_RE.match(text)
    assert m
    number = m.group(1).lstrip("+")
    return f"{number}{m.group(2).upper()}"


def _interp(n: float, points: tuple[tuple[float, float], ...], log_y: bool, clamp: bool) -> float:
    """Piecewise-linear interpolation in log(n) (and log(y) if log_y); end segments extended or clamped."""
    xs = [math.log(x) for x, _ in points]
    ys = [math.log(y) if log_y else y for _, y in points]
    x = math.log(n)
    if clamp and (x <= xs[0] or x >= xs[-1]):
        y = ys[0] if x <= xs[0] else ys[-1]
    else:
        i = next((k for k in range(len(xs) - 2) if x <= xs[k + 1]), len(xs) - 2)
        y = ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])
    return math.exp(y) if log_y else y


def _family_spec(name: str, n_layers: int, d_model: int, ffn_dim: int) -> ModelSpec:
    return ModelSpec(name=name, n_layers=n_layers, d_model=d_model, n_heads=d_model // FAMILY_HEAD_DIM,
                     n_kv_heads=FAMILY_KV_HEADS, head_dim=FAMILY_HEAD_DIM, ffn_dim=ffn_dim,
                     vocab_size=FAMILY_VOCAB, gated_mlp=True, tied_embeddings=False)


def _best_depth(target: float, d_model: int, ffn_dim: int) -> ModelSpec:
    one = _family_spec("x", 1, d_model, ffn_dim).total_params()
    per_layer = _family_spec("x", 2, d_model, ffn_dim).total_params() - one
    fixed = one - per_layer
    layers = max(1, round((target - fixed) / per_layer))
    return _family_spec("x", layers, d_model, ffn_dim)


def shape_line(spec: ModelSpec) -> str:
    """One-line shape, e.g. '80 layers, d_model 8192, 64 heads (8 kv) x 128, ffn 28672, vocab 128256'."""
    kv = f" ({spec.n_kv_heads} kv)" if spec.n_kv_heads != spec.n_heads else ""
    line = (f"{spec.n_layers} layers, d_model {spec.d_model}, {spec.n_heads} heads{kv} x {spec.head_dim}, "
            f"ffn {spec.ffn_dim}, vocab {spec.vocab_size}")
    if spec.is_moe:
        shared = f" + {spec.n_shared_experts} shared" if spec.n_shared_experts else ""
        line += (f", {spec.n_experts} experts{shared} top-{spec.experts_per_token} "
                 f"(expert ffn {spec.moe_ffn_dim})")
    return line


def format_params(n: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if n >= div:
            return f"{n / div:.4g}{suffix}"
    return f"{n:.0f}"


def resolve_size(text: str) -> ModelSpec:
    """The dense Llama-3-style decoder for a size shorthand such as '1T' (rule in the module docstring)."""
    target = parse_size(text)
    if target is None:
        raise InputError(f"field 'model': {excerpt(text)} is not a size; {EXPECTED}")
    label = _canonical(text)
    if target > MAX_SHORTHAND_PARAMS:
        raise InputError(f"field 'model': size {label} is above the supported 1000T; {EXPECTED}")
    anchor = next((name for nominal, name in FAMILY_ANCHORS if math.isclose(target, nominal)), None)
    if anchor is not None:
        spec = load_model(anchor)
        how = f"the published {anchor} shape"
    else:
        d_star = _interp(target, tuple((n, load_model(a).d_model) for n, a in FAMILY_ANCHORS), True, False)
        ratio = _interp(target, FAMILY_FFN_RATIO, False, True)
        lo = max(FAMILY_WIDTH_STEP, math.floor(d_star / FAMILY_WIDTH_STEP) * FAMILY_WIDTH_STEP)
        candidates = []  # nearest width to d* first
        for d in sorted({lo, lo + FAMILY_WIDTH_STEP}, key=lambda d: abs(math.log(d / d_star))):
            ffn = max(FAMILY_FFN_STEP, round(ratio * d / FAMILY_FFN_STEP) * FAMILY_FFN_STEP)
            candidates.append(_best_depth(target, d, ffn))
        spec = next((s for s in candidates if abs(s.total_params() / target - 1) <= WIDTH_FALLBACK_ERROR),
                    min(candidates, key=lambda s: abs(s.total_params() - target)))
        how = f"width nearest d* = {d_star:.0f} (interpolated over llama3-8b/70b/405b), depth closest to N"
        if abs(spec.total_params() / target - 1) > MAX_SHORTHAND_ERROR:
            raise InputError(f"field 'model': size {label} is too small for the dense Llama-3-style family "
                             f"(nearest: {format_params(spec.total_params())} with {spec.n_layers} layers x "
                             f"{spec.d_model}); use a preset or a model .yaml file")
    total = spec.total_params()
    desc = (f"dense Llama-3-style decoder for '{label}': {shape_line(spec)}; "
            f"{format_params(total)} parameters ({100 * (total / target - 1):+.2f}% vs {label}); {how}")
    return replace(spec, name=f"dense-{label}", description=desc,
                   source="size shorthand; family rule in costmodel/catalog.py (anchored on Llama 3)")


def describe_shorthand(text: str) -> str:
    """The resolved shape of a size shorthand, e.g. for '1T': '... 151 layers, d_model 23552, ...'."""
    return resolve_size(text).description


def is_shorthand(text: str) -> bool:
    """True when `text` would be resolved as a size shorthand (not a path or preset name)."""
    t = str(text).strip()
    return not (_is_path(t) or t.lower() in preset_names()) \
        and SIZE_RE.match(t) is not None
