"""Every notebook under notebooks/ runs top to bottom and is committed with the outputs of that run (text and
plots), as `make notebooks` (notebooks/render.py) writes them. Each notebook is run once per test session; its
stored text must equal the fresh run's (images are not compared, but must sit in the cells that plot)."""

from __future__ import annotations

import copy
import difflib
import functools
import importlib.util
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib_inline")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
IDS = [p.stem for p in PATHS]
STALE = "stored outputs are stale: run `make notebooks` and commit the notebooks"


def _load_render():
    spec = importlib.util.spec_from_file_location("notebooks_render", NOTEBOOKS / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_render()


@functools.cache
def fresh_run(path: Path):
    """The notebook run now, in a fresh kernel: once per session, shared by the tests below."""
    return render.execute(path)


def stored(path: Path):
    return nbformat.read(path, as_version=4)


def test_there_are_notebooks():
    names = {p.stem for p in PATHS}
    assert {"plan_1t_tpu_v5p_scaling", "h100_vs_tpu_v5p_405b", "remat_offload_memory",
            "published_runs_accuracy"} <= names


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_notebook_runs_without_errors(path):
    assert render.errors(fresh_run(path)) == []


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_stored_text_outputs_equal_a_fresh_run(path):
    old, new = render.text_outputs(stored(path)), render.text_outputs(fresh_run(path))
    assert len(old) == len(new), f"{path.name}: {STALE}"
    for i, (a, b) in enumerate(zip(old, new, strict=True)):
        if a != b:
            diff = difflib.unified_diff(a.splitlines(), b.splitlines(), "stored", "fresh run", lineterm="", n=1)
            pytest.fail(f"{path.name}, cell In [{i + 1}]: {STALE}\n" + "\n".join(list(diff)[:40]))


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_stored_plots_sit_where_the_notebook_plots(path):
    plots = render.image_cells(fresh_run(path))
    assert plots, f"{path.name}: a fresh run stored no image (inline backend not active?)"
    assert render.image_cells(stored(path)) == plots, f"{path.name}: {STALE}"


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_stored_notebook_is_as_make_notebooks_writes_it(path):
    """One top-to-bottom run (execution counts 1, 2, ...), normalised: a re-run on the same code is byte-identical."""
    nb = stored(path)
    counts = [c.execution_count for c in nb.cells if c.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1)), f"{path.name}: {STALE}"
    assert render.normalize(copy.deepcopy(nb)) == nb, f"{path.name}: {STALE}"
