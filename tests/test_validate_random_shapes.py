"""benchmarks/validate_random_shapes.py (issue 28, item 7): the random shapes are fixed by the seed and within the
issue's ranges, every drawn shape scales down unchanged for its layout (no jax), the current set's figures parse off
validate_cpu's report, and the smallest drawn shape runs end to end (one compile on 8 CPU devices, about 20 s)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "validate_random_shapes.py"


def _module():
    spec = importlib.util.spec_from_file_location("validate_random_shapes", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def test_draw_fixed_by_seed_and_within_ranges():
    v = _module()
    shapes = v.draw(v.SEED)
    assert shapes == v.DRAWN == v.draw(v.SEED)  # reproducible, and the recorded set is the seed's draw
    assert len(shapes) == len(v.LAYOUTS) == 12
    assert v.draw(v.SEED + 1) != shapes
    for (name, _model, degrees, _remat), s in zip(v.LAYOUTS, shapes, strict=True):
        assert 128 <= s.d_model <= 512 and s.d_model % 8 == 0, (name, s)
        assert 128 <= s.seq_len <= 1024 and s.seq_len % 16 == 0, (name, s)
        assert 2 <= s.n_layers <= 4, (name, s)
        if degrees.get("pp", 1) > 1:
            assert s.n_layers % degrees["pp"] == 0, (name, s)
    assert len({(s.d_model, s.seq_len) for s in shapes}) == 12  # twelve distinct shapes
    assert "dp2-fsdp2-tp2-full" in [n for n, *_ in v.LAYOUTS]


def test_drawn_shapes_scale_down_unchanged():
    """The validator runs exactly the drawn shape (no rounding of d_model or seq) for every layout."""
    from costmodel.catalog import load_model
    from planner.validate.scale import Scale, scale_down

    v = _module()
    for (name, model, degrees, remat), s in zip(v.LAYOUTS, v.DRAWN, strict=True):
        small, job, _ = scale_down(load_model(model), v.plan_of(degrees, remat),
                                   Scale(d_model=s.d_model, seq_len=s.seq_len, n_layers=s.n_layers))
        assert (small.d_model, job.seq_len, small.n_layers) == (s.d_model, s.seq_len, s.n_layers), name


def test_current_set_figures_parse():
    v = _module()
    cur = v.current_set()
    assert len(cur) >= 12
    assert all(r["flops"] is not None and r["memory"] is not None for r in cur.values())
    assert v.passes({"flops": 2.9, "memory": -15.0, "collectives": 10.1}) == {"flops": True, "memory": True,
                                                                               "collectives": False}


def test_smallest_shape_end_to_end():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, str(SCRIPT), "--only", "cp4-dp2-full", "--no-tuned"], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    row = next(line for line in r.stdout.splitlines() if "cp4-dp2-full" in line and line.startswith("d160 s400 L2"))
    assert "FAILED" not in row
    float(row.split()[4]), float(row.split()[5])  # FLOPs and memory error %, printed as numbers
    assert "random 1/1" in r.stdout and "current set" in r.stdout
