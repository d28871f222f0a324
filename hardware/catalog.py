"""Hardware presets (YAML under profiles/) and user profiles by path."""

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


def preset_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


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
                 "host_mem_bytes", "host_link_Bps", "power_w"):
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
    """A preset by name (e.g. 'tpu-v5p') or a user's profile by path (a .yaml/.yml suffix in any case, or a '/')."""
    if name_or_path.lower().endswith((".yaml", ".yml")) or "/" in name_or_path:
        return _load_file(str(Path(name_or_path).resolve()))
    if check_name(name_or_path, "hardware") not in preset_names():
        raise unknown("hardware", name_or_path, preset_names())
    return with_calibration(_load_file(str(PROFILE_DIR / f"{name_or_path}.yaml")))


@cache
def with_calibration(chip: Chip) -> Chip:
    """Apply the fitted efficiency overlay (hardware/calibration/NAME.yaml) when one exists."""
    path = CALIBRATION_DIR / f"{chip.name}.yaml"
    if not path.is_file():
        return chip
    data = read_yaml(path)
    eff = build(Efficiency, data.get("eff", {}), path.name + ".eff")
    check_efficiency(eff, path.name + ": eff")
    return replace(chip, eff=eff)
