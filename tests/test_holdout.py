"""Out-of-sample splits (costmodel.holdout), source weighting (costmodel.calibrate) and what `planner bench
published` says about them (issue 28)."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from costmodel import calibrate, holdout
from costmodel.estimate import estimate
from costmodel.job import Job
from costmodel.model import ModelSpec
from costmodel.plan import REMAT_POLICIES, Plan
from costmodel.published import FRAMEWORK_CONVENTION, Case, load_cases
from hardware.catalog import load_hardware
from hardware.chip import Efficiency
from hardware.yamlio import read_yaml
from tests.test_cli_errors import planner as _planner

REPO = Path(__file__).resolve().parents[1]
V5P_RUNS = REPO / "data" / "runs" / "maxtext2023-v5p.csv"  # runs schema, 16 tpu-v5p rows of one source


def _case(i: int, source: str, framework: str = "maxtext", chip: str = "tpu-v5p", fsdp: int = 8,
          truth: Efficiency | None = None) -> Case:
    """A small case whose measured time is the model's own under `truth` (a tiny model: estimates are fast)."""
    d = 512 + 128 * (i % 4)
    m = ModelSpec(f"m{i}", n_layers=2 + i % 3, d_model=d, n_heads=d // 128, ffn_dim=4 * d, vocab_size=32000)
    job = Job(seq_len=1024, global_batch=fsdp * 2)
    plan = Plan(fsdp=fsdp, micro_batch=2, zero=3, remat=REMAT_POLICIES["full"])
    hw = load_hardware(chip)
    t = estimate(m, replace(hw, eff=truth or Efficiency(matmul_peak=0.6)), job, plan).step_time_s
    return Case(f"{source}-{i}", source, m, hw, job, plan, t, framework=framework)


def _stub_fit(calls: list):
    """A stand-in for calibrate._fit_group that records the rows it is given and fits nothing."""
    def fit_group(cases, weights=None, priors=False):
        calls.append({"ids": [c.id for c in cases], "sources": {c.source for c in cases},
                      "frameworks": {c.framework for c in cases}, "chips": [c.plan.chips for c in cases],
                      "weights": None if weights is None else list(weights)})
        eff = Efficiency(matmul_peak=0.5 + 0.01 * len(calls))  # tags the fit: which call predicted a row
        return {c.chip.name: eff for c in cases}, {}
    return fit_group


def test_leave_source_out_never_fits_a_row_of_the_predicted_source(monkeypatch):
    cases = ([_case(i, "alpha") for i in range(4)] + [_case(i, "beta") for i in range(3)]
             + [_case(i, "gamma", framework="other") for i in range(2)])
    calls: list = []
    monkeypatch.setattr(calibrate, "_fit_group", _stub_fit(calls))
    predicted: list = []
    real_predict = holdout.predict

    def spy_predict(test, effs, split, fit=None):
        predicted.append(({c.source for c in test}, next(iter(effs.values()), None)))
        return real_predict(test, effs, split, fit)

    monkeypatch.setattr(holdout, "predict", spy_predict)
    records = holdout.leave_source_out(cases)
    assert sorted(r["id"] for r in records) == sorted(c.id for c in cases)  # every row predicted once
    assert len(calls) == 3 and all(len(c["sources"]) == 2 for c in calls)
    for sources, eff in predicted:
        (held_out,) = sources
        call = calls[int(round((eff.matmul_peak - 0.5) / 0.01)) - 1]
        assert held_out not in call["sources"]
        assert not set(call["ids"]) & {c.id for c in cases if c.source == held_out}
    assert {r["predicted_by"] for r in records} == {"fit"}


def test_a_family_with_one_source_is_predicted_with_the_defaults_without_a_fit(monkeypatch):
    def no_fit(*_a, **_k):
        raise AssertionError("a single-source family must not be fitted out of source")

    monkeypatch.setattr(calibrate, "_fit_group", no_fit)
    cases = [_case(i, "alpha") for i in range(3)]
    records = holdout.leave_source_out(cases)
    assert {r["predicted_by"] for r in records} == {"defaults"} and len(records) == 3
    default = estimate(cases[0].model, replace(cases[0].chip, eff=Efficiency()), cases[0].job, cases[0].plan)
    assert records[0]["predicted_s"] == pytest.approx(default.step_time_s)  # no shipped overlay reaches it


def test_leave_framework_out_and_leave_scale_out_keep_the_predicted_rows_out_of_the_fit(monkeypatch):
    cases = ([_case(i, "alpha", "nemo", fsdp=8) for i in range(3)]
             + [_case(i, "beta", "torchtitan", fsdp=16) for i in range(3)]
             + [_case(i, "gamma", "torchtitan", fsdp=32) for i in range(3)])
    calls: list = []
    monkeypatch.setattr(calibrate, "_fit_group", _stub_fit(calls))
    frameworks = holdout.leave_framework_out(cases)
    assert len(frameworks) == 9 and [c["frameworks"] for c in calls] == [{"torchtitan"}, {"nemo"}]
    calls.clear()
    assert holdout.scale_threshold(cases) == 16  # the median chip count
    scale = holdout.leave_scale_out(cases)
    assert {r["chips"] for r in scale} == {32} and len(calls) == 1 and max(calls[0]["chips"]) == 16


def test_source_weighting_gives_every_source_the_same_total_weight():
    cases = [_case(0, "one")] + [_case(i, "three") for i in range(3)] + [_case(i, "many") for i in range(50)]
    w = calibrate.source_weights(cases)
    totals = {s: w[[c.source == s for c in cases]].sum() for s in ("one", "three", "many")}
    assert totals["one"] == pytest.approx(totals["three"]) == pytest.approx(totals["many"])
    assert w.mean() == pytest.approx(1.0)  # the prior's pull is what it was with unit weights
    rows = calibrate.fit_rows(cases)
    assert len(rows) == 1 + 3 + calibrate.MAX_ROWS_PER_SOURCE
    assert [c.id for c in rows] == [c.id for c in calibrate.fit_rows(list(cases))]  # deterministic


def test_fit_sources_passes_equal_source_weights_to_the_fit(monkeypatch):
    calls: list = []
    monkeypatch.setattr(calibrate, "_fit_group", _stub_fit(calls))
    cases = [_case(i, "small") for i in range(2)] + [_case(i, "big") for i in range(60)]
    calibrate.fit_sources(cases)
    (call,) = calls
    sources = [next(c.source for c in cases if c.id == i) for i in call["ids"]]
    totals = {s: sum(w for w, x in zip(call["weights"], sources, strict=True) if x == s) for s in ("small", "big")}
    assert totals["small"] == pytest.approx(totals["big"]) and sources.count("big") == calibrate.MAX_ROWS_PER_SOURCE


def test_summary_weights_sources_equally():
    recs = [{"source": "a", "family": "f", "chip": "tpu-v5p", "error_pct": 10.0, "log_residual": 0.1,
             "predicted_by": "fit"}] + [{"source": "b", "family": "f", "chip": "tpu-v5p", "error_pct": -30.0,
                                         "log_residual": -0.3, "predicted_by": "fit"} for _ in range(9)]
    s = holdout.summarize(recs)["families"]["f"]
    assert s["rows"] == 10 and s["mape_pct"] == pytest.approx(28.0) and s["source_mape_pct"] == pytest.approx(20.0)
    assert s["calibration_sources"] == ["a", "b"]
    assert s["log_residual_p10"] == pytest.approx(-0.3) and s["log_residual_p90"] == pytest.approx(0.1)


# ---- runs CSVs and the CLI -----------------------------------------------------------------------------------------

def _csv(tmp_path: Path, edits: dict[str, dict[str, str]]) -> Path:
    with V5P_RUNS.open(newline="") as f:
        reader = csv.DictReader(f)
        fields, good = reader.fieldnames, next(reader)
    path = tmp_path / "runs.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerow(good)
        for rid, edit in edits.items():
            w.writerow({**good, "id": rid, **edit})
    return path


def test_unknown_framework_row_is_skipped_naming_the_supported_ones(tmp_path):
    path = _csv(tmp_path, {"odd": {"framework": "jax-magic"}, "none": {"framework": ""},
                           "tt": {"framework": "torchtitan"}, "nt": {"framework": "nanotron"}})
    cases, skipped = load_cases(path)
    supported = ", ".join(sorted(FRAMEWORK_CONVENTION))
    assert skipped == {"odd": f"framework: expected one of {supported}, got 'jax-magic'",
                       "none": f"framework: expected one of {supported}, got none"}
    by = {c.id: c for c in cases}
    assert by["tt"].job.framework == "pytorch-fsdp" and by["nt"].job.framework == "megatron"
    assert by["tt"].framework == "torchtitan"


def _never_fit(monkeypatch) -> None:
    import scipy.optimize

    def fitted(*_a, **_k):
        raise AssertionError("bench published must never fit on the file it predicts")

    for mod, name in ((calibrate, "_fit_group"), (calibrate, "fit"), (calibrate, "fit_sources"),
                      (calibrate, "fit_rows_unweighted"), (scipy.optimize, "least_squares")):
        monkeypatch.setattr(mod, name, fitted)


def test_bench_published_json_has_the_out_of_source_keys_and_never_fits(tmp_path, capsys, monkeypatch):
    _never_fit(monkeypatch)
    path = _csv(tmp_path, {"elsewhere": {"source": "some-other-source"}, "odd": {"framework": "jax-magic"}})
    code, out, err = _planner(capsys, monkeypatch, "bench", "published", "--file", str(path), "--json")
    assert code == 0, err
    data = json.loads(out)
    oos = data["out_of_source"]
    assert "leave-source-out" in oos["computed_by"] and "tpu-v5p" in oos["families"]
    fam = oos["families"]["tpu-v5p"]
    assert {"out_of_source_mape_pct", "log_residual_p10", "log_residual_p90", "rows", "sources"} <= set(fam)
    rows = {r["id"]: r for r in data["rows"]}
    first = next(iter(rows))
    assert rows[first]["in_calibration"] is ("maxtext2023-v5p" in fam["calibration_sources"])
    assert rows["elsewhere"]["in_calibration"] is False
    assert rows["odd"]["skipped"].startswith("framework: expected one of")
    assert data["mape_pct_other_sources"]["overall"] == pytest.approx(abs(rows["elsewhere"]["error_pct"]))
    assert "overall" in data["mape_pct"] and "mape_pct_calibration_sources" in data


def test_bench_published_table_leads_with_the_out_of_source_figures(tmp_path, capsys, monkeypatch):
    _never_fit(monkeypatch)
    code, out, err = _planner(capsys, monkeypatch, "bench", "published", "--file", str(_csv(tmp_path, {})))
    assert code == 0, err
    assert out.index("out-of-source accuracy") < out.index("published runs:")


def test_calibrate_writes_the_leave_source_out_summary_with_the_shipped_overlays(tmp_path, capsys, monkeypatch):
    import hardware.catalog as catalog

    calls: list = []
    monkeypatch.setattr(calibrate, "_fit_group", _stub_fit(calls))
    path = _csv(tmp_path, {"b1": {"source": "second"}, "b2": {"source": "second"}})
    monkeypatch.setattr(catalog, "CALIBRATION_DIR", tmp_path)  # stands in for hardware/calibration
    try:
        code, out, err = _planner(capsys, monkeypatch, "calibrate", "-f", str(path), "--write-shipped")
    finally:
        catalog.with_calibration.cache_clear()  # other tests read the real overlays
    assert code == 0, err
    acc = read_yaml(tmp_path / calibrate.ACCURACY_FILE)
    fam = acc["families"]["tpu-v5p"]
    assert fam["rows"] == 3 and fam["sources"] == ["maxtext2023-v5p", "second"]
    assert fam["calibration_sources"] == fam["sources"] and fam["predicted_by"] == "fit"
    assert "out of source (leave-source-out) tpu-v5p" in out
    # the overlay's fit, then one leave-source-out fit per source, each without the held-out source's rows, for
    # accuracy.yaml and again for evidence.yaml (costmodel.evidence)
    folds = [["maxtext2023-v5p"], ["second"]]
    assert len(calls) == 5 and calls[0]["sources"] == {"maxtext2023-v5p", "second"}
    assert sorted(map(sorted, (c["sources"] for c in calls[1:3]))) == folds
    assert sorted(map(sorted, (c["sources"] for c in calls[3:]))) == folds


def test_borrowers_are_not_fitted():
    with pytest.raises(Exception, match="borrows the fit of h100-sxm"):
        calibrate._load([str(V5P_RUNS)], ["h200"])
    assert calibrate.fit_family("h200") == "h100-sxm" and calibrate.family("a100-40gb") == "a100"
    assert np.isclose(calibrate.source_weights([_case(0, "x")]).sum(), 1.0)


def test_a_family_with_one_source_is_predicted_with_the_prior_means_under_priors(monkeypatch):
    def no_fit(*_a, **_k):
        raise AssertionError("a single-source family must not be fitted out of source")

    monkeypatch.setattr(calibrate, "_fit_group", no_fit)
    cases = [_case(i, "alpha") for i in range(2)]
    records = holdout.leave_source_out(cases, calibrate.Procedure("rows", priors=True))
    assert {r["predicted_by"] for r in records} == {"priors"}
    start = calibrate.start_efficiency("tpu-v5p", priors=True)
    assert start != Efficiency()
    want = estimate(cases[0].model, replace(cases[0].chip, eff=start), cases[0].job, cases[0].plan).step_time_s
    assert records[0]["predicted_s"] == pytest.approx(want)


def test_procedure_calls_the_fit_with_priors_and_a_resample_weighs_a_source_by_its_draws(monkeypatch):
    calls: list = []
    stub = _stub_fit(calls)

    def spy(cases, weights=None, priors=False):
        calls.append({"priors": priors})
        return stub(cases, weights)
    monkeypatch.setattr(calibrate, "_fit_group", spy)
    cases = [_case(i, "a") for i in range(2)] + [_case(i, "b") for i in range(4)] + [_case(0, "c")]
    calibrate.Procedure("sources", priors=True)(cases)
    assert calls[0]["priors"] is True
    calibrate.fit_procedure(cases, "rows", copies={"a": 2, "b": 1})
    assert sorted(calls[-1]["weights"]) == [1.0] * 4 + [2.0] * 2  # 'c' not drawn: left out
    calibrate.fit_procedure(cases, "sources", copies={"a": 2, "b": 1})
    w, ids = np.array(calls[-1]["weights"]), calls[-1]["ids"]
    total = {s: w[[i.startswith(s) for i in ids]].sum() for s in ("a", "b")}
    assert total["a"] == pytest.approx(2 * total["b"]) and w.mean() == pytest.approx(1.0)
