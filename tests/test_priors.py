"""hardware/priors.yaml (issue 28, item 2): one prior per chip family and efficiency parameter, from published
microbenchmarks (docs/priors.md). Its structure: every family maps to presets that exist, every prior lies inside
the fit's bounds (costmodel.calibrate.BOUNDS) with a positive spread, and every prior says where it comes from. Its
use: the penalized fit (costmodel.calibrate, priors=True) moves a parameter within its prior, leaves a parameter no
row sees at its prior mean, and leaves the fit without priors as it was."""

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


# ---- the penalized fit (costmodel.calibrate, priors=True) -----------------------------------------------------------

def _synthetic(truth):
    from dataclasses import replace

    from costmodel.estimate import estimate
    from costmodel.job import Job
    from costmodel.model import ModelSpec
    from costmodel.plan import REMAT_POLICIES, Plan
    from costmodel.published import Case
    from hardware.catalog import load_hardware
    from hardware.chip import Efficiency

    chip = load_hardware("h100-sxm")
    out = []
    for i, (d, seq, fsdp, tp) in enumerate([(2048, 2048, 8, 1), (4096, 4096, 16, 1), (4096, 8192, 8, 2),
                                            (8192, 2048, 32, 4), (1024, 16384, 8, 1), (5120, 4096, 64, 1)]):
        m = ModelSpec(f"m{i}", n_layers=8, d_model=d, n_heads=d // 128, ffn_dim=4 * d, vocab_size=32000)
        job, plan = Job(seq_len=seq, global_batch=fsdp * 2), Plan(fsdp=fsdp, tp=tp, micro_batch=2, zero=3,
                                                                  remat=REMAT_POLICIES["full"])
        t = estimate(m, replace(chip, eff=truth), job, plan).step_time_s
        out.append(Case(f"c{i}", "synthetic", m, replace(chip, eff=Efficiency()), job, plan, t))
    return out


def test_penalized_fit_moves_a_parameter_within_its_prior_and_leaves_unseen_ones_at_the_mean():
    from costmodel.calibrate import _fit_group, priors_of
    from hardware.chip import Efficiency

    cases = _synthetic(Efficiency(matmul_peak=0.6))  # 6.7 sd below the h100 prior (0.80 +- 0.03)
    free = _fit_group(cases)[0]["h100-sxm"]
    held = _fit_group(cases, priors=True)[0]["h100-sxm"]
    mean, sd = priors_of("h100-sxm")["matmul_peak"]
    assert free.matmul_peak == pytest.approx(0.6, abs=0.03)
    assert abs(held.matmul_peak - mean) / sd < abs(free.matmul_peak - mean) / sd - 1  # pulled towards the prior
    # no row runs fp8: lowp_gain is seen by none; with priors it is the prior mean, without it the default
    assert held.lowp_gain == pytest.approx(priors_of("h100-sxm")["lowp_gain"][0], abs=1e-6)
    assert free.lowp_gain == pytest.approx(Efficiency().lowp_gain)


def test_without_priors_the_pull_is_the_weak_one_towards_the_defaults():
    import numpy as np

    from costmodel.calibrate import BOUNDS, PRIOR_WEIGHT, _pull
    from hardware.chip import Efficiency

    names = list(BOUNDS)
    lo, hi = (np.array([BOUNDS[n][i] for n in names]) for i in (0, 1))
    x0, penalty = _pull(names, "h100-sxm", lo, hi, False)
    default = np.clip([getattr(Efficiency(), n) for n in names], lo + 1e-9, hi - 1e-9)
    x = (lo + hi) / 2
    assert np.array_equal(x0, default)
    assert np.array_equal(penalty(x), PRIOR_WEIGHT * (x - default) / np.array([BOUNDS[n][2] for n in names]))
    x0, penalty = _pull(names, "h100-sxm", lo, hi, True)
    assert x0[names.index("matmul_peak")] == pytest.approx(0.80) and penalty(x0)[names.index("matmul_peak")] == 0


def test_start_efficiency_is_the_prior_means_with_priors():
    from costmodel.calibrate import priors_of, start_efficiency
    from hardware.chip import Efficiency

    assert start_efficiency("tpu-v5p") == Efficiency()
    eff = start_efficiency("tpu-v5p", priors=True)
    assert all(getattr(eff, k) == mu for k, (mu, _) in priors_of("tpu-v5p").items())
    assert start_efficiency("cpu-host", priors=True) == Efficiency()  # no family: the defaults


def test_a_malformed_prior_is_one_line_naming_it(tmp_path, monkeypatch):
    from costmodel import calibrate
    from hardware.errors import InputError

    bad = tmp_path / "priors.yaml"
    bad.write_text("families:\n  x:\n    presets: [h100-sxm]\n    priors:\n      matmul_peak: {mean: 0.8, sd: 0}\n")
    monkeypatch.setattr(calibrate, "PRIORS_FILE", bad)
    calibrate._prior_table.cache_clear()
    try:
        with pytest.raises(InputError, match=r"families\.x\.priors\.matmul_peak: expected mean within"):
            calibrate.priors_of("h100-sxm")
    finally:
        monkeypatch.undo()
        calibrate._prior_table.cache_clear()
