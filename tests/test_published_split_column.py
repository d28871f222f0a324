"""The runs schema's optional `pipeline_split` column (Megatron-Core's account_for_embedding/loss_in_pipeline_split):
parsed into the Plan flags, a bad value reported row by row, a file without the column loads as before."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from costmodel.published import PIPELINE_SPLIT, evaluate, load_cases, row_to_case

RUNS = Path(__file__).resolve().parents[1] / "data" / "runs"
MLPERF = RUNS / "mlperf-training.csv"
ROW_405B = "mlperf-v5.0-nvidia-llama405b-512gpu"
EMB, LOSS = "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"


def _rows(path: Path = MLPERF) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _write(tmp_path: Path, rows: list[dict[str, str]], drop: tuple[str, ...] = ()) -> Path:
    p = tmp_path / "runs.csv"
    names = [k for k in rows[0] if k not in drop]
    with p.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=names, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return p


def _flags(case) -> tuple[bool, bool]:
    return getattr(case.plan, EMB), getattr(case.plan, LOSS)


def test_mlperf_405b_rows_set_both_flags_and_are_costed():
    cases, skipped = load_cases(MLPERF)
    assert len(cases) == 29 and skipped == {}
    both = {c.id for c in cases if _flags(c) == (True, True)}
    assert len(both) == 7 and all("llama405b" in i for i in both)
    assert all(_flags(c) == (False, False) for c in cases if c.id not in both)
    rows = {r["id"]: r for r in evaluate(cases)}
    assert all("error_pct" in rows[i] for i in both)  # were skipped: 126 layers do not split over 8 x 8


@pytest.mark.parametrize("value, flags", [("", (False, False)), ("embedding", (True, False)),
                                          ("loss", (False, True)), ("embedding+loss", (True, True)),
                                          (" embedding+loss ", (True, True))])
def test_each_value(value, flags):
    row = next(r for r in _rows() if r["id"] == ROW_405B)
    row.update(n_layers="128" if flags == (False, False) else "127" if flags != (True, True) else "126",
               pipeline_split=value)
    assert _flags(row_to_case(row)) == flags
    assert set(PIPELINE_SPLIT) == {"", "embedding", "loss", "embedding+loss"}


def test_bad_value_is_reported_with_the_row_id(tmp_path):
    rows = _rows()
    bad = next(r for r in rows if r["id"] == ROW_405B)
    bad["pipeline_split"] = "ASYM_PP_EMBED"
    cases, skipped = load_cases(_write(tmp_path, rows))
    assert len(cases) == 28 and list(skipped) == [ROW_405B]
    assert skipped[ROW_405B] == ("pipeline_split: expected empty, embedding, loss or embedding+loss, "
                                 "got 'ASYM_PP_EMBED'")


def test_flags_megatron_refuses_are_reported(tmp_path):
    rows = _rows()
    one = next(r for r in rows if r["id"] == ROW_405B)
    one["pipeline_split"] = "embedding"  # 127 layers do not divide over pp 8
    gpt = next(r for r in rows if r["id"] == "mlperf-v3.1-nvidia-gpt3-512gpu")
    gpt.update(framework="torchtitan", pipeline_split="loss")  # not a Megatron-Core framework
    cases, skipped = load_cases(_write(tmp_path, rows))
    assert len(cases) == 27
    assert skipped[ROW_405B].startswith("pipeline_split 'embedding': pp: num_layers 127 (after "
                                        "account_for_embedding_in_pipeline_split) must be divisible by ")
    assert skipped[gpt["id"]].startswith("pipeline_split 'loss': account_for_loss_in_pipeline_split "
                                         "(--account-for-loss-in-pipeline-split): a Megatron-Core option")


def test_missing_column_means_empty(tmp_path):
    cases, skipped = load_cases(_write(tmp_path, _rows(), drop=("pipeline_split",)))
    assert len(cases) == 29 and skipped == {}
    assert all(_flags(c) == (False, False) for c in cases)
    rows = evaluate(cases)  # as before the column: the 405B rows cannot be split over 8 x 8 without the flags
    assert sum("skipped" in r for r in rows) == 7
    for name in ("torchtitan.csv", "runs_dev.csv"):  # files without the column
        with (RUNS / name).open(newline="") as f:
            assert "pipeline_split" not in next(csv.reader(f))
        cases, _ = load_cases(RUNS / name)
        assert cases and all(_flags(c) == (False, False) for c in cases)
