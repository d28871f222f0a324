"""Hardware presets (YAML under profiles/) and user profiles by path.

Efficiencies of a preset come from its calibration overlay (calibration/NAME.yaml, written by `planner calibrate`).
A preset with no runs of its own names `calibration_sibling` (its nearest calibrated relative) and gets that
preset's overlay instead, following siblings until one has an overlay; efficiency_origin says which applied.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import cache
from pathlib import Path

from hardware.chip import Chip, Efficiency
from hardware.errors import InputError, check_name, excerpt, shown_path, unknown
from hardware.yamlio import build, cache_per_version, read_yaml

PROFILE_DIR = Path(__file__).parent / "profiles"
CALIBRATION_DIR = Path(__file__).parent / "calibration"

# Other names a preset answers to (matched in any case): Google calls TPU v7 "TPU7x" (its Cloud and MaxText name)
# and "Ironwood" (its generation).
ALIASES = {"tpu7x": "tpu-v7", "ironwood": "tpu-v7"}


def preset_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def preset_name(name: str) -> str:
    """The preset a name or alias stands for ('tpu7x' -> 'tpu-v7'), or an InputError suggesting near names."""
    names = preset_names()
    if check_name(name, "hardware") in names:
        return name
    alias = ALIASES.get(name.lower())
    if alias in names:
        return alias
    raise unknown("hardware", name, [*names, *(a for a, target in ALIASES.items() if target in names)])


@cache_per_version
def _load_file(path: str) -> Chip:
    """A profile file, parsed and checked (once per version of it)."""
    where = shown_path(Path(path).name)
    chip = build(Chip, read_yaml(path), where)
    _check(chip, where)
    return chip


def _check(chip: Chip, where: str) -> None:
    """Physical sanity: finite positive peaks, capacities and bandwidths; efficiencies in range."""
    for name in ("peak_bf16_flops", "hbm_bytes", "hbm_bw_Bps", "host_link_Bps", "chips_per_host", "max_chips"):
        if not getattr(chip, name) > 0:
            raise InputError(f"{where}: field {name!r} must be > 0, got {getattr(chip, name)}")
    for name in ("peak_bf16_flops", "peak_fp8_flops", "peak_int8_flops", "hbm_bytes", "hbm_bw_Bps",
                 "host_mem_bytes", "host_link_Bps", "host_mem_bw_Bps", "power_w"):
        v = getattr(chip, name)
        if not math.isfinite(v) or v < 0:
            raise InputError(f"{where}: field {name!r} must be a finite number >= 0, got {v}")
    if not 0 <= chip.hbm_reserve_frac < 1:
        raise InputError(f"{where}: field 'hbm_reserve_frac' must be in [0, 1), got {chip.hbm_reserve_frac}")
    check_efficiency(chip.eff, where + ": eff")
    if not chip.levels:
        raise InputError(f"{where}: field 'levels' must list at least one interconnect level")
    for i, lv in enumerate(chip.levels):
        if not (math.isfinite(lv.bw_per_dir_Bps) and lv.bw_per_dir_Bps > 0):
            raise InputError(f"{where}: levels[{i}].bw_per_dir_Bps must be a finite number > 0, "
                             f"got {lv.bw_per_dir_Bps}")
        if not (math.isfinite(lv.latency_s) and lv.latency_s >= 0):
            raise InputError(f"{where}: levels[{i}].latency_s must be a finite number >= 0, got {lv.latency_s}")
        if lv.domain_chips < 0:
            raise InputError(f"{where}: levels[{i}].domain_chips must be >= 0 (0: unbounded), got {lv.domain_chips}")
        if lv.kind not in ("torus", "switch", "network"):
            raise InputError(f"{where}: levels[{i}].kind must be torus, switch or network, got {excerpt(lv.kind)}")
    sibling = chip.calibration_sibling
    if sibling and (sibling == chip.name or sibling not in preset_names()):
        why = "a chip cannot be its own sibling" if sibling == chip.name else \
            str(unknown("hardware", sibling, preset_names()))
        raise InputError(f"{where}: field 'calibration_sibling' must name another preset: {why}")


def check_efficiency(eff: Efficiency, where: str) -> None:
    """Efficiencies: fractions in (0, 1] (overlaps and gains in [0, 1]), non-negative half-dim and overhead."""
    for name in ("matmul_peak", "attention", "hbm", "link", "net"):
        v = getattr(eff, name)
        if not (math.isfinite(v) and 0 < v <= 1):
            raise InputError(f"{where}.{name}: expected a fraction in (0, 1], got {v}")
    for name in ("overlap", "tp_overlap", "host_overlap", "lowp_gain"):
        v = getattr(eff, name)
        if not (math.isfinite(v) and 0 <= v <= 1):
            raise InputError(f"{where}.{name}: expected a fraction in [0, 1], got {v}")
    for name in ("matmul_half_dim", "step_overhead_s"):
        v = getattr(eff, name)
        if not (math.isfinite(v) and v >= 0):
            raise InputError(f"{where}.{name}: expected a finite number >= 0, got {v}")


def load_hardware(name_or_path: str) -> Chip:
    """A preset by name or alias (e.g. 'tpu-v5p', 'tpu7x') with its calibrated efficiencies, or a user's profile by
    path (a .yaml/.yml suffix in any case, or a '/'). A profile that writes no efficiencies of its own (as the
    presets' files do not) takes the calibration of the preset its `name` or `calibration_sibling` names, as that
    preset would (a copy of h100-sxm.yaml costs as h100-sxm); one that writes `eff` keeps its own."""
    if name_or_path.lower().endswith((".yaml", ".yml")) or "/" in name_or_path:
        chip = _load_file(str(Path(name_or_path).resolve()))
        return with_calibration(chip) if chip.eff == Efficiency() else chip
    return with_calibration(_preset_file(preset_name(name_or_path)))


def _preset_file(name: str) -> Chip:
    return _load_file(str(PROFILE_DIR / f"{name}.yaml"))


def _overlay_path(name: str) -> Path:
    return CALIBRATION_DIR / f"{name}.yaml"


def calibration_owner(chip: Chip) -> str | None:
    """The preset whose overlay with_calibration gives `chip`: its own name when calibration/NAME.yaml exists, else
    the first of its calibration_sibling chain that has one (a chain that loops, or ends without one, gives None)."""
    name, sibling, seen = chip.name, chip.calibration_sibling, set()
    while not (name in preset_names() and _overlay_path(name).is_file()):  # a user's name is never a path
        if not sibling or sibling in seen or sibling not in preset_names():
            return None
        seen.add(name)
        name, sibling = sibling, _preset_file(sibling).calibration_sibling
    return name


def _overlay(name: str) -> tuple[Efficiency, str]:
    """(efficiencies, what they were fitted on) of calibration/NAME.yaml."""
    path = _overlay_path(name)
    data = read_yaml(path)
    eff = build(Efficiency, data.get("eff", {}), path.name + ".eff")
    check_efficiency(eff, path.name + ": eff")
    return eff, str(data.get("fitted_on", "an unnamed runs file"))


@cache
def with_calibration(chip: Chip) -> Chip:
    """Apply the fitted efficiency overlay (hardware/calibration/NAME.yaml) when one exists; for a chip without one,
    its calibration sibling's (calibration_owner). Chips with neither keep the efficiencies they have."""
    owner = calibration_owner(chip)
    if owner is None:
        return chip
    return replace(chip, eff=_overlay(owner)[0])


def efficiency_origin(chip: Chip) -> str:
    """Where `chip`'s efficiencies come from, in words, for `hardware show`: fitted to its own runs, borrowed from a
    calibration sibling's fit (no runs of the chip), the untuned defaults, or set in a user's profile."""
    owner = calibration_owner(chip) if chip.name in preset_names() or chip.calibration_sibling else None
    if owner is not None:
        eff, fitted_on = _overlay(owner)
        if chip.eff == eff:
            if owner == chip.name:
                return f"calibration overlay, fitted on {fitted_on}"
            return (f"from sibling {owner}: no runs of {chip.name} are calibrated; {owner}'s overlay, "
                    f"fitted on {fitted_on}")
    if chip.eff == Efficiency():
        return "defaults (priors; not calibrated)"
    return "set in the profile"
