"""Figures: one plan's step waterfall and memory bars; a sweep's MFU, step time, degrees and memory headroom.

matplotlib is imported inside the functions (with the non-interactive Agg backend unless one is already
chosen), so importing this module costs nothing. The output format follows the file extension: .png, .svg
or .pdf.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hardware.errors import InputError, excerpt
from hardware.fileio import atomic_path, check_output_path

if TYPE_CHECKING:
    from planner.explain import Explanation

FORMATS = (".png", ".svg", ".pdf")
GIB = 2**30
COLORS = {"compute": "#4C72B0", "recompute": "#8172B2", "memory_bound": "#64B5CD", "bubble": "#C44E52",
          "optimizer": "#937860", "offload": "#DA8BC3", "overhead": "#8C8C8C"}
COMM_COLOR = "#DD8452"
MEMORY_COLORS = {"weights": "#4C72B0", "gradients": "#55A868", "optimizer": "#937860", "activations": "#8172B2",
                 "loop_buffers": "#A68BC7", "activation_working": "#B3A2D9", "logits": "#64B5CD",
                 "collective_buffers": "#DD8452"}


def check_figure_path(path: str | Path, flag: str = "--plot") -> Path:
    """The figure path, or InputError: extension not png/svg/pdf, or a path that cannot be written
    (hardware.fileio.check_output_path: missing folder, a folder, a device, an unwritable folder)."""
    p = Path(path)
    if p.suffix.lower() not in FORMATS:
        raise InputError(f"{flag}: {excerpt(str(path))} must end in {', '.join(FORMATS)} (the format follows the "
                         "extension)")
    return check_output_path(p, flag)


def _pyplot():
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
        try:
            matplotlib.use("Agg")
        except Exception:  # noqa: BLE001 - a backend already in use (e.g. in a notebook) is fine
            pass
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path | None, flag: str) -> None:
    """Save to a temporary file beside `path`, renamed over it when complete (hardware.fileio.atomic_path); the
    format is the target's extension."""
    if path is None:
        return
    with atomic_path(path, flag) as tmp:
        fig.savefig(tmp, format=path.suffix[1:].lower(), dpi=120, bbox_inches="tight")


# ---- one plan --------------------------------------------------------------------------------------------

def draw_explanation(ex: Explanation, axes=None):
    """Draw the step waterfall and memory bars of one Explanation on two matplotlib axes; returns the figure."""
    plt = _pyplot()
    own = axes is None
    if own:
        fig, axes = plt.subplots(1, 2, figsize=(14, 0.45 * max(len(ex.waterfall), len(ex.memory)) + 2.6),
                                 gridspec_kw={"width_ratios": [3, 2]})
    else:
        fig = axes[0].figure
    ax_t, ax_m = axes
    step = ex.cost.step_time_s
    labels = [t.label for t in ex.waterfall] + ["step"]
    y = list(range(len(labels)))[::-1]
    for yi, t in zip(y, ex.waterfall, strict=False):
        color = COMM_COLOR if t.key.startswith("comm_") else COLORS.get(t.key, "#999999")
        ax_t.barh(yi, t.seconds, left=t.start_s, color=color)
        ax_t.text(t.start_s + t.seconds + step * 0.01, yi, f"{t.seconds:.3g} s ({t.share * 100:.1f}%)",
                  va="center", fontsize=8)
    ax_t.barh(y[-1], step, color="#333333")
    ax_t.text(step * 1.01, y[-1], f"{step:.3g} s, MFU {ex.cost.mfu * 100:.1f}%", va="center", fontsize=8)
    ax_t.set_yticks(y, labels, fontsize=8)
    ax_t.set_xlim(0, step * 1.35)
    ax_t.set_xlabel("seconds per step")
    name = f"{ex.model} on {ex.chips} x {ex.hardware}"
    if own:
        ax_t.set_title("step waterfall", fontsize=10)
        fig.suptitle(name, fontsize=11)
    else:  # drawn into someone else's figure (e.g. side by side in a notebook): name the plan on the axes
        ax_t.set_title(f"{name}: step waterfall", fontsize=10)

    cats = [k for k, v in ex.memory.items() if v > 0]
    vals = [ex.memory[k] / GIB for k in cats]
    ym = list(range(1, len(cats) + 1))[::-1]
    colors = [MEMORY_COLORS.get(k, "#999999") for k in cats]
    ax_m.barh(ym, vals, color=colors)
    for yi, v in zip(ym, vals, strict=True):
        ax_m.text(v, yi, f" {v:.1f}", va="center", fontsize=8)
    usable = ex.cost.hbm_usable_bytes / GIB
    peak = ex.cost.peak_memory_bytes / GIB
    left = 0.0
    for v, c in zip(vals, colors, strict=True):  # the categories stacked: the total against capacity
        ax_m.barh(0, v, left=left, color=c)
        left += v
    ax_m.text(left, 0, f" {peak:.1f}", va="center", fontsize=8, fontweight="bold")
    ax_m.axvline(usable, color="#C44E52", ls="--", lw=1)
    need = ex.cost.fit_memory_bytes / GIB
    if ex.cost.fit_below_total:  # the fit check's figure (costmodel.memory.fit_floor_bytes)
        ax_m.axvline(need, color="#55A868", ls=":", lw=1)
    ax_m.set_yticks([*ym, 0], [*cats, "total"], fontsize=8)
    ax_m.set_xlabel("GiB per chip")
    fit = "fits" if ex.cost.fits else "does NOT fit"
    needs = f" (needs {need:.1f})" if ex.cost.fit_below_total else ""
    ax_m.set_title(f"memory per chip: {peak:.1f}{needs} of {usable:.1f} GiB usable, {fit}", fontsize=10)
    ax_m.set_xlim(0, max(usable, peak) * 1.18)
    fig.tight_layout()
    return fig


def plot_explanation(ex: Explanation, path: str | Path) -> Path:
    """Write the waterfall + memory figure of one plan; the format follows the extension."""
    p = check_figure_path(path, "--out")
    plt = _pyplot()
    fig = draw_explanation(ex)
    try:
        _save(fig, p, "--out")
    finally:
        plt.close(fig)
    return p


# ---- sweeps ----------------------------------------------------------------------------------------------

DEGREE_COLUMNS = ("dp", "fsdp", "tp", "cp", "pp", "ep")


def _x_positions(values: list) -> tuple[list[float], bool]:
    """Numeric x as is (log scale when it spans > 8x); names at 0..n-1."""
    if all(isinstance(v, int | float) for v in values):
        return [float(v) for v in values], True
    return list(range(len(values))), False


def draw_sweep(rows: list[dict], x: str, series: str | None = None, axes=None, title: str | None = None):
    """MFU, step time, chosen degrees and memory headroom against `x` (one line per value of `series`)."""
    plt = _pyplot()
    if axes is None:
        fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    else:
        fig = axes.flat[0].figure
    ax_mfu, ax_t, ax_d, ax_m = axes.flat
    groups: dict = {}
    for r in rows:
        groups.setdefault(r.get(series) if series else None, []).append(r)
    xs_all = list(dict.fromkeys(r[x] for r in rows))
    xpos, numeric = _x_positions(xs_all)
    where = dict(zip(xs_all, xpos, strict=True))
    for key, rs in groups.items():
        ok = [r for r in rs if r.get("feasible")]
        lab = f"{series}={key}" if series else None
        px = [where[r[x]] for r in ok]
        ax_mfu.plot(px, [r["mfu"] * 100 for r in ok], "o-", label=lab)
        ax_t.plot(px, [r["step_time_s"] for r in ok], "o-", label=lab)
        ax_m.plot(px, [r["headroom_gib"] for r in ok], "o-", label=lab)
        bad = [where[r[x]] for r in rs if not r.get("feasible")]
        if bad:
            ax_mfu.plot(bad, [0] * len(bad), "x", color="#C44E52")
    # Degrees: of the first series only (one panel stays readable), log2 scale.
    first = next(iter(groups.values()))
    ok = [r for r in first if r.get("feasible")]
    for col in DEGREE_COLUMNS + ("micro_batch",):
        vals = [r.get(col, 1) or 1 for r in ok]
        if any(v > 1 for v in vals):
            ax_d.plot([where[r[x]] for r in ok], vals, "o-", label=col)
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ax_d.set_yscale("log", base=2)
    ax_d.yaxis.set_major_formatter(ScalarFormatter())
    ax_d.yaxis.set_minor_formatter(NullFormatter())
    ax_mfu.set_ylabel("MFU %")
    top = max((r["mfu"] * 100 for r in rows if r.get("feasible")), default=100.0)
    ax_mfu.set_ylim(0, min(100.0, top * 1.15) if top > 0 else 100.0)
    ax_t.set_ylabel("step time (s)")
    ax_d.set_ylabel("chosen degree" + (f" ({series}={next(iter(groups))})" if series else ""))
    ax_m.set_ylabel("HBM headroom per chip (GiB)")
    ax_m.axhline(0, color="#C44E52", lw=0.8, ls="--")
    for ax in axes.flat:
        ax.set_xlabel(x)
        if numeric:
            if min(xpos) > 0 and max(xpos) / min(xpos) >= 4:
                ax.set_xscale("log", base=2)
            ax.set_xticks(xpos, [str(v) for v in xs_all], fontsize=8)
            ax.minorticks_off()
        else:
            ax.set_xticks(xpos, [str(v) for v in xs_all], fontsize=8, rotation=20)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title or (f"sweep over {x}" + (f" and {series}" if series else "")), fontsize=11)
    fig.tight_layout()
    return fig


def plot_sweep(rows: list[dict], x: str, series: str | None, path: str | Path, title: str | None = None) -> Path:
    """Write the sweep figure (MFU, step time, degrees, headroom against x); the format follows the extension."""
    p = check_figure_path(path, "--plot")
    plt = _pyplot()
    fig = draw_sweep(rows, x, series, title=title)
    try:
        _save(fig, p, "--plot")
    finally:
        plt.close(fig)
    return p
