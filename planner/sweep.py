"""Sweeps: the best plan at each point of a grid over one or two of chips, global batch, sequence length, model
and hardware.

    axes = [parse_vary("chips=256:8192:x2")]
    rows = run_sweep(SweepBase(model="70B", hardware="tpu-v5p", global_batch=1024), axes, search)

`search(model, chip, chips, job)` is any function that returns the best `(Plan, Cost)` for one point, or None
when nothing fits (it may also raise InputError with the reason). `default_search` wraps the planner's own
search. Each point becomes one row of plain data (degrees, step time, MFU, memory headroom); a point that
cannot be planned is a row with feasible=False and the reason, never an exception. Sweeps of more than
PARALLEL_MIN_POINTS points run in a process pool over all cores.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import pickle
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from costmodel.catalog import load_model
from costmodel.cost import Cost
from costmodel.job import Job
from costmodel.model import ModelSpec
from costmodel.plan import Plan
from hardware.catalog import load_hardware
from hardware.chip import Chip
from hardware.errors import InputError, did_you_mean, excerpt
from hardware.fileio import atomic_path, check_output_path

GIB = 2**30
NUMERIC = ("chips", "global_batch", "seq_len")
NAMED = ("model", "hardware")
VARIABLES = NUMERIC + NAMED
ALIASES = {"chips": "chips", "n": "chips", "global_batch": "global_batch", "global-batch": "global_batch",
           "batch": "global_batch", "gb": "global_batch", "seq_len": "seq_len", "seq-len": "seq_len",
           "seq": "seq_len", "sequence_length": "seq_len", "model": "model", "models": "model", "size": "model",
           "model_size": "model", "hardware": "hardware", "hw": "hardware", "chip": "hardware"}
MAX_POINTS = 2000  # grid points of one sweep (each is a planner search), checked before any work
# The largest value of each swept number: chips as the planner's bound (planner.candidates), batch and length as
# the job's tokens-per-step bound (costmodel.job.MAX_TOKENS_PER_STEP = 2^40).
MAX_VALUE = {"chips": 2**20, "global_batch": 2**40, "seq_len": 2**40}
MAX_WORKERS = 256  # worker processes of one sweep
PARALLEL_MIN_POINTS = 8
FLAGS = {"chips": "--chips", "global_batch": "--global-batch", "seq_len": "--seq-len", "model": "--model",
         "hardware": "--hardware"}

SearchFn = Callable[[ModelSpec, Chip, int, Job], "tuple[Plan, Cost] | None"]


@dataclass(frozen=True)
class Axis:
    name: str  # one of VARIABLES
    values: tuple  # ints for NUMERIC, strings for NAMED

    @property
    def label(self) -> str:
        return self.name


@dataclass(frozen=True)
class SweepBase:
    """The fixed part of every point; the swept variables override it."""

    model: str = ""
    hardware: str = "tpu-v5p"
    chips: int | None = None
    global_batch: int | None = None  # None: the planner's default for each point (about 4M tokens)
    seq_len: int = 4096
    precision: str = "bf16"
    framework: str = "maxtext"


# ---- parsing --------------------------------------------------------------------------------------------

RANGE_FORMS = "a list (256,512,1024) or a range start:stop:xF (geometric) or start:stop:+S (arithmetic)"


def _int(name: str, text: str) -> int:
    """One swept value: a finite whole number from 1 to MAX_VALUE[name] ('1e3' reads as 1000)."""
    try:
        v = float(text)
    except ValueError:
        raise InputError(f"--vary {name}: {excerpt(text)} is not a number; expected {RANGE_FORMS}") from None
    if not math.isfinite(v) or v != int(v) or v < 1:
        raise InputError(f"--vary {name}: {excerpt(text)} must be a finite positive integer")
    if v > MAX_VALUE[name]:
        raise InputError(f"--vary {name}: {excerpt(text)} is more than {MAX_VALUE[name]:,}, the largest {name} "
                         "a sweep takes")
    return int(v)


def parse_range(name: str, spec: str) -> tuple[int, ...]:
    """'256,512' -> (256, 512); '256:8192:x2' -> (256, 512, ..., 8192); '1024:4096:+1024' -> (1024, ..., 4096).
    At most MAX_POINTS values, each a whole number from 1 to MAX_VALUE[name]."""
    spec = spec.strip()
    if not spec:
        raise InputError(f"--vary {name}: no values; expected {RANGE_FORMS}")
    if ":" not in spec:
        items = [s.strip() for s in spec.split(",")]
        if any(not s for s in items):
            raise InputError(f"--vary {name}: empty item in {excerpt(spec)}; expected {RANGE_FORMS}")
        return tuple(dict.fromkeys(_int(name, s) for s in items))
    parts = spec.split(":")
    if len(parts) != 3 or not all(p.strip() for p in parts):
        raise InputError(f"--vary {name}: range {excerpt(spec)} must be start:stop:xF or start:stop:+S")
    start, stop, step = _int(name, parts[0]), _int(name, parts[1]), parts[2].strip().lower()
    if start > stop:
        raise InputError(f"--vary {name}: range {excerpt(spec)} is inverted (start {start} > stop {stop})")
    if step.startswith(("x", "*")):
        out = _geometric(name, spec, start, stop, step)
    else:
        out = _arithmetic(name, spec, start, stop, _int(name, step.lstrip("+")))
    return tuple(dict.fromkeys(out))


def _too_many(name: str, spec: str) -> InputError:
    return InputError(f"--vary {name}: range {excerpt(spec)} has more than the {MAX_POINTS} points a sweep "
                      "takes; expected a larger step")


def _geometric(name: str, spec: str, start: int, stop: int, step: str) -> list[int]:
    """start, start*F, ... up to stop (rounded to whole numbers); F finite and greater than 1."""
    try:
        factor = float(step[1:])
    except ValueError:
        raise InputError(f"--vary {name}: factor {excerpt(step)} is not a number") from None
    if not (math.isfinite(factor) and factor > 1):
        raise InputError(f"--vary {name}: factor {excerpt(step)} must be a finite number greater than 1")
    out: list[int] = []
    v = float(start)
    while v < stop + 0.5:  # floats throughout: a huge factor gives inf, which ends the loop
        if len(out) == MAX_POINTS:  # (steps are counted before rounding merges repeats: a bounded loop)
            raise _too_many(name, spec)
        out.append(int(round(v)))
        v *= factor
    return out


def _arithmetic(name: str, spec: str, start: int, stop: int, step: int) -> list[int]:
    """start, start+S, ... up to stop; the count is known before any value is made."""
    values = range(start, stop + 1, step)
    if len(values) > MAX_POINTS:
        raise _too_many(name, spec)
    return list(values)


def parse_vary(text: str) -> Axis:
    """'chips=256:8192:x2', 'global_batch=512,1024', 'model=8B,70B,405B', 'hardware=tpu-v5p,h100-sxm'."""
    name, eq, spec = text.partition("=")
    key = name.strip().lower()
    if not eq:
        raise InputError(f"--vary: {excerpt(text)} must be VARIABLE=VALUES, e.g. chips=256:8192:x2")
    if key not in ALIASES:
        raise InputError(f"--vary: unknown variable {excerpt(name.strip())}{did_you_mean(key, VARIABLES)}; "
                         f"expected one of: {', '.join(VARIABLES)}")
    var = ALIASES[key]
    return Axis(var, parse_range(var, spec) if var in NUMERIC else _names(var, spec))


def _names(var: str, spec: str) -> tuple[str, ...]:
    """A comma-separated list of model or hardware names, counted before any is loaded, each loaded once to fail
    early on an unknown name (InputError with near names)."""
    items = [s.strip() for s in spec.split(",")]
    if not spec.strip() or any(not s for s in items):
        raise InputError(f"--vary {var}: expected a comma-separated list of names, got {excerpt(spec)}")
    values = tuple(dict.fromkeys(items))
    if len(values) > MAX_POINTS:
        raise InputError(f"--vary {var}: {len(values):,} values is more than the {MAX_POINTS} a sweep takes")
    for s in values:
        load_model(s) if var == "model" else load_hardware(s)
    return values


def check_axes(axes: list[Axis], base: SweepBase, given: dict[str, object] | None = None) -> None:
    """One or two different variables; every fixed one known; a variable swept and also fixed by its flag (a
    non-None value in `given`, keyed by variable) is a contradiction; at most MAX_POINTS points in all."""
    if not axes:
        raise InputError("--vary: give one or two variables to sweep, e.g. --vary chips=256:8192:x2")
    if len(axes) > 2:
        raise InputError(f"--vary: at most two variables, got {len(axes)} ({', '.join(a.name for a in axes)})")
    if len(axes) == 2 and axes[0].name == axes[1].name:
        raise InputError(f"--vary: {axes[0].name} is given twice")
    for a in axes:
        if (given or {}).get(a.name) is not None:
            raise InputError(f"--vary {a.name} and {FLAGS[a.name]}: the sweep varies {a.name}, so it cannot also be "
                             f"fixed; drop one of them")
    varied = {a.name for a in axes}
    if "model" not in varied and not base.model:
        raise InputError("--model: required unless the sweep varies model")
    if "chips" not in varied and base.chips is None:
        raise InputError("--chips: required unless the sweep varies chips")
    n = math.prod(len(a.values) for a in axes)
    if n > MAX_POINTS:
        raise InputError(f"--vary: {n} points is more than the {MAX_POINTS} a sweep takes")


def points(base: SweepBase, axes: list[Axis], given: dict[str, object] | None = None) -> list[dict]:
    """Every grid point as a dict of model, hardware, chips, global_batch, seq_len, precision, framework."""
    check_axes(axes, base, given)
    fixed = dict(base.__dict__)
    out = []
    for combo in itertools.product(*(a.values for a in axes)):
        out.append({**fixed, **{a.name: v for a, v in zip(axes, combo, strict=True)}})
    return out


# ---- running --------------------------------------------------------------------------------------------

def default_search(m: ModelSpec, chip: Chip, chips: int, job: Job) -> tuple[Plan, Cost] | None:
    """The planner's best plan for one point (planner.solve), as (plan, cost); None when nothing fits."""
    from planner.solve import best_plan  # the planner search; imported here to keep start-up light

    return best_plan(m, chip, chips, job)


def default_global_batch(chips: int, seq_len: int) -> int:
    """The planner's default batch for a point that does not set one (about 4M tokens, divisible to fit chips)."""
    from planner.candidates import default_global_batch as planner_default

    return planner_default(chips, seq_len)


def row_for(point: dict, plan: Plan | None, cost: Cost | None, reason: str = "", seconds: float = 0.0) -> dict:
    row = {k: point[k] for k in ("model", "hardware", "chips", "global_batch", "seq_len", "precision", "framework")}
    row["feasible"] = plan is not None and cost is not None and cost.fits
    row["reason"] = reason
    if plan is not None and cost is not None:
        if not cost.fits and not reason:
            row["reason"] = f"best plan needs {cost.fit_memory_bytes / GIB:.1f} GiB per chip of " \
                            f"{cost.hbm_usable_bytes / GIB:.1f} usable"
        row.update({"step_time_s": cost.step_time_s, "mfu": cost.mfu, "tokens_per_s": cost.tokens_per_s,
                    "tflops_per_chip": cost.tflops_per_chip,
                    **plan.degrees(), "vpp": plan.vpp, "micro_batch": plan.micro_batch,
                    "grad_accum": cost.grad_accum, "zero": plan.zero, "remat": plan.remat.summary(),
                    "offload_optimizer": plan.offload_optimizer, "offload_params": plan.offload_params,
                    "slices": plan.slices, "peak_memory_gib": cost.peak_memory_bytes / GIB,
                    "fit_memory_gib": cost.fit_memory_bytes / GIB, "usable_gib": cost.hbm_usable_bytes / GIB,
                    "headroom_gib": (cost.hbm_usable_bytes - cost.fit_memory_bytes) / GIB,
                    "dominant": cost.dominant})
    row["search_s"] = seconds
    return row


def run_point(point: dict, search: SearchFn) -> dict:
    """Plan one point; any InputError (bad divisibility, unknown name, nothing fits) becomes the row's reason."""
    t0 = time.perf_counter()
    try:
        if point.get("global_batch") is None:
            point = {**point, "global_batch": default_global_batch(point["chips"], point["seq_len"])}
        m, chip = load_model(point["model"]), load_hardware(point["hardware"])
        job = Job(seq_len=point["seq_len"], global_batch=point["global_batch"], precision=point["precision"],
                  framework=point["framework"])
        found = search(m, chip, point["chips"], job)
    except InputError as e:
        return row_for(point, None, None, str(e), time.perf_counter() - t0)
    if found is None:
        return row_for(point, None, None, "no plan fits in memory", time.perf_counter() - t0)
    plan, cost = found
    return row_for(point, plan, cost, "", time.perf_counter() - t0)


def run_sweep(base: SweepBase, axes: list[Axis], search: SearchFn = default_search, workers: int | None = None,
              on_done: Callable[[int, int], None] | None = None) -> list[dict]:
    """One row per grid point, in grid order. workers: None = all cores when there are more than
    PARALLEL_MIN_POINTS points, else 1. on_done(done, total) is called after each point (progress bars)."""
    pts = points(base, axes)
    return run_points(pts, search, workers, on_done)


def run_points(pts: list[dict], search: SearchFn = default_search, workers: int | None = None,
               on_done: Callable[[int, int], None] | None = None) -> list[dict]:
    n = len(pts)
    if workers is None:
        workers = (os.cpu_count() or 1) if n > PARALLEL_MIN_POINTS else 1
    workers = max(1, min(workers, n, MAX_WORKERS))
    if workers > 1:
        try:  # a lambda or closure cannot travel to worker processes: run it here instead
            pickle.dumps(search)
        except (pickle.PicklingError, AttributeError, TypeError):
            workers = 1
    if workers == 1:
        rows = []
        for i, p in enumerate(pts):
            rows.append(run_point(p, search))
            if on_done:
                on_done(i + 1, n)
        return rows
    return _run_pool(pts, search, workers, on_done)


def _ignore_sigint() -> None:
    """Pool initializer: Ctrl-C goes to the whole process group; only the parent acts on it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT held back while the workers are forked, so none takes it before _ignore_sigint runs; a Ctrl-C in
    that moment reaches the parent when the block ends."""
    if not hasattr(signal, "pthread_sigmask"):  # (Windows: no signal masks)
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _run_pool(pts: list[dict], search: SearchFn, workers: int,
              on_done: Callable[[int, int], None] | None) -> list[dict]:
    """The points over a process pool, rows in grid order. On Ctrl-C (or any error) the pool is abandoned
    (_abandon) and the exception re-raised: no orphaned processes, no partial output."""
    rows: list[dict | None] = [None] * len(pts)
    pool = ProcessPoolExecutor(max_workers=workers, initializer=_ignore_sigint)
    try:
        with _sigint_blocked():
            index = {pool.submit(run_point, p, search): i for i, p in enumerate(pts)}
        for done, future in enumerate(as_completed(index), start=1):
            rows[index[future]] = future.result()
            if on_done:
                on_done(done, len(pts))
    except BaseException:
        _abandon(pool)
        raise
    pool.shutdown(wait=True)
    return [r for r in rows if r is not None]


def _abandon(pool: ProcessPoolExecutor) -> None:
    """Cancel the queued points, terminate the workers (a running search is not waited for) and wait for the
    pool's manager thread to finish, so that nothing of the pool outlives the call. Only the pool cancels futures
    (cancel_futures): a future cancelled from this thread while the pool marks its points failed raises
    InvalidStateError in the manager thread on Python 3.11."""
    procs = list((getattr(pool, "_processes", None) or {}).values())  # no public handle on the workers
    manager = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.join(timeout=5)
    if manager is not None:
        manager.join(timeout=5)


# ---- output ---------------------------------------------------------------------------------------------

TABLE_FORMATS = (".csv", ".parquet")


def check_table_path(path: str | Path, flag: str = "--out") -> Path:
    """The table path, or InputError: extension not .csv/.parquet, Parquet without pyarrow, or a path that cannot
    be written (hardware.fileio.check_output_path: missing folder, a folder, a device, an unwritable folder)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in TABLE_FORMATS:
        raise InputError(f"{flag}: {excerpt(str(path))} must end in .csv or .parquet")
    check_output_path(p, flag)
    if suffix == ".parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise InputError(f"{flag}: writing Parquet needs pyarrow (pip install pyarrow); "
                             f"or give a .csv path") from None
    return p


def write_table(rows: Iterable[dict], path: str | Path, flag: str = "--out") -> Path:
    """Rows to CSV, or Parquet when the path ends in .parquet (pandas; pyarrow for Parquet), written atomically
    (hardware.fileio.atomic_path): a failed write leaves an existing file as it was."""
    import pandas as pd

    p = check_table_path(path, flag)
    df = pd.DataFrame(list(rows))
    with atomic_path(p, flag) as tmp:
        if p.suffix.lower() == ".parquet":
            df.to_parquet(tmp, index=False)
        else:
            df.to_csv(tmp, index=False)
    return p
