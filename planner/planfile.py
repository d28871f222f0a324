"""Plan files: one YAML (or JSON) document that says what to train, on what, and how (format in README_planfile.md).

`save_plan(...)` writes one; `load_plan(path) -> PlanFile` reads one back, checks every field and the plan's
divisibility rules, and raises a one-line InputError naming the file, the field and what was expected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from costmodel.catalog import load_model
from costmodel.constraints import check_plan
from costmodel.cost import Cost
from costmodel.estimate import dcn_split
from costmodel.job import Job
from costmodel.model import ModelSpec
from costmodel.plan import (
    AXES,
    CPU_OFFLOAD_LAYERS,
    EP_OVERLAP,
    FP8_PARAMS,
    GRAD_BF16,
    MEGATRON_COUNTS,
    MEGATRON_SWITCHES,
    RECOMPUTE_LAYERS,
    REMAT_POLICIES,
    SPLIT_FLAGS,
    TENSORS,
    Plan,
    Remat,
)
from hardware.catalog import load_hardware, preset_names
from hardware.chip import Chip
from hardware.errors import MAX_NAME_CHARS, InputError, check_name, did_you_mean, escape, excerpt, shown_path, unknown
from hardware.fileio import check_output_path, read_text, write_text
from hardware.yamlio import MAX_DEPTH, MAX_INT_DIGITS, build, parse_yaml, to_dict

VERSION = 1
TOP_FIELDS = ("version", "description", "model", "hardware", "chips", "job", "plan", "predicted")
REQUIRED_TOP = ("version", "model", "hardware", "chips", "job", "plan")
PLAN_FIELDS = ("degrees", "slices", "ici", "dcn", "micro_batch", "vpp", "zero", "sequence_parallel", "remat",
               "offload_optimizer", "offload_params", "vocab_tiles", *SPLIT_FLAGS, EP_OVERLAP,
               RECOMPUTE_LAYERS, CPU_OFFLOAD_LAYERS, FP8_PARAMS, GRAD_BF16)
PREDICTED_FIELDS = ("step_time_s", "mfu", "tokens_per_s", "peak_memory_bytes", "fit_memory_bytes", "fits")
MODEL_META = ("name", "description", "source")
MAX_REF_CHARS = 1024  # a model or hardware reference that is a path (a name: MAX_NAME_CHARS)
MAX_DESCRIPTION_CHARS = 4096


@dataclass(frozen=True)
class PlanFile:
    """A loaded plan file. `model_ref`/`hardware_ref` are the names or paths the file used ('' = inline)."""

    model: ModelSpec
    hardware: Chip
    chips: int
    job: Job
    plan: Plan
    model_ref: str = ""
    hardware_ref: str = ""
    description: str = ""
    predicted: dict[str, Any] | None = None  # the cost summary saved with the file, for reference only
    path: str = ""

    def with_plan(self, plan: Plan, job: Job | None = None) -> PlanFile:
        return replace(self, plan=plan, job=job or self.job, predicted=None)


# ---- small typed readers: each error names file, field and the expected type ----------------------------------

def _err(where: str, field: str, expected: str, value: Any) -> InputError:
    return InputError(f"{where}: field {field!r}: expected {expected}, got {excerpt(value)}")


def _check_keys(data: dict, allowed: tuple[str, ...], where: str, section: str) -> None:
    for key in data:
        if key not in allowed:
            prefix = f"{section}." if section else ""
            raise InputError(f"{where}: unknown field {excerpt(prefix + str(key))}"
                             f"{did_you_mean(str(key)[:MAX_NAME_CHARS], allowed)}; "
                             f"expected one of: {', '.join(allowed)}")


def _int(value: Any, where: str, field: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise _err(where, field, kind, value)
    return value


def _bool(value: Any, where: str, field: str) -> bool:
    if not isinstance(value, bool):
        raise _err(where, field, "true or false", value)
    return value


def _mapping(value: Any, where: str, field: str) -> dict:
    if not isinstance(value, dict):
        raise _err(where, field, "a mapping", value)
    return value


# ---- model and hardware references ---------------------------------------------------------------------------

def _looks_like_path(text: str) -> bool:
    return text.lower().endswith((".yaml", ".yml")) or "/" in text


def _check_ref(value: str, where: str, field: str) -> str:
    """A model or hardware reference is data: a name (printable, at most MAX_NAME_CHARS) or a path (printable,
    at most MAX_REF_CHARS)."""
    if not _looks_like_path(value):
        return check_name(value, f"{where}: field {field!r}")
    if not value.isprintable() or len(value) > MAX_REF_CHARS:
        raise _err(where, field, f"a path of at most {MAX_REF_CHARS:,} printable characters", value)
    return value


def _check_description(value: Any, where: str) -> str:
    """Free text: printable (line breaks allowed, no other control characters), at most MAX_DESCRIPTION_CHARS."""
    if not isinstance(value, str):
        raise _err(where, "description", "a string", value)
    if not value.replace("\n", " ").isprintable() or len(value) > MAX_DESCRIPTION_CHARS:
        raise _err(where, "description", f"printable text of at most {MAX_DESCRIPTION_CHARS:,} characters", value)
    return value


def _resolve_ref(text: str, base: Path) -> str:
    """A relative path is looked up next to the plan file first, then in the working directory."""
    if _looks_like_path(text) and not Path(text).is_absolute() and (base / text).is_file():
        return str(base / text)
    return text


def same_shape(a: ModelSpec, b: ModelSpec) -> bool:
    """Equal apart from name, description and source."""
    blank = dict.fromkeys(MODEL_META, "")
    return replace(a, **blank) == replace(b, **blank)


def model_ref_for(model: ModelSpec) -> str:
    """The preset name (or size shorthand) that reproduces `model` exactly, or '' when it must be written inline."""
    for ref in (model.name, model.name.removeprefix("dense-")):
        try:
            if load_model(ref) == model:
                return ref
        except InputError:
            continue
    return ""


def hardware_ref_for(chip: Chip) -> str:
    if chip.name in preset_names() and load_hardware(chip.name) == chip:
        return chip.name
    return ""


def _load_model_field(value: Any, where: str, base: Path) -> tuple[ModelSpec, str]:
    if isinstance(value, str):
        _check_ref(value, where, "model")
        try:
            return load_model(_resolve_ref(value, base)), value
        except InputError as e:
            raise InputError(f"{where}: field 'model': {e}") from None
    if isinstance(value, dict):
        return build(ModelSpec, value, f"{where}: model"), ""
    raise _err(where, "model", "a preset name, a model YAML path, a size such as 70B, or a mapping of model fields",
               value)


def _load_hardware_field(value: Any, where: str, base: Path) -> tuple[Chip, str]:
    if not isinstance(value, str):
        raise _err(where, "hardware", "a hardware preset name or a profile YAML path", value)
    _check_ref(value, where, "hardware")
    try:
        return load_hardware(_resolve_ref(value, base)), value
    except InputError as e:
        raise InputError(f"{where}: field 'hardware': {e}") from None


# ---- plan section -------------------------------------------------------------------------------------------

def _remat_from(value: Any, where: str) -> Remat:
    field = "plan.remat"
    if isinstance(value, str):
        check_name(value, f"{where}: field {field!r}")
        if value.startswith("custom"):
            raise _err(where, field, "a policy name, or a mapping {policy: custom, tensors: {...}}", value)
        if value not in REMAT_POLICIES:
            raise InputError(f"{where}: field {field!r}: {unknown('remat policy', value, REMAT_POLICIES)}")
        return REMAT_POLICIES[value]
    data = _mapping(value, where, field)
    _check_keys(data, ("policy", "tensors"), where, field)
    policy = data.get("policy", "custom")
    if not isinstance(policy, str):
        raise _err(where, field + ".policy", "a string", policy)
    check_name(policy, f"{where}: field '{field}.policy'")
    tensors = _mapping(data.get("tensors", {}), where, field + ".tensors")
    _check_keys(tensors, TENSORS, where, field + ".tensors")
    for t, c in tensors.items():
        if c not in ("device", "remat", "offload"):
            raise _err(where, f"{field}.tensors.{t}", "one of device, remat, offload", c)
    if policy == "custom":
        return Remat(name="custom", **tensors)
    if policy not in REMAT_POLICIES:
        raise InputError(f"{where}: field '{field}.policy': {unknown('remat policy', policy, REMAT_POLICIES)}")
    named = REMAT_POLICIES[policy]
    differ = [t for t, c in tensors.items() if named.choices()[t] != c]
    if differ:
        raise InputError(f"{where}: field '{field}.tensors': {', '.join(differ)} differ from policy {policy!r}; "
                         "set policy: custom to choose tensors freely")
    return named


def _degrees(value: Any, where: str, field: str) -> dict[str, int]:
    data = _mapping(value, where, field)
    _check_keys(data, AXES, where, field)
    return {a: _int(data.get(a, 1), where, f"{field}.{a}") for a in AXES}


def _plan_from(data: dict, where: str) -> Plan:
    _check_keys(data, PLAN_FIELDS, where, "plan")
    if "degrees" not in data:
        raise InputError(f"{where}: missing field 'plan.degrees' (a mapping of {', '.join(AXES)} to integers)")
    deg = _degrees(data["degrees"], where, "plan.degrees")
    kw: dict[str, Any] = dict(deg)
    for f in ("slices", "micro_batch", "vpp", "vocab_tiles"):
        if f in data:
            kw[f] = _int(data[f], where, f"plan.{f}")
    if "zero" in data:
        z = data["zero"]
        if isinstance(z, bool) or z not in (0, 1, 2, 3):
            raise _err(where, "plan.zero", "0, 1, 2 or 3", z)
        kw["zero"] = z
    for f in ("sequence_parallel", "offload_optimizer", "offload_params", *MEGATRON_SWITCHES):
        if f in data:
            kw[f] = _bool(data[f], where, f"plan.{f}")
    for f in MEGATRON_COUNTS:  # block recompute, layer CPU offload; 0: off
        if f in data:
            kw[f] = _int(data[f], where, f"plan.{f}", minimum=0)
    if "remat" in data:
        kw["remat"] = _remat_from(data["remat"], where)
    try:
        plan = Plan(**kw)
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    return plan


def _check_layout(plan: Plan, chip: Chip, data: dict, where: str) -> None:
    """Optional ici/dcn maps must match the layout the cost model uses (costmodel.estimate.dcn_split)."""
    if "ici" not in data and "dcn" not in data:
        return
    if chip.scale_up.kind != "torus":
        raise InputError(f"{where}: fields 'plan.ici'/'plan.dcn' are for TPU (torus) hardware; {chip.name} is not")
    try:
        dcn = dcn_split(plan)
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    want_dcn = {a: dcn.get(a, 1) for a in AXES}
    want_ici = {a: plan.degrees()[a] // want_dcn[a] for a in AXES}
    for key, want in (("ici", want_ici), ("dcn", want_dcn)):
        if key in data:
            got = _degrees(data[key], where, f"plan.{key}")
            if got != want:
                shown = ", ".join(f"{a}: {v}" for a, v in want.items() if v > 1) or "all 1"
                span = "slices over DCN: data first, then pipeline, then fsdp" if key == "dcn" else "ICI"
                raise InputError(f"{where}: field 'plan.{key}': expected {{{shown}}} (the degrees spanning {span}, "
                                 "derived from plan.degrees and plan.slices; fix or delete it), got "
                                 f"{excerpt(data[key])}")


# ---- load ------------------------------------------------------------------------------------------------------

def _is_json(path: Path) -> bool:
    return path.suffix.lower() == ".json"


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise InputError(f"duplicate key {excerpt(key)}")
        out[key] = value
    return out


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise InputError(f"integer of {len(text):,} characters (at most {MAX_INT_DIGITS})")
    return int(text)


def _depth(value: Any) -> int:
    """Nesting of lists and mappings, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def parse_json(text: str, where: str) -> Any:
    """A .json plan file, parsed as JSON (YAML 1.1 reads json.dumps' 1e-05 as a string) with the YAML loader's
    refusals (hardware.yamlio.StrictLoader): duplicate keys, integers over MAX_INT_DIGITS digits, nesting deeper
    than MAX_DEPTH."""
    try:
        data = json.loads(text, object_pairs_hook=_json_object, parse_int=_json_int)
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: not valid JSON at line {e.lineno}") from None
    except RecursionError:
        raise InputError(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
    if _depth(data) > MAX_DEPTH:
        raise InputError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    return data


def read_plan_data(p: Path, where: str) -> dict[str, Any]:
    """The top-level mapping of a plan file: hardware.fileio.read_text's checks (size, UTF-8), then JSON for a
    .json suffix (any case) and the strict YAML loader otherwise."""
    text = read_text(p)
    data = parse_json(text, where) if _is_json(p) else parse_yaml(text, where)
    if not isinstance(data, dict):
        raise InputError(f"{where}: expected a mapping of field: value at the top level")
    return data


def load_plan(path: str | Path, check: bool = True) -> PlanFile:
    """Read and check a plan file (YAML or JSON, at most 1 MB; read_plan_data)."""
    p = Path(path)
    where = shown_path(p)
    data = read_plan_data(p, where)
    if "version" not in data:
        raise InputError(f"{where}: missing field 'version' (an integer; this planner reads version {VERSION})")
    v = data["version"]
    if isinstance(v, bool) or not isinstance(v, int):
        raise _err(where, "version", f"the integer {VERSION}", v)
    if v < VERSION:
        raise InputError(f"{where}: field 'version': plan file format {v} is older than this planner reads "
                         f"(expected {VERSION}); re-save it with `planner estimate ... --save-plan`")
    if v > VERSION:
        raise InputError(f"{where}: field 'version': plan file format {v} is newer than this planner reads "
                         f"(expected {VERSION}); upgrade the planner")
    _check_keys(data, TOP_FIELDS, where, "")
    for f in REQUIRED_TOP:
        if f not in data:
            expected = {"model": "preset name, path or mapping", "hardware": "preset name or path",
                        "chips": "integer", "job": "mapping", "plan": "mapping"}[f]
            raise InputError(f"{where}: missing field {f!r} ({expected})")
    base = p.resolve().parent
    description = _check_description(data.get("description", ""), where)
    model, model_ref = _load_model_field(data["model"], where, base)
    chip, hw_ref = _load_hardware_field(data["hardware"], where, base)
    chips = _int(data["chips"], where, "chips")
    job_data = _mapping(data["job"], where, "job")
    try:
        job = build(Job, job_data, f"{where}: job")
    except InputError as e:
        msg = str(e)
        raise InputError(msg if msg.startswith(where) else f"{where}: job: {msg}") from None
    plan_data = _mapping(data["plan"], where, "plan")
    plan = _plan_from(plan_data, where)
    predicted = None
    if "predicted" in data:
        predicted = _mapping(data["predicted"], where, "predicted")
        _check_keys(predicted, PREDICTED_FIELDS, where, "predicted")
        for k, val in predicted.items():
            ok = isinstance(val, bool) if k == "fits" else isinstance(val, int | float) and not isinstance(val, bool)
            if not ok:
                raise _err(where, f"predicted.{k}", "true or false" if k == "fits" else "a number", val)
    if check:
        try:
            check_plan(model, chip, job, plan, chips)
        except InputError as e:
            raise InputError(f"{where}: {e}") from None
        _check_layout(plan, chip, plan_data, where)
    return PlanFile(model, chip, chips, job, plan, model_ref, hw_ref, description, predicted, where)


# ---- save ------------------------------------------------------------------------------------------------------

def _remat_dict(r: Remat) -> dict:
    return {"policy": r.name, "tensors": r.choices()}


def plan_dict(plan: Plan, chip: Chip | None) -> dict:
    out: dict[str, Any] = {"degrees": plan.degrees(), "slices": plan.slices}
    if chip is not None and chip.scale_up.kind == "torus":
        dcn = dcn_split(plan)
        out["ici"] = {a: plan.degrees()[a] // dcn.get(a, 1) for a in AXES}
        out["dcn"] = {a: dcn.get(a, 1) for a in AXES}
    out.update(micro_batch=plan.micro_batch, vpp=plan.vpp, zero=plan.zero,
               sequence_parallel=plan.sequence_parallel, remat=_remat_dict(plan.remat),
               offload_optimizer=plan.offload_optimizer, offload_params=plan.offload_params)
    if plan.vocab_tiles > 1:
        out["vocab_tiles"] = plan.vocab_tiles
    # written only when set (Megatron-Core's)
    out.update({f: True for f in MEGATRON_SWITCHES if getattr(plan, f)})
    out.update({f: getattr(plan, f) for f in MEGATRON_COUNTS if getattr(plan, f)})  # only when set
    return out


def predicted_dict(cost: Cost) -> dict:
    return {"step_time_s": cost.step_time_s, "mfu": cost.mfu, "tokens_per_s": cost.tokens_per_s,
            "peak_memory_bytes": cost.peak_memory_bytes, "fit_memory_bytes": cost.fit_memory_bytes, "fits": cost.fits}


def planfile_dict(model: ModelSpec | str, hardware: Chip | str, chips: int, job: Job, plan: Plan,
                  cost: Cost | None = None, description: str = "") -> dict:
    """The plan file's content as plain data (what save_plan writes)."""
    if isinstance(model, str):
        model_value: Any = model
    else:
        model_value = model_ref_for(model) or {k: v for k, v in to_dict(model).items() if v != "" or k == "name"}
    if isinstance(hardware, str):
        hw_value, chip = hardware, load_hardware(hardware)
    else:
        hw_value, chip = hardware_ref_for(hardware), hardware
        if not hw_value:
            raise InputError(f"hardware {excerpt(hardware.name)}: a plan file names hardware by preset or profile "
                             "path; pass the path of its profile YAML")
    out: dict[str, Any] = {"version": VERSION}
    if description:  # written by this tool (it may quote a user's path): escaped, so it loads back
        out["description"] = escape(description)[:MAX_DESCRIPTION_CHARS]
    out.update(model=model_value, hardware=hw_value, chips=chips, job=to_dict(job), plan=plan_dict(plan, chip))
    if cost is not None:
        out["predicted"] = predicted_dict(cost)
    return out


HEADER = ("# planner plan file (format version {v}); see planner/README_planfile.md.\n"
          "# `planner estimate --plan FILE` costs it; `planner export --plan FILE --format maxtext|megatron` turns it\n"
          "# into a training config. 'predicted' is the estimate when the file was written, for reference only.\n")


class _Flow(dict):
    """A small mapping written on one line ({dp: 1, fsdp: 16, ...})."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Flow, lambda d, v: d.represent_mapping("tag:yaml.org,2002:map", v.items(), flow_style=True))
FLOW_KEYS = ("degrees", "ici", "dcn", "tensors")


def _flowed(obj: Any, key: str = "") -> Any:
    if isinstance(obj, dict):
        inner = {k: _flowed(v, k) for k, v in obj.items()}
        return _Flow(inner) if key in FLOW_KEYS else inner
    return obj


def dumps(data: dict, fmt: str = "yaml") -> str:
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    body = yaml.dump(_flowed(data), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
    return HEADER.format(v=VERSION) + body


def save_plan(path: str | Path, model: ModelSpec | str, chip_name: str | Chip, chips: int, job: Job, plan: Plan,
              cost: Cost | None = None, description: str = "", flag: str = "--save") -> Path:
    """Write a plan file (JSON when the path ends in .json, any case, else YAML), atomically through
    hardware.fileio.write_text: an existing file is replaced whole or left unchanged. Returns the path written.

    model: a ModelSpec (written as its preset name when one reproduces it exactly, else inline) or the name or
    path the user gave; chip_name: a hardware preset name or profile path (or a preset's Chip); flag: the option
    that named the path, for errors (call hardware.fileio.check_output_path with it before any search)."""
    p = check_output_path(path, flag)
    text = dumps(planfile_dict(model, chip_name, chips, job, plan, cost, description),
                 "json" if _is_json(p) else "yaml")
    write_text(p, text, flag)
    return p


def planfile_text(pf: PlanFile, fmt: str = "yaml", cost: Cost | None = None) -> str:
    """A loaded/constructed PlanFile back to text (for `planner export --format json` and `planner import`)."""
    model: ModelSpec | str = pf.model_ref or pf.model
    if pf.model_ref and _looks_like_path(pf.model_ref):
        model = pf.model  # a relative path may not resolve from where the text goes: write the spec inline
    hardware: Chip | str = pf.hardware_ref if pf.hardware_ref and not _looks_like_path(pf.hardware_ref) \
        else (pf.hardware_ref or pf.hardware)
    if isinstance(hardware, str) and _looks_like_path(hardware):
        hardware = str(Path(hardware).resolve())
    return dumps(planfile_dict(model, hardware, pf.chips, pf.job, pf.plan, cost, pf.description), fmt)
