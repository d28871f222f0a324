"""Orderable TPU slice shapes (hardware.topology, sourced from the Cloud TPU docs) and how suggest says a job spans
slices."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hardware.catalog import load_hardware
from hardware.errors import InputError
from hardware.topology import slice_shape, valid_slice_sizes

PLANNER = str(Path(sys.executable).parent / "planner")


@pytest.mark.parametrize("name", ["tpu-v4", "tpu-v5p", "tpu-v7"])
def test_3d_slices_below_a_cube_are_the_offered_shapes(name):
    chip = load_hardware(name)
    small = [n for n in valid_slice_sizes(chip) if n < 64]
    assert small == [4, 8, 16, 32]
    assert [slice_shape(chip, n) for n in small] == [(1, 2, 2), (2, 2, 2), (2, 2, 4), (2, 4, 4)]
    assert all(d % 4 == 0 for n in valid_slice_sizes(chip) if n >= 64 for d in slice_shape(chip, n))


@pytest.mark.parametrize("name", ["tpu-v5e", "tpu-v6e"])
def test_2d_slices_are_the_offered_shapes(name):
    assert valid_slice_sizes(load_hardware(name)) == [1, 4, 8, 16, 32, 64, 128, 256]


def test_a_slice_of_40_chips_cannot_be_ordered():
    with pytest.raises(InputError, match="cannot form a slice of 40 chips"):
        slice_shape(load_hardware("tpu-v5p"), 40)


def test_suggest_says_how_a_count_that_is_no_slice_is_formed():
    r = subprocess.run([PLANNER, "suggest", "-m", "llama2-7b", "-n", "1000", "--top", "1", "--json"],
                       capture_output=True, text=True)
    d = json.loads(r.stdout)
    assert r.returncode == 0 and d["slices"] == 125
    assert any("125 slices of 8 chips (2x2x2) joined over DCN; nearest single-slice sizes: 960, 1024" in n
               for n in d["notes"])


def test_a_plan_on_part_of_the_smallest_slice_can_still_be_costed():
    v5p = load_hardware("tpu-v5p")
    assert slice_shape(v5p, 1) == (1, 1, 1) and slice_shape(v5p, 2) == (1, 1, 2)
    assert 1 not in valid_slice_sizes(v5p) and 2 not in valid_slice_sizes(v5p)
