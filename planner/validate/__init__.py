"""Validator: run a plan as a real sharded JAX training step, compare the cost model with XLA, calibrate.

jax is imported only inside this package's submodules (never by `planner` or `cli.main` at import time).
Call `set_host_devices(n)` before the first jax import so that the CPU shows `n` devices.
"""

from __future__ import annotations

import os
import sys

# The concurrency-optimised scheduler ignores remat in its temp figure; the all-reduce combiner merges every
# gradient all-reduce into one at the end of the backward pass (all unreduced gradients live at once), where
# accelerators reduce-scatter layer by layer; cse_barrier_expander drops the optimization barriers that chain the
# flash attention's blocks (planner.validate.flash), leaving every block's scores live at once, where a flash
# kernel holds one (docs/validator_random_shapes.md).
CPU_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",
             "--xla_disable_hlo_passes=cpu-all-reduce-combiner,cse_barrier_expander")


def set_host_devices(n: int) -> None:
    """Ask XLA for `n` host-platform (CPU) devices; must run before jax is imported to take effect."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={n}")
    for f in CPU_FLAGS:
        if f.split("=")[0] not in " ".join(flags):
            flags.append(f)
    os.environ["XLA_FLAGS"] = " ".join(flags)


def jax_loaded() -> bool:
    return "jax" in sys.modules
