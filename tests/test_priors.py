"""hardware/priors.yaml (issue 28, item 2): one prior per chip family and efficiency parameter, from published
microbenchmarks (docs/priors.md). The file is data only; these tests check its structure: every family maps to
presets that exist, every prior lies inside the fit's bounds (costmodel.calibrate.BOUNDS) with a positive spread, and
every prior says where it comes from."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from costmodel.calibrate import BOUNDS
from hardware.catalog import preset_names
from hardware.chip import EFFICIENCY_FIELDS

PRIORS = Path(__file__).resolve().parent.parent / "hardware" / "priors.yaml"
FAMILIES = ("a100", "h100", "h200", "b200", "gb200", "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu-v7")
SILICON = ("matmul_peak", "matmul_half_dim", "attention", "hbm", "link", "net")  # every family has these
GROUNDED = ("measured", "derived", "weak")
KEY = re.compile(r"\[([A-Za-z0-9-]+)\]")


@pytest.fixture(scope="module")
def doc() -> dict:
    return yaml.safe_load(PRIORS.read_text())


def _priors(doc: dict):
    for family, spec in doc["families"].items():
        for name, prior in spec["priors"].items():
            yield family, name, prior


def test_families_are_the_chip_families(doc):
    assert set(doc["families"]) == set(FAMILIES)


def test_every_family_maps_to_existing_presets(doc):
    names = set(preset_names())
    seen: dict[str, str] = {}
    for family, spec in doc["families"].items():
        assert spec["presets"], family
        for preset in spec["presets"]:
            assert preset in names, f"{family}: no preset {preset!r}"
            assert preset not in seen, f"{preset} in both {seen.get(preset)} and {family}"
            seen[preset] = family
    # every accelerator preset has a family (cpu-host is the validator's host, not a training chip)
    assert names - set(seen) <= {"cpu-host"}


def test_every_family_has_the_silicon_parameters(doc):
    for family, spec in doc["families"].items():
        missing = [p for p in SILICON if p not in spec["priors"]]
        assert not missing, f"{family}: no prior for {missing}"


def test_priors_name_efficiency_parameters_and_lie_within_bounds(doc):
    for family, name, prior in _priors(doc):
        assert name in EFFICIENCY_FIELDS and name in BOUNDS, f"{family}: {name} is not an efficiency parameter"
        lo, hi, _ = BOUNDS[name]
        mean, sd = prior["mean"], prior["sd"]
        assert isinstance(mean, (int, float)) and isinstance(sd, (int, float)), f"{family}.{name}"
        assert lo <= mean <= hi, f"{family}.{name}: mean {mean} outside BOUNDS [{lo}, {hi}]"
        assert sd > 0, f"{family}.{name}: sd {sd}"


def test_every_prior_is_sourced(doc):
    sources = doc["sources"]
    for family, name, prior in _priors(doc):
        where = f"{family}.{name}"
        assert prior["grounded"] in GROUNDED, where
        for field in ("source", "derivation"):
            assert isinstance(prior.get(field), str) and prior[field].strip(), f"{where}: empty {field}"
        cited = KEY.findall(prior["source"])
        for key in cited:
            assert key in sources, f"{where}: cites [{key}], not in sources"
        if prior["grounded"] != "weak":
            assert cited, f"{where}: a {prior['grounded']} prior must cite a measurement"
    for key, text in sources.items():
        assert isinstance(text, str) and len(text) > 20, key


def test_measured_silicon_priors_exist_for_every_gpu_and_tpu_generation(doc):
    """The point of the file: matmul_peak is measured (not assumed) wherever a GEMM benchmark was found."""
    measured = {f for f, name, p in _priors(doc) if name == "matmul_peak" and p["grounded"] == "measured"}
    assert {"a100", "h100", "h200", "b200", "gb200", "tpu-v5e", "tpu-v6e", "tpu-v7"} <= measured


def test_unmodelled_section_is_data_not_priors(doc):
    for name, entry in doc["unmodelled"].items():
        assert name not in BOUNDS
        assert entry["note"].strip()
        for chip, item in entry.items():
            if chip != "note":
                assert item["value"] > 0 and item["source"].strip(), f"{name}.{chip}"
