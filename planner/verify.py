"""Compile a TPU plan's MaxText export ahead of time with MaxText's own train_compile and read XLA's memory.

`verify_plan(pf, env)` writes the plan's MaxText config (planner.export) to a temporary directory, runs
``python -m maxtext.trainers.pre_train.train_compile CONFIG compile_topology=... compile_topology_num_slices=...``
with the MaxText environment's Python (libtpu compiles for the TPU topology on the CPU host), and parses the
``Memory analysis: CompiledMemoryStats(...)`` line: total per chip = argument + output - alias + temp. XLA
refusing the program for lack of HBM (RESOURCE_EXHAUSTED) is status 'oom'.
The parser is also what benchmarks/maxtext_memory/run.py uses (it runs under the MaxText environment's Python),
so this module imports only the standard library at load time.
(details: docs/verify.md)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from costmodel.cost import Cost
    from planner.planfile import PlanFile

DEFAULT_ENV = "/work/maxtext-env"  # benchmarks/maxtext_memory/Makefile.inc: MAXTEXT_ENV ?= /work/maxtext-env
ENV_VAR = "MAXTEXT_ENV"
MAKE_HINT = "create it with `make maxtext-memory-env` (MAXTEXT_ENV=DIR to put it elsewhere) or give --maxtext-env DIR"
TRAIN_COMPILE = "maxtext.trainers.pre_train.train_compile"
DEFAULT_TIMEOUT_S = 1500  # run.py's per-compile default: 1-3 min on 2 cores for 4-64 chips, more for 1000+
MEM_RE = re.compile(r"Memory analysis: CompiledMemoryStats\((.*?)\)\s*$", re.M)
FLOPS_RE = re.compile(r"'flops': ([0-9.eE+]+)")
OOM_RE = re.compile(r"RESOURCE_EXHAUSTED: [^\n]{0,300}?(?=\. HLO module|$)", re.M)
ERROR_LINE_RE = re.compile(r"^[\w.]*(Error|Exception)\b")  # 'jax.errors.JaxRuntimeError: ...', 'ValueError: ...'
GIB = 2**30


def parse_memory(text: str) -> dict[str, int] | None:
    """The last CompiledMemoryStats line of a train_compile log as {field: bytes}, or None when there is none."""
    m = MEM_RE.findall(text)
    if not m:
        return None
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m[-1])}


def total_bytes(mem: dict[str, int]) -> int:
    """Device HBM per chip: argument + output - alias + temp (XLA's usual peak-footprint formula; host_* and
    generated code excluded; docs/memory_validation.md)."""
    return (mem["argument_size_in_bytes"] + mem["output_size_in_bytes"] - mem["alias_size_in_bytes"]
            + mem["temp_size_in_bytes"])


@dataclass(frozen=True)
class Compiled:
    """One train_compile run: status ok | oom (XLA refused: over HBM) | error | timeout."""

    status: str
    seconds: float
    memory: dict[str, int] = field(default_factory=dict)  # CompiledMemoryStats fields (status ok)
    reason: str = ""  # one line: XLA's RESOURCE_EXHAUSTED message, the error's last lines, or the timeout

    @property
    def total_bytes(self) -> int | None:
        return total_bytes(self.memory) if self.memory else None


def classify(text: str, rc: int) -> tuple[str, dict[str, int], str]:
    """(status, memory, reason) from a finished compile's log and exit code."""
    mem = parse_memory(text)
    if rc == 0 and mem is not None:
        return "ok", mem, ""
    if oom := OOM_RE.search(text):  # XLA refuses a step that does not fit in HBM
        return "oom", {}, oom.group(0)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith(("I1", "W1", "I0", "W0"))]
    raised = [ln for ln in lines if ERROR_LINE_RE.match(ln)]  # the exception's own line, else the last line
    last = (raised or lines or ["no output"])[-1]
    return "error", {}, f"rc={rc}: " + (last if len(last) <= 400 else last[:397] + "...")


# ---- the environment ---------------------------------------------------------------------------------------

def find_env(flag: str | None) -> Path:
    """The MaxText environment's Python: --maxtext-env DIR, else $MAXTEXT_ENV, else the Makefile's default (the
    first of these given is the one used). InputError (one line, exit 2) when it has no maxtext to import."""
    from hardware.errors import InputError

    if flag:
        where, root = "--maxtext-env", flag
    elif os.environ.get(ENV_VAR):
        where, root = f"${ENV_VAR}", os.environ[ENV_VAR]
    else:
        where, root = "the default MaxText environment", DEFAULT_ENV
    python = Path(root) / "bin" / "python"
    if not python.is_file():
        raise InputError(f"{where} {root}: no MaxText environment there (no bin/python); {MAKE_HINT}")
    if not has_maxtext(python):
        raise InputError(f"{where} {root}: its Python cannot import maxtext; {MAKE_HINT}")
    return python


def has_maxtext(python: Path) -> bool:
    """Whether `python` finds the maxtext package (looked up, not imported: a fraction of a second)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('maxtext') is None)"
    try:
        return subprocess.run([str(python), "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


# ---- the command -------------------------------------------------------------------------------------------

def check_verifiable(pf: PlanFile) -> None:
    """InputError unless the plan is a TPU plan under MaxText's conventions (what train_compile can compile)."""
    from hardware.errors import InputError

    chip = pf.hardware
    if chip.vendor != "tpu":
        raise InputError(f"hardware: verify compiles TPU plans with MaxText's train_compile; {chip.name} is a "
                         f"{chip.vendor.upper()} (expected a TPU such as tpu-v5p)")
    if pf.job.framework != "maxtext":
        raise InputError(f"framework: verify compiles MaxText plans; this plan is under {pf.job.framework} "
                         "(expected maxtext)")


def topology(pf: PlanFile) -> tuple[str, int]:
    """(compile_topology, compile_topology_num_slices) for the plan as exported (planner.export_maxtext)."""
    from hardware.errors import InputError
    from planner.export_maxtext import compile_topology, maxtext_config

    slices = maxtext_config(pf)[0]["num_slices"]
    aot = dict(kv.split("=", 1) for kv in compile_topology(pf, slices).split())
    if not aot:
        raise InputError(f"hardware: MaxText names no compile_topology for {pf.hardware.name}; expected one of "
                         "tpu-v4, tpu-v5p, tpu-v5e, tpu-v6e, tpu-v7")
    return aot["compile_topology"], int(aot["compile_topology_num_slices"])


def command(python: Path, config: Path, topo: str, slices: int, out_dir: Path) -> list[str]:
    """The train_compile command line for an exported config (synthetic data, no checkpointing)."""
    return [str(python), "-m", TRAIN_COMPILE, str(config), f"compile_topology={topo}",
            f"compile_topology_num_slices={slices}", "run_name=planner_verify", f"base_output_directory={out_dir}",
            "dataset_type=synthetic", "enable_checkpointing=false"]


def run_compile(cmd: list[str], log_path: Path, timeout_s: float, cwd: Path) -> Compiled:
    """Run `cmd` (its own process group, output to `log_path`), killing the group after `timeout_s`."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another libtpu user may be running
    t0 = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(cwd),
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return Compiled("timeout", time.monotonic() - t0, reason=f"no result after {timeout_s:g} s (--timeout)")
        except BaseException:  # Ctrl-C: leave no compiler behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    status, mem, reason = classify(log_path.read_text(errors="replace"), rc)
    return Compiled(status, time.monotonic() - t0, mem, reason)


# ---- one plan ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Verified:
    """A plan compiled: where (topology, slices), what XLA said, and the cost model's prediction for it."""

    topology: str
    slices: int
    compiled: Compiled
    predicted: Cost | None  # the exported plan's cost (None: it cannot be costed)
    warnings: tuple[str, ...] = ()  # the export's (a plan MaxText cannot express exactly is compiled as adapted)

    @property
    def refused(self) -> bool:
        """The compiler (or MaxText) refused the plan: over HBM, or an error; a timeout says nothing."""
        return self.compiled.status in ("oom", "error")

    def to_dict(self) -> dict:
        c, p = self.compiled, self.predicted
        out = {"status": c.status, "compile_topology": self.topology, "compile_topology_num_slices": self.slices,
               "compile_seconds": round(c.seconds, 1), "compiler_total_bytes": c.total_bytes,
               "compiler_memory": dict(c.memory), "reason": c.reason, "warnings": list(self.warnings)}
        if p is not None:
            out.update(predicted_total_bytes=p.peak_memory_bytes, predicted_fit_bytes=p.fit_memory_bytes,
                       hbm_usable_bytes=p.hbm_usable_bytes, predicted_fits=p.fits)
        return out

    def line(self) -> str:
        """One line: compiler GiB per chip beside the prediction (or why there is none)."""
        c, p = self.compiled, self.predicted
        pred = (f"predicted {p.peak_memory_bytes / GIB:.2f} GiB (fit floor {p.fit_memory_bytes / GIB:.2f} of "
                f"{p.hbm_usable_bytes / GIB:.2f} usable)") if p is not None else "no prediction"
        where = f"{self.topology} x {self.slices} slice{'s' if self.slices > 1 else ''}, {c.seconds:.0f} s"
        if c.status != "ok":
            return f"{c.status} ({where}): {c.reason}; {pred}"
        got = c.total_bytes
        ratio = f", predicted/compiler {p.peak_memory_bytes / got:.3f}" if p is not None and got else ""
        return f"compiles ({where}): compiler {got / GIB:.2f} GiB per chip, {pred}{ratio}"


def verify_plan(pf: PlanFile, python: Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> Verified:
    """Export `pf` for MaxText, compile it for its topology with `python`'s train_compile, in a temporary dir."""
    from planner.export import export_result

    check_verifiable(pf)
    topo, slices = topology(pf)
    res = export_result(pf, "maxtext")
    with tempfile.TemporaryDirectory(prefix="planner-verify-") as tmp:
        d = Path(tmp)
        config = d / "plan.yml"
        config.write_text(res.text)
        cmd = command(python, config, topo, slices, d / "out")
        compiled = run_compile(cmd, d / "train_compile.log", timeout_s, d)
    return Verified(topo, slices, compiled, res.cost, res.warnings)
