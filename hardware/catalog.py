"""Hardware presets (YAML under profiles/) and user profiles by path."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path

from hardware.chip import Chip, Efficiency
from hardware.errors import InputError, unknown
from hardware.yamlio import build, read_yaml

PROFILE_DIR = Path(__file__).parent / "profiles"
CALIBRATION_DIR = Path(__file__).parent / "calibration"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


@cache
def _load_file(path: str) -> Chip:
    chip = build(Chip, read_yaml(path), Path(path).name)
    _check(chip, Path(path).name)
    return chip


def _check(chip: Chip, where: str) -> None:
    """Physical sanity: positive peaks, capacities and bandwidths."""
    for name in ("peak_bf16_flops", "hbm_bytes", "hbm_bw_Bps", "host_link_Bps", "chips_per_host", "max_chips"):
        if getattr(chip, name) <= 0:
            raise InputError(f"{where}: field {name!r} must be > 0, got {getattr(chip, name)}")
    if not chip.levels:
        raise InputError(f"{where}: field 'levels' must list at least one interconnect level")
    for i, lv in enumerate(chip.levels):
        if lv.bw_per_dir_Bps <= 0:
            raise InputError(f"{where}: levels[{i}].bw_per_dir_Bps must be > 0, got {lv.bw_per_dir_Bps}")
        if lv.kind not in ("torus", "switch", "network"):
            raise InputError(f"{where}: levels[{i}].kind must be torus, switch or network, got {lv.kind!r}")


def load_hardware(name_or_path: str) -> Chip:
    """A preset by name (e.g. 'tpu-v5p') or a user's profile by path (anything ending in .yaml/.yml)."""
    if name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path:
        return _load_file(str(Path(name_or_path).resolve()))
    if name_or_path not in preset_names():
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
    return replace(chip, eff=eff)
