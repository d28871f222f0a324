"""Measure a device's matmul rate over shapes and its memory bandwidth with JAX; print one JSON object.

    python -m planner.validate.microbench [--quick] [--dtype bfloat16] [--devices 8]

On a GPU/TPU this measures device 0 (bf16 by default); on the CPU (--quick) small shapes in fp32, so that the
script that calls it (benchmarks/device_calibration.sh) runs end to end anywhere.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def _time(fn, *args, reps: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile + warm-up
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main(argv: list[str]) -> None:
    quick = "--quick" in argv
    if "--devices" in argv:
        from planner.validate import set_host_devices

        set_host_devices(int(argv[argv.index("--devices") + 1]))
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    on_cpu = dev.platform == "cpu"
    dtype = argv[argv.index("--dtype") + 1] if "--dtype" in argv else ("float32" if on_cpu else "bfloat16")
    dt = jnp.dtype(dtype)
    shapes = [(256, 256, 256), (512, 512, 512), (1024, 1024, 1024)] if (quick or on_cpu) else \
        [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 1024),
         (8192, 1024, 8192), (8192, 8192, 128), (8192, 128, 8192)]
    reps = 3 if (quick or on_cpu) else 10
    mm = []
    f = jax.jit(lambda a, b: a @ b)
    for m, k, n in shapes:
        a = jax.device_put(jnp.ones((m, k), dt), dev)
        b = jax.device_put(jnp.ones((k, n), dt), dev)
        t = _time(f, a, b, reps=reps)
        mm.append({"m": m, "k": k, "n": n, "seconds": t, "tflops": 2 * m * k * n / t / 1e12})
    # memory bandwidth: y = x * 2 reads and writes the buffer once each
    nbytes = (64 << 20) if (quick or on_cpu) else (4 << 30)
    x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), dev)
    g = jax.jit(lambda v: v * 2.0)
    t = _time(g, x, reps=reps)
    out = {"device": str(dev), "platform": dev.platform, "device_kind": getattr(dev, "device_kind", ""),
           "n_devices": len(jax.devices()), "dtype": dtype, "matmul": mm,
           "best_matmul_tflops": max(r["tflops"] for r in mm),
           "hbm": {"bytes": nbytes, "seconds": t, "GBps": 2 * nbytes / t / 1e9}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
