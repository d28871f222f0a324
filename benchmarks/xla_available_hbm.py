"""The HBM XLA:TPU lets a compiled program use, per chip, read off the compiler itself.

Usage (needs libtpu; no TPU): python benchmarks/xla_available_hbm.py [--write]
For each TPU generation, compiles ahead of time (jax.experimental.topologies) a one-chip program that needs far
more than any chip has and reads the capacity from XLA's refusal ("... exceeds available HBM (31.24G)", G = GiB).
The profiles' hbm_reserve_frac (hardware/profiles/tpu-*.yaml) is 1 - available / hbm_bytes: the capacity the
planner's fit check (costmodel.memory.fit_floor_bytes, the floor XLA's peak stays under) may fill.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# generation: (topology name, chip config, profile); v4 and v5p run one JAX device per chip (megacore)
GENERATIONS = {"v4": ("v4:2x2x1", "megacore", "tpu-v4"), "v5e": ("v5e:2x2", "default", "tpu-v5e"),
               "v5p": ("v5:2x2x1", "megacore", "tpu-v5p"), "v6e": ("v6e:2x2", "default", "tpu-v6e")}
GIB = 2**30


def available_hbm_gib(topology: str, chip_config: str) -> float:
    """XLA's 'available HBM' for one chip of the topology, in GiB, from a compile it must refuse."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.topologies import get_topology_desc
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    desc = get_topology_desc(platform="tpu", topology_name=topology, chip_config_name=chip_config,
                             chips_per_host_bounds=(2, 2, 1), num_slices=1, wrap=(False, False, False))
    sh = NamedSharding(Mesh(np.array(list(desc.devices)[:1]), ("x",)), P())

    def step(x):  # a sorted 200k x 200k fp32 outer product: ~300 GiB of temporaries
        return jnp.sort(jnp.outer(x, x), axis=1)[:, :8].sum(axis=1)

    try:
        jax.jit(step, in_shardings=sh).lower(jax.ShapeDtypeStruct((200_000,), jnp.float32, sharding=sh)).compile()
    except Exception as e:  # noqa: BLE001 - the refusal is the measurement
        hit = re.search(r"exceeds available HBM \(([\d.]+)G\)", str(e))
        if hit:
            return float(hit.group(1))
        raise
    raise RuntimeError(f"{topology}: XLA compiled a ~300 GiB program; no capacity to read")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    from hardware.catalog import load_hardware

    lines = [f"{'generation':10s} {'topology':10s} {'XLA available GiB':>18s} {'profile HBM GiB':>16s} "
             f"{'implied reserve':>16s} {'profile reserve':>16s}"]
    for gen, (topo, cfg, profile) in GENERATIONS.items():
        avail = available_hbm_gib(topo, cfg)
        chip = load_hardware(profile)
        hbm = chip.hbm_bytes / GIB
        lines.append(f"{gen:10s} {topo:10s} {avail:18.2f} {hbm:16.2f} {1 - avail / hbm:16.4f} "
                     f"{chip.hbm_reserve_frac:16.4f}")
    from importlib.metadata import version

    lines.append(f"(jax {version('jax')}, libtpu {version('libtpu')}; XLA prints the capacity in GiB with two "
                 "decimals)")
    text = "\n".join(lines)
    print(text)
    if args.write:
        (ROOT / "benchmarks" / "xla_available_hbm_report.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
