"""New chips from spec sheets and priors alone (issue 28, item 5): tpu-v7 (Ironwood; also `tpu7x`, `ironwood`),
h800 and gb200 (NVL72). Each profile's numbers are the sourced values; no run of these chips is calibrated, so their
efficiencies are their calibration sibling's overlay (hardware.catalog.with_calibration), and `planner estimate` and
`planner suggest` work on them. Evidence: docs/hardware_new_chips.md."""

from __future__ import annotations

import csv
import json
import re
from dataclasses import fields, replace
from pathlib import Path

import pytest
import yaml

from hardware import catalog
from hardware.catalog import (
    ALIASES,
    CALIBRATION_DIR,
    PROFILE_DIR,
    calibration_owner,
    efficiency_origin,
    load_hardware,
    preset_names,
    with_calibration,
)
from hardware.chip import GIB, Efficiency
from hardware.errors import InputError
from hardware.topology import slice_shape, valid_slice_sizes
from tests.test_cli_errors import planner

REPO = Path(__file__).resolve().parents[1]
NEW = ("tpu-v7", "h800", "gb200")
SIBLING = {"tpu-v7": "tpu-v5p", "h800": "h100-sxm", "gb200": "b200"}


# ---- the profiles: sourced numbers -------------------------------------------------------------------------------

# field: value, exactly as written in the profiles (and docs/hardware_new_chips.md)
PINNED = {
    "tpu-v7": dict(peak_bf16_flops=2.307e15, peak_fp8_flops=4.614e15, peak_int8_flops=0.0, hbm_bytes=192 * GIB,
                   hbm_bw_Bps=7.38e12, host_mem_bytes=2.4e11, host_link_Bps=3.2e10, chips_per_host=4,
                   max_chips=18432, hbm_reserve_frac=0.01303, power_w=0.0),
    "h800": dict(peak_bf16_flops=9.89e14, peak_fp8_flops=1.979e15, peak_int8_flops=1.979e15, hbm_bytes=85520809984,
                 hbm_bw_Bps=3.35e12, host_mem_bytes=2.56e11, host_link_Bps=6.4e10, chips_per_host=8,
                 max_chips=131072, hbm_reserve_frac=0.08, power_w=700.0),
    "gb200": dict(peak_bf16_flops=2.5e15, peak_fp8_flops=5.0e15, peak_int8_flops=5.0e15, hbm_bytes=1.86e11,
                  hbm_bw_Bps=8.0e12, host_mem_bytes=2.4e11, host_link_Bps=2.25e11, chips_per_host=4,
                  max_chips=131072, hbm_reserve_frac=0.08, power_w=1200.0),
}
# (name, kind, domain_chips, bw_per_dir_Bps, torus_dims, wrap_rule) per level, innermost first
LEVELS = {
    "tpu-v7": [("ici", "torus", 9216, 9.0e10, 3, "cube4"), ("dcn", "network", 0, 1.25e10, 0, "")],
    "h800": [("nvlink", "switch", 8, 2.0e11, 0, ""), ("ib", "network", 0, 5.0e10, 0, "")],
    "gb200": [("nvlink", "switch", 72, 9.0e11, 0, ""), ("ib", "network", 0, 5.0e10, 0, "")],
}


def test_the_new_chips_are_presets():
    assert set(NEW) <= set(preset_names())


@pytest.mark.parametrize("name", NEW)
def test_profile_numbers_are_the_sourced_values(name):
    chip = load_hardware(name)
    assert chip.name == name and chip.vendor == ("tpu" if name == "tpu-v7" else "gpu")
    assert chip.description and len(chip.sources) >= 4
    for field_name, value in PINNED[name].items():
        assert getattr(chip, field_name) == value, field_name
    got = [(lv.name, lv.kind, lv.domain_chips, lv.bw_per_dir_Bps, lv.torus_dims, lv.wrap_rule) for lv in chip.levels]
    assert got == LEVELS[name]
    assert chip.calibration_sibling == SIBLING[name]


@pytest.mark.parametrize("name", NEW)
def test_physical_sanity(name):
    chip = load_hardware(name)
    # every spec sheet here gives fp8 at twice the dense bf16 rate (H100/H800: 1,979 and 989, NVIDIA's roundings of
    # 1,978.9 and 989.4)
    assert chip.peak_fp8_flops == pytest.approx(2 * chip.peak_bf16_flops, rel=1e-3)
    assert chip.peak_flops("fp8") == chip.peak_fp8_flops and chip.effective_peak_flops("bf16") == chip.peak_bf16_flops
    assert chip.levels[0].bw_per_dir_Bps > chip.levels[-1].bw_per_dir_Bps  # scale-up faster than scale-out
    assert chip.levels[-1].kind == "network" and chip.levels[-1].domain_chips == 0
    assert chip.max_chips >= chip.levels[0].domain_chips >= chip.chips_per_host
    assert chip.usable_hbm_bytes < chip.hbm_bytes < 256e9
    assert chip.host_link_Bps < chip.hbm_bw_Bps


def test_tpu_v7_is_a_3d_torus_of_cubes_up_to_a_pod():
    chip = load_hardware("tpu-v7")
    assert chip.is_tpu and chip.scale_up.torus_dims == 3 and chip.scale_up.wrap_rule == "cube4"
    assert 9216 in valid_slice_sizes(chip) and max(valid_slice_sizes(chip)) == 9216
    assert slice_shape(chip, 9216) == (16, 24, 24)  # MaxText's tpu7x-18432 (devices) = 16x24x24 chips
    assert slice_shape(chip, 256) == (4, 8, 8)  # tpu7x-512
    # no int8 path on TPU7x (JAX tpu_info: bf16 and fp8 matmuls only): int8 falls back to the bf16 peak
    assert chip.peak_flops("int8") == chip.peak_bf16_flops


def test_tpu_v7_usable_hbm_is_what_xla_makes_available():
    """XLA:TPU (libtpu AOT, tpu7x:2x2x1) offers 94.75 GiB per TensorCore device; two devices per chip."""
    usable = load_hardware("tpu-v7").usable_hbm_bytes / GIB
    assert 2 * 94.75 - 0.02 <= usable <= 2 * 94.75


def test_h800_is_h100_silicon_with_nvlink_cut_to_400_gb_s_bidirectional():
    h800, h100 = load_hardware("h800"), load_hardware("h100-sxm")
    assert h800.levels[0].bw_per_dir_Bps * 2 == 400e9 and h100.levels[0].bw_per_dir_Bps * 2 == 900e9
    differ = {"name", "description", "sources", "levels", "calibration_sibling"}
    for f in fields(h800):
        if f.name not in differ:
            assert getattr(h800, f.name) == getattr(h100, f.name), f.name
    assert h800.levels[1] == h100.levels[1]  # same 400G InfiniBand per GPU
    assert replace(h800.levels[0], bw_per_dir_Bps=h100.levels[0].bw_per_dir_Bps) == h100.levels[0]


def test_gb200_is_a_72_gpu_nvlink_domain_of_b200_silicon():
    gb, b = load_hardware("gb200"), load_hardware("b200")
    assert gb.scale_up.kind == "switch" and gb.scale_up.domain_chips == 72 and b.scale_up.domain_chips == 8
    assert gb.scale_up.bw_per_dir_Bps == b.scale_up.bw_per_dir_Bps == 9.0e11  # NVLink5 either way
    assert gb.peak_bf16_flops > b.peak_bf16_flops and gb.power_w > b.power_w  # B200 at 1,200 W vs HGX's 1,000 W
    assert gb.host_link_Bps > 3 * b.host_link_Bps  # NVLink-C2C to Grace, not PCIe Gen5


@pytest.mark.parametrize("name", NEW)
def test_every_number_carries_a_comment(name):
    number = re.compile(r"^\s*(- )?\w+:\s*-?[0-9.]+(e[+-]?[0-9]+)?\s*(#.*)?$")
    for i, line in enumerate((PROFILE_DIR / f"{name}.yaml").read_text().splitlines(), 1):
        if number.match(line):
            assert "#" in line, f"{name}.yaml line {i} has no source comment: {line!r}"


@pytest.mark.parametrize("name", NEW)
def test_profiles_carry_no_efficiencies_and_no_overlay_of_their_own(name):
    """No runs of these chips go into calibration: no eff in the profile, no calibration/NAME.yaml, no runs rows."""
    assert "eff" not in yaml.safe_load((PROFILE_DIR / f"{name}.yaml").read_text())
    assert not (CALIBRATION_DIR / f"{name}.yaml").exists()
    # by path the profile costs as the preset does: its sibling's overlay, never one of its own
    assert load_hardware(str(PROFILE_DIR / f"{name}.yaml")).eff == load_hardware(name).eff


def test_no_runs_of_the_new_chips_in_the_calibration_data():
    names = {*NEW, *ALIASES}
    files = sorted((REPO / "data" / "runs").glob("*.csv")) + sorted((REPO / "benchmarks").glob("runs*.csv"))
    for path in files:
        with path.open(newline="") as f:
            rows = [r for r in csv.DictReader(f) if (r.get("hardware") or "").strip().lower() in names]
        assert not rows, f"{path.name}: runs of {sorted({r['hardware'] for r in rows})} must not be calibrated"


# ---- names ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("alias", ["tpu7x", "ironwood", "TPU7x", "Ironwood"])
def test_aliases_name_tpu_v7(alias):
    assert load_hardware(alias) == load_hardware("tpu-v7")
    assert load_hardware(alias).name == "tpu-v7"


def test_unknown_names_still_suggest():
    with pytest.raises(InputError, match=r"unknown hardware 'tpu7' \(did you mean 'tpu7x'\?\)"):
        load_hardware("tpu7")
    with pytest.raises(InputError, match=r"did you mean 'tpu-v5[ep]'\?") as e:
        load_hardware("tpu-v5")
    assert "tpu-v7" in str(e.value) and "ironwood" in str(e.value)  # the list names presets and aliases
    with pytest.raises(InputError, match=r"did you mean 'h800'\?"):
        load_hardware("h80")
    with pytest.raises(InputError, match=r"did you mean 'gb200'\?"):
        load_hardware("gb20")


def test_an_alias_is_not_a_path_and_a_path_is_not_an_alias(tmp_path):
    with pytest.raises(InputError, match="tpu7x.yaml"):
        load_hardware(str(tmp_path / "tpu7x.yaml"))  # a missing file, not the preset


# ---- the sibling rule ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NEW)
def test_efficiencies_are_the_siblings_overlay(name):
    chip, sibling = load_hardware(name), load_hardware(SIBLING[name])
    assert calibration_owner(chip) == SIBLING[name]
    assert chip.eff == sibling.eff != Efficiency()
    origin = efficiency_origin(chip)
    assert origin.startswith(f"from sibling {SIBLING[name]}") and f"no runs of {name}" in origin


def test_efficiency_origin_for_calibrated_uncalibrated_and_user_chips(tmp_path):
    assert efficiency_origin(load_hardware("h100-sxm")).startswith("calibration overlay, fitted on ")
    assert "borrowed from h100-sxm" in efficiency_origin(load_hardware("b200"))  # its overlay says so
    assert efficiency_origin(load_hardware("cpu-host")) == "defaults (priors; not calibrated)"
    data = yaml.safe_load((PROFILE_DIR / "h800.yaml").read_text())
    data.update(name="my-h800", eff={"hbm": 0.5})
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump(data))
    assert efficiency_origin(load_hardware(str(path))) == "set in the profile"


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A profiles and a calibration directory of our own; the with_calibration cache is cleared around the test."""
    prof, cal = tmp_path / "profiles", tmp_path / "calibration"
    prof.mkdir()
    cal.mkdir()
    monkeypatch.setattr(catalog, "PROFILE_DIR", prof)
    monkeypatch.setattr(catalog, "CALIBRATION_DIR", cal)
    with_calibration.cache_clear()
    base = yaml.safe_load((PROFILE_DIR / "h800.yaml").read_text())

    def profile(name: str, sibling: str = "") -> None:
        (prof / f"{name}.yaml").write_text(yaml.safe_dump({**base, "name": name, "calibration_sibling": sibling}))

    def overlay(name: str, matmul_peak: float) -> None:
        (cal / f"{name}.yaml").write_text(yaml.safe_dump({"chip": name, "fitted_on": f"runs-{name}.csv",
                                                          "eff": {"matmul_peak": matmul_peak}}))
    yield profile, overlay
    with_calibration.cache_clear()


def test_sibling_chain_is_followed_and_an_own_overlay_wins(sandbox):
    profile, overlay = sandbox
    profile("a", "b")
    profile("b", "c")
    profile("c")
    overlay("c", 0.61)
    assert [load_hardware(n).eff.matmul_peak for n in "abc"] == [0.61, 0.61, 0.61]
    assert calibration_owner(load_hardware("a")) == "c"
    assert efficiency_origin(load_hardware("a")).startswith("from sibling c: no runs of a")
    overlay("b", 0.52)
    with_calibration.cache_clear()
    assert [load_hardware(n).eff.matmul_peak for n in "abc"] == [0.52, 0.52, 0.61]
    overlay("a", 0.43)
    with_calibration.cache_clear()
    assert load_hardware("a").eff.matmul_peak == 0.43
    assert efficiency_origin(load_hardware("a")) == "calibration overlay, fitted on runs-a.csv"


def test_sibling_loop_or_chain_without_overlay_keeps_defaults(sandbox):
    profile, _ = sandbox
    profile("a", "b")
    profile("b", "a")
    profile("lonely")
    for name in ("a", "b", "lonely"):
        assert load_hardware(name).eff == Efficiency()
        assert calibration_owner(load_hardware(name)) is None
        assert efficiency_origin(load_hardware(name)) == "defaults (priors; not calibrated)"


@pytest.mark.parametrize("sibling, needle", [("h100-sx", "did you mean 'h100-sxm'"), ("mine", "its own sibling")])
def test_a_bad_sibling_is_one_error_naming_the_field(tmp_path, sibling, needle):
    data = yaml.safe_load((PROFILE_DIR / "h800.yaml").read_text())
    data.update(name="mine", calibration_sibling=sibling)
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(InputError) as e:
        load_hardware(str(path))
    msg = str(e.value)
    assert "mine.yaml" in msg and "calibration_sibling" in msg and needle in msg and "\n" not in msg


# ---- the planner on the new chips ------------------------------------------------------------------------------

ESTIMATES = {  # hardware: small plans (chips, degrees)
    "tpu-v7": ("-n", "8", "--fsdp", "8", "-b", "8"),
    "tpu7x": ("-n", "8", "--fsdp", "8", "-b", "8"),
    "ironwood": ("-n", "16", "--fsdp", "8", "--tp", "2", "-b", "16"),
    "h800": ("-n", "8", "--fsdp", "8", "-b", "8"),
    "gb200": ("-n", "72", "--fsdp", "72", "-b", "72"),
}


@pytest.mark.parametrize("hw", sorted(ESTIMATES))
def test_planner_estimate_runs(hw, capsys, monkeypatch):
    code, out, err = planner(capsys, monkeypatch, "estimate", "-m", "llama3-8b", "-H", hw, *ESTIMATES[hw],
                             "--seq-len", "4096", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["hardware"] == catalog.preset_name(hw)
    assert d["step_time_s"] > 0 and 0 < d["mfu"] < 1 and d["fits"]
    code, out, err = planner(capsys, monkeypatch, "estimate", "-m", "llama3-8b", "-H", hw, *ESTIMATES[hw])
    assert code == 0 and "step time" in out, err


def _estimate(capsys, monkeypatch, hw: str, *args: str) -> dict:
    code, out, err = planner(capsys, monkeypatch, "estimate", "-m", "llama3-8b", "-H", hw, *args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_h800_tensor_parallel_pays_for_its_narrower_nvlink(capsys, monkeypatch):
    plan = ("-n", "8", "--tp", "8", "-b", "8")
    h800, h100 = _estimate(capsys, monkeypatch, "h800", *plan), _estimate(capsys, monkeypatch, "h100-sxm", *plan)
    t800, t100 = h800["breakdown"]["time_s"], h100["breakdown"]["time_s"]
    assert t800["compute"] == t100["compute"]  # same silicon, same efficiencies
    assert 1.9 < t800["comm_tp"] / t100["comm_tp"] <= 450 / 200  # bandwidth term 2.25x, latency term equal
    assert h800["step_time_s"] > h100["step_time_s"]


def test_gb200_keeps_72_gpus_on_nvlink_where_b200_crosses_the_network(capsys, monkeypatch):
    plan = ("-n", "72", "--fsdp", "72", "-b", "72")
    gb, b = _estimate(capsys, monkeypatch, "gb200", *plan), _estimate(capsys, monkeypatch, "b200", *plan)
    assert {c["level"] for c in gb["collectives"] if c["axis"] == "fsdp"} == {"scale-up"}
    assert {c["level"] for c in b["collectives"] if c["axis"] == "fsdp"} == {"network"}
    assert gb["breakdown"]["time_s"]["comm_fsdp"] < b["breakdown"]["time_s"]["comm_fsdp"]


@pytest.mark.parametrize("hw, chips", [("gb200", "72"), ("tpu-v7", "256")])
def test_planner_suggest_returns_plans(hw, chips, capsys, monkeypatch):
    code, out, err = planner(capsys, monkeypatch, "suggest", "-m", "llama3-70b", "-H", hw, "-n", chips, "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["plans"] and all(p["fits"] and p["step_time_s"] > 0 and 0 < p["mfu"] < 1 for p in d["plans"])
    best = d["plans"][0]["degrees"]
    assert best["dp"] * best["fsdp"] * best["tp"] * best["cp"] * best["pp"] * best["ep"] == int(chips)


def test_a_copy_of_a_preset_given_by_path_keeps_its_calibration(tmp_path):
    """A profile file that writes no efficiencies (as the presets' files do not) costs as the preset its name
    names; one that writes `eff` keeps its own; a name that looks like a path never reads a file."""
    import shutil

    import yaml

    from hardware.catalog import efficiency_origin, load_hardware

    copy = tmp_path / "mine.yaml"
    shutil.copy(Path(__file__).resolve().parents[1] / "hardware" / "profiles" / "h100-sxm.yaml", copy)
    assert load_hardware(str(copy)).eff == load_hardware("h100-sxm").eff
    assert efficiency_origin(load_hardware(str(copy))).startswith("calibration overlay")
    data = yaml.safe_load(copy.read_text())
    own = tmp_path / "own.yaml"
    own.write_text(yaml.safe_dump({**data, "eff": {"matmul_peak": 0.5}}))
    assert load_hardware(str(own)).eff.matmul_peak == 0.5
    assert efficiency_origin(load_hardware(str(own))) == "set in the profile"
    odd = tmp_path / "odd.yaml"
    odd.write_text(yaml.safe_dump({**data, "name": "../profiles/h100-sxm"}))
    assert efficiency_origin(load_hardware(str(odd))) == "defaults (priors; not calibrated)"
