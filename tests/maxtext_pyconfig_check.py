"""Run under a Python that has maxtext==0.2.5 installed (not the planner's venv): load exported configs through
MaxText's own pyconfig and report what MaxText derives from them, as JSON lines.

    python tests/maxtext_pyconfig_check.py CASES.json

CASES.json: a list of {"file": path, "topology": "v5p-128" | "a3", "slices": n}. For each case MaxText builds its
config as for ahead-of-time compilation on that topology (no devices needed), then the mesh degrees are checked
with MaxText's own fill_unspecified_mesh_axes.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> None:
    from maxtext.configs import pyconfig
    from maxtext.utils import max_utils

    cases = json.load(open(sys.argv[1]))
    for case in cases:
        out = {"file": case["file"]}
        try:
            cfg = pyconfig.initialize(["train.py", case["file"], "run_name=planner_check",
                                       f"base_output_directory={case.get('outdir', '/tmp/planner_check')}",
                                       "enable_checkpointing=false", "dataset_type=synthetic",
                                       f"compile_topology={case['topology']}",
                                       f"compile_topology_num_slices={case['slices']}"])
            devices = cfg.num_target_devices
            ici = max_utils.fill_unspecified_mesh_axes(list(cfg.ici_parallelism), devices // cfg.num_slices, "ICI")
            if cfg.num_slices > 1:
                max_utils.fill_unspecified_mesh_axes(list(cfg.dcn_parallelism), cfg.num_slices, "DCN")
            out.update(ok=True, devices=devices, num_slices=cfg.num_slices, ici=list(ici),
                       global_batch=cfg.global_batch_size_to_train_on, remat_policy=cfg.remat_policy,
                       pipeline_microbatches=cfg.num_pipeline_microbatches,
                       pipeline_repeats=cfg.num_pipeline_repeats if cfg.using_pipeline_parallelism else 1)
        except BaseException as e:  # noqa: BLE001 - report any MaxText complaint for this case
            out.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
