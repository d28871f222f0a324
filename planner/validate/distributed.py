"""One validator program over several processes (hosts): `jax.distributed.initialize` before the mesh is built.

On a cluster every host runs the same `planner validate` command with its own --process-id; the mesh then spans
all processes' devices (jax.devices() is global) and each process feeds its own shards of the same deterministic
parameters and batch. On CPU hosts (and the two-process test on localhost) the cross-process collectives run
over gloo.
"""

from __future__ import annotations

from hardware.errors import InputError


def check_args(coordinator: str, num_processes: int, process_id: int, devices: int) -> int:
    """Validate the flags before jax starts; returns the devices each process creates (CPU)."""
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise InputError(f"--coordinator: expected HOST:PORT, got {coordinator!r}")
    if num_processes < 1:
        raise InputError(f"--num-processes: expected a positive integer, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise InputError(f"--process-id: expected 0..{num_processes - 1}, got {process_id}")
    if devices % num_processes:
        raise InputError(f"--devices {devices} (the global count) does not divide over {num_processes} processes; "
                         f"use a multiple of {num_processes}")
    return devices // num_processes


def initialize(coordinator: str, num_processes: int, process_id: int, timeout_s: int = 120) -> None:
    """jax.distributed.initialize with gloo CPU collectives (jax must not have created its backends yet)."""
    import jax

    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # older/newer jax without the option: the platform's default collectives
        pass
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=timeout_s)



def stdout_to_stderr():
    """Send file descriptor 1 to stderr (gloo prints its connection messages on stdout, which would corrupt
    --json); returns a function that puts stdout back."""
    import os
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)

    def restore() -> None:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)

    return restore
